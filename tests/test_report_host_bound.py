"""The report's compute on two clocks: how much of it the GPU spent waiting for its host (host-bound) and
how long the device was busy, per rank, per class and for the headline; silent on a trace without GPU
times."""

from __future__ import annotations

import json

import pytest

from prism_megatron.report import build_report, read_report, render_html, summary_text, write_report
from prism_megatron.report.wandb_log import report_summary
from prism_megatron.trace import write_trace
from prism_megatron.trace.fold import FoldClass, make_fold

# Per rank and iteration: segment A (compute clock 0..1 of the iteration), a blocking all_reduce over the
# rank's own group, segment B (1..2); (host, device) seconds of each. Rank 0's A is host-bound (the GPU
# waits 0.6 s for the host), its B device-bound; rank 1's B takes more host than device time, but its host
# ran ahead while the device was busy with A, so the GPU never waits: host-bound is what the replay's
# stream waited, not a per-segment max.
SEGMENTS = {0: ((0.8, 0.2), (0.1, 0.5)), 1: ((0.1, 0.9), (0.5, 0.1))}
# Iteration 1 is the warm-up before GPU timing (one clock, its segments 0.5 s each: 1.0 s, shorter than the
# timed one, so a window over all iterations would pick it); iteration 2 is timed. Two only: the ranks do
# not synchronise, so over more iterations they would drift apart.
WARM = 0.5


def _trace(tmp_path, gpu_rows: bool = True, fold: bool = False, machine: dict | None = None, name: str = ""):
    """A two-rank trace; ``fold``: both ranks are the sandbox of one class (of 2 ranks); ``machine``: the
    emulating machine its job recorded."""
    manifest = {"world_size": 2,
                "groups": [{"id": r, "name": f"own{r}", "ranks": [r], "backend": "nccl"} for r in (0, 1)],
                "ranks": [{"rank": r, "exit_code": 0, "device": "cuda:0"} for r in (0, 1)]}
    if fold:
        plan = make_fold([0, 1], 8, [FoldClass("pair", "both ranks", 2, (0, 1))], [0, 0])
        manifest["job"] = {"fold": plan.to_json()}
    if machine is not None:
        manifest.setdefault("job", {})["machine"] = machine
    ops, marks, gpu = [], [], []
    for r, (a, b) in SEGMENTS.items():
        for it, (c0, seg) in enumerate(((0.0, WARM), (2 * WARM, 1.0))):
            ops.append({"rank": r, "index": it, "kind": "all_reduce", "group": r, "seq": it, "peer": -1,
                        "root": -1, "bytes": (r + 1) << 20, "dtype": "torch.float32", "shapes": [[(r + 1) << 18]],
                        "reduce_op": "sum", "async_op": False, "t_issue": 10.0 * it + 1,
                        "t_complete": 10.0 * it + 1, "compute_before": WARM if it == 0 else WARM + seg, "label": ""})
            marks += [{"rank": r, "name": "iteration", "phase": ph, "t": 10.0 * it + dt, "compute_clock": c,
                       "attrs": {"iteration": it + 1} if ph == "B" else {}}
                      for ph, dt, c in (("B", 0.0, c0), ("E", 5.0, c0 + 2 * seg))]
            if gpu_rows and it:
                gpu += [{"rank": r, "clock_start": c0 + k, "clock_end": c0 + k + 1, "cpu": host, "gpu": dev,
                         "syncs": []} for k, (host, dev) in enumerate((a, b))]
    return write_trace(tmp_path / (name or ("f" if fold else "t")), manifest, ops, marks=marks, gpu=gpu or None)


def test_host_bound_and_device_busy_per_rank_and_headline(tmp_path):
    report = build_report(_trace(tmp_path), cluster=None)  # communication free
    pred = report["prediction"]
    # rank 0: A on the device 0..0.2, the GPU waits for the host until 0.8, B 0.8..1.3 (device-bound);
    # rank 1: A 0..0.9, B 0.9..1.0 (its host issued B by 0.6). The iteration is 1.3 s (the warm-up on one
    # clock is left out of the headline).
    assert pred["iteration_time_s"] == pytest.approx(1.3)
    rows = {b["rank"]: b for b in pred["breakdown"]}
    assert (rows[0]["compute_s"], rows[0]["host_bound_s"], rows[0]["device_busy_s"]) == (
        pytest.approx(1.3), pytest.approx(0.6), pytest.approx(0.7))
    assert (rows[1]["compute_s"], rows[1]["host_bound_s"], rows[1]["device_busy_s"]) == (
        pytest.approx(1.0), pytest.approx(0.0, abs=1e-12), pytest.approx(1.0))
    # the headline: the critical rank (rank 0: its compute is the critical path)
    assert pred["host_bound"] == {"rank": 0, "class": rows[0]["class"], "compute_s": pytest.approx(1.3),
                                  "host_bound_s": pytest.approx(0.6), "device_busy_s": pytest.approx(0.7)}

    text = summary_text(report, width=400)
    assert ("compute host-bound: 46 % of 1.30 s (rank 0, " in text
            and "the device was busy 700.0 ms (what the GPU alone needs: a floor, not a prediction)" in text), text
    assert "host-bound: 46 % of 1.30 s" in render_html(report)
    summary = report_summary(report)
    assert (summary["prism/host_bound_ms"], summary["prism/device_busy_ms"]) == (pytest.approx(600),
                                                                                pytest.approx(700))
    back = read_report(write_report(report, tmp_path / "report.json"))
    assert back["prediction"]["host_bound"] == pred["host_bound"]


def test_class_figures_are_the_mean_over_the_sandbox_ranks(tmp_path):
    """In the headline's window (the timed iteration), as the breakdown: not the warm-up's."""
    report = build_report(_trace(tmp_path, fold=True), cluster=None)
    [pair] = report["fold"]["classes"]
    assert (pair["compute_s"], pair["host_bound_s"], pair["device_busy_s"]) == (
        pytest.approx(1.15), pytest.approx(0.3), pytest.approx(0.85))
    text = summary_text(report, width=400)
    assert "host-bound" in text and "device busy" in text
    assert report_summary(report)["prism/classes/pair/device_busy_ms"] == pytest.approx(850)


def test_a_trace_without_gpu_times_says_nothing_of_it(tmp_path):
    report = build_report(_trace(tmp_path, gpu_rows=False, fold=True), cluster=None)
    pred = report["prediction"]
    assert pred["host_bound"] is None
    assert {(b["host_bound_s"], b["device_busy_s"]) for b in pred["breakdown"]} == {(None, None)}
    assert (report["fold"]["classes"][0]["host_bound_s"], report["fold"]["classes"][0]["device_busy_s"]) == (None, None)
    text = summary_text(report, width=400)
    assert "host-bound" not in text and "device busy" not in text
    assert "host-bound" not in render_html(report)
    assert not any("host_bound" in k or "device_busy" in k for k in report_summary(report))
    json.dumps(report)


H200_HOST = {"gpus": ["NVIDIA H200"], "cpu": "Intel(R) Xeon(R) Platinum 8480C", "cores": 16}
H100_HOST = {"gpus": ["NVIDIA H100 80GB HBM3"], "cpu": "AMD EPYC 9454 48-Core Processor", "cores": 16}


def test_a_host_bound_headline_names_the_machine_whose_host_measured_it(tmp_path):
    """46 % host-bound: the line says the host time is the emulating machine's, and which; the report keeps
    the machine; a trace that recorded none says nothing of it."""
    report = build_report(_trace(tmp_path, machine=H200_HOST), cluster=None)
    assert report["job"]["machine"] == H200_HOST
    text = summary_text(report, width=400)
    assert ("the device was busy 700.0 ms (what the GPU alone needs: a floor, not a prediction); that host time is "
            "the emulating machine's (Intel(R) Xeon(R) Platinum 8480C, 16 cores): another host moves it") in text
    assert "another host moves it" in render_html(report)
    assert read_report(write_report(report, tmp_path / "report.json"))["job"]["machine"] == H200_HOST
    bare = build_report(_trace(tmp_path, name="bare"), cluster=None)
    assert bare["job"]["machine"] is None and "another host moves it" not in summary_text(bare, width=400)


def test_compare_says_when_host_bound_layouts_come_from_different_machines(tmp_path):
    """Two host-bound reports of two emulating machines: their order may be the machines', said; of one
    machine: nothing said."""
    from prism_megatron.report.compare import comparison_text, layout_of

    def row(label, machine):
        return layout_of(build_report(_trace(tmp_path, machine=machine, name=label), cluster=None), label, label)

    text = comparison_text([row("a", H200_HOST), row("b", H100_HOST)])
    assert ("note: host-bound times here come from different or unrecorded emulating machines (a: Intel(R) Xeon(R) "
            "Platinum 8480C, 16 cores; b: AMD EPYC 9454 48-Core Processor, 16 cores): a host-bound time is its "
            "emulating host's, so the order may be the machines'") in text
    assert "note: host-bound" not in comparison_text([row("c", H200_HOST), row("d", H200_HOST)])
    assert "f: not recorded" in comparison_text([row("e", H200_HOST), row("f", None)])
