"""Assemble the report of a trace: replay prediction, memory per rank and class, OOMs, verdict.

Works from trace files only (no runtime, no Megatron), so a report can be made anywhere, long
after the run. A job that died (of OOM, say) still gets a report: its replay usually cannot
finish, and then the prediction is null with the reason, while the memory part says why it died.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prism_megatron.replay import (
    Breakdown,
    Compute,
    GraphError,
    IncompleteCaptureError,
    ReplayResult,
    graph_from_trace,
    replay,
    zero_cost,
)
from prism_megatron.replay.export import activity_runs
from prism_megatron.trace import PrismTrace, TraceFormatError, read_trace
from prism_megatron.trace.fold import Fold
from prism_megatron.trace.microbatches import MicrobatchFold
from prism_megatron.trace.schema import stopped_by_signal

from .classify import UNKNOWN, class_order, rank_class
from .costing import Costing, choose_costing
from .live import basis, timed_iterations
from .margin import (
    TE_SUBSTITUTION_MARGIN,
    WITHIN_MARGIN,
    class_caps,
    class_estimates,
    class_verdicts,
    oom_classes,
    te_substituted,
)
from .runs import merge_narrow
from .schema import FORMAT, VERSION
from .units import fmt_bytes, rank_ranges

#: Exit code of a rank that ran out of memory under its cap (contract with the runtime).
OOM_EXIT_CODE = 5
#: The HTML timeline shows every rank up to this many, else a sample (one row per rank is unreadable).
MAX_TIMELINE_ROWS = 64
#: The report's timeline resolves a window into about this many steps per row (the page is ~1,000 pixels wide).
TIMELINE_STEPS = 2048
MAX_PATH_STEPS = 12
MAX_ERROR_LINES = 8
_MARKS = ("layout", "workload", "memory", "oom", "megatron_estimate")
_MEMORY_INTS = ("allocated", "reserved", "max_allocated", "max_reserved")


def build_report(trace_dir: str | Path, cluster: str | None = None,
                 calibrated: str | Path | None = None) -> dict[str, Any]:
    """The report dict of the trace at ``trace_dir`` (see ``schema.REPORT``).

    ``cluster`` names a cluster profile that costs communication (``costing.NO_PROFILE``: none, free);
    without it, the profile the run recorded in the trace (none recorded: free). ``calibrated``: a
    calibrated graph of this trace (``prism-megatron calibrate``), whose replay then gives the
    prediction. Raises TraceFormatError for a bad trace (or bad marks) and ProfileError (a ValueError)
    for a bad profile or a recorded profile file that is gone; a replay that fails gives a null prediction.
    """
    return assemble(trace_dir, cluster, calibrated)[0]


def assemble(trace_dir: str | Path, cluster: str | None = None,
             calibrated: str | Path | None = None) -> tuple[dict[str, Any], ReplayResult | None]:
    """The report and the replay it came from (None when the replay failed), for the timeline export."""
    trace = read_trace(trace_dir)
    marks = _read_marks(trace)
    fold = trace.fold
    if fold is None:
        classes = {r: rank_class(marks["layout"].get(r)) for r in range(trace.world_size)}
    else:  # the fold's classes; only live ranks have rows
        classes = {r: fold.class_name(r) for r in fold.live}
    job = trace.manifest["job"]
    costing = choose_costing(cluster, trace)
    result, error = _replay(trace, costing.cluster) if calibrated is None else _replay_calibrated(calibrated)
    memory = _memory(marks, classes, trace)
    oom = [_oom_entry(r, a, classes[r]) for r, a in sorted(marks["oom"].items())]
    exit5 = [e["rank"] for e in trace.manifest["ranks"] if e["exit_code"] == OOM_EXIT_CODE]
    dead = {e["rank"] for e in oom} | set(exit5)
    if result is None and calibrated is None:
        error = _oom_not_replayed(fold, dead) or error
    target = _target(job.get("target_gpu"))
    timed = None if calibrated else timed_iterations(trace)
    report = {
        "format": FORMAT,
        "version": VERSION,
        "created": datetime.now(timezone.utc).isoformat(),
        "trace": str(trace_dir),
        "job": {
            "world_size": trace.world_size,
            "argv": job["argv"] if isinstance(job.get("argv"), list) else None,
            "script": job["script"] if isinstance(job.get("script"), str) else None,
            "devices": job["devices"] if isinstance(job.get("devices"), (list, str)) else None,
            "slots_per_device": job["slots_per_device"] if type(job.get("slots_per_device")) is int else None,
            "machine": _machine(job.get("machine")),
        },
        "target": target,
        "prediction": None if result is None else _prediction(result, costing, classes, marks["workload"],
                                                              calibrated is not None, fold, trace.world_size,
                                                              timed,
                                                              trace.microbatches),
        "prediction_error": error,
        "memory": memory,
        "oom": oom,
        "swap": _swap(job.get("swap")),
        "verdict": verdict(memory, oom, exit5, classes, target["gpu"], _captured_in_full(fold))
        + _unmeasured(fold, dead),
        "fold": None if fold is None else _fold(fold, memory, result, timed),
        "anchors": {**_anchors(marks, memory), "fake_pg": _fake_pg(Path(trace_dir), memory)},
    }
    same_costing = costing.recorded or (costing.cluster is None and trace.cluster is None)
    if report["prediction"] is not None and calibrated is None and same_costing:
        checked = _live_check(job.get("live_predictions"), result, trace.path / "manifest.json")
        if checked is not None:  # the live predictions were replays of the same trace costed the same way
            report["prediction"]["live_predictions"] = checked
    subs = _substitutions(job.get("substitutions"), trace.path / "manifest.json")
    if subs is not None:
        report["substitutions"] = subs
    _mark_margin(report, _estimates(job.get("memory_estimates"), trace.path / "manifest.json"))
    return report, result


#: Relative difference within which a logged live prediction counts as the report's own figure (both are the same
#: replay's arithmetic; JSON keeps floats exactly).
LIVE_AGREES = 1e-9


def _live_check(logged: Any, result: ReplayResult, where: Path) -> dict[str, Any] | None:
    """The live predictions Megatron's log line gave (the trace's ``job.live_predictions``) against this replay's
    iterations: how many were logged and those that differ. An iteration whose GPU times arrived only with the
    next one was predicted live on one clock, so it may differ; any other difference is a fault."""
    def seconds(v: Any) -> bool:
        return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and v != float("inf"))

    if logged is None:
        return None
    if not isinstance(logged, dict) or not all(isinstance(k, str) and k.isdigit() and seconds(v)
                                               for k, v in logged.items()):
        raise TraceFormatError(where, "job.live_predictions", "expected iteration (as text) -> seconds or null")
    ours = {it.number: it.time for it in result.iterations()}
    differ = [{"iteration": int(k), "logged_s": v, "report_s": ours.get(int(k))} for k, v in logged.items()
              if v is None or int(k) not in ours or abs(v - ours[int(k)]) > LIVE_AGREES * max(abs(v), 1e-12)]
    return {"logged": len(logged), "differ": sorted(differ, key=lambda d: d["iteration"])}


def _mark_margin(report: dict[str, Any], estimates: dict[int, int]) -> None:
    """Each memory class's verdict; where the run substituted Transformer Engine, those within the margin
    (report.margin) are named so, in the class rows and after the verdict line (whose prefix stays). A
    class that ran out of memory is weighed by prism's estimate of its peak (``estimates``: rank -> bytes,
    the trace's ``job.memory_estimates``), given in its row and after the verdict line."""
    margin = TE_SUBSTITUTION_MARGIN if te_substituted(report.get("substitutions")) else None
    by_class = class_estimates(report["memory"], estimates)
    verdicts = class_verdicts(report["memory"], report["oom"], margin, by_class)
    dead = oom_classes(report["memory"], report["oom"])
    for c in report["memory"]["classes"]:
        c["verdict"] = verdicts[c["class"]]
        if c["class"] in by_class:
            c["estimate"] = by_class[c["class"]]
    near = [name for name, v in verdicts.items() if v == WITHIN_MARGIN]
    if near:
        report["verdict"] += (f"; within the TE-substitution margin (peak within {margin:.0%} of the cap, "
                              f"local spec rendered for Transformer Engine): {', '.join(near)}")
    caps = class_caps(report["memory"])
    weighed = [f"{name} {fmt_bytes(by_class[name])}" + _past(by_class[name], caps.get(name))
               for name in sorted(dead) if name in by_class]
    if weighed:
        report["verdict"] += ("; an OOM capture stops at its failing allocation, so prism's estimate gives the "
                              f"class's need: {', '.join(weighed)}")


def _past(need: int, cap: int | None) -> str:
    """" (N past its cap)" where ``need`` exceeds ``cap``; "" otherwise."""
    return f" ({fmt_bytes(need - cap)} past its cap)" if cap is not None and need > cap else ""


def _estimates(value: Any, where: Path) -> dict[int, int]:
    """The trace's ``job.memory_estimates`` (rank -> prism's estimate of its class's peak, bytes); {} where
    it recorded none."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and k.isdigit() and type(v) is int and v >= 0 for k, v in value.items()):
        raise TraceFormatError(where, "field 'job.memory_estimates'", "is not a map of rank -> bytes (int >= 0)")
    return {int(k): v for k, v in value.items()}


def _substitutions(subs: Any, where: Path) -> list[dict[str, str]] | None:
    """The recipe's substitutions the run recorded (manifest job.substitutions); None when it recorded none."""
    if subs is None:
        return None
    keys = ("setting", "published", "rendered", "affects")
    if not isinstance(subs, list) or not all(
            isinstance(x, dict) and set(x) == set(keys) and all(isinstance(x[k], str) for k in keys) for x in subs):
        raise TraceFormatError(where, "field 'job.substitutions'",
                               f"is not a list of {{{', '.join(keys)}}} strings")
    return [dict(x) for x in subs]


def provenance(cluster: str | None, gpu_timed: bool = False, calibrated: bool = False,
               fold: Fold | None = None, full: bool = False, gpus_per_node: int | None = None,
               method: str = "", microbatches: MicrobatchFold | None = None, recorded: bool = False) -> str:
    """Where the predicted numbers come from, in a sentence: they are not measurements. A folded
    trace adds which ranks were real and how the virtual ones were made, and how the job was replayed
    (``method``: the replay's own sentence, ReplayResult.method; else ``full``: the synthesised graph
    of every rank, or the live ranks symmetrically); a micro-batch fold says how many ran. ``recorded``:
    ``cluster`` is the profile the trace recorded (the run's own), and the sentence says so."""
    base = _provenance(Costing(cluster, recorded), gpu_timed, calibrated)
    if microbatches is not None:
        base = f"{base}; {microbatches.describe()}"
    if fold is None:
        return base
    n, w = len(fold.live), fold.world_size
    ways = fold.contribution_counts()
    made = ", ".join(f"{way} {ways[way]}" for way in ways)
    kept = "; ".join(x for x in (fold.unrecorded_standins(), fold.unrecorded_reductions(), fold.reused_captures())
                     if x) if fold.capture_mode == "serial" else ""
    serial = ("" if fold.capture_mode != "serial" else
              f" captured serially, one at a time ({n} captures; in each, the other live ranks were virtual: "
              "collectives answered by self mirror, small reductions from the other classes' recorded inputs, "
              "receives from a virtual pipeline neighbour by seeded stand-ins" + (f"; {kept}" if kept else "") + ")")
    return (f"{base}; {n} of {w} ranks ran for real (ranks {rank_ranges(fold.live)}){serial}, the other {w - n} are "
            f"virtual: each mirrors its class's sandbox rank (compute, and op inputs: {made}), its collectives "
            f"costed for the full groups on {gpus_per_node or fold.gpus_per_node} GPUs per node; "
            + (f"tokens each folded expert rank receives: {fold.expert_tokens} of live rank(s) "
               f"{rank_ranges(fold.live)}'s routing (the router's per-expert token counts summed over its peers' "
               "translations too: aux losses, expert bias); " if fold.expert_tokens else "")
            + (method or ("replay of the synthesised graph of every rank" if full else
                          "symmetric replay of the live ranks")))


def _provenance(costing: Costing, gpu_timed: bool, calibrated: bool) -> str:
    if calibrated:
        return ("calibrated graph: compute and the ops inside a slice measured with each slice's ranks "
                "running for real; other ops " + (costing.describe() if costing.cluster else "free"))
    comm = costing.describe()
    compute = ("host and GPU time per segment, measured (host: median over like iterations so far and like "
               "ranks; the median iteration of those so measured)" if gpu_timed else "compute")
    return f"{compute} from the bare trace (uncalibrated); communication {comm}"


# ------------------------------------------------------------------------------------------ marks


def _anchors(marks: dict[str, dict[int, Any]], memory: dict[str, Any]) -> dict[str, Any]:
    """Estimates users already have, beside our measured figures: Megatron's theoretical memory
    (of its most loaded shard) against the largest measured max allocated."""
    formula = next(iter(marks["megatron_estimate"].values()), None)
    top = max(memory["classes"], key=lambda c: c["max_allocated"], default=None)
    return {"megatron_formula": formula,
            "measured_max_allocated": None if top is None else {"class": top["class"], "bytes": top["max_allocated"]}}


def _fake_pg(trace_dir: Path, memory: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Megatron's --fake-process-group peaks (``fake-pg-anchor.json``, written by ``run
    --prism-anchor-fake-pg``) beside each rank's measured max allocated; None when not asked for."""
    path = trace_dir / "fake-pg-anchor.json"
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except ValueError:
        raise TraceFormatError(path, "JSON", "is invalid") from None
    if not isinstance(doc, dict) or doc.get("format") != "prismanchor" or doc.get("version") != 1:
        raise TraceFormatError(path, "field 'format'/'version'", "is not prismanchor version 1")
    if not isinstance(doc.get("ranks"), list):
        raise TraceFormatError(path, "field 'ranks'", "is missing or not a list")
    measured = {r["rank"]: r["max_allocated"] for r in memory["ranks"]}
    out = []
    for entry in doc["ranks"]:
        if not isinstance(entry, dict) or not isinstance(entry.get("rank"), int):
            raise TraceFormatError(path, "field 'ranks[].rank'", "is missing or not an integer")
        out.append({**entry, "measured_max_allocated": measured.get(entry["rank"])})
    return out


def _read_marks(trace: PrismTrace) -> dict[str, dict[int, Any]]:
    """The contract marks by name: layout/workload/oom -> {rank: attrs}, memory -> {rank: [attrs]}."""
    table: pa.Table = trace.marks
    table = table.filter(pc.is_in(table.column("name"), value_set=pa.array(_MARKS)))
    where = trace.path / trace.manifest["files"]["marks"]
    out: dict[str, dict[int, Any]] = {name: {} for name in _MARKS}
    memory: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in table.sort_by([("rank", "ascending"), ("t", "ascending")]).to_pylist():
        field = f"mark '{row['name']}' of rank {row['rank']}: attrs"
        try:
            attrs = json.loads(row["attrs"]) if row["attrs"] else {}
        except ValueError:
            raise TraceFormatError(where, field, "is not JSON") from None
        if not isinstance(attrs, dict):
            raise TraceFormatError(where, field, "is not a JSON object")
        if row["name"] == "memory":
            _check_ints(attrs, _MEMORY_INTS, where, field)
            _check_ints(attrs, ("cap",), where, field, nullable=True)
            memory[row["rank"]].append(attrs)
        elif row["name"] == "oom":
            _check_ints(attrs, _MEMORY_INTS, where, field)
            _check_ints(attrs, ("requested", "cap"), where, field, nullable=True)
            out["oom"].setdefault(row["rank"], attrs)  # the first: a rank dies of its first OOM
        else:
            out[row["name"]].setdefault(row["rank"], attrs)
    out["memory"] = dict(memory)
    return out


def _check_ints(attrs: dict, keys: tuple[str, ...], where: Path, field: str, nullable: bool = False) -> None:
    for key in keys:
        value = attrs.get(key)
        if value is None and nullable:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            got = "is missing" if key not in attrs else f"is {value!r}"
            raise TraceFormatError(where, f"{field} '{key}'", f"{got}, expected a byte count")
        attrs[key] = int(value)


# ------------------------------------------------------------------------------------- prediction


def cost_model(cluster: str | None, fold: Fold | None = None, gpus_per_node: int | None = None) -> Any:
    """The cost function of a replay: free without ``cluster``; else the profile's model with the
    target's placement (``gpus_per_node``, else the fold's, else the profile's node size)."""
    if cluster is None:
        return zero_cost
    from prism_megatron.calibration.costmodel import CollectiveCostModel
    from prism_megatron.calibration.profiles import load_profile

    return CollectiveCostModel(load_profile(cluster),  # a bad profile is bad input: let it raise
                               gpus_per_node=gpus_per_node or (fold.gpus_per_node if fold is not None else None))


def _replay(trace: PrismTrace, cluster: str | None) -> tuple[ReplayResult | None, str | None]:
    cost = cost_model(cluster, trace.fold)
    try:
        return replay(graph_from_trace(trace), cost), None
    except IncompleteCaptureError as e:  # not a failure of the replay: there is no whole job to replay
        return None, f"{e.reason()}; the memory figures are each capture's own (an incomplete one's " \
                     "until it stopped)"
    except GraphError as e:  # DeadlockError included: typically a job that died mid-iteration
        whole = _whole_iterations_of_a_stopped_run(trace, cost)
        if whole is not None:
            return whole, None
        lines = str(e).splitlines()  # a deadlock names every stuck rank: thousands of lines at scale
        more = f"\n  ... and {len(lines) - MAX_ERROR_LINES} more line(s)" if len(lines) > MAX_ERROR_LINES else ""
        return None, "the replay failed: " + "\n".join(lines[:MAX_ERROR_LINES]) + more


def _whole_iterations_of_a_stopped_run(trace: PrismTrace, cost: Any) -> ReplayResult | None:
    """A run stopped from outside mid-iteration (a signal: its trace incomplete) leaves collectives some
    ranks never reached, which no replay can finish: replay the iterations every rank ended instead, saying
    so in the graph's notes. None for any other trace, where no iteration was ended by every rank, or where
    that fails too."""
    from .live import until_iteration, whole_iterations

    if not stopped_by_signal(trace.incomplete) or trace.fold is not None and trace.fold.capture_mode == "serial":
        return None  # a job that failed (a rank's OOM, a crash) is not predicted from what it did before
    n = whole_iterations(trace)
    part = until_iteration(trace, n) if n else None
    if part is None:
        return None
    try:
        result = replay(graph_from_trace(part), cost)
    except GraphError:
        return None
    result.graph.notes.append(f"the run stopped mid-iteration ({trace.incomplete}): iterations 1-{n}, the ones "
                              "every rank ended, are replayed")
    return result


def _replay_calibrated(path: str | Path) -> tuple[ReplayResult | None, str | None]:
    from prism_megatron.calibration.calibrated import read_calibrated

    try:
        return read_calibrated(path).replay(), None
    except GraphError as e:
        return None, f"the replay of the calibrated graph {path} failed: {str(e).splitlines()[0]}"


def _headline(result: ReplayResult, timed: dict[int, bool] | None) -> list:
    """The iterations the headline figure is the median of: on a trace with GPU times, those whose
    compute was measured on two clocks (set-up and the warm-up iterations before GPU timing started
    are left out: they are one-clock wall time, not the steady iteration); else all of them."""
    its = result.iterations()
    measured = [it for it in its if timed and timed.get(it.number)]
    return measured or its


def _window(result: ReplayResult, timed: dict[int, bool] | None = None) -> tuple[int | None, float, float]:
    """The median iteration (number, and the span its time covers); the whole run when there are no
    iteration marks."""
    its = _headline(result, timed)
    if not its:
        return None, 0.0, result.makespan
    median = statistics.median_low(it.time for it in its)
    it = next(it for it in its if it.time == median)
    return it.number, *it.window


def _prediction(result: ReplayResult, costing: Costing, classes: dict[int, str],
                workload: dict[int, dict], calibrated: bool = False, fold: Fold | None = None,
                world_size: int | None = None, timed: dict[int, bool] | None = None,
                microbatches: MicrobatchFold | None = None) -> dict[str, Any]:
    times = result.iteration_times()
    headline = [it.time for it in _headline(result, timed)] or times
    median = statistics.median(headline) if headline else None
    work = workload.get(0) or next(iter(workload.values()), {})
    tokens, flops = work.get("tokens_per_iteration"), work.get("flops_per_iteration")
    if microbatches is not None:  # the ranks ran the captured global batch; the target's is M / m_c of it
        scale = microbatches.target / microbatches.captured
        tokens = tokens * scale if _num(tokens) else tokens
        flops = flops * scale if _num(flops) else flops
    per_s = median if median and median > 0 else None
    number, t0, t1 = _window(result, timed)
    breakdown = []
    if fold is not None:  # a folded job's replay may hold synthesised ranks besides the live ones
        classes = {**classes, **{r: fold.class_name(r) for r in result.graph.ranks}}
    for r in result.graph.ranks:
        b = result.breakdown(r, t0, t1)
        breakdown.append({"rank": r, "class": classes.get(r, UNKNOWN), "compute_s": b.compute,
                          "exposed_comm_s": b.exposed_comm, "bubble_s": b.bubble, **_clocks(result, r, b)})
    its = result.iterations()
    return {
        "provenance": provenance(costing.cluster, any(b["host_bound_s"] is not None for b in breakdown), calibrated,
                                 fold, method=result.method, microbatches=microbatches, recorded=costing.recorded),
        "cluster": costing.cluster,
        "iteration_times_s": times,
        "iteration_time_s": median,
        # optional (no version bump): per iteration what its prediction rests on, as Megatron's log line said
        "iteration_bases": [] if calibrated else [basis(None if timed is None else timed.get(it.number, False))
                                                  for it in its],
        "tokens_per_s": tokens / per_s if per_s and _num(tokens) else None,
        "tflops_per_gpu": flops / per_s / (world_size or len(classes)) / 1e12 if per_s and _num(flops) else None,
        "breakdown": breakdown,
        "host_bound": _host_bound(result, breakdown, t0, t1),
        "critical_path": _critical_path(result, t0, t1),
        "timeline": _timeline(result, classes, number, t0, t1),
        "notes": list(result.graph.notes),
    }


def _gpu_timed(result: ReplayResult, rank: int) -> bool:
    """Whether the rank's compute had measured GPU times (then it ran on two clocks in the replay)."""
    return any(isinstance(ev, Compute) and ev.gpu is not None for ev in result.graph.events[rank])


def _clocks(result: ReplayResult, rank: int, b: Breakdown) -> dict[str, float | None]:
    """The two parts of a rank's compute in a window (the replay's, ``Breakdown.host_wait``): host_bound_s,
    the GPU waited for its host to issue work (a segment's host time outran its device time), and
    device_busy_s, the GPU ran the compute; both None when the rank had no measured GPU times."""
    if not _gpu_timed(result, rank):
        return {"host_bound_s": None, "device_busy_s": None}
    return {"host_bound_s": b.host_wait, "device_busy_s": b.compute - b.host_wait}


def _host_bound(result: ReplayResult, breakdown: list[dict[str, Any]], t0: float,
                t1: float) -> dict[str, Any] | None:
    """The headline's compute on two clocks: the breakdown row of the critical rank (of the GPU-timed ranks,
    the one with the most compute on the critical path in [t0, t1]; ties: the most compute); None when no
    rank had measured GPU times."""
    rows = [b for b in breakdown if b["host_bound_s"] is not None]
    if not rows:
        return None
    on_path: dict[int, float] = defaultdict(float)
    for s in result.critical_path:
        if s.kind == "compute":
            for r in s.ranks:
                on_path[r] += max(min(s.end, t1) - max(s.start, t0), 0.0)
    top = max(rows, key=lambda b: (on_path[b["rank"]], b["compute_s"], -b["rank"]))
    return {k: top[k] for k in ("rank", "class", "compute_s", "host_bound_s", "device_busy_s")}


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _critical_path(result: ReplayResult, t0: float, t1: float) -> dict[str, Any]:
    """The path's steps inside the window, consecutive steps of one kind on the same ranks merged."""
    steps: list[dict[str, Any]] = []
    for s in result.critical_path:
        start, end = max(s.start, t0), min(s.end, t1)
        if end <= start:
            continue
        ranks = rank_ranges(s.ranks)
        if steps and steps[-1]["kind"] == s.kind and steps[-1]["ranks"] == ranks:
            last = steps[-1]
            last["end_s"] = end
            if last["label"] != s.label:
                last["label"] = ""
            continue
        steps.append({"kind": s.kind, "ranks": ranks, "start_s": start, "end_s": end, "label": s.label})
    by_kind: dict[str, float] = defaultdict(float)
    for s in steps:
        by_kind[s["kind"]] += s["end_s"] - s["start_s"]
    longest = sorted(sorted(steps, key=lambda s: s["start_s"] - s["end_s"])[:MAX_PATH_STEPS],
                     key=lambda s: s["start_s"])
    return {"steps": longest, "total_steps": len(steps),
            "by_kind_s": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))}


def _timeline(result: ReplayResult, classes: dict[int, str], number: int | None,
              t0: float, t1: float) -> dict[str, Any]:
    """What the HTML page draws: per shown rank, its activity in the window, merged runs of a kind, runs narrower
    than 1/TIMELINE_STEPS of the window merged (``runs.merge_narrow``; timeline.json keeps every one)."""
    ranks = result.graph.ranks
    if len(ranks) <= MAX_TIMELINE_ROWS:
        shown, note = ranks, ""
    else:
        first: dict[str, int] = {}
        for r in ranks:
            first.setdefault(classes.get(r, UNKNOWN), r)
        picked = set(list(first.values())[:MAX_TIMELINE_ROWS])
        need = MAX_TIMELINE_ROWS // 2 - len(picked)
        picked.update(ranks[round(i * (len(ranks) - 1) / max(need - 1, 1))] for i in range(max(need, 0)))
        shown = sorted(picked, key=lambda r: (class_order(classes.get(r, UNKNOWN)), r))
        note = f"{len(shown)} of {len(ranks)} ranks: the first of each class and evenly spaced others, by class"
    rows = []
    width = (t1 - t0) / TIMELINE_STEPS
    for r in shown:
        segs = [[kind, round(start - t0, 9), round(end - t0, 9)]
                for kind, start, end in activity_runs(result.within(r, t0, t1), lambda s: s.kind, t0, t1)]
        rows.append({"rank": r, "class": classes.get(r, UNKNOWN), "segments": merge_narrow(segs, width, digits=9)})
    return {"iteration": number, "start_s": t0, "end_s": t1, "note": note, "rows": rows}


# ------------------------------------------------------------------------------------------- fold


def _fold(fold: Fold, memory: dict[str, Any], result: ReplayResult | None,
          timed: dict[int, bool] | None = None) -> dict[str, Any]:
    """The rank classes of a folded job: what each stands for, its peak memory and its time (the mean
    over its sandbox ranks in the headline's median iteration; null without a prediction), with the
    compute's two clocks where its sandbox ranks had measured GPU times (see :func:`_clocks`)."""
    mem = {c["class"]: c for c in memory["classes"]}
    window = _window(result, timed) if result is not None else None
    out = []
    for c in fold.classes:
        row: dict[str, Any] = {"name": c.name, "role": c.role, "count": c.count, "sandbox": list(c.sandbox),
                               "max_allocated": mem[c.name]["max_allocated"] if c.name in mem else None,
                               "max_reserved": mem[c.name]["max_reserved"] if c.name in mem else None,
                               "compute_s": None, "exposed_comm_s": None, "bubble_s": None,
                               "host_bound_s": None, "device_busy_s": None}
        if window is not None:
            _, t0, t1 = window
            ranks = [r for r in c.sandbox if r in result.graph.events]
            parts = [result.breakdown(r, t0, t1) for r in ranks]
            if parts:
                row.update(compute_s=sum(b.compute for b in parts) / len(parts),
                           exposed_comm_s=sum(b.exposed_comm for b in parts) / len(parts),
                           bubble_s=sum(b.bubble for b in parts) / len(parts))
            clocks = [_clocks(result, r, b) for r, b in zip(ranks, parts, strict=True)]
            if clocks and all(x["host_bound_s"] is not None for x in clocks):
                row.update({k: sum(x[k] for x in clocks) / len(clocks) for k in ("host_bound_s", "device_busy_s")})
        out.append(row)
    return {"world_size": fold.world_size, "live": list(fold.live), "gpus_per_node": fold.gpus_per_node,
            "contributions": fold.contribution_counts(), "classes": out}


# ----------------------------------------------------------------------------------------- memory


def _memory(marks: dict[str, dict[int, Any]], classes: dict[int, str], trace: PrismTrace) -> dict[str, Any]:
    """Per rank: the maxima over its memory marks (and its OOM mark); per class: the worst rank."""
    exit5 = {e["rank"] for e in trace.manifest["ranks"] if e["exit_code"] == OOM_EXIT_CODE}
    sources: set[str] = set()
    ranks = []
    for r in sorted(set(marks["memory"]) | set(marks["oom"])):
        seen = marks["memory"].get(r, []) + ([marks["oom"][r]] if r in marks["oom"] else [])
        sources.update(str(a["source"]) for a in marks["memory"].get(r, []) if a.get("source"))
        caps = [a["cap"] for a in seen if a.get("cap") is not None]
        cap = caps[-1] if caps else None
        reserved = max(a["max_reserved"] for a in seen)
        ranks.append({"rank": r, "class": classes[r], "max_allocated": max(a["max_allocated"] for a in seen),
                      "max_reserved": reserved, "cap": cap, "headroom": None if cap is None else cap - reserved,
                      "oom": r in marks["oom"] or r in exit5, **_peak_iteration(marks["memory"].get(r, []))})
    by_class: dict[str, list[dict]] = defaultdict(list)
    for entry in ranks:
        by_class[entry["class"]].append(entry)
    out_classes = []
    for name in sorted(by_class, key=class_order):
        members = by_class[name]
        rooms = [m["headroom"] for m in members if m["headroom"] is not None]
        out_classes.append({"class": name, "ranks": [m["rank"] for m in members],
                            "max_allocated": max(m["max_allocated"] for m in members),
                            "max_reserved": max(m["max_reserved"] for m in members),
                            "headroom": min(rooms) if rooms else None,
                            "peak_iteration": max((m["peak_iteration"] for m in members
                                                   if m["peak_iteration"] is not None), default=None),
                            "peak_rising": any(m["peak_rising"] for m in members)})
    return {"source": ", ".join(sorted(sources)) or None, "ranks": ranks, "classes": out_classes}


def _peak_iteration(seen: list[dict[str, Any]]) -> dict[str, Any]:
    """The iteration by whose end a rank's max reserved (what the verdict rests on) was reached, and whether it
    still rose in the last iteration captured: then a longer run may peak higher (MoE routing that drifts,
    growth the captured iterations did not see), and the report says so beside the class."""
    by_iteration = sorted((a["iteration"], a["max_reserved"]) for a in seen if isinstance(a.get("iteration"), int))
    if not by_iteration:
        return {"peak_iteration": None, "peak_rising": False}
    top = max(v for _, v in by_iteration)
    first = next(i for i, v in by_iteration if v == top)
    rising = len(by_iteration) >= 2 and first == by_iteration[-1][0] and top > by_iteration[-2][1]
    return {"peak_iteration": first, "peak_rising": rising}


def _oom_entry(rank: int, attrs: dict[str, Any], cls: str) -> dict[str, Any]:
    entry = {"rank": rank, "class": cls}
    entry.update({k: attrs.get(k) for k in ("requested", *_MEMORY_INTS, "cap")})
    entry["message"] = str(attrs.get("message") or "")
    entry["snapshot"] = attrs["snapshot"] if isinstance(attrs.get("snapshot"), str) else None
    where = attrs.get("where")  # optional: traces written before the site was recorded lack it
    entry["where"] = [str(f) for f in where] if isinstance(where, list) else []
    return entry


def _machine(m: Any) -> dict[str, Any] | None:
    """The emulating machine as the trace recorded it (``launch.job_record``), or None where it did not."""
    if not isinstance(m, dict) or not isinstance(m.get("gpus"), list):
        return None
    return {"gpus": [str(g) for g in m["gpus"]], "cpu": m["cpu"] if isinstance(m.get("cpu"), str) else None,
            "cores": m["cores"] if type(m.get("cores")) is int else None}


def _target(gpu: Any) -> dict[str, Any]:
    gpu = gpu if isinstance(gpu, dict) else {}

    def get(key: str, kind: type) -> Any:
        value = gpu.get(key)
        return value if isinstance(value, kind) and not isinstance(value, bool) else None

    return {"gpu": get("name", str), "capacity_bytes": get("capacity", int), "usable_bytes": get("usable", int),
            "context_bytes": get("context", int), "source": get("source", str)}


def _swap(swap: Any) -> dict[str, Any] | None:
    if swap is None:
        return None
    return swap if isinstance(swap, dict) else {"value": swap}


# ---------------------------------------------------------------------------------------- verdict


def _unmeasured(fold: Fold | None, dead: set[int]) -> str:
    """What a verdict leaves out when a serial run's capture did not complete: its class was measured in part
    (until the capture stopped) or not at all; "" otherwise. A capture whose rank ran out of memory under the
    target's cap (in ``dead``) is not listed: its OOM is its class's verdict."""
    cut = [c for c in fold.incomplete_captures() if c.rank not in dead] if fold is not None else []
    if not cut:
        return ""
    parts = [f"{c.cls} (capture {c.number} of {c.of} {c.status})" for c in cut]
    return f"; class(es) not measured in full: {', '.join(parts)}"


def _oom_not_replayed(fold: Fold | None, dead: set[int]) -> str | None:
    """Why a serial run whose only incomplete captures ran out of memory under the target's cap has no time
    prediction (launcher.serial.OOM_CONTINUES_RULE): the job does not run there. None for any other trace."""
    cut = fold.incomplete_captures() if fold is not None else []
    if not cut or any(c.rank not in dead for c in cut):
        return None
    names = ", ".join(dict.fromkeys(c.cls for c in cut))
    return (f"class(es) {names} ran out of memory under the target's cap (the verdict names each): the job does "
            "not run on the target, so there is no iteration time to predict; the memory figures are each "
            "capture's own (an OOM capture's until its failing allocation)")


def _captured_in_full(fold: Fold | None) -> set[str]:
    """A serial run's classes whose capture completed (their peaks are the whole job's); none for any other trace:
    a run together ends every rank at the first OOM."""
    if fold is None or fold.capture_mode != "serial" or "captures" not in fold.capture:
        return set()
    cut = {c.rank for c in fold.incomplete_captures()}
    return {fold.class_name(c["rank"]) for c in fold.capture["captures"] if c["rank"] not in cut}


def verdict(memory: dict[str, Any], oom: list[dict[str, Any]], exit5: list[int], classes: dict[int, str],
            gpu: str | None = None, complete: set[str] = frozenset()) -> str:
    """One line: did it run out of memory (who, at which request: the worst rank first, then the worst of each other
    class that did, then the ``complete`` classes, measured to the end, that fit), or does it fit (with what to
    spare)."""
    on = f" on {gpu}" if gpu else ""  # after the cap: the prefixes (OOM:, fits:) stay fixed for programs
    if oom:
        def held(e: dict) -> float:  # what the program held and asked for: allocated bytes repeat, reserved do not
            return float("-inf") if e["requested"] is None else e["allocated"] + e["requested"]

        worst: dict[str, dict] = {}  # per class its worst rank, the worst class first
        for e in sorted(oom, key=lambda e: (-held(e), e["rank"])):
            worst.setdefault(e["class"], e)
        named = [_oom_words(e, on) for e in worst.values()]
        others = len({e["rank"] for e in oom} | set(exit5)) - len(worst)
        more = f"; {others} other rank(s) out of memory too" if others else ""
        dead = {e["class"] for e in oom} | {classes.get(r, UNKNOWN) for r in exit5}
        fit = [f"{c['class']} (peak reserved {fmt_bytes(c['max_reserved'])}, headroom {fmt_bytes(c['headroom'])})"
               for c in memory["classes"]
               if c["class"] in complete and c["class"] not in dead and c["headroom"] is not None
               and c["headroom"] >= 0]
        fits = f"; class(es) that fit: {', '.join(fit)}" if fit else ""
        return "OOM: " + "; ".join(named) + more + fits
    if exit5:
        r = min(exit5)
        return (f"OOM: rank {r} ({classes.get(r, UNKNOWN)}) exited with code {OOM_EXIT_CODE} (out of memory)"
                f"{f'; {len(exit5) - 1} other rank(s) too' if len(exit5) > 1 else ''}")
    ranks = memory["ranks"]
    if not ranks:
        return ("no memory figures in this trace (on CPU they need --prism-track-memory on or "
                "--prism-target-gpu; on a GPU they are always recorded)")
    capped = [e for e in ranks if e["headroom"] is not None]
    if not capped:
        peak = max(ranks, key=lambda e: e["max_reserved"])
        return (f"no cap to compare with: peak reserved {fmt_bytes(peak['max_reserved'])} on rank {peak['rank']} "
                f"({peak['class']})")
    tight = min(capped, key=lambda e: (e["headroom"], e["rank"]))
    if tight["headroom"] < 0:
        return (f"does not fit: rank {tight['rank']} ({tight['class']}) reserves {fmt_bytes(-tight['headroom'])} "
                f"more than its cap{on}")
    return f"fits: smallest headroom {fmt_bytes(tight['headroom'])}{on} (rank {tight['rank']}, {tight['class']})"


def _oom_words(e: dict[str, Any], on: str) -> str:
    """One rank's OOM in the verdict: "rank 3 (last) ran out of memory asking for 1.0 GiB at ... with 3.2 GiB
    allocated and 3.5 GiB of its 4.0 GiB cap reserved". No "needs N more": the capture stopped at that request,
    so what the class needs is not known from it (the verdict's tail gives prism's estimate), and its reserved
    bytes, which such a figure would rest on, move between runs of one program where its allocated bytes do not
    (docs/measurements.md)."""
    who = f"rank {e['rank']} ({e['class']})"
    at = f" at {e['where'][-1]}" if e.get("where") else ""  # the program's innermost frame
    if e["requested"] is not None and e["cap"] is not None:
        return (f"{who} ran out of memory{on} asking for {fmt_bytes(e['requested'])}{at} with "
                f"{fmt_bytes(e['allocated'])} allocated and {fmt_bytes(e['reserved'])} of its "
                f"{fmt_bytes(e['cap'])} cap reserved")
    message = e["message"].strip().splitlines()[0][:160] if e["message"].strip() else "no message"
    return f"{who} ran out of memory: {message}"
