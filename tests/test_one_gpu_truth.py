"""bench/gpu/one_gpu_truth.py's scoring: real repeats against an emulation, with and without its trace."""

from __future__ import annotations

from bench_scripts import load_bench

WARM = [900.0, 600.0]  # iterations 1-2, left out on both sides


def _iters(values: list[float]) -> dict[str, dict]:
    return {str(i): {"ms": v, "note": None, "loss": "1.0", "at": float(i)} for i, v in enumerate(WARM + values, 1)}


def _step(kind: str, ms: float) -> dict:
    """A step of eight measured iterations of ``ms`` each; an emulation's names a trace that is not there."""
    step = {"kind": kind, "iterations": _iters([ms] * 8), "measured_from": 3}
    if kind.startswith("emu"):
        step.update(world=1, variant="", trace="dense-bf16-mbs2/trace-01-emu1")
    return step


def test_an_emulation_without_its_trace_is_scored_by_its_live_prediction_and_marked(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    report = {"steps": {"dense-bf16-mbs2": [_step("real-threads1", 200.0), _step("emu1", 202.0),
                                            _step("real-threads1", 200.0)]}}
    text = truth.analyse(report, tmp_path)  # no trace under tmp_path
    em = report["rows"]["dense-bf16-mbs2"]["emulations"]["emu1"]
    assert em["predicted_ms"] == 202.0 and em["predicted_from"] == "live"
    assert abs(em["error_pct"] - 1.0) < 1e-9
    assert "emu1*" in text and "traces not kept" in text
    assert "(1 emulations): 1.00 %" in text  # two real repeats that agree: ground truth, scored


def test_real_repeats_that_disagree_are_no_ground_truth(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    report = {"steps": {"dense-bf16-mbs2": [_step("real-threads1", 200.0), _step("emu1", 202.0),
                                            _step("real-threads1", 210.0)]}}
    text = truth.analyse(report, tmp_path)
    assert "(0 emulations)" in text
    assert "not ground truth (spread" in text and "dense-bf16-mbs2 emu1 error" in text


def test_a_forked_real_run_is_listed_beside_the_real_runs_and_not_scored_as_one(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    report = {"steps": {"dense-bf16-mbs2": [_step("real-threads1", 200.0), _step("real-forked", 210.0),
                                            _step("real-threads1", 200.0)]}}
    text = truth.analyse(report, tmp_path)
    row = report["rows"]["dense-bf16-mbs2"]
    assert row["real_medians_ms"] == [200.0, 200.0] and row["real_spread_pct"] == 0.0  # not pooled with the reals
    assert row["forked"] == [210.0]
    assert "real-forked (the driver forked from a template" in text and "210.0 ms (+5.0 % against real)" in text
