"""Give a rank's compute events the host and device times measured on a GPU (the trace's gpu table).

The graph is built on the rank's one compute clock (where ops, markers and waits sit). A measured
segment covers a stretch of that clock (clock_start, clock_end]; every Compute of the graph spans
whole segments, because the graph splits compute only at points where the rank called into the
runtime, and each such call ends a segment. So each Compute becomes the sum of its segments' host
and device times, cut where the program waited for the device (a CpuSync there). Any stretch of
a Compute no segment covers (timing lost) stays one-clock: host and device both take its length.

Host time is the noisy figure (one rank's plain iterations of the same work differ widely;
docs/history.md): each segment's host time is the median over the iterations up to its own that ran
the same sequence of segments (`typical_host_times`), so one slow iteration of one rank does not
become the prediction's critical path, and an iteration is predicted alike while the capture runs
and after it. Device times stay as measured (the profiler's, stable).

Iteration markers also get a CpuSync before them: Megatron times an iteration with its timers,
which synchronise the device (as does ``bench/accuracy``'s real-run stamping), so an iteration ends
when its device work has, not when the host has queued it.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from ..trace.schema import segment_pieces
from .graph import Compute, CpuSync, Event, Mark, Wait

_TOL = 1e-9  # seconds: the graph's clock is a running sum of per-op differences of the rank's clock


def _syncs(row: dict[str, Any]) -> list:
    """A row's waits for the device (the writer's JSON text, or already a list)."""
    syncs = row["syncs"]
    if isinstance(syncs, str):
        return json.loads(syncs) if syncs else []
    return syncs


def _pieces(row: dict[str, Any]) -> list[tuple[float, float] | None]:
    """A segment as (host, device) pieces with None where the program waited for the device."""
    *waited, last = segment_pieces(row["cpu"], row["gpu"], _syncs(row))
    return [x for piece in waited for x in (piece, None)] + [last]


def typical_host_times(rows: list[dict[str, Any]], iteration_ends: list[float]) -> list[dict[str, Any]]:
    """``rows`` of one rank with each segment's host time (``cpu``, and its waits' host offsets in
    proportion) replaced by the median over the iterations of the same shape up to its own: iterations
    are the stretches of the rank's clock between ``iteration_ends`` (its iteration markers' compute
    clocks), and two have the same shape when they hold the same number of segments; segment k of one is
    pooled with segment k of the earlier ones. Only earlier iterations, so that an iteration's prediction
    is the same whether the trace ends with it (the live prediction in Megatron's log line) or goes on
    (the report). Rows before the first end (set-up and the first iteration) or after the last, and the
    first iteration of each shape, keep their own time."""
    ends = sorted(iteration_ends)
    windows: dict[int, list[int]] = defaultdict(list)  # iteration k (1..) -> indices into rows, clock order
    order = sorted(range(len(rows)), key=lambda i: rows[i]["clock_start"])
    k = 0
    for i in order:
        while k < len(ends) and rows[i]["clock_start"] >= ends[k] - _TOL:
            k += 1
        if 0 < k < len(ends):  # a whole iteration after the first
            windows[k].append(i)
    pools: dict[tuple[int, int], list[float]] = defaultdict(list)  # (shape, position) -> host times so far
    out = [dict(r) for r in rows]
    for _, idx in sorted(windows.items()):
        for pos, i in enumerate(idx):
            pool = pools[(len(idx), pos)]
            pool.append(rows[i]["cpu"])
            if len(pool) < 2:
                continue
            row, typical = out[i], statistics.median(pool)
            scale = typical / row["cpu"] if row["cpu"] > 0 else 1.0
            row["syncs"] = [[off * scale, before] for off, before in _syncs(row)]
            row["cpu"] = typical
    return out


def with_gpu_times(events: list[Event], rows: Iterable[dict[str, Any]]) -> list[Event]:
    """``events`` of one rank with measured times on its Compute events (unchanged if ``rows`` is empty)."""
    rows = sorted(rows, key=lambda r: r["clock_end"])
    if not rows:
        return events
    out: list[Event] = []
    moved: dict[int, int] = {}  # event index -> its index in ``out`` (waits name ops by index)
    clock, j = 0.0, 0
    for i, ev in enumerate(events):
        if not isinstance(ev, Compute):
            if isinstance(ev, Mark) and ev.name == "iteration":
                out.append(CpuSync())
            moved[i] = len(out)
            out.append(Wait(tuple(moved[r] for r in ev.refs)) if isinstance(ev, Wait) else ev)
            continue
        stop = clock + ev.duration
        cpu = gpu = covered = 0.0
        while j < len(rows) and rows[j]["clock_end"] <= stop + _TOL:
            row = rows[j]
            j += 1
            if row["clock_end"] <= clock + _TOL and row["clock_end"] - row["clock_start"] > _TOL:
                continue  # a segment before this Compute that no Compute covered (cannot happen; be safe)
            covered += row["clock_end"] - row["clock_start"]
            for piece in _pieces(row):
                if piece is None:
                    out.append(Compute(cpu, ev.label, gpu))
                    out.append(CpuSync())
                    cpu = gpu = 0.0
                else:
                    cpu += piece[0]
                    gpu += piece[1]
        lost = max(ev.duration - covered, 0.0)
        out.append(Compute(cpu + lost, ev.label, gpu + lost))
        clock = stop
    return out
