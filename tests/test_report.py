"""`prism-megatron report`: classes, memory maxima, OOM verdicts, replay figures, file formats, CLI."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from prism_megatron.cli import main
from prism_megatron.report import (
    ReportFormatError,
    build_report,
    make_report,
    rank_class,
    read_report,
    render_html,
    summary_text,
    write_report,
)
from prism_megatron.trace import TraceFormatError, write_trace

GIB = 1 << 30
MIB = 1 << 20
CAP = 4 * GIB
#: the failing allocation's site an OOM mark records (``memory.probe.allocation_site``), outermost first
OOM_SITE = ["megatron/core/transformer/transformer_layer.py:420 (forward)",
            "megatron/core/transformer/mlp.py:150 (forward)"]
# per iteration: stage 0 computes A, then sends to stage 1, which computes B[k]; an all_reduce ends it
A = 1.0
B = (2.0, 4.0, 3.0)  # iteration times with free communication: 3, 5, 4 -> median 4 (iteration 3)


def _op(rank, index, kind, group, seq, t, compute_before, peer=-1):
    return {"rank": rank, "index": index, "kind": kind, "group": group, "seq": seq, "peer": peer, "root": -1,
            "bytes": 1 << 20, "dtype": "torch.bfloat16", "shapes": [[512, 1024]], "reduce_op": "" if peer >= 0
            else "sum", "async_op": False, "t_issue": t, "t_complete": t + 0.01, "compute_before": compute_before,
            "label": "pp" if peer >= 0 else "dp"}


def _mark(rank, name, t, clock, phase="i", **attrs):
    return {"rank": rank, "name": name, "phase": phase, "t": t, "compute_clock": clock, "attrs": attrs}


def _memory(rank, iteration, t, clock, max_allocated, max_reserved, cap=CAP):
    return _mark(rank, "memory", t, clock, iteration=iteration, allocated=max_allocated // 2,
                 reserved=max_reserved // 2, max_allocated=max_allocated, max_reserved=max_reserved,
                 source="cuda", cap=cap)


def set_job(trace, field, value):
    """Set the manifest's job.FIELD as a run writes it; returns the trace."""
    manifest = trace / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["job"][field] = value
    manifest.write_text(json.dumps(doc))
    return trace


def make_trace(path, world=4, oom_rank=None, target=True, memory=True, layout=True, ep_size=1):
    """A pp=2 job: ranks [0, world/2) are stage 0, the rest stage 1; rank r pairs with r + world/2.

    Stage-0 rank r's peak reserved memory grows to (1 + r/8) GiB, stage-1 ranks to 3.5 GiB (+ r/16);
    with ``oom_rank`` that rank dies in iteration 2 asking for 1 GiB with 3.5 GiB reserved (cap 4 GiB).
    """
    half = world // 2
    groups = [{"id": 0, "name": "world", "ranks": list(range(world)), "backend": "nccl"}]
    groups += [{"id": 1 + r, "name": f"pp{r}", "ranks": [r, r + half], "backend": "nccl"} for r in range(half)]
    ops, marks = [], []
    for r in range(world):
        stage, peer = (0, r + half) if r < half else (1, r - half)
        if layout:
            marks.append(_mark(r, "layout", 0.0, 0.0, tp=0, tp_size=1, pp=stage, pp_size=2, dp=r % half,
                               dp_size=half, cp=0, cp_size=1, ep=r % ep_size, ep_size=ep_size, vpp_size=None))
        marks.append(_mark(r, "workload", 0.0, 0.0, global_batch_size=8, seq_length=512,
                           tokens_per_iteration=4096, flops_per_iteration=8e12 * world / 4))
        idx, clock = 0, 0.0
        for k, b in enumerate(B, start=1):
            base = 10.0 * k
            marks.append(_mark(r, "iteration", base, clock, "B", iteration=k))
            if r == oom_rank and k == 2:
                marks.append(_mark(r, "oom", base + 0.5, clock, requested=GIB, allocated=3 * GIB,
                                   reserved=int(3.5 * GIB), max_allocated=3 * GIB, max_reserved=int(3.5 * GIB),
                                   cap=CAP, message="CUDA out of memory. Tried to allocate 1.00 GiB",
                                   snapshot="oom-rank3.pickle", where=OOM_SITE))
                break
            if stage == 0:
                ops.append(_op(r, idx, "send", 1 + r, k - 1, base + A, A, peer=peer))
                ops.append(_op(r, idx + 1, "all_reduce", 0, k - 1, base + A + 0.1, 0.0))
                clock += A
            else:
                ops.append(_op(r, idx, "recv", 1 + peer, k - 1, base + 0.05, 0.0, peer=peer))
                ops.append(_op(r, idx + 1, "all_reduce", 0, k - 1, base + b + 1.0, b))
                clock += b
            idx += 2
            marks.append(_mark(r, "iteration", base + 9.0, clock, "E", iteration=k))
            if memory:
                peak = int((1 + r / 8) * GIB) if stage == 0 else int((3.5 + r / 16) * GIB) - (3 - k) * MIB
                marks.append(_memory(r, k, base + 9.5, clock, peak - 256 * MIB, peak))
    job = {"argv": ["pretrain_gpt.py", "--pp", "2"], "script": "pretrain_gpt.py", "devices": ["0"],
           "slots_per_device": 2, "swap": {"3": {"swaps_out": 2, "swaps_in": 2}}}
    if target:
        job["target_gpu"] = {"name": "H100 80GB", "capacity": 80 * GIB, "usable": CAP, "context": 76 * GIB,
                             "source": "test"}
    ranks = [{"rank": r, "exit_code": 5 if r == oom_rank else 0, "device": "cuda:0"} for r in range(world)]
    return write_trace(path, {"world_size": world, "groups": groups, "ranks": ranks, "job": job}, ops, marks=marks)


# ----------------------------------------------------------------------------------------- classes


def test_rank_class():
    def layout(**kw):
        return {"tp": 0, "tp_size": 1, "pp": 0, "pp_size": 1, "dp": 0, "dp_size": 1, "cp": 0, "cp_size": 1,
                "ep": 0, "ep_size": 1, "vpp_size": None, **kw}

    assert rank_class(None) == "unknown"
    assert rank_class(layout()) == "all ranks"
    assert rank_class(layout(pp=0, pp_size=4)) == "stage 0 of 4 (first)"
    assert rank_class(layout(pp=2, pp_size=4)) == "stage 2 of 4"
    assert rank_class(layout(pp=3, pp_size=4)) == "stage 3 of 4 (last)"
    assert rank_class(layout(ep=5, ep_size=8)) == "expert rank 5"
    assert rank_class(layout(pp=1, pp_size=2, ep=1, ep_size=2)) == "stage 1 of 2 (last) · expert rank 1"


# ------------------------------------------------------------------------------------ build_report


def test_fitting_job_prediction_memory_and_verdict(tmp_path):
    rep = build_report(make_trace(tmp_path / "t"))
    pred = rep["prediction"]
    assert rep["prediction_error"] is None
    assert pred["iteration_times_s"] == pytest.approx([3.0, 5.0, 4.0])
    assert pred["iteration_time_s"] == pytest.approx(4.0)
    assert pred["tokens_per_s"] == pytest.approx(4096 / 4.0)
    assert pred["tflops_per_gpu"] == pytest.approx(8e12 / 4.0 / 4 / 1e12)
    assert "communication free" in pred["provenance"] and "uncalibrated" in pred["provenance"]
    # median iteration (3): stage 0 computes 1 s then waits 3 s, stage 1 waits 1 s then computes 3 s
    bd = {b["rank"]: b for b in pred["breakdown"]}
    assert (bd[0]["compute_s"], bd[0]["bubble_s"]) == pytest.approx((1.0, 3.0))
    assert (bd[3]["compute_s"], bd[3]["bubble_s"], bd[3]["exposed_comm_s"]) == pytest.approx((3.0, 1.0, 0.0))
    assert bd[2]["class"] == "stage 1 of 2 (last)"
    tl = pred["timeline"]
    assert tl["iteration"] == 3 and tl["end_s"] - tl["start_s"] == pytest.approx(4.0)
    assert [s[0] for s in tl["rows"][0]["segments"]] == ["compute", "bubble"]
    assert pred["critical_path"]["by_kind_s"]["compute"] == pytest.approx(4.0)

    mem = rep["memory"]
    assert mem["source"] == "cuda"
    by_rank = {e["rank"]: e for e in mem["ranks"]}
    assert by_rank[1]["max_reserved"] == int(1.125 * GIB)  # the max over its iterations
    assert by_rank[1]["max_allocated"] == int(1.125 * GIB) - 256 * MIB
    assert by_rank[3]["max_reserved"] == int((3.5 + 3 / 16) * GIB)  # last iteration is the largest
    assert by_rank[3]["headroom"] == CAP - by_rank[3]["max_reserved"]
    assert not any(e["oom"] for e in mem["ranks"])
    classes = {c["class"]: c for c in mem["classes"]}
    assert list(classes) == ["stage 0 of 2 (first)", "stage 1 of 2 (last)"]
    assert classes["stage 1 of 2 (last)"]["ranks"] == [2, 3]
    assert classes["stage 1 of 2 (last)"]["max_reserved"] == by_rank[3]["max_reserved"]
    assert classes["stage 1 of 2 (last)"]["headroom"] == by_rank[3]["headroom"]
    assert classes["stage 0 of 2 (first)"]["headroom"] == CAP - by_rank[1]["max_reserved"]
    # the peak's iteration: stage 0 holds its peak from iteration 1 on; stage 1 still grew in iteration 3, the
    # last: a longer run may peak higher, and the terminal table says so
    assert [(by_rank[r]["peak_iteration"], by_rank[r]["peak_rising"]) for r in range(4)] == [
        (1, False), (1, False), (3, True), (3, True)]
    assert [(c["peak_iteration"], c["peak_rising"]) for c in mem["classes"]] == [(1, False), (3, True)]

    assert rep["verdict"] == "fits: smallest headroom 320.0 MiB on H100 80GB (rank 3, stage 1 of 2 (last))"
    assert rep["target"] == {"gpu": "H100 80GB", "capacity_bytes": 80 * GIB, "usable_bytes": CAP,
                             "context_bytes": 76 * GIB, "source": "test"}
    assert rep["job"]["argv"] == ["pretrain_gpt.py", "--pp", "2"] and rep["job"]["slots_per_device"] == 2
    assert rep["swap"] == {"3": {"swaps_out": 2, "swaps_in": 2}}
    assert rep["oom"] == []


def test_cluster_profile_costs_communication(tmp_path):
    free = build_report(make_trace(tmp_path / "t"))["prediction"]
    costed = build_report(tmp_path / "t", cluster="h100-nvlink-ib400")["prediction"]
    assert "cluster profile h100-nvlink-ib400" in costed["provenance"] and costed["cluster"] == "h100-nvlink-ib400"
    assert costed["iteration_time_s"] > free["iteration_time_s"]
    assert any(b["exposed_comm_s"] > 0 for b in costed["breakdown"])


def test_oom_job_verdict_names_rank_and_class(tmp_path):
    rep = build_report(make_trace(tmp_path / "t", oom_rank=3))
    # rank 3 stopped in iteration 2, the others wait forever in its all_reduce: no prediction, no crash
    assert rep["prediction"] is None
    assert "deadlock" in rep["prediction_error"]
    # the verdict names the program's innermost frame of the failing request, and what was allocated then
    assert rep["verdict"].startswith("OOM: rank 3 (stage 1 of 2 (last)) ran out of memory on H100 80GB asking for "
                                     "1.0 GiB at megatron/core/transformer/mlp.py:150 (forward) with 3.0 GiB "
                                     "allocated and 3.5 GiB of its 4.0 GiB cap reserved")
    assert "fit" not in rep["verdict"]  # the first stage's ranks ended with the job: not measured to its end
    [oom] = rep["oom"]
    assert oom == {"rank": 3, "class": "stage 1 of 2 (last)", "requested": GIB, "allocated": 3 * GIB,
                   "reserved": int(3.5 * GIB), "max_allocated": 3 * GIB, "max_reserved": int(3.5 * GIB),
                   "cap": CAP, "message": "CUDA out of memory. Tried to allocate 1.00 GiB",
                   "snapshot": "oom-rank3.pickle", "where": OOM_SITE}
    by_rank = {e["rank"]: e for e in rep["memory"]["ranks"]}
    assert by_rank[3]["oom"] and not by_rank[2]["oom"]
    # its iteration-1 memory mark (3.6875 GiB - 2 MiB) is larger than the OOM mark's 3.5 GiB
    assert by_rank[3]["max_reserved"] == int((3.5 + 3 / 16) * GIB) - 2 * MIB


def test_verdict_without_cap_or_memory_or_layout(tmp_path):
    no_mem = build_report(make_trace(tmp_path / "a", memory=False, layout=False))
    assert no_mem["verdict"].startswith("no memory figures in this trace (on CPU they need")
    assert no_mem["memory"] == {"source": None, "ranks": [], "classes": []}
    assert {b["class"] for b in no_mem["prediction"]["breakdown"]} == {"unknown"}
    moe = build_report(make_trace(tmp_path / "b", ep_size=2, target=False))
    assert moe["target"]["gpu"] is None
    assert [c["class"] for c in moe["memory"]["classes"]] == [
        "stage 0 of 2 (first) · expert rank 0", "stage 0 of 2 (first) · expert rank 1",
        "stage 1 of 2 (last) · expert rank 0", "stage 1 of 2 (last) · expert rank 1"]


def test_bad_memory_mark_names_file_and_field(tmp_path):
    path = make_trace(tmp_path / "t")
    import pyarrow.parquet as pq

    marks = pq.read_table(path / "marks.parquet").to_pylist()
    for m in marks:
        if m["name"] == "memory" and m["rank"] == 2:
            attrs = json.loads(m["attrs"])
            del attrs["max_reserved"]
            m["attrs"] = json.dumps(attrs)
    manifest = json.loads((path / "manifest.json").read_text())
    ops = pq.read_table(path / "ops.parquet")
    write_trace(path, manifest, ops, marks=marks)
    with pytest.raises(TraceFormatError, match=r"marks.parquet: mark 'memory' of rank 2: attrs 'max_reserved' "
                                               r"is missing"):
        build_report(path)


# ------------------------------------------------------------------------------------------ files


def test_make_report_says_what_each_step_took_as_it_ends(tmp_path):
    """A thousand-rank job's replay takes minutes: the run says when it starts and what each step took."""
    said: list[str] = []
    paths = make_report(make_trace(tmp_path / "t"), tmp_path / "out", say=said.append)
    assert [re.sub(r"[0-9.]+ (s|KiB)", r"N \1", m) for m in said] == [
        f"replaying the trace and building the report of {tmp_path / 't'}", "replayed and built in N s",
        "report.json and report.html written in N s", "timeline.json (N KiB) written in N s"]
    assert set(paths) == {"report", "html", "timeline"}


def test_the_report_step_bench_reads_the_steps_a_run_says(tmp_path):
    """bench/targets/report_step_model.py sums the step's three timed lines as a run prints them (publish's
    ``prism: report:`` prefix on make_report's words), and says so when the run did not reach its report."""
    from tests.bench_scripts import load_bench

    bench = load_bench("targets/report_step_model.py")
    said: list[str] = []
    make_report(make_trace(tmp_path / "t"), tmp_path / "out", say=said.append)
    run = tmp_path / "run"
    run.mkdir()
    lines = "".join(f"prism: report: {m}\n" for m in said)
    (run / "run.log").write_text("prism: capture: 1/1 ranks finished\n" + lines)
    times = [float(x) for m in said[1:] for x in re.findall(r"in ([0-9.]+) s$", m)]
    assert len(times) == 3 and bench.measured(run) == pytest.approx(sum(times))
    (run / "run.log").write_text("".join(f"prism: report: {m}\n" for m in said[:2]))  # cut before the files
    assert bench.measured(run) is None


def test_report_json_round_trip_and_reader_errors(tmp_path):
    paths = make_report(make_trace(tmp_path / "t"), tmp_path / "out")
    assert set(paths) == {"report", "html", "timeline"}
    rep = read_report(paths["report"])
    assert rep["format"] == "prismreport" and rep["version"] == 7
    assert rep["job"]["machine"] is None  # this synthetic trace recorded no machine
    assert rep == json.loads(paths["report"].read_text())
    assert {(b["host_bound_s"], b["device_busy_s"]) for b in rep["prediction"]["breakdown"]} == {(None, None)}
    assert rep["prediction"]["host_bound"] is None  # a CPU trace: one clock, nothing to say
    assert read_report(tmp_path / "out") == rep  # the directory works too

    bad = tmp_path / "bad.json"
    write_report(rep, bad)
    doc = json.loads(bad.read_text())
    doc["version"] = 8
    bad.write_text(json.dumps(doc))
    with pytest.raises(ReportFormatError, match=r"report .*bad.json: field 'version' is 8; this reader supports"):
        read_report(bad)
    del doc["job"]["machine"]  # v6 had no machine: it reads as null; v7 must have it
    doc["version"] = 7
    bad.write_text(json.dumps(doc))
    with pytest.raises(ReportFormatError, match=r"field 'job.machine' is missing"):
        read_report(bad)
    doc["version"] = 6
    bad.write_text(json.dumps(doc))
    assert read_report(bad)["job"]["machine"] is None
    for row in doc["memory"]["classes"]:  # v4 had no peak iteration: it reads as null; v5 must have it
        del row["peak_iteration"], row["peak_rising"]
    doc["version"] = 5
    bad.write_text(json.dumps(doc))
    with pytest.raises(ReportFormatError, match=r"field 'memory.classes\[0\].peak_iteration' is missing"):
        read_report(bad)
    doc["version"] = 4
    bad.write_text(json.dumps(doc))
    assert {(c["peak_iteration"], c["peak_rising"]) for c in read_report(bad)["memory"]["classes"]} == {(None, None)}
    doc["version"] = 3  # v3 had no device_busy_s nor host_bound: they read as null
    del doc["prediction"]["host_bound"]
    for b in doc["prediction"]["breakdown"]:
        del b["device_busy_s"]
    bad.write_text(json.dumps(doc))
    assert read_report(bad)["prediction"]["host_bound"] is None
    assert {b["device_busy_s"] for b in read_report(bad)["prediction"]["breakdown"]} == {None}
    doc["version"] = 4  # v4 has them
    bad.write_text(json.dumps(doc))
    with pytest.raises(ReportFormatError, match=r"field 'prediction.breakdown\[0\].device_busy_s' is missing"):
        read_report(bad)
    doc["version"] = 2  # v2 had no fold: it reads as null
    del doc["fold"]
    bad.write_text(json.dumps(doc))
    assert read_report(bad)["fold"] is None
    doc["version"] = 1  # v1 had no host_bound_s: it reads as null
    for b in doc["prediction"]["breakdown"]:
        del b["host_bound_s"]
    bad.write_text(json.dumps(doc))
    assert {b["host_bound_s"] for b in read_report(bad)["prediction"]["breakdown"]} == {None}
    del doc["memory"]["classes"][0]["headroom"]
    bad.write_text(json.dumps(doc))
    with pytest.raises(ReportFormatError, match=r"bad.json: field 'memory.classes\[0\].headroom' is missing"):
        read_report(bad)
    doc = json.loads(paths["report"].read_text())
    doc["prediction"]["iteration_time_s"] = "4 s"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ReportFormatError, match=r"field 'prediction.iteration_time_s' is string, expected"):
        read_report(bad)
    doc["format"] = "prismtrace"
    bad.write_text(json.dumps(doc))
    with pytest.raises(ReportFormatError, match=r"field 'format' is 'prismtrace', expected 'prismreport'"):
        read_report(bad)
    with pytest.raises(ReportFormatError, match=r"nope.json: file is missing"):
        read_report(tmp_path / "nope.json")
    with pytest.raises(ReportFormatError, match=r"field 'verdict' is missing"):
        write_report({k: v for k, v in rep.items() if k != "verdict"}, tmp_path / "w.json")
    assert not (tmp_path / "w.json").exists()


def test_html_is_self_contained_with_svg(tmp_path):
    paths = make_report(make_trace(tmp_path / "t", oom_rank=None))
    assert paths["html"].parent == tmp_path / "t"  # default: next to the trace
    page = paths["html"].read_text()
    assert page.count("<svg") >= 2  # timeline and memory chart
    assert not re.search(r"https?://|<script|<link|@import|src=", page)
    assert "fits: smallest headroom" in page and "iteration 3" in page
    # one timeline row per rank, coloured by kind
    assert all(f">rank {r}<" in page for r in range(4))
    assert 'fill="#3b82f6"' in page and 'fill="#e5e7eb"' in page

    rep = build_report(make_trace(tmp_path / "oom", oom_rank=3))
    rep["oom"][0]["message"] = "<b>boom</b>"
    page = render_html(rep)
    assert "&lt;b&gt;boom&lt;/b&gt;" in page and "<b>boom" not in page
    assert ">OOM</text>" in page and "No prediction because the job did not run to its end" in page
    assert "the replay failed" in page and ">1 rank</b><span>out of memory" in page
    # the site, innermost first, in the OOM table
    assert ("<td>megatron/core/transformer/mlp.py:150 (forward) &lt;- "
            "megatron/core/transformer/transformer_layer.py:420 (forward)</td>") in page


def test_timeline_json_is_trace_events(tmp_path):
    paths = make_report(make_trace(tmp_path / "t"), tmp_path / "out", cluster="h100-nvlink-ib400")
    doc = json.loads(paths["timeline"].read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {0, 1, 2, 3} <= {e["pid"] for e in xs}
    assert {"compute", "bubble"} <= {e["cat"] for e in xs}
    assert doc["otherData"]["provenance"]["cluster"] == "h100-nvlink-ib400"
    # a failed replay leaves no (stale) timeline behind
    make_trace(tmp_path / "t", oom_rank=3)
    assert "timeline" not in make_report(tmp_path / "t", tmp_path / "out")
    assert not (tmp_path / "out" / "timeline.json").exists()


def test_terminal_summary(tmp_path):
    text = summary_text(build_report(make_trace(tmp_path / "t", oom_rank=3)), width=140)
    verdict_end = text.index("OOM: rank 3 (stage 1 of 2 (last))") + len("OOM: rank 3")
    assert "\nout of memory" in text[verdict_end:]  # the verdict first, then the table of failing allocations
    assert "no prediction: the replay failed" in text
    assert "stage 0 of 2 (first)" in text and "CUDA out of memory" not in text  # its figures are the columns
    assert "megatron/core/transformer/mlp.py:150 (forward)" in text.split("asked for at")[1]
    big = summary_text(build_report(make_trace(tmp_path / "big", world=40)), width=140)
    assert "median iteration per class" in big and "20-39" in big  # 40 ranks: per class, not per rank
    assert "predicted iteration 4" in big
    assert "it. 3 rising" in big and "rising: stage 1 of 2 (last) reserved more in the last captured" in big
    # the trace of make_trace had rank 3 swapped twice each way (no bytes or seconds recorded)
    assert "state preservation during the capture: swaps: 2 out, 2 in, 0.0 GiB moved" in text
    assert "state preservation" not in summary_text(dict(build_report(make_trace(tmp_path / "n")), swap=None))


def test_terminal_headline_says_which_iterations_its_median_is_of(tmp_path):
    """On a GPU trace the headline is the median of the iterations timed on host and GPU, not of the
    warm-up iterations before GPU timing started; the line says so and still shows all of them."""
    from prism_megatron.report.live import basis

    report = build_report(make_trace(tmp_path / "t", world=4))
    pred = report["prediction"]
    n = len(pred["iteration_times_s"])
    assert n >= 2
    times = [10.0 * (i + 1) for i in range(n)]
    timed = dict(pred, iteration_times_s=times, iteration_time_s=times[-1],
                 iteration_bases=[basis(False)] * (n - 1) + [basis(True)])
    text = summary_text(dict(report, prediction=timed), width=200)
    assert f"(median of 1 timed on host and GPU; all {n}: 10.00 s - {times[-1]:.2f} s)" in text, text
    every = dict(pred, iteration_times_s=times, iteration_bases=[basis(True)] * n)
    assert f"(median of {n}; 10.00 s - " in summary_text(dict(report, prediction=every), width=200)


# -------------------------------------------------------------------------------------------- CLI


def test_cli_report(tmp_path):
    trace = make_trace(tmp_path / "t", oom_rank=3)
    res = CliRunner().invoke(main, ["report", str(trace), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert "OOM: rank 3 (stage 1 of 2 (last))" in res.output
    assert f"wrote {tmp_path / 'out' / 'report.html'}" in res.output
    assert read_report(tmp_path / "out" / "report.json")["oom"][0]["rank"] == 3

    ok = CliRunner().invoke(main, ["report", str(make_trace(tmp_path / "f")), "--cluster", "h100-nvlink-ib400"])
    assert ok.exit_code == 0, ok.output
    assert "costed by cluster profile h100-nvlink-ib400" in ok.output and (tmp_path / "f" / "timeline.json").exists()

    missing = CliRunner().invoke(main, ["report", str(tmp_path / "nope")])
    assert missing.exit_code == 1
    assert f"trace {tmp_path / 'nope'}: directory does not exist" in missing.output
    assert "Traceback" not in missing.output
    bad = CliRunner().invoke(main, ["report", str(trace), "--cluster", "no-such-cluster"])
    assert bad.exit_code == 1 and "cluster profile no-such-cluster" in bad.output


def test_report_imports_neither_runtime_nor_megatron(tmp_path):
    """Reports are made anywhere from trace files: no runtime, torch or Megatron needed."""
    import subprocess
    import sys

    make_trace(tmp_path / "t")
    code = ("import sys; from prism_megatron.report import make_report; "
            f"make_report({str(tmp_path / 't')!r}, cluster='h100-nvlink-ib400'); "
            "print(sorted(m for m in sys.modules if m.startswith(('prism_megatron.runtime', 'megatron', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_megatron_formula_anchor_beside_the_measured_peak(tmp_path):
    from prism_megatron.report.units import fmt_bytes
    from prism_megatron.trace import read_trace

    t = read_trace(make_trace(tmp_path / "t"))
    marks = t.marks.to_pylist()
    marks.append(_mark(0, "megatron_estimate", 0.0, 0.0, weight_and_optimizer=2 * GIB, activation=GIB,
                       total=3 * GIB, source="megatron.training.theoretical_memory_usage (most loaded shard)"))
    manifest = {k: t.manifest[k] for k in ("world_size", "groups", "ranks", "job")}
    path = write_trace(tmp_path / "t2", manifest, t.ops.to_pylist(), marks=marks)
    report = build_report(path)
    anchors = report["anchors"]
    assert anchors["megatron_formula"]["total"] == 3 * GIB
    top = max(report["memory"]["classes"], key=lambda c: c["max_allocated"])
    assert anchors["measured_max_allocated"] == {"class": top["class"], "bytes": top["max_allocated"]}
    text = summary_text(report, width=300)
    expected = 100 * (3 * GIB - top["max_allocated"]) / top["max_allocated"]
    assert "Megatron's memory formula (most loaded shard): 3.0 GiB" in text and f"{expected:+.1f}%" in text
    assert "memory formula" in render_html(report)
    assert build_report(make_trace(tmp_path / "plain"))["anchors"]["megatron_formula"] is None

    # the most loaded class ran out of memory: its peak stops at the failing allocation, so no difference
    t = read_trace(make_trace(tmp_path / "oom", oom_rank=3))
    marks = [*t.marks.to_pylist(), marks[-1]]
    manifest = {k: t.manifest[k] for k in ("world_size", "groups", "ranks", "job")}
    report = build_report(write_trace(tmp_path / "oom2", manifest, t.ops.to_pylist(), marks=marks))
    top = report["anchors"]["measured_max_allocated"]
    assert top["class"] == report["oom"][0]["class"]
    text = summary_text(report, width=300)
    assert (f"vs measured max allocated {fmt_bytes(top['bytes'])} ({top['class']}, up to its OOM: a floor of its "
            "need, so no difference is given)") in text
    assert "%)" not in text.split("Megatron's memory formula")[1].splitlines()[0]


def test_untimed_differences_name_what_differs_beyond_times(tmp_path):
    from prism_megatron.trace import read_trace
    from prism_megatron.trace.untimed import untimed_differences

    a, same = read_trace(make_trace(tmp_path / "a")), read_trace(make_trace(tmp_path / "b"))
    assert untimed_differences(a, same) == []
    assert untimed_differences(a, read_trace(make_trace(tmp_path / "m", memory=False))) == ["marks"]
    assert untimed_differences(a, read_trace(make_trace(tmp_path / "w", world=6))) == ["ops", "marks", "groups"]


def test_a_stopped_runs_report_predicts_from_the_iterations_every_rank_ended(tmp_path):
    """A run stopped mid-iteration (SIGTERM from a time limit) leaves collectives some ranks never reached:
    the replay of the whole trace deadlocks, so the report replays the iterations every rank ended and says
    so; a complete trace that deadlocks still says why it has no prediction."""
    trace = make_trace(tmp_path / "t", oom_rank=3)  # rank 3 stops in iteration 2
    assert "deadlock" in build_report(trace)["prediction_error"]  # complete: a real deadlock
    manifest = trace / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc.update(complete=False, incomplete="ended by SIGTERM")
    manifest.write_text(json.dumps(doc))
    rep = build_report(trace)
    assert rep["prediction_error"] is None and len(rep["prediction"]["iteration_times_s"]) == 1
    assert any("stopped mid-iteration (ended by SIGTERM): iterations 1-1" in n for n in rep["prediction"]["notes"])
    doc.update(incomplete="rank 3 ran out of memory under the target's cap (predicted OOM)")
    manifest.write_text(json.dumps(doc))
    assert build_report(trace)["prediction"] is None  # a job that failed is not predicted from its first iterations


def test_the_pages_timeline_merges_a_kinds_contiguous_segments_whatever_their_boundaries():
    """Segments whose boundaries are no round numbers (every real replay's) merge like round ones: a rank's run of
    compute units is one bar, not one per unit."""
    from types import SimpleNamespace

    from prism_megatron.replay.engine import ReplayResult, Segment
    from prism_megatron.report.build import _timeline

    cuts = [0.0, 1 / 3, 2 / 3, 1.0, 7 / 6, 4 / 3]
    kinds = ["compute", "compute", "bubble", "compute", "compute"]
    segs = [Segment(0, k, a, b) for k, a, b in zip(kinds, cuts, cuts[1:], strict=False)]
    segs.insert(2, Segment(0, "comm", 0.5, 0.6, "all_reduce"))  # in flight beside the compute: not drawn
    result = ReplayResult(SimpleNamespace(ranks=[0]), 0.0, {}, {0: segs}, {}, [], [])
    rows = _timeline(result, {0: "only"}, 1, 0.0, 4 / 3)["rows"]
    assert rows == [{"rank": 0, "class": "only", "segments": [["compute", 0.0, 0.666666667],
                                                              ["bubble", 0.666666667, 1.0],
                                                              ["compute", 1.0, 1.333333333]]}]


def test_the_reports_timeline_merges_runs_narrower_than_its_resolution_keeping_each_kinds_share(tmp_path):
    """A row of 20,000 alternating short runs (an MoE layer's waits) is kept as about a step each, each
    with its runs' count and every kind's seconds, nothing lost; a run a step wide stays as it is. A v6 reader
    takes such entries; it refuses one of another length, and a v5 report may not have them."""
    from types import SimpleNamespace

    from prism_megatron.replay.engine import ReplayResult, Segment
    from prism_megatron.report.build import TIMELINE_STEPS, _timeline
    from prism_megatron.report.runs import parts

    segs = [Segment(0, "compute" if i % 4 else "bubble", i * 1e-6, (i + 1) * 1e-6) for i in range(40_000)]
    segs.append(Segment(0, "exposed_comm", 0.04, 0.08))
    result = ReplayResult(SimpleNamespace(ranks=[0]), 0.0, {}, {0: segs}, {}, [], [])
    entries = _timeline(result, {0: "only"}, 1, 0.0, 0.08)["rows"][0]["segments"]
    assert entries[-1] == ["exposed_comm", 0.04, 0.08]
    merged = [parts(e) for e in entries[:-1]]
    steps = TIMELINE_STEPS / 2  # the runs fill half the window: one entry per step or two
    assert steps / 2 <= len(merged) <= steps
    assert sum(n for *_, n, _ in merged) == 20_000  # a bubble, then one run of three compute units
    assert abs(sum(share.get("bubble", 0.0) for *_, share in merged) - 0.01) < 1e-9
    assert {kind for kind, *_ in merged} == {"compute"}
    assert all(abs(a[2] - b[1]) < 1e-12 for a, b in zip(merged, merged[1:], strict=False))  # contiguous

    rep = read_report(make_report(make_trace(tmp_path / "t"), tmp_path / "out")["report"])
    row = rep["prediction"]["timeline"]["rows"][0]
    row["segments"] = entries
    path = tmp_path / "merged.json"
    path.write_text(json.dumps(rep))
    assert read_report(path)["prediction"]["timeline"]["rows"][0]["segments"][0] == entries[0]
    rep["version"] = 5
    path.write_text(json.dumps(rep))
    with pytest.raises(ReportFormatError, match=r"field 'prediction.timeline.rows\[0\].segments\[0\]' has 4 items"):
        read_report(path)
    rep["version"] = 6
    row["segments"] = [["compute", 0.0, 1.0, {"segments": 2}]]
    path.write_text(json.dumps(rep))
    with pytest.raises(ReportFormatError, match=r"segments\[0\]\[3\].share_s' is missing"):
        read_report(path)


def test_the_chrome_timeline_keeps_one_slice_for_an_activity_that_goes_on():
    """Contiguous slices of one activity (unlabelled compute units, whose boundaries are no round numbers) are one
    slice on the rank's activity thread; another kind or label, or a gap, starts a new one; comm keeps every op."""
    from types import SimpleNamespace

    from prism_megatron.replay.engine import Segment
    from prism_megatron.replay.export import ACTIVITY_TID, to_chrome

    segs = [Segment(0, "compute", 0.0, 1 / 3), Segment(0, "compute", 1 / 3, 2 / 3),
            Segment(0, "comm", 0.5, 0.6, "all_reduce"), Segment(0, "comm", 0.6, 0.7, "all_reduce"),
            Segment(0, "exposed_comm", 2 / 3, 0.7), Segment(0, "compute", 0.7, 0.8, "optimizer"),
            Segment(0, "compute", 0.8, 0.9), Segment(0, "compute", 1.0, 1.1)]
    result = SimpleNamespace(graph=SimpleNamespace(ranks=[0], source="t"), segments={0: segs}, marks=[],
                             critical_path=[], makespan=1.1, iteration_times=lambda: [1.1])
    xs = [e for e in to_chrome(result)["traceEvents"] if e["ph"] == "X"]
    activity = [(e["name"], e["ts"], round(e["ts"] + e["dur"], 3)) for e in xs if e["tid"] == ACTIVITY_TID]
    assert activity == [("compute", 0.0, 666666.667), ("exposed_comm", 666666.667, 700000.0),
                        ("optimizer", 700000.0, 800000.0), ("compute", 800000.0, 900000.0),
                        ("compute", 1000000.0, 1100000.0)]
    assert sum(e["cat"] == "comm" for e in xs) == 2


def test_the_timeline_holds_the_headline_iteration_unless_every_one_is_asked_for(tmp_path):
    """timeline.json holds the iteration the headline time is the median of (every rank's whole step in it, and the
    loop's time before it that the iteration's time counts): slices clipped to that window, marker spans only where
    both their ends are inside it; 'all' holds every iteration; anything else is refused, named."""
    from prism_megatron.replay.engine import MarkTime
    from prism_megatron.replay.export import _marks_within

    trace = make_trace(tmp_path / "t")
    one = make_report(trace, tmp_path / "one")
    number = read_report(one["report"])["prediction"]["timeline"]["iteration"]
    doc = json.loads(one["timeline"].read_text())
    lo, hi = doc["otherData"]["window_s"]
    assert doc["otherData"]["iteration"] == number
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert xs and all(lo * 1e6 - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= hi * 1e6 + 1e-3 for e in xs)
    its = [e for e in doc["traceEvents"] if e.get("name") == "iteration" and e["ph"] in "BE"]
    assert {e["args"]["iteration"] for e in its if e["ph"] == "B"} == {number}
    assert sorted(e["pid"] for e in its if e["ph"] == "B") == sorted(e["pid"] for e in its if e["ph"] == "E") == \
        [0, 1, 2, 3]

    every = json.loads(make_report(trace, tmp_path / "all", timeline="all")["timeline"].read_text())
    assert "window_s" not in every["otherData"]
    assert {e["args"]["iteration"] for e in every["traceEvents"] if e.get("name") == "iteration" and e["ph"] == "B"} \
        == {1, 2, 3}
    assert len([e for e in every["traceEvents"] if e["ph"] == "X"]) > len(xs)
    with pytest.raises(ValueError, match="timeline 'median': one of iteration, all"):
        make_report(trace, tmp_path / "bad", timeline="median")

    marks = [MarkTime(0, "it", "B", 0.0), MarkTime(0, "unit", "B", 0.5), MarkTime(0, "unit", "E", 1.5),
             MarkTime(0, "unit", "B", 1.5), MarkTime(0, "unit", "E", 1.5), MarkTime(0, "x", "i", 1.7),
             MarkTime(0, "it", "E", 2.0), MarkTime(1, "unit", "B", 1.8), MarkTime(1, "unit", "E", 2.5)]
    kept = _marks_within(marks, 1.0, 2.1)  # spans cut by either edge go with both their ends
    assert [(m.rank, m.name, m.phase, m.t) for m in kept] == [(0, "unit", "B", 1.5), (0, "unit", "E", 1.5),
                                                              (0, "x", "i", 1.7)]


def test_the_page_draws_runs_of_segments_narrower_than_a_pixel_as_one_rect_each_with_every_kinds_share():
    """A row of 10,000 alternating 1 us segments over 10 ms (an MoE layer's waits) draws as about a rect per pixel,
    each coloured by its main kind and saying every kind's share; a segment a pixel wide is drawn as it is."""
    from prism_megatron.report.html import drawn_segments

    tiny = [["compute" if i % 4 else "bubble", i * 1e-6, (i + 1) * 1e-6] for i in range(10_000)]
    wide = ["exposed_comm", 0.01, 0.02]
    drawn = drawn_segments([*tiny, wide], pixel_s=19.5e-6)  # about 1,000 pixels over 20 ms
    assert drawn[-1] == ("exposed_comm", 0.01, 0.02, "exposed communication 10.0 ms (at 10.0 ms)")
    groups = drawn[:-1]
    assert len(groups) == 500
    assert all(kind == "compute" for kind, *_ in groups)
    assert groups[0][3] == "20 segments in 20.0 µs (at 0): compute 75%, bubble (waiting) 25%"
    assert groups[0][1] == 0.0 and abs(groups[-1][2] - 0.01) < 1e-12
    assert all(abs(a[2] - b[1]) < 1e-12 for a, b in zip(groups, groups[1:], strict=False))  # nothing left out
    assert drawn_segments([wide], 1e-5) == [drawn[-1]]
