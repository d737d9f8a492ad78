"""The execution graph replay walks: per rank, an ordered list of events.

A rank's program is a sequence of compute segments (a duration), communication ops (matched
across ranks: collectives by (group, seq), point-to-point by (group, src, dst, seq)), explicit
waits on earlier asynchronous ops, and scheduling-unit markers. That is all a bare or calibrated
PrismTrace says about a rank, and all the engine needs.

Graphs come from a PrismTrace (:func:`graph_from_trace`) or are built directly in Python
(:class:`GraphBuilder`), which tests use for hand-made schedules.

Waits, when building from a trace: a non-async op blocks the rank until it completes. For an async
op, PrismTrace v5 records where the program first waited for it (``ops.t_wait``, ``wait_clock``),
also when the op had already completed then: the :class:`Wait` goes there, and the replay decides
whether the op is done by that point (``batch_isend_irecv`` + ``wait()`` at the end of each of
Megatron's p2p calls lands at the end of the call, whatever the capture's timing was). Where the trace
holds no wait (traces before v5; a wait prism cannot see, such as torch's own on a Work's future) the
slot log stands in: a rank gives its slot back exactly when it blocks on
ops that are not yet complete, so a slot release that does not belong to a synchronous op is a wait on
the async ops still incomplete at that moment, placed at the rank's compute clock of the release; a
wait that found its ops already complete left no trace, and such ops are awaited together with the
next blocking op of the rank or at the end of the rank, which may let compute overlap communication
that the real program waited for.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .collector import paused

if TYPE_CHECKING:
    from ..trace.fold import Fold, IncompleteCapture

#: Op kinds that are point-to-point (matched by src/dst), everything else is a collective.
P2P_KINDS = frozenset({"send", "recv"})


class GraphError(ValueError):
    """The graph is inconsistent: an op with no partner, a group without that rank, a bad wait."""


class IncompleteCaptureError(GraphError):
    """A serial run's merged trace whose captures did not all complete (``Fold.incomplete_captures``): each
    class's program is its live rank's whole capture, so a class whose capture stopped early or never ran
    has none, and the other live ranks' p2p ops with it have no partner (they would be dropped as
    unmatched and the rest read as a schedule it does not fit)."""

    def __init__(self, source: str, captures: list[IncompleteCapture]) -> None:
        self.captures = captures
        super().__init__(f"{source}: {self.reason()}")

    def reason(self) -> str:
        """The captures that did not complete, and why that stops the replay: one line."""
        return (f"{'; '.join(c.sentence for c in self.captures)}: a serially captured fold is replayed only when "
                f"all {self.captures[0].of} of its captures completed")


@dataclass(frozen=True)
class Group:
    """A process group: its id, name and member global ranks (in group-rank order)."""

    id: int
    ranks: tuple[int, ...]
    name: str = ""


@dataclass(frozen=True)
class Compute:
    """The rank computes for ``duration`` seconds.

    ``gpu``: seconds of device work the segment queued (GPU busy time), when it was measured. Then
    ``duration`` is the host's time to issue it, and the engine runs the host and the device as two
    clocks, as with a real GPU whose host runs ahead (see replay.engine). ``None``: one clock.
    """

    duration: float
    label: str = ""
    gpu: float | None = None


@dataclass(frozen=True)
class CpuSync:
    """The host waits until the device has finished everything queued so far (``.item()``,
    ``torch.cuda.synchronize()``, a copy to host memory). Only meaningful with two clocks."""


@dataclass(frozen=True)
class Comm:
    """One communication op as issued by one rank.

    ``seq`` is the per-group collective sequence number, or for p2p the per (group, src, dst)
    one; ``peer`` is the p2p partner's global rank; ``nbytes`` follows the trace ("bytes this rank
    contributes/sends or receives, whichever is larger"), which is also nccl-tests' size convention.
    """

    kind: str
    group: int
    seq: int
    peer: int = -1
    root: int = -1
    nbytes: int = 0
    dtype: str = ""
    async_op: bool = False
    label: str = ""

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P_KINDS

    def but(self, **changes: Any) -> Comm:
        """A copy with ``changes`` (values of the fields' types): ``dataclasses.replace`` without the frozen
        class's per-field ``__setattr__``, for the schedules' rewrites, which make millions of copies."""
        copy = object.__new__(Comm)
        copy.__dict__.update(self.__dict__, **changes)
        return copy


@dataclass(frozen=True)
class Wait:
    """Block until the ops at these positions of the same rank's event list have completed."""

    refs: tuple[int, ...]


@dataclass(frozen=True)
class Mark:
    """A scheduling-unit marker (phase 'B', 'E' or 'i'); takes no time."""

    name: str
    phase: str
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


Event = Compute | Comm | Wait | Mark | CpuSync


@dataclass
class Graph:
    """Per-rank event lists plus the process groups they refer to."""

    groups: dict[int, Group]
    events: dict[int, list[Event]]
    source: str = "<python>"
    #: what building the graph had to leave out or guess, for reports
    notes: list[str] = field(default_factory=list)
    #: a folded graph holds the fold's live ranks only (groups keep their full rank lists); replay
    #: then runs symmetrically (replay.engine) and replay.synthesize builds every rank from it
    fold: Fold | None = None

    @property
    def ranks(self) -> list[int]:
        return sorted(self.events)

    def validate(self) -> None:
        """Raise GraphError if an op names an unknown group or a group without its rank."""
        members = {gid: frozenset(g.ranks) for gid, g in self.groups.items()}
        if self.fold is not None:
            virtual = sorted(set(self.events) - set(self.fold.live))
            if virtual:
                raise GraphError(f"{self.source}: folded graph has events for virtual rank(s) {virtual[:8]}")
        for rank, evs in self.events.items():
            for i, ev in enumerate(evs):
                if isinstance(ev, Comm):
                    g = self.groups.get(ev.group)
                    if g is None:
                        raise GraphError(
                            f"{self.source}: rank {rank} event {i} ({ev.kind}) names unknown group {ev.group}"
                        )
                    if rank not in members[ev.group]:
                        raise GraphError(
                            f"{self.source}: rank {rank} event {i} ({ev.kind}) on group {ev.group} "
                            f"whose ranks {list(g.ranks)} do not include it"
                        )
                    if ev.is_p2p and ev.peer not in members[ev.group]:
                        raise GraphError(
                            f"{self.source}: rank {rank} event {i} ({ev.kind}) peer {ev.peer} "
                            f"is not in group {ev.group}"
                        )
                elif isinstance(ev, Wait):
                    for ref in ev.refs:
                        if not (0 <= ref < i and isinstance(evs[ref], Comm)):
                            raise GraphError(
                                f"{self.source}: rank {rank} event {i} waits on event {ref}, not an earlier op"
                            )
                elif isinstance(ev, Compute):
                    if not (math.isfinite(ev.duration) and ev.duration >= 0):
                        raise GraphError(f"{self.source}: rank {rank} event {i} has compute duration {ev.duration}")
                    if ev.gpu is not None and not (math.isfinite(ev.gpu) and ev.gpu >= 0):
                        raise GraphError(f"{self.source}: rank {rank} event {i} has GPU busy time {ev.gpu}")


class GraphBuilder:
    """Build a graph by hand: sequence numbers are assigned as a real backend would.

    ``send``/``recv`` count per (group, src, dst); collectives count per (group, rank), so that
    the order of calls on each rank is what matters, as with torch.distributed.
    """

    def __init__(self, groups: Iterable[Group] | None = None) -> None:
        self.groups: dict[int, Group] = {g.id: g for g in groups or ()}
        self.events: dict[int, list[Event]] = defaultdict(list)
        self._coll_seq: dict[tuple[int, int], int] = defaultdict(int)
        self._p2p_seq: dict[tuple[int, int, int, str], int] = defaultdict(int)

    def group(self, gid: int, ranks: Sequence[int], name: str = "") -> int:
        self.groups[gid] = Group(gid, tuple(ranks), name)
        return gid

    def compute(self, rank: int, duration: float, label: str = "", gpu: float | None = None) -> int:
        """Host time ``duration``; ``gpu``: device busy time, which gives the rank two clocks."""
        self.events[rank].append(Compute(float(duration), label, None if gpu is None else float(gpu)))
        return len(self.events[rank]) - 1

    def cpu_sync(self, rank: int) -> int:
        """The host waits for the device (gives the rank two clocks)."""
        self.events[rank].append(CpuSync())
        return len(self.events[rank]) - 1

    def collective(self, rank: int, kind: str, group: int, nbytes: int = 0, *, async_op: bool = False,
                   root: int = -1, label: str = "") -> int:
        seq = self._coll_seq[(group, rank)]
        self._coll_seq[(group, rank)] += 1
        self.events[rank].append(Comm(kind, group, seq, -1, root, nbytes, "", async_op, label))
        return len(self.events[rank]) - 1

    def _p2p(self, rank: int, kind: str, peer: int, group: int, nbytes: int, async_op: bool, label: str) -> int:
        src, dst = (rank, peer) if kind == "send" else (peer, rank)
        key = (group, src, dst, kind)
        seq = self._p2p_seq[key]
        self._p2p_seq[key] += 1
        self.events[rank].append(Comm(kind, group, seq, peer, -1, nbytes, "", async_op, label))
        return len(self.events[rank]) - 1

    def send(self, rank: int, peer: int, group: int, nbytes: int = 0, *, async_op: bool = False,
             label: str = "") -> int:
        return self._p2p(rank, "send", peer, group, nbytes, async_op, label)

    def recv(self, rank: int, peer: int, group: int, nbytes: int = 0, *, async_op: bool = False,
             label: str = "") -> int:
        return self._p2p(rank, "recv", peer, group, nbytes, async_op, label)

    def wait(self, rank: int, *refs: int) -> int:
        self.events[rank].append(Wait(tuple(refs)))
        return len(self.events[rank]) - 1

    def mark(self, rank: int, name: str, phase: str, **attrs: Any) -> int:
        self.events[rank].append(Mark(name, phase, attrs))
        return len(self.events[rank]) - 1

    def build(self, source: str = "<python>") -> Graph:
        graph = Graph(dict(self.groups), {r: list(evs) for r, evs in self.events.items()}, source)
        graph.validate()
        return graph


def _mark_attrs(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text and text != "{}" else {}
    except ValueError:
        return {"attrs": text}
    return value if isinstance(value, dict) else {"attrs": value}


def _rank_events(ops: list[dict[str, Any]], marks: list[dict[str, Any]],
                 releases: list[tuple[float, float]] = ()) -> list[Event]:
    """One rank's events: compute before each op, the op, waits for async ops, markers in place.

    Markers, recorded waits (an op's ``t_wait``/``wait_clock``) and slot releases (``(t_release,
    compute clock then)``) sit between the last op issued at or before their time and the next one; the
    compute segment they fall into is split at their compute clock (the rank's cumulative compute
    seconds), which is consistent with ``compute_before`` (the per-op increments of the same clock).
    """
    waits: dict[float, list[int]] = defaultdict(list)  # t_wait -> trace indices of the ops waited then
    wait_clock: dict[float, float] = {}
    for op in ops:
        t_wait = op.get("t_wait", math.nan)
        if op["async_op"] and t_wait is not None and math.isfinite(t_wait):
            waits[t_wait].append(op["index"])
            wait_clock[t_wait] = op["wait_clock"]
    points = sorted([(m["t"], m["compute_clock"], m) for m in marks] + [(t, c, None) for t, c in releases]
                    + [(t, wait_clock[t], tuple(idx)) for t, idx in waits.items()],
                    key=lambda p: p[0])
    recorded = {i for idx in waits.values() for i in idx}
    events: list[Event] = []
    at_event: dict[int, int] = {}  # trace index of an async op -> its event index
    outstanding: dict[int, float] = {}  # event index of an async op not waited yet -> its t_complete in the trace
    inferred: set[int] = set()  # those of them whose wait the trace did not record (older traces)
    last: dict[str, Any] | None = None
    clock = 0.0  # cumulative compute at the current point
    pi = 0

    def at(c: float, limit_clock: float) -> None:
        nonlocal clock
        c = min(max(c, clock), limit_clock)
        if c > clock:
            events.append(Compute(c - clock))
            clock = c

    def wait(refs: tuple[int, ...]) -> None:
        nonlocal outstanding
        events.append(Wait(refs))
        outstanding = {i: d for i, d in outstanding.items() if i not in refs}

    def place(limit_t: float, limit_clock: float) -> None:
        nonlocal pi
        while pi < len(points) and points[pi][0] < limit_t:
            t, c, m = points[pi]
            pi += 1
            if isinstance(m, dict):
                at(c, limit_clock)
                events.append(Mark(m["name"], m["phase"], _mark_attrs(m["attrs"])))
                continue
            if isinstance(m, tuple):  # the program waited for these ops here, complete or not
                refs = tuple(at_event[i] for i in m if at_event.get(i) in outstanding)
                if refs:
                    at(c, limit_clock)
                    wait(refs)
                continue
            if last is not None and not last["async_op"] and last["t_complete"] >= t:
                continue  # the release of a synchronous op blocking at issue
            waited = tuple(i for i, done in outstanding.items() if done >= t and i in inferred)
            if waited:
                at(c, limit_clock)
                wait(waited)

    for op in ops:
        target = clock + max(float(op["compute_before"]), 0.0)
        place(op["t_issue"], target)
        at(target, target)
        events.append(Comm(op["kind"], op["group"], op["seq"], op["peer"], op["root"], op["bytes"], op["dtype"],
                           bool(op["async_op"]), op["label"]))
        last = op
        if op["async_op"]:
            outstanding[len(events) - 1] = op["t_complete"]
            at_event[op["index"]] = len(events) - 1
            if op["index"] not in recorded:
                inferred.add(len(events) - 1)
        elif outstanding.keys() & inferred:
            wait(tuple(i for i in outstanding if i in inferred))
    place(math.inf, math.inf)
    if outstanding:
        wait(tuple(outstanding))
    return events


def _releases(slots: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """(t_release, the rank's compute clock at the release) of one rank's slot grants.

    The clock must be the one ops' compute_before and marks' compute_clock use (the rank's own, v2),
    or a wait lands inside the wrong compute segment: with slot-holding time (which includes the
    runtime's staging) a pipeline stage's backward overlapped its wait for the gradient.
    """
    return [(s["t_release"], s["compute_clock"]) for s in sorted(slots, key=lambda s: s["t_grant"])]


def _resolve_any_source(per_rank: dict[int, list[dict[str, Any]]]) -> None:
    """Give recvs posted without a source (peer -1) the sender whose send matched them.

    Pairs are taken in order of issue; a recv from any source is rare in Megatron, and this keeps
    the graph explicit for the engine.
    """
    pending = [(r, op) for r, ops in per_rank.items() for op in ops if op["kind"] == "recv" and op["peer"] < 0]
    if not pending:
        return
    taken: set[tuple[int, int]] = set()
    for rank, op in sorted(pending, key=lambda x: x[1]["t_issue"]):
        sends = sorted(
            ((s_rank, s) for s_rank, s_ops in per_rank.items() for s in s_ops
             if s["kind"] == "send" and s["peer"] == rank and s["group"] == op["group"]
             and (s_rank, s["index"]) not in taken),
            key=lambda x: x[1]["t_complete"],
        )
        if not sends:
            raise GraphError(f"rank {rank} op {op['index']}: recv from any source has no matching send")
        s_rank, s = sends[0]
        taken.add((s_rank, s["index"]))
        op["peer"], op["seq"] = s_rank, s["seq"]


def _drop_unmatched_p2p(per_rank: dict[int, list[dict[str, Any]]]) -> list[str]:
    """Remove sends/recvs whose partner never posted (e.g. a fire-and-forget send at exit).

    The op's compute_before moves to the rank's next op so that no compute time is lost. A partner
    that is not in ``per_rank`` (a virtual rank of a folded trace) is not judged here.
    """
    def key(rank: int, op: dict[str, Any]) -> tuple:
        src, dst = (rank, op["peer"]) if op["kind"] == "send" else (op["peer"], rank)
        return (op["group"], src, dst, op["seq"])

    sides: dict[tuple, set[str]] = defaultdict(set)
    for rank, ops in per_rank.items():
        for op in ops:
            if op["kind"] in P2P_KINDS:
                sides[key(rank, op)].add(op["kind"])
    notes = []
    for rank, ops in per_rank.items():
        kept, carry = [], 0.0
        for op in ops:
            if op["kind"] in P2P_KINDS and op["peer"] in per_rank and len(sides[key(rank, op)]) < 2:
                carry += op["compute_before"]
                notes.append(f"rank {rank} op {op['index']}: {op['kind']} to/from rank {op['peer']} on group "
                             f"{op['group']} has no matching {'recv' if op['kind'] == 'send' else 'send'}; left out")
                continue
            if carry:
                op = dict(op, compute_before=op["compute_before"] + carry)
                carry = 0.0
            kept.append(op)
        per_rank[rank] = kept
    return notes


def _iteration_ops(ops: list[dict[str, Any]], marks: list[dict[str, Any]],
                   sizes: dict[int, int]) -> dict[int, list[tuple[float, tuple]]]:
    """A rank's ops in each whole iteration after the first (k = 1, 2, ...: those issued between its k-th
    and (k+1)-th iteration ends), each as (its compute clock at issue, (kind, bytes, dtype, group size)):
    what tells like ranks apart (gpu_segments.like_rank_host_times). The bytes of a kind whose sizes follow
    the data (ops.DATA_SIZED_KINDS: MoE's token all_to_all) are left out: expert ranks of one class that
    routed different token counts still ran the same host code."""
    from ..ops import DATA_SIZED_KINDS

    ends = sorted(m["t"] for m in marks if m["name"] == "iteration" and m["phase"] == "E")
    out: dict[int, list[tuple[float, tuple]]] = defaultdict(list)
    clock, k = 0.0, 0
    for op in ops:  # in order of issue
        clock += max(float(op["compute_before"]), 0.0)
        while k < len(ends) and op["t_issue"] >= ends[k]:
            k += 1
        if 0 < k < len(ends):
            size = None if op["kind"] in DATA_SIZED_KINDS else op["bytes"]
            out[k].append((clock, (op["kind"], size, op["dtype"], sizes.get(op["group"]))))
    return {k: out.get(k, []) for k in range(1, len(ends))}


@paused()
def graph_from_trace(trace: Any, gpu_times: bool = True, typical_host: bool = True,
                     like_ranks: bool = True) -> Graph:
    """Build the graph of a PrismTrace (``prism_megatron.trace.read_trace(dir)``).

    ``gpu_times``: give compute the host and device times the trace measured on GPUs (its gpu table;
    the engine then runs two clocks per rank); False replays every rank on its one compute clock.
    ``typical_host``: each segment's host time is its median over like iterations (gpu_segments);
    False keeps every iteration's own. ``like_ranks`` (with ``typical_host``): then the median over the
    ranks that issued the same ops (gpu_segments.like_rank_host_times); False keeps each rank's own.
    A micro-batch-folded trace (``trace.microbatches``) gives every rank the target's micro-batches
    (replay.microbatch_fold). A serial run's merged trace with a capture that did not complete is an
    IncompleteCaptureError naming it.
    """
    from . import gpu_segments
    from .gpu_segments import typical_host_times, with_gpu_times

    fold = getattr(trace, "fold", None)
    cut = fold.incomplete_captures() if fold is not None else []
    if cut:
        raise IncompleteCaptureError(str(getattr(trace, "path", "<trace>")), cut)
    groups = {g["id"]: Group(g["id"], tuple(g["ranks"]), g.get("name", "")) for g in trace.manifest["groups"]}
    marks_by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for m in trace.marks.to_pylist():
        marks_by_rank[m["rank"]].append(m)
    slots_by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in trace.slots.to_pylist():
        slots_by_rank[s["rank"]].append(s)
    real = list(fold.live) if fold is not None else range(trace.world_size)
    per_rank = {r: trace.ops_for_rank(r) for r in real}
    _resolve_any_source(per_rank)
    notes = _drop_unmatched_p2p(per_rank)
    for device, verdict in (trace.manifest.get("job", {}).get("gpu_timing_by_device") or {}).items():
        if not verdict.get("on"):  # --swap auto kept swapping there: its ranks' compute is on one clock
            notes.append(f"{device}: {verdict.get('why', 'GPU timing off')}")
    events = {r: _rank_events(per_rank[r], marks_by_rank.get(r, []), _releases(slots_by_rank.get(r, [])))
              for r in real}
    gpu = getattr(trace, "gpu", None)
    if gpu_times and gpu is not None and gpu.num_rows:
        rows_by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for row in gpu.to_pylist():
            row["syncs"] = gpu_segments.parsed_syncs(row)  # JSON text in the file: parsed once, not per pass
            rows_by_rank[row["rank"]].append(row)
        if typical_host:
            ends = {r: [m["compute_clock"] for m in ms if m["name"] == "iteration" and m["phase"] == "E"]
                    for r, ms in marks_by_rank.items()}
            rows_by_rank = {r: typical_host_times(rows, ends.get(r, [])) for r, rows in rows_by_rank.items()}
            if like_ranks:
                sizes = {gid: len(g.ranks) for gid, g in groups.items()}
                iteration_ops = {r: _iteration_ops(per_rank[r], marks_by_rank.get(r, []), sizes) for r in real}
                rows_by_rank = gpu_segments.like_rank_host_times(rows_by_rank, ends, iteration_ops)
        events = {r: with_gpu_times(evs, rows_by_rank.get(r, [])) for r, evs in events.items()}
    graph = Graph(groups, events, str(getattr(trace, "path", "<trace>")), notes, fold)
    microbatches = getattr(trace, "microbatches", None)
    if microbatches is not None:  # m_c of the target's M micro-batches ran: every rank's program at M
        from .microbatch_fold import expand_microbatches

        graph = expand_microbatches(graph, microbatches)
    graph.validate()
    return graph
