"""bench/gpu/one_gpu_truth.py's scoring: real repeats against an emulation, with and without its trace."""

from __future__ import annotations

import pytest
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


def test_a_real_spans_run_splits_each_measured_iteration_into_forward_backward_and_the_rest():
    truth = load_bench("gpu/one_gpu_truth.py")
    assert truth.microbatches(truth.config_of("dense-fp32-mbs1-host-recompute")) == 8
    # 2 micro-batches per iteration; iteration k's forwards take k ms each, its backwards 2k ms
    spans = []
    for k in (1, 2, 3, 4):
        for _ in range(2):
            spans += [["forward", 0.0, k / 1e3], ["backward", 0.0, 2 * k / 1e3]]
    step = {"kind": "real-spans", "measured_from": 3, "spans": spans,
            "iterations": {str(k): {"ms": 10.0 * k} for k in (1, 2, 3, 4, 5)}}  # iteration 5 has no spans: left out
    got = truth.real_spans(step, 2)
    assert got["iterations"] == 2  # iterations 3 and 4
    assert got["iteration_ms"] == pytest.approx(35.0)
    assert got["forward_ms"] == pytest.approx(7.0)  # medians of 2x3 and 2x4
    assert got["backward_ms"] == pytest.approx(14.0)
    assert got["rest_ms"] == pytest.approx(35 - 21)  # (30 - 18, 40 - 24): median 14
    assert truth.real_spans({**step, "spans": spans[:8]}, 2) is None  # no measured iteration has its spans
