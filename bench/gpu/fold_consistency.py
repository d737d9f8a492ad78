"""Phase 2 against full capture on one device: the same Megatron job captured whole and folded.

For each job, one run with every rank (``--prism-fold off``) and one with only the sandbox
(``--prism-fold on``), by the core driver on the same device(s):

- dense: GPT at TP2·PP2·DP(W/4) (W = ``--world``, 8 by default: 4 of 8 ranks live when folded);
- moe:   GPT with ``--experts`` experts, top-2, alltoall dispatch, at PP2·EP(``--moe-ep``)·DP(W/2); the v1
         sandbox holds whole expert groups, so it folds only when DP > EP (PP2·EP2·DP4: 4 of 8 live).

Printed side by side, per rank class of the fold: max allocated / reserved bytes of the full run
(the class's members: the largest, and their spread) and of the fold's live rank, and the difference;
the predicted iteration time of each run (report headline: median of the iterations measured on two
clocks) and the ratio; the losses; each run's wall time.

Where the two predictions differ, the decomposition says why (``diagnose``): per class and run,
the measured host, device and one-clock compute time per iteration (medians over the two-clock
iterations) of every member; both predictions with each rank's own host times (no pooling over like
ranks, replay.gpu_segments); and the full capture replayed *as if folded* — only one replica's ranks,
symmetrically, as the fold's trace is replayed — once per replica. full vs its folded views: what
replaying every replica adds; a folded view vs the fold: what the capture itself measured
differently (more ranks sharing the device, or the machine's drift between runs).

The time criterion compares like with like: the full capture replayed as the fold is (one measured rank
per class, the rest synthesised) once per choice of which member's measured host and device times stand
for each class (``member_choices``); the fold's prediction against the median of those and inside their
range says whether it differs by more than which rank happened to be measured. The full capture's own
headline pools the host times of every like rank (more of them than a fold has), a different estimator.
The fold replayed with the full capture's host, then device, times of the same ranks splits the rest.

Memory per iteration: the running peak at each iteration's end per class, and (MoE) the rows each rank
received in its token dispatches. A fold mirrors data-parallel gradients (the sandbox replica's own
stand for the others'), so from the first optimizer step on its weights, hence its expert routing and
expert activations, follow the sandbox's data, not the mean over replicas: iteration 1 is the one the
two runs share. ``--same-batches`` gives every replica the same data in both runs: then they should agree
at every iteration.

    python bench/gpu/fold_consistency.py --devices 0 --out DIR              # on the GPU machine
    python bench/gpu/fold_consistency.py --devices cpu --tiny --out DIR     # end to end on CPU, tiny shapes

``--repeats N`` captures each job N times each way, interleaved (off, on, off, on, ...): the tables are the
first pair's; a last block gives every run's prediction, fold/full, and the spread of the full runs among
themselves and of the folds among themselves, so a difference of a few percent can be judged against the
run-to-run noise. ``bench/gpu/fold_segments.py`` compares two captures segment by segment.

``--out`` gets fold_consistency.json, fold_consistency.txt and traces.tar.gz (traces, rank logs,
metrics); the runs work in ``--work`` (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

CORE = "prism_megatron/megatron/driver/core_gpt.py"


# ----------------------------------------------------------------------------- the runs
def _flags(a: argparse.Namespace, job: str) -> list[str]:
    moe = job == "moe"
    dp = a.world // 2 if moe else a.world // 4
    hidden = a.moe_hidden if moe else a.hidden
    gbs = dp * a.mbs * a.micro  # a.micro micro-batches per model replica
    flags = (f"--num-layers {a.layers} --hidden-size {hidden} --num-attention-heads {a.heads} "
             f"--seq-length {a.seq} --max-position-embeddings {a.seq} --tokenizer-type NullTokenizer "
             f"--vocab-size 32000 --mock-data --micro-batch-size {a.mbs} --global-batch-size {gbs} "
             f"--train-iters {a.iters} --lr 0.0001 --seed 1234 --transformer-impl local "
             f"--no-gradient-accumulation-fusion --log-interval 1 --eval-iters 0 --eval-interval 1000 "
             "--pipeline-model-parallel-size 2").split()
    if a.bf16:
        flags += ["--bf16", "--no-masked-softmax-fusion"]
    if moe:
        flags += ["--num-experts", str(a.experts), "--moe-router-topk", "2", "--moe-ffn-hidden-size", str(a.moe_ffn),
                  "--expert-model-parallel-size", str(a.moe_ep), "--moe-token-dispatcher-type", "alltoall",
                  "--disable-bias-linear"]  # megatron-core 0.19.2's expert bias fails on the GPU (core_gpt.py)
    else:
        flags += ["--tensor-model-parallel-size", "2"]
    return flags


def _name(job: str, fold: str, repeat: int) -> str:
    """A run's name in --work (its trace is trace-NAME): the first repeat's as without --repeats."""
    return f"{job}-fold-{fold}" + (f"-r{repeat}" if repeat else "")


def _run(a: argparse.Namespace, job: str, fold: str, flags: list[str], timeout: float, repeat: int = 0) -> dict:
    work = Path(a.work)
    name = _name(job, fold, repeat)
    trace = work / f"trace-{name}"
    metrics = work / f"{name}.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, PRISM_MEGATRON_METRICS=str(metrics), CUDA_DEVICE_MAX_CONNECTIONS="1",
               WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    if a.pin_cores:
        env["PRISM_PIN_CORES"] = "1"
    if a.spin_us:
        env["PRISM_SPIN_GRANT_US"] = str(a.spin_us)
    if a.same_batches:
        env["PRISM_SAME_BATCHES"] = "1"
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--prism-emulate", "--prism-world-size", str(a.world),
           "--prism-devices", a.devices, "--prism-driver", "core", "--prism-fold", fold, "--prism-fold-depth", a.depth,
           "--prism-swap", "none",
           "--prism-report", "off", "--prism-track-memory", "on", "--prism-log-ranks", "none",
           "--prism-trace-dir", str(trace), CORE, *flags]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        text, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc, text = 124, _stop(p) + f"\n(timed out after {timeout:.0f} s)"
    wall = time.perf_counter() - t0
    (work / f"{name}.log").write_text(text)
    out = {"job": job, "fold": fold, "repeat": repeat, "rc": rc, "wall_s": wall, "trace": str(trace)}
    if rc != 0:
        out["error"] = text[-2500:]
        return out
    return _collect(a, out, trace, metrics)


def _ranks_of(launcher: int) -> list[int]:
    """The rank processes of a launcher: its children forked from it (the same command line; the
    coordinator, a child too, runs another)."""
    def cmdline(pid: int) -> bytes:
        try:
            return Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return b""
    own, out = cmdline(launcher), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher and cmdline(int(stat.parent.name)) == own:
            out.append(int(stat.parent.name))
    return out


def _stop(p: subprocess.Popen, grace: float = 20.0) -> str:
    """A run past its time: every rank writes its threads' stacks into its log (SIGUSR1, the launcher's
    hang reports), then the launcher ends the job on its own path (SIGTERM: the trace so far, the logs),
    killed only if that takes over ``grace`` seconds. Returns the run's output."""
    for pid in _ranks_of(p.pid):
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            pass
    time.sleep(1.0)
    p.send_signal(signal.SIGTERM)
    try:
        text, _ = p.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        p.kill()
        text, _ = p.communicate()
    return text or ""


def _analysed(a: argparse.Namespace, job: str, fold: str, repeat: int = 0) -> dict | None:
    """The row of an earlier run in ``--work`` (``--analyse``): its trace, metrics and log as it left them."""
    work = Path(a.work)
    name = _name(job, fold, repeat)
    trace, log = work / f"trace-{name}", work / f"{name}.log"
    if not (trace / "manifest.json").exists():
        return None
    wall = re.search(r"done in ([0-9.]+) s", log.read_text()) if log.exists() else None
    out = {"job": job, "fold": fold, "repeat": repeat, "rc": 0,
           "wall_s": float(wall.group(1)) if wall else float("nan"), "trace": str(trace)}
    return _collect(a, out, trace, work / f"{name}.metrics.jsonl")


def _collect(a: argparse.Namespace, out: dict, trace: Path, metrics: Path) -> dict:
    """A finished run's row: memory per rank, prediction and losses from its trace and metrics."""
    from prism_megatron.report.build import build_report

    report = build_report(trace, cluster=a.cluster)
    out["ranks"] = {r["rank"]: {"max_allocated": r["max_allocated"], "max_reserved": r["max_reserved"],
                                "class": r["class"]} for r in report["memory"]["ranks"]}
    plan = json.loads((trace / "manifest.json").read_text())["job"].get("fold")
    out["rep"] = plan["rep"] if plan else None
    out["gpus_per_node"] = plan["gpus_per_node"] if plan else None
    pred = report["prediction"] or {}
    out["iteration_s"] = pred.get("iteration_time_s")
    out["iteration_times_s"] = pred.get("iteration_times_s")
    out["iteration_bases"] = pred.get("iteration_bases")
    out["breakdown"] = pred.get("breakdown")
    out["prediction_error"] = report.get("prediction_error")
    losses: dict[int, list[float]] = {}
    used = 0
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            used = max(used, row.get("device_used") or 0)
            if "lm loss" in row.get("loss", {}):
                losses.setdefault(row["iteration"], []).append(row["loss"]["lm loss"])
    out["losses"] = {k: statistics.mean(v) for k, v in sorted(losses.items()) if v}
    out["device_used_max"] = used  # the device's memory in use at iteration ends, all ranks together
    return out


# ----------------------------------------------------------------------------- why predictions differ
def _headline(trace, result) -> tuple[float | None, list[int]]:
    """The report's headline of a replay (median over the iterations measured on two clocks) and
    the iteration numbers it is taken over."""
    from prism_megatron.report.live import timed_iterations

    timed = timed_iterations(trace)
    its = result.iterations()
    used = [it for it in its if timed and timed.get(it.number)] or its
    return (statistics.median(it.time for it in used) if used else None), [it.number for it in used]


def _replica_shifts(rep: list[int]) -> list[int]:
    """Offsets s such that every live rank l has l + s in its own class (one whole other replica)."""
    live = sorted(set(rep))
    members = {x: {r for r, y in enumerate(rep) if y == x} for x in live}
    shifts = sorted({r - x for x in live for r in members[x]})
    return [s for s in shifts if all(x + s in members[x] for x in live)]


def _as_folded(trace, rep: list[int], gpus_per_node: int, shift: int):
    """The full capture ``trace`` as a folded trace whose live ranks are replica ``shift`` of the fold
    ``rep`` (each live rank l becomes l + shift; every other rank mirrors the one of its class there)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from prism_megatron.trace.fold import make_fold

    moved = {x: x + shift for x in set(rep)}
    fold = make_fold([moved[x] for x in rep], gpus_per_node)
    live = pa.array(fold.live, pa.int32())

    def only(table):
        return table.filter(pc.is_in(table.column("rank"), value_set=live))

    return dataclasses.replace(trace, fold=fold, ops=only(trace.ops), marks=only(trace.marks),
                               slots=only(trace.slots), gpu=only(trace.gpu))


def _iteration_rows(trace) -> dict[int, dict[int, list[int]]]:
    """rank -> iteration (1-based) -> indices into ``trace.gpu`` of the rank's GPU-timed segments inside
    it, in clock order."""
    clocks: dict[int, list[tuple[str, float]]] = {}
    for m in trace.marks.to_pylist():
        if m["name"] == "iteration" and m["phase"] in ("B", "E"):
            clocks.setdefault(m["rank"], []).append((m["phase"], m["compute_clock"]))
    rows: dict[int, list[tuple[float, float, int]]] = {}
    for i, row in enumerate(trace.gpu.to_pylist()):
        rows.setdefault(row["rank"], []).append((row["clock_start"], row["clock_end"], i))
    out: dict[int, dict[int, list[int]]] = {}
    for rank, marks in clocks.items():
        begins = [c for p, c in marks if p == "B"]
        ends = [c for p, c in marks if p == "E"]
        mine = sorted(rows.get(rank, []))
        for k, (b, e) in enumerate(zip(begins, ends, strict=False), start=1):
            out.setdefault(rank, {})[k] = [i for s, t, i in mine if b - 1e-9 <= s and t <= e + 1e-9]
    return out


def _measured_by(view, source, pick: dict[int, int], columns: tuple[str, ...] = ("cpu", "gpu", "syncs")):
    """``view`` (a folded trace) whose live rank l carries, inside every whole iteration, the measured
    ``columns`` of the gpu table (host time, device time and waits) of ``source``'s rank ``pick[l]``,
    segment k onto segment k (the same program: a class's members issue the same ops); set-up, tail and
    l's own ops stay l's. An iteration whose segment counts differ is a ValueError naming both ranks."""
    import pyarrow as pa

    mine_at, theirs_at = _iteration_rows(view), _iteration_rows(source)
    cols = {name: source.gpu.column(name).to_pylist() for name in columns}
    new = {name: view.gpu.column(name).to_pylist() for name in cols}
    for live, member in pick.items():
        if live == member and view is source:
            continue
        for k, mine in mine_at.get(live, {}).items():
            theirs = theirs_at.get(member, {}).get(k)
            if theirs is None:
                continue
            if len(theirs) != len(mine):
                raise ValueError(f"iteration {k}: rank {member} has {len(theirs)} GPU-timed segments, "
                                 f"rank {live} {len(mine)}: not the same program")
            for i, j in zip(mine, theirs, strict=True):
                for name in new:
                    new[name][i] = cols[name][j]
    gpu = view.gpu
    for name, values in new.items():
        field = gpu.schema.field(name)
        gpu = gpu.set_column(gpu.schema.get_field_index(name), field, pa.array(values, field.type))
    return dataclasses.replace(view, gpu=gpu)


def member_choices(trace, rep: list[int], gpus_per_node: int, cluster: str, limit: int = 256) -> list[dict]:
    """The full capture ``trace`` replayed as the fold ``rep`` is (only one measured rank per class, the
    rest synthesised from it), once per choice of which class member's measured times stand for the
    class: what the fold's prediction would have been had its sandbox measured like each of the full
    capture's members. Every choice up to ``limit`` of them, else ``limit`` drawn at random (seed 0)."""
    import itertools
    import random

    from prism_megatron.replay import graph_from_trace, replay
    from prism_megatron.report.build import cost_model

    base = _as_folded(trace, rep, gpus_per_node, 0)
    classes = {x: [r for r, y in enumerate(rep) if y == x] for x in sorted(set(rep))}
    total = math.prod(len(m) for m in classes.values())
    picks = list(itertools.product(*classes.values())) if total <= limit else \
        [tuple(random.Random(f"{n}").choice(m) for m in classes.values()) for n in range(limit)]
    out = []
    for pick in picks:
        view = _measured_by(base, trace, dict(zip(classes, pick, strict=True)))
        head, _ = _headline(view, replay(graph_from_trace(view), cost_model(cluster, view.fold)))
        out.append({"members": list(pick), "iteration_s": head})
    return out


def memory_by_iteration(trace) -> dict[int, dict[int, int]]:
    """rank -> iteration -> max allocated bytes at the iteration's end (its memory mark): a running peak,
    the allocator's peak is not reset between iterations; the first iteration holding the final value
    is the one the rank's peak was reached in."""
    out: dict[int, dict[int, int]] = {}
    for m in trace.marks.to_pylist():
        if m["name"] == "memory":
            attrs = json.loads(m["attrs"])
            if attrs.get("iteration") is not None:
                out.setdefault(m["rank"], {})[attrs["iteration"]] = attrs["max_allocated"]
    return out


def expert_rows(trace) -> dict[int, dict[int, list[int]]]:
    """rank -> iteration -> rows (token copies) the rank received in each MoE token dispatch of its
    forward passes: the first of each pair of 2-D all-to-alls inside a forward mark (dispatch, then
    combine, per MoE layer), its output rows. Empty for a job without expert all-to-alls."""
    windows: dict[int, list[tuple[float, float, int]]] = {}
    opened: dict[int, tuple[float, int]] = {}
    for m in sorted(trace.marks.to_pylist(), key=lambda m: (m["rank"], m["compute_clock"], m["phase"] != "E")):
        if m["name"] != "forward":
            continue
        if m["phase"] == "B":
            opened[m["rank"]] = (m["compute_clock"], json.loads(m["attrs"]).get("iteration", 0))
        elif m["phase"] == "E" and m["rank"] in opened:
            b, it = opened.pop(m["rank"])
            windows.setdefault(m["rank"], []).append((b, m["compute_clock"], it))
    out: dict[int, dict[int, list[int]]] = {}
    for rank, wins in windows.items():
        clock, seen = 0.0, []
        for op in trace.ops_for_rank(rank):
            clock += op["compute_before"]
            if op["kind"] in ("all_to_all", "all_to_all_single"):
                shapes = json.loads(op["shapes"])
                if len(shapes) == 2 and len(shapes[1]) == 2:
                    seen.append((clock, shapes[1][0]))
        for b, e, it in wins:
            inside = [rows for c, rows in seen if b - 1e-9 <= c <= e + 1e-9]
            out.setdefault(rank, {}).setdefault(it, []).extend(inside[0::2])
    return out


def _per_iteration(trace) -> dict[int, dict[int, dict[str, float]]]:
    """rank -> iteration -> measured seconds: one-clock compute (the rank's compute clock across the
    iteration), host and device time (sums over its GPU-timed segments; 0 where none)."""
    clocks: dict[int, list[tuple[str, float]]] = {}
    for m in trace.marks.to_pylist():
        if m["name"] == "iteration" and m["phase"] in ("B", "E"):
            clocks.setdefault(m["rank"], []).append((m["phase"], m["compute_clock"]))
    rows: dict[int, list[dict]] = {}
    for row in trace.gpu.to_pylist():
        rows.setdefault(row["rank"], []).append(row)
    out: dict[int, dict[int, dict[str, float]]] = {}
    for rank, marks in clocks.items():
        begins = [c for p, c in marks if p == "B"]
        ends = [c for p, c in marks if p == "E"]
        for k, (b, e) in enumerate(zip(begins, ends, strict=False), start=1):
            inside = [r for r in rows.get(rank, []) if b - 1e-9 <= r["clock_start"] and r["clock_end"] <= e + 1e-9]
            out.setdefault(rank, {})[k] = {"compute": e - b, "host": sum(r["cpu"] for r in inside),
                                           "device": sum(r["gpu"] for r in inside), "segments": len(inside)}
    return out


def diagnose(full: dict, fold: dict, cluster: str) -> dict:
    """Where the full capture's prediction and the fold's part: see the module docstring."""
    from prism_megatron.replay import graph_from_trace, replay
    from prism_megatron.report.build import cost_model
    from prism_megatron.trace import read_trace

    t_full, t_fold = read_trace(full["trace"]), read_trace(fold["trace"])
    rep, gpn = fold["rep"], fold["gpus_per_node"]
    views = {}
    for shift in _replica_shifts(rep):
        view = _as_folded(t_full, rep, gpn, shift)
        result = replay(graph_from_trace(view), cost_model(cluster, view.fold))
        head, used = _headline(view, result)
        views[shift] = {"live": list(view.fold.live), "iteration_s": head, "iterations": used,
                        "iteration_times_s": result.iteration_times()}
    own = {}  # each rank's own host times (no pooling over like ranks): the replay before that pooling
    for name, t in (("full", t_full), ("fold", t_fold)):
        result = replay(graph_from_trace(t, like_ranks=False), cost_model(cluster, t.fold))
        own[name] = _headline(t, result)[0]
    timed = sorted(set(views[min(views)]["iterations"])) if views else []
    measured = {"full": _per_iteration(t_full), "fold": _per_iteration(t_fold)}
    classes = {}
    for live in sorted(set(rep)):
        members = [r for r, x in enumerate(rep) if x == live]
        entry = {}
        for key in ("compute", "host", "device"):
            def med(run: str, rank: int, key: str = key) -> float | None:
                its = measured[run].get(rank, {})
                vals = [its[k][key] for k in timed if k in its]
                return statistics.median(vals) if vals else None
            entry[key] = {"full": {r: med("full", r) for r in members}, "fold": med("fold", live)}
        classes[live] = entry
    choices = member_choices(t_full, rep, gpn, cluster)
    swapped = {}  # the fold replayed with the full capture's host (cpu) or device (gpu, syncs) times, same ranks
    for what, columns in (("host", ("cpu",)), ("device", ("gpu", "syncs"))):
        view = _measured_by(t_fold, t_full, {x: x for x in set(rep)}, columns)
        swapped[what] = _headline(view, replay(graph_from_trace(view), cost_model(cluster, view.fold)))[0]
    memory = {"full": memory_by_iteration(t_full), "fold": memory_by_iteration(t_fold)}
    rows = {"full": expert_rows(t_full), "fold": expert_rows(t_fold)}
    return {"views": views, "own_host": own, "timed_iterations": timed, "classes": classes, "measured": measured,
            "choices": choices, "swapped": swapped, "memory_by_iteration": memory, "expert_rows": rows}


# ----------------------------------------------------------------------------- the tables
def _ms(x: float | None) -> str:
    return f"{x * 1e3:.2f}" if isinstance(x, (int, float)) and math.isfinite(x) else "n/a"


def summarize(rows: list[dict], jobs: list[str], diags: dict[str, dict], say) -> None:
    for job in jobs:
        full = next((r for r in rows if r["job"] == job and r["fold"] == "off" and "ranks" in r), None)
        fold = next((r for r in rows if r["job"] == job and r["fold"] == "on" and "ranks" in r), None)
        if full is None or fold is None or not fold["rep"]:
            say(f"{job}: a run failed or did not fold (see its log)")
            continue
        say(f"\n== {job}: memory per class (bytes; full: the largest of the class's members, and their spread)")
        say(f"{'live rank (class; ranks)':34} {'full max alloc':>15} {'fold max alloc':>15} {'diff B':>10} "
            f"{'diff %':>8} {'full members spread B':>21} {'full max resv':>15} {'fold max resv':>15}")
        for live, m in sorted(fold["ranks"].items()):
            members = [r for r, rep in enumerate(fold["rep"]) if rep == live and r in full["ranks"]]
            alloc = [full["ranks"][r]["max_allocated"] for r in members]
            resv = max(full["ranks"][r]["max_reserved"] for r in members)
            diff = m["max_allocated"] - max(alloc)
            label = f"rank {live} ({m['class']}; {len(members)})"
            say(f"{label:34} {max(alloc):>15,} {m['max_allocated']:>15,} {diff:>10,} {100 * diff / max(alloc):>8.3f} "
                f"{max(alloc) - min(alloc):>21,} {resv:>15,} {m['max_reserved']:>15,}")
        fi, fo = full["iteration_s"], fold["iteration_s"]
        ratio = f"{fo / fi:.4f}" if fi and fo else "n/a"
        say(f"== {job}: predicted iteration (median of two-clock iterations): full {_ms(fi)} ms, fold {_ms(fo)} ms, "
            f"fold/full {ratio}")
        say(f"   per iteration (ms): full {[_ms(t) for t in full['iteration_times_s'] or []]}, "
            f"fold {[_ms(t) for t in fold['iteration_times_s'] or []]}")
        fl, ol = full["losses"], fold["losses"]
        finite = all(math.isfinite(v) for v in (*fl.values(), *ol.values()))
        gaps = [abs(ol[k] - fl[k]) for k in fl if k in ol]
        spread = (max(fl.values()) - min(fl.values())) if fl else float("nan")
        say(f"== {job}: losses full {({k: round(v, 4) for k, v in fl.items()})} fold "
            f"{({k: round(v, 4) for k, v in ol.items()})}; all finite: {finite}; largest |fold - full| "
            f"{max(gaps, default=float('nan')):.4f} (full run's spread over iterations {spread:.4f})")
        say(f"== {job}: wall full {full['wall_s']:.1f} s, fold {fold['wall_s']:.1f} s; device memory in use at "
            f"iteration ends, at most: full {full['device_used_max'] / 2**30:.1f} GiB, "
            f"fold {fold['device_used_max'] / 2**30:.1f} GiB")
        d = diags.get(job)
        if not d:
            continue
        say(f"-- {job}: why (over iterations {d['timed_iterations']}):")
        a, b = d["own_host"]["full"], d["own_host"]["fold"]
        say(f"   each rank's own host times (no pooling over like ranks): full {_ms(a)} ms, fold {_ms(b)} ms, "
            f"fold/full {b / a:.4f}" if a and b else "   each rank's own host times: n/a")
        for _, v in sorted(d["views"].items()):
            t = v["iteration_s"]
            vs = f"this / full {t / fi:.4f}, fold / this {fo / t:.4f}" if t and fi and fo else "n/a"
            say(f"   full capture replayed as if folded, live {v['live']}: {_ms(t)} ms ({vs})")
        say(f"   {'class (live rank)':26} {'what, ms/iteration':18} {'fold':>9}   full, per member")
        timed = any(e["host"]["fold"] for e in d["classes"].values())  # GPU rows (none on CPU)
        for live, entry in sorted(d["classes"].items()):
            for key in ("compute", "host", "device") if timed else ("compute",):
                e = entry[key]
                members = "  ".join(f"{r}:{_ms(v)}" for r, v in sorted(e["full"].items()))
                say(f"   {('rank ' + str(live)):26} {key:18} {_ms(e['fold']):>9}   {members}")
        if timed:  # without GPU rows (CPU) the members' measured times are one clock each: nothing to move
            _say_choices(job, d, fi, fo, say)
        _say_iterations(job, d, fold["rep"], say)


def _say_choices(job: str, d: dict, full_s: float | None, fold_s: float | None, say) -> None:
    """The fold's prediction against the full capture's own spread over which member is measured (the
    statistic for the time criterion: like compared with like, the same synthesis from one rank a class)."""
    times = sorted(c["iteration_s"] for c in d.get("choices", []) if c["iteration_s"])
    if not times or not fold_s or not full_s:
        return
    med = statistics.median(times)
    lo, hi = times[0], times[-1]
    say(f"-- {job}: full capture replayed as the fold is, one measured member per class, over {len(times)} "
        f"choices of member: min {_ms(lo)}, median {_ms(med)}, max {_ms(hi)} ms (/ full {lo / full_s:.4f} .. "
        f"{hi / full_s:.4f})")
    for what, t in d.get("swapped", {}).items():
        if t:
            say(f"   fold replayed with the full capture's {what} times of the same ranks: {_ms(t)} ms "
                f"(/ full {t / full_s:.4f}, / fold {t / fold_s:.4f})")
    inside = "inside" if lo <= fold_s <= hi else "outside"
    say(f"   fold / median of the choices {fold_s / med:.4f} (|.-1| {'<=' if abs(fold_s / med - 1) <= 0.02 else '>'} "
        f"2 %); fold {inside} the choices' range; fold / full {fold_s / full_s:.4f}")


def _say_iterations(job: str, d: dict, rep: list[int], say) -> None:
    """Per class and iteration: the running peak (max allocated at the iteration's end) and, for MoE, the
    rows the class's ranks received in their token dispatches; full: per member, fold: its live rank."""
    mem, rows = d.get("memory_by_iteration", {}), d.get("expert_rows", {})
    if not mem.get("fold"):
        return
    say(f"-- {job}: running peak (max allocated at each iteration's end, MB) and rows received by MoE token "
        f"dispatches (sum over the iteration's forward passes | largest one), full per member | fold")
    for live in sorted(set(rep)):
        members = [r for r, x in enumerate(rep) if x == live]
        its = sorted(mem["fold"].get(live, {}))
        for k in its:
            def cell(run: str, r: int, k: int = k) -> str:
                peak = mem[run].get(r, {}).get(k)
                got = rows.get(run, {}).get(r, {}).get(k)
                text = f"{peak / 1e6:,.0f}" if peak is not None else "n/a"
                return text + (f" [{sum(got):,} | {max(got):,}]" if got else "")
            full = "  ".join(f"{r}: {cell('full', r)}" for r in members)
            peaks = [mem["full"].get(r, {}).get(k) for r in members]
            fold_peak = mem["fold"][live].get(k)
            diff = (f"{100 * (fold_peak - max(peaks)) / max(peaks):+.2f} %"
                    if fold_peak is not None and None not in peaks else "n/a")
            say(f"   rank {live} it {k}: full {full}   fold {cell('fold', live)}   fold vs full class max {diff}")


def noise(rows: list[dict], jobs: list[str], say) -> dict[str, dict]:
    """With --repeats: the fold/full ratio of predicted iteration time beside the spread of the full runs
    among themselves and of the folds among themselves (max - min over the median), so a difference of a
    few percent can be told from run-to-run noise."""
    out = {}
    for job in jobs:
        times = {f: [r["iteration_s"] for r in rows if r["job"] == job and r["fold"] == f and r.get("iteration_s")]
                 for f in ("off", "on")}
        pairs = {}
        for r in rows:
            if r["job"] == job and r.get("iteration_s"):
                pairs.setdefault(r.get("repeat", 0), {})[r["fold"]] = r["iteration_s"]
        ratios = [p["on"] / p["off"] for _, p in sorted(pairs.items()) if "on" in p and "off" in p]
        full, fold = times["off"], times["on"]
        if not full or not fold:
            say(f"== {job}: repeats: no full or no folded prediction")
            continue
        mf, mo = statistics.median(full), statistics.median(fold)
        e = {"full_s": full, "fold_s": fold, "ratio_of_medians": mo / mf, "pair_ratios": ratios,
             "full_spread": (max(full) - min(full)) / mf, "fold_spread": (max(fold) - min(fold)) / mo}
        out[job] = e
        say(f"== {job}: {len(full)} full and {len(fold)} folded runs, predicted iteration (ms): "
            f"full {[_ms(t) for t in full]}, fold {[_ms(t) for t in fold]}")
        say(f"   fold/full of the medians {e['ratio_of_medians']:.4f}; per repeat {[round(x, 4) for x in ratios]}; "
            f"spread (max - min) / median: full among themselves {100 * e['full_spread']:.2f} %, "
            f"fold among themselves {100 * e['fold_spread']:.2f} %")
    return out


def _bundle(a: argparse.Namespace, limit: int = 15 << 20) -> None:
    """Traces, logs and metrics of every run into one archive under --out (what comes back); without the
    rank logs where that is over ``limit`` bytes."""
    target = Path(a.out) / "traces.tar.gz"
    for logs in (True, False):
        with tarfile.open(target, "w:gz") as tar:
            for p in sorted(Path(a.work).iterdir()):
                if logs or not p.name.endswith(".logs"):
                    tar.add(p, arcname=p.name)
        if target.stat().st_size <= limit:
            return


def _public(rows: list[dict]) -> list[dict]:
    """Rows as written to the results: each trace named as in the archive (traces.tar.gz), not by its path."""
    return [{**r, "trace": Path(r["trace"]).name} if "trace" in r else r for r in rows]


def _shown_argv(argv: list[str]) -> list[str]:
    """The command as printed into result files: the directories it was given named OUT and WORK, not
    the paths of the machine it ran on."""
    shown, names = [], {"--out": "OUT", "--work": "WORK"}
    for i, arg in enumerate(argv):
        shown.append(names[argv[i - 1]] if i and argv[i - 1] in names else arg)
    return shown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="0")
    ap.add_argument("--out", required=True, help="results: fold_consistency.{json,txt}, traces.tar.gz")
    ap.add_argument("--work", default=None, help="where the runs write (default: a temporary directory)")
    ap.add_argument("--cluster", default="h200-nvlink-ib400")
    ap.add_argument("--jobs", default="dense,moe")
    ap.add_argument("--world", type=int, default=8, help="ranks of each job (dense DP = W/4, MoE DP = W/2)")
    ap.add_argument("--depth", default="replica", choices=("auto", "replica", "class"),
                    help="--prism-fold-depth of the folded run")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=4096, help="dense job's hidden size")
    ap.add_argument("--moe-hidden", type=int, default=2048)
    ap.add_argument("--moe-ffn", type=int, default=4096, help="each expert's FFN size")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--moe-ep", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per model replica")
    ap.add_argument("--iters", type=int, default=None,
                    help="iterations (default 5, 3 with --tiny); iterations 2.. are measured on two clocks")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--order", default="off,on", choices=["off,on", "on,off"],
                    help="which capture of each job runs first (--prism-fold off: full)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="captures of each job per fold setting, interleaved (off,on,off,on,... per --order); "
                         "prints fold/full beside each side's spread among its own runs")
    ap.add_argument("--pin-cores", action="store_true",
                    help="each rank on a core of its own (PRISM_PIN_CORES=1; needs more cores than ranks)")
    ap.add_argument("--spin-us", type=int, default=0,
                    help="a blocked rank spins this long for its grant before it sleeps (PRISM_SPIN_GRANT_US): "
                         "its core stays awake however many ranks take turns before it")
    ap.add_argument("--same-batches", action="store_true",
                    help="every DP replica reads replica 0's samples in both runs (core driver's PRISM_SAME_BATCHES): "
                         "the full reduction then equals the fold's mirror, so MoE routing and memory should agree "
                         "at every iteration, not only the first")
    ap.add_argument("--tiny", action="store_true", help="CPU check: hidden 64, 2 layers, seq 64, mbs 1")
    ap.add_argument("--timeout", type=float, default=200, help="seconds per run at most")
    ap.add_argument("--budget", type=float, default=440,
                    help="seconds for the whole script: a run that could not end inside it is not started")
    ap.add_argument("--analyse", action="store_true",
                    help="run nothing: rebuild the tables from the traces, metrics and logs in --work")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats must be a positive integer, got {a.repeats}")
    if a.analyse and a.work is None:
        ap.error("--analyse needs --work (the directory of the earlier runs)")
    if a.tiny:
        a.hidden = a.moe_hidden = a.moe_ffn = 64
        a.layers, a.heads, a.seq, a.mbs, a.micro, a.bf16 = 2, 4, 64, 1, 2, False
    a.iters = a.iters or (3 if a.tiny else 5)
    jobs = a.jobs.split(",")
    for job in jobs:
        if job not in ("dense", "moe"):
            ap.error(f"--jobs: unknown job {job!r} (dense, moe)")
    start = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = None
    if a.work is None:
        tmp = tempfile.mkdtemp(prefix="fold-consistency-")
        a.work = tmp
    Path(a.work).mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    say(f"# {' '.join(_shown_argv(sys.argv))}")
    rows, diags = [], {}
    reserve = 45.0  # seconds kept for a run past its time to end (_stop), the reports, the tables and the archive
    shown = ("job", "fold", "rc", "wall_s", "iteration_s", "iteration_times_s", "device_used_max", "rep")
    if a.repeats > 1:
        shown = ("repeat", *shown)
    for job in jobs:
        flags = _flags(a, job)
        for k, fold in ((k, f) for k in range(a.repeats) for f in a.order.split(",")):  # off,on,off,on,...
            what = f"{job} --prism-fold {fold}" + (f" (repeat {k})" if k else "")
            if a.analyse:
                r = _analysed(a, job, fold, k)
                if r is None:
                    say(f"{what}: no trace in {a.work}")
                else:
                    rows.append(r)
                continue
            left = a.budget - (time.perf_counter() - start) - reserve
            if left < 30:
                say(f"{what}: not run ({left:.0f} s of --budget left)")
                continue
            r = _run(a, job, fold, flags, min(a.timeout, left), repeat=k)
            rows.append(r)
            so_far = json.dumps({"rows": _public(rows)}, indent=1, default=str)
            (out / "fold_consistency.json").write_text(so_far)
            say(json.dumps({k: v for k, v in r.items() if k in shown}))
            if "error" in r:
                say(r["error"])
        full = next((r for r in rows if r["job"] == job and r["fold"] == "off" and "ranks" in r), None)
        folded = next((r for r in rows if r["job"] == job and r["fold"] == "on" and "ranks" in r), None)
        if full and folded and folded["rep"]:
            try:
                diags[job] = diagnose(full, folded, a.cluster)
            except Exception as e:  # the decomposition must not lose the main figures
                say(f"{job}: decomposition failed: {type(e).__name__}: {e}")
    summarize(rows, jobs, diags, say)
    result = {"rows": _public(rows), "why": diags}
    if a.repeats > 1:
        say("\n== run-to-run noise (--repeats: the first repeat's runs are the tables above)")
        result["repeats"] = noise(rows, jobs, say)
    (out / "fold_consistency.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "fold_consistency.txt").write_text("\n".join(lines) + "\n")
    if not a.analyse:
        _bundle(a)
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"# total {time.perf_counter() - start:.0f} s; results in {out}", flush=True)


if __name__ == "__main__":
    main()
