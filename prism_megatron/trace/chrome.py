"""Export a PrismTrace as Chrome trace-event JSON (chrome://tracing, Perfetto, Speedscope).

Layout: one process per rank (pid = rank). Thread 0 "compute" shows slot grants as "compute"
slices and scheduling-unit markers as B/E spans and instants; thread 1 "comm" shows each
communication op from issue to completion.

Viewers require the slices of one thread to nest. Markers are recorded while a rank holds a slot,
so a span usually begins inside one grant and ends inside another; each grant is therefore cut at
the span boundaries that fall inside it. Async ops can overlap without nesting (isend beside
irecv); such ops go to extra threads "comm +1", "comm +2"... instead of breaking thread 1.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from .reader import PrismTrace, read_trace
from .schema import FORMAT, VERSION
from .writer import atomic_write_text

COMPUTE_TID = 0
COMM_TID = 1
# Sort order of events sharing a timestamp on one thread: close spans, open spans, then slices.
_PHASE_ORDER = {"E": 0, "B": 1, "X": 2, "i": 3}


def _us(t: float) -> float:
    """Seconds -> microseconds, rounded to the nanosecond so that adjacent slices meet exactly."""
    return round(t * 1e6, 3)


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None  # NaN/inf are not JSON


def _json(text: str, empty: Any) -> Any:
    """Parsed JSON text, or the text itself if a foreign writer stored something else."""
    if not text:
        return empty
    try:
        return json.loads(text)
    except ValueError:
        return text


def _attrs(text: str) -> dict[str, Any]:
    value = _json(text, {})
    return value if isinstance(value, dict) else {"attrs": value}


def _by_rank(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        out[row["rank"]].append(row)
    return out


def _balanced_marks(marks: list[dict[str, Any]], end_t: float) -> list[tuple[float, str, str, dict]]:
    """Markers of one rank as (t, phase, name, args) with every B matched by a properly nested E.

    Hooks use context managers, so marks nest already; this only repairs traces of ranks that
    died mid-span (close at the rank's last timestamp) or foreign writers (stray E -> instant).
    """
    out: list[tuple[float, str, str, dict]] = []
    stack: list[str] = []
    for m in marks:
        t = m["t"]
        if not math.isfinite(t):
            continue
        args = _attrs(m["attrs"])
        args["compute_clock"] = _num(m["compute_clock"])
        name, phase = m["name"], m["phase"]
        if phase == "B":
            stack.append(name)
            out.append((t, "B", name, args))
        elif phase == "E" and name in stack:
            while stack[-1] != name:
                out.append((t, "E", stack.pop(), {"prism": f"closed by the end of '{name}'"}))
            stack.pop()
            out.append((t, "E", name, args))
        elif phase == "E":
            out.append((t, "i", name, {**args, "prism": "end without begin"}))
        else:
            out.append((t, "i", name, args))
    for name in reversed(stack):
        out.append((end_t, "E", name, {"prism": "never ended; closed at the rank's last event"}))
    return out


def _compute_thread(rank: int, marks: list, grants: list, end_t: float) -> list[dict[str, Any]]:
    keyed: list[tuple[float, int, int, dict[str, Any]]] = []
    spans = _balanced_marks(marks, end_t)
    for t, phase, name, args in spans:
        ev: dict[str, Any] = {
            "name": name,
            "cat": "mark",
            "ph": phase,
            "pid": rank,
            "tid": COMPUTE_TID,
            "ts": _us(t),
        }
        if phase == "i":
            ev["s"] = "t"
        ev["args"] = args
        keyed.append((ev["ts"], _PHASE_ORDER[phase], len(keyed), ev))

    bounds = sorted({_us(t) for t, phase, _, _ in spans if phase in "BE"})
    for g in grants:
        a, b = g["t_grant"], g["t_release"]
        if not math.isfinite(a):
            continue
        b = end_t if not math.isfinite(b) else max(a, b)
        start, stop = _us(a), _us(b)
        cuts = bounds[bisect.bisect_right(bounds, start) : bisect.bisect_left(bounds, stop)]
        edges = [start, *cuts, stop]
        for k in range(len(edges) - 1):
            args: dict[str, Any] = {"device": g["device"], "slot": g["slot"]}
            if len(edges) > 2:
                args["part"] = f"{k + 1}/{len(edges) - 1}"
            ev = {
                "name": "compute",
                "cat": "slot",
                "ph": "X",
                "pid": rank,
                "tid": COMPUTE_TID,
                "ts": edges[k],
                "dur": round(edges[k + 1] - edges[k], 3),
                "args": args,
            }
            keyed.append((ev["ts"], _PHASE_ORDER["X"], len(keyed), ev))
    keyed.sort(key=lambda item: item[:3])
    return [ev for *_, ev in keyed]


def _comm_threads(rank: int, ops: list, groups: dict, end_t: float) -> tuple[list[dict[str, Any]], int]:
    """Op slices on thread 1, spilling ops that would misnest onto further threads."""
    items = []
    for op in ops:
        if not math.isfinite(op["t_issue"]):
            continue
        done = op["t_complete"]
        end = end_t if not math.isfinite(done) else max(done, op["t_issue"])
        items.append((_us(op["t_issue"]), _us(end), op))
    items.sort(key=lambda it: (it[0], -it[1], it[2]["index"]))

    lanes: list[list[float]] = []  # per lane: stack of end times of the enclosing open slices
    events = []
    for start, stop, op in items:
        lane_no = len(lanes)
        for k, stack in enumerate(lanes):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or stop <= stack[-1]:
                lane_no = k
                break
        else:
            lanes.append([])
        lanes[lane_no].append(stop)
        group = groups.get(op["group"], {})
        args: dict[str, Any] = {
            "kind": op["kind"],
            "index": op["index"],
            "group": op["group"],
            "group_name": group.get("name", ""),
            "seq": op["seq"],
            "peer": op["peer"],
            "bytes": op["bytes"],
            "dtype": op["dtype"],
            "shapes": _json(op["shapes"], []),
            "async_op": op["async_op"],
            "compute_before": _num(op["compute_before"]),
        }
        if op["root"] >= 0:
            args["root"] = op["root"]
        if op["reduce_op"]:
            args["reduce_op"] = op["reduce_op"]
        if not math.isfinite(op["t_complete"]):
            args["prism"] = "never completed; drawn to the rank's last event"
        events.append(
            {
                "name": op["label"] or op["kind"],
                "cat": "comm",
                "ph": "X",
                "pid": rank,
                "tid": COMM_TID + lane_no,
                "ts": start,
                "dur": round(stop - start, 3),
                "args": args,
            }
        )
    events.sort(key=lambda ev: (ev["tid"], ev["ts"]))
    return events, max(1, len(lanes))


def _last_time(*rows_and_keys: tuple[list[dict[str, Any]], tuple[str, ...]]) -> float:
    times = [r[k] for rows, keys in rows_and_keys for r in rows for k in keys]
    finite = [t for t in times if math.isfinite(t)]
    return max(finite, default=0.0)


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def to_chrome(trace: PrismTrace) -> dict[str, Any]:
    """Build the Chrome trace-event JSON object for ``trace`` (timestamps in microseconds)."""
    groups = trace.groups()
    marks = _by_rank(trace.marks.to_pylist())
    slots = _by_rank(trace.slots.to_pylist())
    ops = _by_rank(trace.ops.to_pylist())
    for rows in marks.values():
        # Stable: equal times keep their recorded order. NaN (skipped later) must not upset the sort.
        rows.sort(key=lambda m: m["t"] if math.isfinite(m["t"]) else math.inf)

    metadata: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    for rank in trace.real_ranks:  # a folded trace has rows of its live ranks only
        r_marks, r_slots, r_ops = marks.get(rank, []), slots.get(rank, []), ops.get(rank, [])
        end_t = _last_time(
            (r_marks, ("t",)), (r_slots, ("t_grant", "t_release")), (r_ops, ("t_issue", "t_complete"))
        )
        comm, n_lanes = _comm_threads(rank, r_ops, groups, end_t)
        metadata.append(_meta("process_name", rank, 0, {"name": f"rank {rank}"}))
        metadata.append(_meta("process_sort_index", rank, 0, {"sort_index": rank}))
        metadata.append(_meta("thread_name", rank, COMPUTE_TID, {"name": "compute"}))
        metadata.append(_meta("thread_sort_index", rank, COMPUTE_TID, {"sort_index": COMPUTE_TID}))
        for lane in range(n_lanes):
            tid = COMM_TID + lane
            metadata.append(
                _meta("thread_name", rank, tid, {"name": "comm" if lane == 0 else f"comm +{lane}"})
            )
            metadata.append(_meta("thread_sort_index", rank, tid, {"sort_index": tid}))
        events.extend(_compute_thread(rank, r_marks, r_slots, end_t))
        events.extend(comm)

    return {
        "traceEvents": metadata + events,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": FORMAT,
            "version": VERSION,
            "source": str(trace.path),
            "created": trace.manifest.get("created", ""),
            "world_size": trace.world_size,
        },
    }


def chrome_json(obj: dict[str, Any]) -> str:
    """Trace-event JSON as Perfetto and chrome://tracing read it, without the spaces ``json.dumps`` puts after
    its separators by default (a thousand-rank job's timeline is hundreds of MB)."""
    return json.dumps(obj, separators=(",", ":")) + "\n"


def write_chrome(trace: PrismTrace | str | Path, out_path: str | Path) -> Path:
    """Write ``to_chrome(trace)`` to ``out_path`` atomically; ``trace`` may also be a trace path."""
    if not isinstance(trace, PrismTrace):
        trace = read_trace(trace)
    return atomic_write_text(out_path, chrome_json(to_chrome(trace)))
