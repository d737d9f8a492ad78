"""Inter-slice calibration: one consistent timeline from slices measured at different times.

Each slice ran some ranks for real (the others replayed) at its own time, so timestamps of two
slices cannot be compared: each slice has its own clock, offset arbitrarily. Only *differences on
one clock* are kept: every rank's compute durations (from its own slice), and for every op one
duration. Absolute times are then rebuilt through the dependency edges by the replay engine's
max-plus rules: a collective starts when its last member issues it (and not before the group's
previous collective ended) and completes for all members together at start + duration; a send and
its recv start at the later of their issues, so a recv never completes before its send was issued.
Any clock offset between slices therefore cancels: the result depends on no absolute time.

The duration rule for an op:

- all its members ran in one slice (a collective: the whole group; a send/recv: both ends) ->
  ``measured``: (latest member completion) - (latest member issue, or the end of the group's
  previous collective if later, as NCCL runs a communicator's ops on one stream), clamped at 0;
- otherwise -> ``model``: ``cost(spec)`` (e.g. a :class:`CollectiveCostModel`). A member that ran
  in another slice met a *replayed* partner whose timing is the bare graph's, so the wait inside
  the measured interval is an artefact of the slice, not a cost of the op; no slice saw it whole.
- ``use_model(spec)`` true -> ``model`` even when measured: the physical machine cannot exhibit
  the target's link for that op (e.g. a group that spans target nodes, see :func:`spans_nodes`).

Input from a slice run (see :func:`slice_run_from_trace`): the slice's PrismTrace gives, per real
rank, the graph events (``graph_from_trace``: compute from ``ops.compute_before``, marks'
``compute_clock`` and the slot log) and, per op in order, ``ops.t_issue`` / ``ops.t_complete`` on
the coordinator clock of that run; ``manifest.ranks[].device`` says what the rank ran on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..replay.engine import CommSpec, CostFn
from ..replay.graph import Comm, Event, Graph, GraphError, Group, graph_from_trace
from .calibrated import CalibratedGraph, OpCost, SliceProvenance, op_key


class AlignError(ValueError):
    """The slice measurements cannot be combined: overlapping or missing ranks, bad timings."""


@dataclass
class SliceRun:
    """What one slice measured: its real ranks' events and, per op in order, (t_issue, t_complete).

    ``events`` has the slice's ranks only, compute durations as measured; ``op_times[rank][k]`` is
    the k-th Comm event's issue and completion on this slice's clock; ``groups`` are the job's.
    """

    index: int
    groups: dict[int, Group]
    events: dict[int, list[Event]]
    op_times: dict[int, list[tuple[float, float]]]
    device: str = ""
    source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.events))


def spans_nodes(gpus_per_node: int) -> Callable[[CommSpec], bool]:
    """A ``use_model`` predicate: the op's ranks sit on more than one target node (rank // gpus_per_node)."""
    return lambda spec: len({r // gpus_per_node for r in spec.ranks}) > 1


def _same(op: dict[str, Any], ev: Comm) -> bool:
    """Is trace row ``op`` the one ``graph_from_trace`` turned into ``ev``?"""
    if op["kind"] != ev.kind or op["group"] != ev.group:
        return False
    if ev.is_p2p and op["peer"] == -1:
        return True  # a recv from any source: graph_from_trace gave it its sender's peer and seq
    return op["seq"] == ev.seq and op["peer"] == ev.peer


def comm_rows(graph: Graph, trace: Any, rank: int) -> list[dict[str, Any]]:
    """The trace row of each of ``rank``'s Comm events of ``graph`` (``graph_from_trace(trace)``), in order.

    Rows the graph left out (unmatched p2p) are skipped; raises AlignError if an event has no row.
    """
    ops, k, rows = trace.ops_for_rank(rank), 0, []
    for i, ev in enumerate(graph.events[rank]):
        if not isinstance(ev, Comm):
            continue
        while k < len(ops) and not _same(ops[k], ev):
            k += 1
        if k == len(ops):
            raise AlignError(f"{graph.source}: rank {rank} event {i} ({ev.kind} on group {ev.group}) has no op row")
        rows.append(ops[k])
        k += 1
    return rows


def slice_run_from_trace(trace: Any, ranks: Collection[int], index: int = 0) -> SliceRun:
    """The measurement of one slice from its PrismTrace (``trace.read_trace``); ``ranks`` ran for real.

    The trace covers every rank (replayed ones too, so that each send finds its recv); only the
    slice's ranks are kept. Trace ops are paired with the graph's Comm events in order, skipping
    those the graph left out (unmatched p2p).
    """
    graph = graph_from_trace(trace)  # on GPUs with the slice's measured host/device times (two clocks)
    ranks = sorted(set(ranks))
    absent = [r for r in ranks if r not in graph.events]
    if absent:
        raise AlignError(f"{graph.source}: slice {index} ranks {absent} are not in the trace")
    op_times = {r: [(float(op["t_issue"]), float(op["t_complete"])) for op in comm_rows(graph, trace, r)]
                for r in ranks}
    devices = sorted({e["device"] for e in trace.manifest["ranks"] if e["rank"] in set(ranks)})
    return SliceRun(index, dict(graph.groups), {r: graph.events[r] for r in ranks}, op_times,
                    ", ".join(devices), graph.source, list(graph.notes))


def _assemble(runs: Sequence[SliceRun], source: str) -> tuple[Graph, dict[int, int]]:
    groups: dict[int, Group] = {}
    events: dict[int, list[Event]] = {}
    slice_of: dict[int, int] = {}
    notes: list[str] = []
    indices = [run.index for run in runs]
    if len(set(indices)) != len(indices):
        raise AlignError(f"slice indices {indices} repeat: each slice has its own clock and needs its own index")
    for run in runs:
        for gid, g in run.groups.items():
            if groups.setdefault(gid, g).ranks != g.ranks:
                raise AlignError(f"slice {run.index}: group {gid} has ranks {list(g.ranks)}, another slice says "
                                 f"{list(groups[gid].ranks)}")
        for r, evs in run.events.items():
            if r in slice_of:
                raise AlignError(f"rank {r} is in slice {slice_of[r]} and in slice {run.index}; every rank must be "
                                 "measured in exactly one slice")
            n_ops = sum(isinstance(e, Comm) for e in evs)
            times = run.op_times.get(r, [])
            if len(times) != n_ops:
                raise AlignError(f"slice {run.index}: rank {r} has {n_ops} op(s) but {len(times)} op timing(s)")
            for k, (t0, t1) in enumerate(times):
                if not (math.isfinite(t0) and math.isfinite(t1) and t1 >= t0):
                    raise AlignError(f"slice {run.index}: rank {r} op {k} has issue {t0} and completion {t1}; "
                                     "expected finite times with completion >= issue")
            slice_of[r] = run.index
            events[r] = list(evs)
        notes += [f"slice {run.index}: {n}" for n in run.notes]
    missing = sorted({r for g in groups.values() for r in g.ranks} - set(events))
    if missing:
        raise AlignError(f"rank(s) {missing[:20]} belong to process groups but were measured in no slice")
    graph = Graph(groups, events, source, notes)
    try:
        graph.validate()
    except GraphError as e:
        raise AlignError(str(e)) from None
    return graph, slice_of


def _describe_cost(cost: CostFn | None) -> str:
    if cost is None:
        return ""
    profile = getattr(cost, "profile", None)
    if profile is not None:
        return (f"{type(cost).__name__}(profile {getattr(profile, 'name', '?')} from {getattr(profile, 'path', '?')}, "
                f"algorithm {getattr(cost, 'algorithm', '?')}, protocol {getattr(cost, 'protocol', '?')})")
    return getattr(cost, "__qualname__", type(cost).__name__)


def align_slices(runs: Sequence[SliceRun], cost: CostFn | None = None, *,
                 use_model: Callable[[CommSpec], bool] | None = None, serialize_group_collectives: bool = True,
                 trace: str = "", cost_name: str = "") -> CalibratedGraph:
    """Combine slice measurements into one calibrated graph (rule in the module docstring).

    ``cost`` prices the ops no slice measured whole (required when there are any);
    ``use_model`` forces the model for ops the physical machine cannot exhibit. The timeline is
    ``result.replay()``. Raises AlignError on inconsistent input.
    """
    graph, slice_of = _assemble(runs, f"calibration of {trace}" if trace else "calibrated graph")
    op_times = {r: run.op_times.get(r, []) for run in runs for r in run.events}
    members: dict[tuple, dict[int, tuple[Comm, float, float]]] = {}
    for r in graph.ranks:
        times = iter(op_times[r])
        for ev in graph.events[r]:
            if isinstance(ev, Comm):
                members.setdefault(op_key(r, ev), {})[r] = (ev, *next(times))
    costs: dict[tuple, OpCost] = {}
    group_end: dict[int, float] = {}  # measured end of each group's latest collective
    model_ops = 0
    for key in sorted(members):  # per group, collectives in seq order: the previous one's end is known
        mem = members[key]
        ev = next(iter(mem.values()))[0]
        p2p = key[0] == "p2p"
        ranks = key[2:4] if p2p else graph.groups[key[1]].ranks
        if set(mem) != set(ranks):
            raise AlignError(f"op {key} ({ev.kind}) was issued by rank(s) {sorted(mem)} but involves {list(ranks)}")
        nbytes = max(m[0].nbytes for m in mem.values())
        spec = (CommSpec("send", nbytes, tuple(ranks), ev.group, src=key[2], dst=key[3], dtype=ev.dtype) if p2p
                else CommSpec(ev.kind, nbytes, tuple(ranks), ev.group, root=ev.root, dtype=ev.dtype))
        slices = {slice_of[r] for r in mem}
        kind = "send/recv" if p2p else ev.kind
        if len(slices) == 1:
            start = max(m[1] for m in mem.values())
            if not p2p and serialize_group_collectives and ev.group in group_end:
                start = max(start, group_end[ev.group])
            end = max(m[2] for m in mem.values())
            if not p2p:
                group_end[ev.group] = end
            if use_model is None or not use_model(spec):
                costs[key] = OpCost(kind, nbytes, max(end - start, 0.0), "measured", slices.pop())
                continue
        if cost is None:
            why = (f"was measured in no single slice (its members ran in slices {sorted(slices)})"
                   if len(slices) > 1 else "is to be costed by the model (use_model)")
            raise AlignError(f"op {key} ({ev.kind} of {nbytes} B over ranks {list(ranks)}) {why}: pass a cost model "
                             "to price it")
        duration = float(cost(spec))
        if not (math.isfinite(duration) and duration >= 0):
            raise AlignError(f"cost function returned {duration} for {spec}")
        costs[key] = OpCost(kind, nbytes, duration, "model")
        model_ops += 1
    graph.notes.append(f"{len(costs) - model_ops} op(s) measured in a slice, {model_ops} costed by "
                       f"{cost_name or _describe_cost(cost) or 'the model'}")
    provenance = [SliceProvenance(run.index, run.ranks, run.device, run.source) for run in runs]
    return CalibratedGraph(graph, costs, provenance, trace, cost_name or _describe_cost(cost),
                           serialize_group_collectives)
