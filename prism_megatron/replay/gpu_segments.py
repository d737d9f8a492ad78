"""Give a rank's compute events the host and device times measured on a GPU (the trace's gpu table).

The graph is built on the rank's one compute clock (where ops, markers and waits sit). A measured
segment covers a stretch of that clock (clock_start, clock_end]; every Compute of the graph spans
whole segments, because the graph splits compute only at points where the rank called into the
runtime, and each such call ends a segment. So each Compute becomes the sum of its segments' host
and device times, cut where the program waited for the device (a CpuSync there). Any stretch of
a Compute no segment covers (timing lost) stays one-clock: host and device both take its length.

Iteration markers also get a CpuSync before them: Megatron times an iteration with its timers,
which synchronise the device (as does ``bench/accuracy``'s real-run stamping), so an iteration ends
when its device work has, not when the host has queued it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..trace.schema import segment_pieces
from .graph import Compute, CpuSync, Event, Mark, Wait

_TOL = 1e-9  # seconds: the graph's clock is a running sum of per-op differences of the rank's clock


def _pieces(row: dict[str, Any]) -> list[tuple[float, float] | None]:
    """A segment as (host, device) pieces with None where the program waited for the device."""
    syncs = row["syncs"]
    if isinstance(syncs, str):
        syncs = json.loads(syncs) if syncs else []
    *waited, last = segment_pieces(row["cpu"], row["gpu"], syncs)
    return [x for piece in waited for x in (piece, None)] + [last]


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
