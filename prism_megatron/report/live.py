"""The predicted time of one iteration while the capture still runs (Megatron's log line shows it).

The coordinator calls ``predict_iteration`` (given to it by the launcher: the runtime knows no
replay) once every rank has ended iteration N, with a snapshot of the trace so far. Each rank's
records are cut at its N-th ``iteration`` end, so the graph holds whole iterations only (every
collective of them has all its members; later ops are left out), and the replay's iteration N is
the prediction. Same provenance as the report's (the note says it briefly): bare-graph compute,
communication free or costed by a cluster profile.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from prism_megatron.trace import read_trace

if TYPE_CHECKING:
    from prism_megatron.replay.engine import ResumableReplay


def _iteration_ends(marks: pa.Table) -> dict[int, list[float]]:
    """Per rank, the times of its ``iteration`` ends, in order."""
    ends: dict[int, list[float]] = {}
    for m in marks.filter(pc.and_(pc.equal(marks["name"], "iteration"), pc.equal(marks["phase"], "E"))).to_pylist():
        ends.setdefault(m["rank"], []).append(m["t"])
    return {r: sorted(ts) for r, ts in ends.items()}


def _cut_times(marks: pa.Table, iteration: int) -> dict[int, float]:
    """Per rank, the time of its ``iteration``-th iteration end."""
    return {r: ts[iteration - 1] for r, ts in _iteration_ends(marks).items() if len(ts) >= iteration}


def _until(table: pa.Table, column: str, cut: dict[int, float]) -> pa.Table:
    keep = [cut.get(r, float("inf")) >= t for r, t in zip(table["rank"].to_pylist(), table[column].to_pylist(),
                                                          strict=True)]
    return table.filter(pa.array(keep, pa.bool_()))


#: Share of an iteration's compute clock its rows may leave uncovered and the iteration still count as timed
#: (the clocks are running sums: their rounding, not lost segments).
COVERED = 1e-3


def timed_iterations(trace) -> dict[int, bool] | None:
    """Per iteration (1, 2, ... in order), whether every rank's has measured host/GPU times over all its
    compute (None: a trace of ranks on CPUs, which has none). What the report's per-iteration basis and
    the live note say.

    On a GPU an iteration's times normally arrive at its own end (runtime.gpu_timing); set-up and the
    first iterations, and the first profiled one where it waits for the next, are on one clock. An
    iteration whose rows cover only part of its compute (segments lost) is not timed either: the replay
    runs the rest on one clock (replay.gpu_segments), where every op the host waits for is exposed.
    """
    if not trace.gpu.num_rows and not any(str(r.get("device", "")).startswith("cuda")
                                          for r in trace.manifest.get("ranks", [])):
        return None
    clocks: dict[int, list[float]] = {}
    for m in trace.marks.filter(pc.equal(trace.marks["name"], "iteration")).to_pylist():
        clocks.setdefault(m["rank"], []).append(m["compute_clock"])
    windows = {r: [(c[i] - 1e-9, c[i + 1] + 1e-9) for i in range(0, len(c) - 1, 2)] for r, c in clocks.items()}
    covered: dict[tuple[int, int], float] = {}  # one pass over the rows: this runs in the coordinator
    for rank, start, end in zip(trace.gpu["rank"].to_pylist(), trace.gpu["clock_start"].to_pylist(),
                                trace.gpu["clock_end"].to_pylist(), strict=True):
        for k, (a, b) in enumerate(windows.get(rank, ())):
            if a <= start and end <= b:
                covered[rank, k + 1] = covered.get((rank, k + 1), 0.0) + end - start
                break

    def whole(rank: int, k: int) -> bool:
        a, b = windows[rank][k - 1]
        return (rank, k) in covered and covered[rank, k] >= (b - a) * (1 - COVERED) - 2e-9

    count = min((len(w) for w in windows.values()), default=0)
    return {k: all(whole(r, k) for r in windows) for k in range(1, count + 1)}


def basis(timed: bool | None) -> str:
    """What a predicted iteration's compute rests on, as the live note and the report say it."""
    if timed is None:
        return "compute on one clock (no GPU timing)"
    return ("host and GPU time measured (host: median over like iterations so far and like ranks)" if timed
            else "one clock (no host and GPU time measured for all of this iteration, or not yet)")


def until_iteration(trace, iteration: int):
    """``trace`` with each rank's records cut at its ``iteration``-th iteration end (whole iterations only:
    every collective of them has all its members), or None where no rank has ended it."""
    cut = _cut_times(trace.marks, iteration)
    if not cut:
        return None
    return replace(trace, ops=_until(trace.ops, "t_issue", cut), marks=_until(trace.marks, "t", cut),
                   slots=_until(trace.slots, "t_grant", cut))


def whole_iterations(trace) -> int:
    """How many iterations every rank of ``trace`` ended (0: none, or no iteration marks)."""
    ends = _iteration_ends(trace.marks)
    ranks = {r["rank"] for r in trace.manifest.get("ranks", [])} or set(ends)
    return min((len(ends.get(r, ())) for r in ranks), default=0)


#: per (snapshot directory, cluster, nodes' size): the replay of the last prediction, which the next goes on from
_REPLAYS: dict[tuple[str, str | None, int | None], ResumableReplay] = {}


def predict_iteration(trace_dir: str | Path, iteration: int, cluster: str | None = None) -> tuple[float | None, str]:
    """(predicted seconds of ``iteration`` or None, a note with the provenance or why not).

    Called at each logged iteration of a run with the same ``trace_dir``: the replay goes on from where the
    last prediction's stopped (replay.ResumableReplay), so it costs one iteration's replay, not one of every
    iteration so far, and gives the same times (the snapshot and its graph are still read and built whole)."""
    from prism_megatron.replay import graph_from_trace
    from prism_megatron.replay.engine import ResumableReplay

    trace = read_trace(trace_dir)
    part = until_iteration(trace, iteration)
    if part is None:
        return None, f"no rank has ended iteration {iteration}"
    from .build import cost_model

    key = (str(Path(trace_dir).resolve()), cluster, trace.fold.gpus_per_node if trace.fold is not None else None)
    if key not in _REPLAYS:
        _REPLAYS[key] = ResumableReplay(cost_model(cluster, trace.fold))
    times = {it.number: it.time for it in _REPLAYS[key].iterations(graph_from_trace(part))}
    if iteration not in times:
        return None, f"iteration {iteration} has no markers in the replay ({json.dumps(sorted(times))})"
    timed = timed_iterations(part)
    clocks = "" if timed is None else basis(timed.get(iteration, False)) + ", "
    return times[iteration], f"uncalibrated, {clocks}communication " + (f"costed by {cluster}" if cluster else "free")
