"""Export a predicted timeline as Chrome trace-event JSON (chrome://tracing, Perfetto).

One process per rank (pid = rank): thread 0 shows what the rank does (compute, exposed_comm,
bubble — these never overlap; contiguous slices of one activity are one slice), thread 1 the
scheduling-unit markers as nested B/E spans, and threads 2, 3... the communication ops in flight
(several lanes because async ops overlap and viewers require the slices of one thread to nest).
One more process shows the critical path. A window (``to_chrome(..., window=(lo, hi))``) keeps what
happens in it: activity and comm slices clipped to it, marker spans wholly inside it (a begin without its
end would draw as never ending), the critical path clipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..trace.chrome import chrome_json
from ..trace.writer import atomic_write_text
from .engine import ReplayResult, Segment

ACTIVITY_TID = 0
MARKS_TID = 1
COMM_TID = 2


def _us(t: float) -> float:
    return round(t * 1e6, 3)


def _lanes(segments: list[Any]) -> list[int]:
    """Assign each (sorted) interval the first lane whose last interval ended before it starts."""
    ends: list[float] = []
    out = []
    for s in segments:
        for lane, e in enumerate(ends):
            if e <= s.start:
                ends[lane] = s.end
                out.append(lane)
                break
        else:
            ends.append(s.end)
            out.append(len(ends) - 1)
    return out


def activity_runs(segments: Iterable[Segment], key: Callable[[Segment], Any], lo: float = -math.inf,
                  hi: float = math.inf) -> list[tuple[Any, float, float]]:
    """A rank's activity (its segments but comm, which overlap it) clipped to [lo, hi], as (key, start, end) runs:
    contiguous segments of one ``key`` are one run (the same activity going on, as a timeline draws it); compared
    unrounded, since a rounded end never equals the next start."""
    out: list[list[Any]] = []
    for s in segments:
        start, end = max(s.start, lo), min(s.end, hi)
        if s.kind == "comm" or end <= start:
            continue
        k = key(s)
        if out and out[-1][0] == k and abs(out[-1][2] - start) < 1e-12:
            out[-1][2] = end
        else:
            out.append([k, start, end])
    return [(k, a, b) for k, a, b in out]


def _marks_within(marks: list[Any], lo: float, hi: float) -> list[Any]:
    """The marks in [lo, hi], in their order: instants there, B/E spans (paired per rank and name, innermost
    first) wholly there."""
    keep: set[int] = set()
    open_: dict[tuple[int, str], list[int]] = {}
    for i, m in enumerate(marks):
        if m.phase == "B":
            open_.setdefault((m.rank, m.name), []).append(i)
        elif m.phase == "E":
            stack = open_.get((m.rank, m.name))
            begin = stack.pop() if stack else None
            if begin is not None and lo <= marks[begin].t and m.t <= hi:
                keep.update((begin, i))
        elif lo <= m.t <= hi:
            keep.add(i)
    return [m for i, m in enumerate(marks) if i in keep]


def to_chrome(result: ReplayResult, provenance: dict[str, Any] | None = None,
              window: tuple[float, float] | None = None, iteration: int | None = None) -> dict[str, Any]:
    """The trace-event JSON object of a replay result; ``window`` (seconds): only what happens in it,
    ``iteration``: the iteration that window is (said in the file)."""
    lo, hi = window or (-math.inf, math.inf)
    events: list[dict[str, Any]] = []
    cp_pid = max(result.graph.ranks, default=-1) + 1
    marks: dict[int, list[Any]] = {}
    for m in result.marks if window is None else _marks_within(result.marks, lo, hi):
        marks.setdefault(m.rank, []).append(m)
    for rank in result.graph.ranks:
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        names = {ACTIVITY_TID: "activity", MARKS_TID: "markers"}
        segs = result.segments.get(rank, []) if window is None else result.within(rank, lo, hi)
        for (name, kind), start, end in activity_runs(segs, lambda s: (s.label or s.kind, s.kind), lo, hi):
            events.append({"ph": "X", "pid": rank, "tid": ACTIVITY_TID, "name": name, "cat": kind,
                           "ts": _us(start), "dur": _us(end) - _us(start)})
        comms = sorted((s for s in segs if s.kind == "comm" and s.end > lo and s.start < hi),
                       key=lambda s: (s.start, -s.end))
        for s, lane in zip(comms, _lanes(comms), strict=True):
            names[COMM_TID + lane] = "comm" if lane == 0 else f"comm +{lane}"
            start, end = max(s.start, lo), min(s.end, hi)
            events.append({"ph": "X", "pid": rank, "tid": COMM_TID + lane, "name": s.label, "cat": "comm",
                           "ts": _us(start), "dur": _us(end) - _us(start), "args": dict(s.args)})
        for m in marks.get(rank, ()):
            ev = {"ph": m.phase, "pid": rank, "tid": MARKS_TID, "name": m.name, "ts": _us(m.t), "args": m.attrs}
            if m.phase == "i":
                ev["s"] = "t"
            events.append(ev)
        for tid, name in names.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
    events.append({"ph": "M", "name": "process_name", "pid": cp_pid, "args": {"name": "critical path"}})
    for step in result.critical_path:
        start, end = max(step.start, lo), min(step.end, hi)
        if end <= start and window is not None:
            continue
        events.append({"ph": "X", "pid": cp_pid, "tid": 0, "name": step.label or step.kind, "cat": step.kind,
                       "ts": _us(start), "dur": _us(end) - _us(start), "args": {"ranks": list(step.ranks)}})
    meta = {"producer": "prism-megatron replay", "source": result.graph.source,
            "makespan_s": result.makespan, "iteration_times_s": result.iteration_times()}
    if window is not None:
        meta.update(window_s=[lo, hi], iteration=iteration)
    if provenance:
        meta["provenance"] = provenance
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}


def write_chrome(result: ReplayResult, path: str | Path, provenance: dict[str, Any] | None = None,
                 window: tuple[float, float] | None = None, iteration: int | None = None) -> Path:
    """Write the predicted timeline (``to_chrome``'s, its arguments) to ``path`` atomically; return the path."""
    return atomic_write_text(path, chrome_json(to_chrome(result, provenance, window, iteration)))
