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
and after it. Then over *like ranks* (`like_rank_host_times`): ranks that issued the same ops (kinds,
bytes, dtypes, group sizes; not the bytes of MoE's token all_to_all: data-parallel replicas,
tensor-parallel peers and expert ranks of one stage) run the same host code, and the emulating
machine's processes differ in host speed by tens of percent for it (docs/measurements.md); left per
rank, the replay's collectives would wait for whichever process ran slowest, so a capture of every
replica predicted more than a folded one, which measures one. Device times stay as measured (the
profiler's, stable).

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


def parsed_syncs(row: dict[str, Any]) -> list:
    """A row's waits for the device (the writer's JSON text, or already a list)."""
    syncs = row["syncs"]
    if isinstance(syncs, str):
        return json.loads(syncs) if syncs and syncs != "[]" else []  # most segments never waited: no parse
    return syncs


def _pieces(row: dict[str, Any]) -> list[tuple[float, float] | None]:
    """A segment as (host, device) pieces with None where the program waited for the device."""
    *waited, last = segment_pieces(row["cpu"], row["gpu"], parsed_syncs(row))
    return [x for piece in waited for x in (piece, None)] + [last]


def typical_host_times(rows: list[dict[str, Any]], iteration_ends: list[float],
                       window: int | None = None) -> list[dict[str, Any]]:
    """``rows`` of one rank with each segment's host time (``cpu``, and its waits' host offsets in
    proportion) replaced by the median over the iterations of the same shape up to its own: iterations
    are the stretches of the rank's clock between ``iteration_ends`` (its iteration markers' compute
    clocks), and two have the same shape when they hold the same number of segments; segment k of one is
    pooled with segment k of the earlier ones. Only earlier iterations, so that an iteration's prediction
    is the same whether the trace ends with it (the live prediction in Megatron's log line) or goes on
    (the report). Rows before the first end (set-up and the first iteration) or after the last, and the
    first iteration of each shape, keep their own time. ``window``: pool only the latest that many
    (bench/gpu/host_pool_window.py weighs it against every earlier one)."""
    windows = _windows(rows, iteration_ends)
    pools: dict[tuple[int, int], list[float]] = defaultdict(list)  # (shape, position) -> host times so far
    out = [dict(r) for r in rows]
    for _, idx in sorted(windows.items()):
        for pos, i in enumerate(idx):
            pool = pools[(len(idx), pos)]
            pool.append(rows[i]["cpu"])
            if len(pool) < 2:
                continue
            _set_host(out[i], statistics.median(pool[-window:] if window else pool))
    return out


def _windows(rows: list[dict[str, Any]], iteration_ends: list[float]) -> dict[int, list[int]]:
    """Iteration k (1..) -> indices into ``rows`` of its segments, in clock order: the whole iterations
    after the first (set-up, the first iteration and the tail after the last end are in none)."""
    ends = sorted(iteration_ends)
    windows: dict[int, list[int]] = defaultdict(list)
    order = sorted(range(len(rows)), key=lambda i: rows[i]["clock_start"])
    k = 0
    for i in order:
        while k < len(ends) and rows[i]["clock_start"] >= ends[k] - _TOL:
            k += 1
        if 0 < k < len(ends):
            windows[k].append(i)
    return windows


def _set_host(row: dict[str, Any], host: float) -> None:
    """Give ``row`` the host time ``host``, its waits' host offsets in proportion."""
    scale = host / row["cpu"] if row["cpu"] > 0 else 1.0
    row["syncs"] = [[off * scale, before] for off, before in parsed_syncs(row)]
    row["cpu"] = host


def like_rank_host_times(rows_by_rank: dict[int, list[dict[str, Any]]], ends_by_rank: dict[int, list[float]],
                         ops_by_rank: dict[int, dict[int, list[tuple[float, Any]]]]) -> dict[int, list[dict[str, Any]]]:
    """``rows_by_rank`` with host times (as :func:`typical_host_times` left them) pooled over *like ranks*.

    ``ops_by_rank[rank][k]``: the ops the rank issued in iteration k (the k-th whole iteration after the
    first, as in :func:`typical_host_times`), each as (its compute clock at issue, a key: kind, bytes,
    dtype, group size). Ranks whose keys in iteration k are equal ran the same program on the same shapes
    there; the host time of each stretch between two of their ops (the sum of its segments: ranks may
    split a stretch differently, e.g. the last rank around its iteration line) becomes the median over
    them, spread over the stretch's segments in proportion. Set-up, the first iteration and the tail keep
    each rank's own. Only iterations a rank has ended count, so the live prediction of an iteration and
    the report still agree."""
    out = {r: [dict(x) for x in rows] for r, rows in rows_by_rank.items()}
    like: dict[tuple, list[tuple[int, list[list[int]]]]] = defaultdict(list)  # (k, keys) -> (rank, stretches)
    for r, rows in out.items():
        for k, idx in _windows(rows, ends_by_rank.get(r, [])).items():
            ops = ops_by_rank.get(r, {}).get(k)
            if not ops:  # no op to tell what the rank ran: alike with no one
                continue
            stretches: list[list[int]] = [[] for _ in range(len(ops) + 1)]
            j = 0
            for i in idx:
                while j < len(ops) and rows[i]["clock_end"] > ops[j][0] + _TOL:
                    j += 1
                stretches[j].append(i)
            like[(k, tuple(key for _, key in ops))].append((r, stretches))
    for members in like.values():
        if len(members) < 2:
            continue
        for s in range(len(members[0][1])):
            own = [(r, st[s], sum(out[r][i]["cpu"] for i in st[s])) for r, st in members]
            own = [x for x in own if x[2] > 0]
            if len(own) < 2:
                continue
            typical = statistics.median(h for _, _, h in own)
            for r, idx, h in own:
                for i in idx:
                    _set_host(out[r][i], out[r][i]["cpu"] * typical / h)
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
