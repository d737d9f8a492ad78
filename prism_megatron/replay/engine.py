"""Discrete-event replay of an execution graph: predicted timelines, breakdown, critical path.

Semantics (NCCL-like, no link contention):

- a rank runs its events in order; compute advances its clock by the segment's duration;
- a collective starts when every member has issued it (and, per group, not before the group's
  previous collective ended: one NCCL stream per communicator) and completes for all members
  together at start + cost;
- a send and its recv start at max(send issue, recv issue) and complete together at start + cost
  (rendezvous);
- a non-async op blocks its rank until it completes; an async op does not, and a :class:`Wait`
  blocks until the ops it names complete.

Two clocks. On a GPU the host only issues work: kernels and NCCL ops are queued on the device and
the host runs ahead of it. A rank whose graph measured GPU time (``Compute.gpu``) or has a
:class:`CpuSync` therefore has a host clock and a device-stream clock. A compute segment takes
``duration`` of host time and ``gpu`` of device time, starting where the stream is (never behind
the host), and ending no earlier than the host finished issuing it. An op is issued
when its inputs are ready on the stream; blocking ops and waits hold the stream, not the host
(NCCL returns at once), and the host waits for the device only at a CpuSync and at the rank's end.
Marks are host times. Other ranks have one clock (stream == host): the rules above reduce to it.

Symmetric replay (a folded graph, ``Graph.fold``): only the live ranks are replayed. A collective
over a group with virtual members starts when its live members have issued it (each virtual member
issues it when its representative does, so this is exact where the fold's symmetry is) and is
costed for the whole group: its size and its ranks' placement on nodes. A live rank's p2p partner
must be live. :func:`replay` of a folded graph goes through replay.folded, which picks a method
that is exact for the fold (symmetric, one synthesised pipeline, or every rank) and checks it.

Since no resource is shared, every time is a max-plus function of the inputs and the order in
which ranks are advanced does not change the result. Link contention between concurrent ops and
compute slowdown from overlapping communication are not modelled.

Segments describe the device stream (the one clock, for a one-clock rank). Blocked time is split
in two: while an awaited op is in flight it is *exposed communication*; before it could start (a
peer had not issued yet) it is *bubble*, as is a rank's idle time after its last event. Stream time
spent waiting for the host to issue is *compute* labelled ``HOST_WAIT`` ("host"): the part of a segment
whose host time outran its device time (``Breakdown.host_wait``); the rest of compute is the device
busy. compute + exposed_comm + bubble is the length of the window, for every rank.

Communication hidden behind the host. On a two-clock rank the stream may wait for an op while the
host is still issuing the work that follows it; if the device then waits for the host anyway (a
"host" stretch) before the host next waits for the device (a CpuSync), the op cost the rank no time:
the device would have waited for the host instead. Such exposed_comm is re-labelled compute "host"
(:meth:`_Replay._hide_behind_host`), so that exposed communication is what lengthens the rank's time,
as the critical path says. Where the host does wait for the device first (a CpuSync, or the rank's
end), the comm waits since the previous one stay exposed up to the time the host waited, earliest
hidden first; exact for one op, an upper bound on what free communication would save for several.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prism_megatron.trace.markers import TIMER_PAUSES

from .collector import paused
from .graph import P2P_KINDS, Comm, Compute, CpuSync, Event, Graph, GraphError, Mark, Wait

#: Label of the compute segments in which a two-clock rank's stream waited for its host to issue work.
HOST_WAIT = "host"


class DeadlockError(GraphError):
    """Ranks wait on ops that can never complete; the message names each rank and op."""


@dataclass(frozen=True)
class CommSpec:
    """What a cost function sees of one matched op."""

    kind: str
    nbytes: int
    ranks: tuple[int, ...]
    group: int
    src: int = -1
    dst: int = -1
    root: int = -1
    dtype: str = ""


CostFn = Callable[[CommSpec], float]


def zero_cost(spec: CommSpec) -> float:
    """Free communication: isolates compute and dependency structure (bubbles)."""
    return 0.0


@dataclass
class OpResult:
    """One matched op: who issued it when, when it ran, and what made it start when it did."""

    key: tuple
    kind: str
    group: int
    ranks: tuple[int, ...]
    nbytes: int = 0
    label: str = ""
    issue: dict[int, float] = field(default_factory=dict)
    event: dict[int, int] = field(default_factory=dict)
    start: float = math.nan
    end: float = math.nan
    # ("issue", rank, event index) or ("group", key of the previous collective of the group)
    why: tuple = ()

    @property
    def done(self) -> bool:
        return not math.isnan(self.end)


@dataclass(frozen=True)
class Segment:
    """A piece of a rank's predicted timeline. kind: compute, exposed_comm, bubble or comm."""

    rank: int
    kind: str
    start: float
    end: float
    label: str = ""
    args: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def duration(self) -> float:
        return self.end - self.start


_new = object.__new__


def _segment(rank: int, kind: str, start: float, end: float, label: str = "", args: dict | None = None) -> Segment:
    """Segment(...) without the frozen dataclass's per-field __setattr__, which matters at millions of
    events (the replay makes one or two per event)."""
    seg = _new(Segment)
    seg.__dict__.update(rank=rank, kind=kind, start=start, end=end, label=label, args={} if args is None else args)
    return seg


@dataclass(frozen=True)
class Breakdown:
    """Time of one rank over a window. compute + exposed_comm + bubble == window length."""

    compute: float
    exposed_comm: float
    bubble: float
    comm: float  # time any of the rank's ops was in flight (overlapped or not)
    host_wait: float = 0.0  # of compute: the stream waited for the host to issue (HOST_WAIT); the rest is device busy

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble


@dataclass(frozen=True)
class MarkTime:
    rank: int
    name: str
    phase: str
    t: float
    attrs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class Iteration:
    """One training iteration: from the first rank's begin to the last rank's end.

    Its time is the training loop's period, as Megatron's ``elapsed time per iteration`` times it: from
    the last rank's end of the iteration before (what the loop does between two steps, its logging
    among it, is the iteration's too; an evaluation or a checkpoint save between them is not, Megatron
    stops that timer for them: ``trace.markers.TIMER_PAUSES``), or from the begin where no iteration
    came before.
    """

    number: int
    start: float
    end: float
    since: float | None = None  # the iteration before's end, where there is one
    excluded: float = 0.0  # evaluation and checkpoint saves between that end and this iteration's begin

    @property
    def time(self) -> float:
        t0, t1 = self.window
        return t1 - t0 - self.excluded

    @property
    def window(self) -> tuple[float, float]:
        """The span its time covers (an evaluation or a save inside it included)."""
        return (self.start if self.since is None else self.since), self.end


@dataclass(frozen=True)
class PathStep:
    """A step of the critical path: a compute segment of one rank or an op over its ranks."""

    kind: str  # "compute" or the op kind
    ranks: tuple[int, ...]
    start: float
    end: float
    label: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class ReplayResult:
    """Everything a replay predicts. Times are seconds from the start of the replay."""

    graph: Graph
    makespan: float
    rank_end: dict[int, float]
    segments: dict[int, list[Segment]]
    ops: dict[tuple, OpResult]
    marks: list[MarkTime]
    critical_path: list[PathStep]
    #: per rank, per event: (time the rank reached it, time the rank moved past it); host clock for
    #: Compute, Mark and CpuSync, device stream for Comm and Wait (the same with one clock)
    event_times: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    #: how the job was replayed (a folded graph: which method, replay.folded); "" for every rank of a
    #: graph that is not folded
    method: str = ""
    #: per rank: its segments' starts and the longest one's duration, or None where they are not in start order
    _index: dict[int, tuple[list[float], float] | None] = field(default_factory=dict, init=False, repr=False,
                                                                  compare=False)

    def within(self, rank: int, t0: float, t1: float) -> list[Segment]:
        """The rank's segments that may overlap [t0, t1], in their order: a window of a long replay without a
        pass over every segment (a thousand-rank job's replay holds millions); callers clip them to it."""
        segs = self.segments.get(rank, [])
        if rank not in self._index:
            starts = [s.start for s in segs]
            ordered = all(a <= b for a, b in zip(starts, starts[1:], strict=False))
            self._index[rank] = (starts, max((s.end - s.start for s in segs), default=0.0)) if ordered else None
        index = self._index[rank]
        if index is None:
            return segs
        starts, longest = index
        return segs[bisect.bisect_left(starts, t0 - longest):bisect.bisect_right(starts, t1)]

    def breakdown(self, rank: int, t0: float = 0.0, t1: float | None = None) -> Breakdown:
        """Per-rank compute / exposed comm / bubble / comm within [t0, t1] (default: whole run)."""
        t1 = self.makespan if t1 is None else t1
        sums: dict[str, float] = defaultdict(float)
        segs = self.within(rank, t0, t1)
        for seg in segs:
            overlap = min(seg.end, t1) - max(seg.start, t0)
            if overlap > 0:
                sums[seg.kind] += overlap
                if seg.kind == "compute" and seg.label == HOST_WAIT:
                    sums[HOST_WAIT] += overlap
        covered = sums["compute"] + sums["exposed_comm"] + sums["bubble"]
        idle = max((t1 - t0) - covered, 0.0)  # before the rank's first event / after its last
        comm = _union_length([(s.start, s.end) for s in segs if s.kind == "comm"], t0, t1)
        return Breakdown(sums["compute"], sums["exposed_comm"], sums["bubble"] + idle, comm, sums[HOST_WAIT])

    def iterations(self, name: str = "iteration") -> list[Iteration]:
        """Iterations from B/E markers called ``name``; [] when the graph has none."""
        return iterations_of(self.marks, name)

    def iteration_times(self) -> list[float]:
        """Per-iteration predicted times, or [makespan] when there are no iteration markers."""
        its = self.iterations()
        return [it.time for it in its] if its else [self.makespan]

    def summary(self, classes: dict[int, str] | None = None) -> str:
        """A short text report: iteration times, per-rank breakdown, critical path by kind.

        ``classes`` (rank -> class name): one breakdown row per class, the mean of its ranks, instead
        of one per rank (a folded or synthesised job of thousands of ranks).
        """
        lines = [f"replay of {self.graph.source}: makespan {self.makespan * 1e3:.3f} ms"]
        for it in self.iterations():
            lines.append(f"  iteration {it.number}: {it.time * 1e3:.3f} ms")
        rows: dict[Any, list[int]] = defaultdict(list)
        for r in self.graph.ranks:
            rows[r if classes is None else classes[r]].append(r)
        width = max([5, *(len(str(k)) for k in rows)])
        head = "rank" if classes is None else "class (mean of its ranks)"
        lines.append(f"  {head:>{width}} {'compute':>10} {'exposed':>10} {'bubble':>10} {'comm':>10}  (ms)")
        for key, members in rows.items():
            bs = [self.breakdown(r) for r in members]
            mean = [sum(getattr(b, f) for b in bs) / len(bs) * 1e3 for f in ("compute", "exposed_comm", "bubble",
                                                                               "comm")]
            lines.append(f"  {key!s:>{width}} " + " ".join(f"{x:>10.3f}" for x in mean))
        by_kind: dict[str, float] = defaultdict(float)
        for step in self.critical_path:
            by_kind[step.kind] += step.duration
        parts = ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1]))
        lines.append(f"  critical path: {len(self.critical_path)} steps; {parts}")
        for note in self.graph.notes[:10]:
            lines.append(f"  note: {note}")
        if len(self.graph.notes) > 10:
            lines.append(f"  ... and {len(self.graph.notes) - 10} more note(s)")
        return "\n".join(lines)


def iterations_of(marks: list[MarkTime], name: str = "iteration") -> list[Iteration]:
    """Iterations from a replay's B/E markers called ``name``; [] when there are none."""

    def number(begin: MarkTime, k: int) -> int:
        n = begin.attrs.get(name, begin.attrs.get("number", k))
        return n if isinstance(n, int) else k

    bounds = _spans(marks, name, number)
    pauses = [s for pause in TIMER_PAUSES for s in _spans(marks, pause, lambda b, k: k).values()]
    out = []
    for n, (start, end) in sorted(bounds.items()):
        since = bounds[n - 1][1] if n - 1 in bounds and bounds[n - 1][1] <= end else None
        excluded = 0.0 if since is None else sum(max(min(e, start) - max(b, since), 0.0) for b, e in pauses)
        out.append(Iteration(n, start, end, since, excluded))
    return out


def _spans(marks: list[MarkTime], name: str, key: Callable[[MarkTime, int], int]) -> dict[int, tuple[float, float]]:
    """The ``name`` spans over the ranks, first begin to last end, each rank's k-th span (begin ``b``)
    joined to the others' of the same ``key(b, k)``."""
    begins: dict[int, list[MarkTime]] = defaultdict(list)
    ends: dict[int, list[MarkTime]] = defaultdict(list)
    for m in marks:
        if m.name == name and m.phase in ("B", "E"):
            (begins if m.phase == "B" else ends)[m.rank].append(m)
    together: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for rank, bs in begins.items():
        for k, (b, e) in enumerate(zip(bs, ends.get(rank, []), strict=False)):
            together[key(b, k)].append((b.t, e.t))
    return {k: (min(b for b, _ in v), max(e for _, e in v)) for k, v in together.items()}


def _union_length(intervals: list[tuple[float, float]], t0: float, t1: float) -> float:
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, t0), min(e, t1)) for s, e in intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _describe(rank: int, i: int, ev: Event) -> str:
    if isinstance(ev, Comm):
        where = f"peer {ev.peer}" if ev.is_p2p else f"seq {ev.seq}"
        label = f" [{ev.label}]" if ev.label else ""
        return f"rank {rank} event {i}: {ev.kind} on group {ev.group} ({where}){label}"
    return f"rank {rank} event {i}: {type(ev).__name__}"


class _Replay:
    def __init__(self, graph: Graph, cost: CostFn, serialize_groups: bool) -> None:
        self.g = graph
        self.cost = cost
        self.serialize = serialize_groups
        self.ops: dict[tuple, OpResult] = {}
        self.keys: dict[int, dict[int, tuple]] = defaultdict(dict)  # rank -> event index -> op key
        self.pc = {r: 0 for r in graph.events}
        self.clock = {r: 0.0 for r in graph.events}  # host
        self.stream = {r: 0.0 for r in graph.events}  # device; == clock on a one-clock rank
        self.end: dict[int, float] = {}  # max(clock, stream) once the rank is done
        self.two_clock = {r: any(isinstance(e, CpuSync) or (isinstance(e, Compute) and e.gpu is not None)
                                 for e in evs) for r, evs in graph.events.items()}
        # rank -> compute event index -> (stream before, device start, device busy end, stream after)
        self.span: dict[int, dict[int, tuple[float, float, float]]] = defaultdict(dict)  # compute: start, busy, end
        self.ready: dict[int, list[float]] = {r: [math.nan] * len(e) for r, e in graph.events.items()}
        self.done_t: dict[int, list[float]] = {r: [math.nan] * len(e) for r, e in graph.events.items()}
        self.issued: dict[int, bool] = defaultdict(bool)  # current blocking Comm already issued
        self.parked: dict[tuple, list[int]] = defaultdict(list)
        self.segments: dict[int, list[Segment]] = defaultdict(list)
        self.marks: list[MarkTime] = []
        self.group_last: dict[int, tuple] = {}
        # symmetric replay: a collective needs its live members only (all members in a full graph)
        self.live = frozenset(graph.events) if graph.fold is not None else None
        self.need: dict[int, int] = {}
        # two-clock rank -> (position in its segments, seconds the host waited for the device) per CpuSync
        self.host_waits: dict[int, list[tuple[int, float]]] = defaultdict(list)

    # --- ops ---------------------------------------------------------------------------------------
    def _issue(self, rank: int, i: int, ev: Comm) -> tuple:
        # the op's key: collectives match by (group, seq), p2p by (group, src, dst, seq)
        p2p = ev.kind in P2P_KINDS
        if p2p:
            key = ("p2p", ev.group, rank, ev.peer, ev.seq) if ev.kind == "send" else (
                "p2p", ev.group, ev.peer, rank, ev.seq)
        else:
            key = ("coll", ev.group, ev.seq)
        op = self.ops.get(key)
        if op is None:
            ranks = (key[2], key[3]) if p2p else self.g.groups[ev.group].ranks
            if self.live is not None and p2p and ev.peer not in self.live:
                raise GraphError(f"{self.g.source}: {_describe(rank, i, ev)}: the peer is a virtual rank; symmetric "
                                 "replay needs live p2p partners (replay the synthesised full graph instead)")
            op = self.ops[key] = OpResult(key, "send/recv" if p2p else ev.kind, ev.group, tuple(ranks))
        elif not p2p and op.kind != ev.kind:
            raise GraphError(f"{self.g.source}: {_describe(rank, i, ev)} matches {op.kind} of rank "
                             f"{next(iter(op.issue))} (same group and seq, different op)")
        if rank in op.issue:
            raise GraphError(f"{self.g.source}: {_describe(rank, i, ev)} is issued twice (seq {ev.seq} repeats)")
        op.issue[rank] = self.stream[rank]  # the op's inputs are ready on the device
        op.event[rank] = i
        if ev.nbytes > op.nbytes:
            op.nbytes = ev.nbytes
        op.label = op.label or ev.label
        self.keys[rank][i] = key
        need = self.need.get(ev.group) if not p2p else 2
        if need is None:
            need = self.need[ev.group] = len(op.ranks) if self.live is None else self._live_members(ev.group)
        if len(op.issue) == need:
            self._complete(op)
        return key

    def _live_members(self, gid: int) -> int:
        """How many members of group ``gid`` are live; each virtual one must mirror a member (exactness)."""
        group, rep = self.g.groups[gid], self.g.fold.rep
        members = frozenset(group.ranks)
        for r in group.ranks:
            if rep[r] not in members:
                raise GraphError(f"{self.g.source}: group {gid} (ranks {list(group.ranks)[:8]}) has virtual member "
                                 f"{r} whose representative {rep[r]} is not in the group: symmetric replay "
                                 "cannot time its part")
        return sum(1 for r in group.ranks if r in self.live)

    def _complete(self, op: OpResult) -> None:
        last = max(op.issue, key=lambda r: (op.issue[r], -r))
        start, why = op.issue[last], ("issue", last, op.event[last])
        if self.serialize and op.key[0] == "coll":
            prev = self.group_last.get(op.group)
            if prev is not None and self.ops[prev].end > start:
                start, why = self.ops[prev].end, ("group", prev)
            self.group_last[op.group] = op.key
        ev = self.g.events[last][op.event[last]]
        spec = _new(CommSpec)  # CommSpec(...) without the frozen dataclass's slow constructor (once per op)
        if op.key[0] == "p2p":
            spec.__dict__.update(kind="send", nbytes=op.nbytes, ranks=op.ranks, group=op.group, src=op.ranks[0],
                                 dst=op.ranks[1], root=-1, dtype=ev.dtype)
        else:
            spec.__dict__.update(kind=op.kind, nbytes=op.nbytes, ranks=op.ranks, group=op.group, src=-1, dst=-1,
                                 root=ev.root, dtype=ev.dtype)
        duration = float(self.cost(spec))
        if not (math.isfinite(duration) and duration >= 0):
            raise ValueError(f"cost function returned {duration} for {spec}")
        op.start, op.end, op.why = start, start + duration, why
        for r in op.issue:  # every member, or every live member in a symmetric replay
            self.segments[r].append(_segment(r, "comm", op.start, op.end, op.label or op.kind,
                                             {"kind": op.kind, "group": op.group, "bytes": op.nbytes,
                                              "issue": op.issue.get(r)}))
        for r in self.parked.pop(op.key, ()):
            self.work.append(r)

    # --- ranks -------------------------------------------------------------------------------------
    def _block(self, rank: int, i: int, keys: tuple[tuple, ...]) -> bool:
        """Finish a blocking event if its ops are done (True), else park the rank (False).

        The device stream waits for the ops; the host goes on at once with two clocks (NCCL returns
        immediately) and waits with them with one clock.
        """
        ops = self.ops
        for k in keys:
            if ops[k].end != ops[k].end:  # nan: not done
                self.parked[k].append(rank)
                return False
        b = self.stream[rank]
        if len(keys) == 1:  # the common case, without the general merge below
            op = ops[keys[0]]
            e = op.end if op.end > b else b
            if e > b:
                seg = self.segments[rank]
                s = op.start if op.start > b else b
                if s > b:
                    seg.append(_segment(rank, "bubble", b, s, "waiting for the op to start"))
                seg.append(_segment(rank, "exposed_comm", s, e, op.label))
            self.stream[rank] = e
            if not self.two_clock[rank]:
                self.clock[rank] = e
            return True
        e = max([b] + [self.ops[k].end for k in keys])
        flight = sorted((max(self.ops[k].start, b), min(self.ops[k].end, e)) for k in keys)
        t = b
        for s, f in flight:
            if f <= t:
                continue
            if s > t:
                self.segments[rank].append(_segment(rank, "bubble", t, s, "waiting for the op to start"))
                t = s
            self.segments[rank].append(_segment(rank, "exposed_comm", t, f, self.ops[keys[0]].label))
            t = f
        if e > t:
            self.segments[rank].append(_segment(rank, "bubble", t, e))
        self.stream[rank] = e
        if not self.two_clock[rank]:
            self.clock[rank] = e
        return True

    def _compute(self, rank: int, i: int, ev: Compute) -> None:
        """Host issues for ``duration``; the device runs ``gpu`` from where its stream is.

        The stream is never behind the host (a compute leaves it at or after the host's new time, a
        CpuSync brings the host at most to it), so the device starts the segment's work at once.
        """
        c, g = ev.duration, ev.duration if ev.gpu is None else ev.gpu
        clock, start = self.clock[rank], self.stream[rank]
        busy = start + g
        after = max(busy, clock + c)  # the device cannot finish before the host has issued it all
        for label, t0, t1 in ((ev.label, start, busy), (HOST_WAIT, busy, after)):
            if t1 > t0:  # HOST_WAIT: the stream idles, waiting for the host to issue work
                self.segments[rank].append(_segment(rank, "compute", t0, t1, label))
        self.span[rank][i] = (start, busy, after)
        self.clock[rank], self.stream[rank] = clock + c, after

    def _run(self, rank: int) -> None:
        # The hot loop of the replay: dispatch on the exact event type, per-rank lists held locally.
        evs = self.g.events[rank]
        n = len(evs)
        ready, done_t, clock, stream = self.ready[rank], self.done_t[rank], self.clock, self.stream
        i = self.pc[rank]
        while i < n:
            ev = evs[i]
            kind = type(ev)
            on_stream = kind is Comm or kind is Wait  # device events; the others are timed on the host
            now = stream if on_stream else clock
            if ready[i] != ready[i]:  # nan: first time here
                ready[i] = now[rank]
            if kind is Compute:
                self._compute(rank, i, ev)
            elif kind is Comm:
                if not self.issued[rank]:
                    key = self._issue(rank, i, ev)
                    self.issued[rank] = True
                else:
                    key = self.keys[rank][i]
                if not ev.async_op and not self._block(rank, i, (key,)):
                    self.pc[rank] = i
                    return
                self.issued[rank] = False
            elif kind is Mark:
                self.marks.append(MarkTime(rank, ev.name, ev.phase, clock[rank], ev.attrs))
            elif kind is CpuSync:
                if stream[rank] > clock[rank] and self.two_clock[rank]:
                    self.host_waits[rank].append((len(self.segments[rank]), stream[rank] - clock[rank]))
                clock[rank] = max(clock[rank], stream[rank])
            elif kind is Wait:
                keys = self.keys[rank]
                if not self._block(rank, i, tuple(keys[j] for j in ev.refs)):
                    self.pc[rank] = i
                    return
            else:
                raise GraphError(f"{self.g.source}: rank {rank} event {i} is a {kind.__name__}, not an event")
            done_t[i] = now[rank]
            i += 1
        self.pc[rank] = i

    def _advance(self) -> list[int]:
        """Run every rank as far as its events and the ops' partners let it; the ranks left short of their end."""
        self.work = list(self.g.ranks)
        while self.work:
            self._run(self.work.pop())
        return [r for r in self.g.ranks if self.pc[r] < len(self.g.events[r])]

    def grows_into(self, graph: Graph) -> bool:
        """Whether ``graph`` is this replay's graph with events appended to ranks' lists and nothing else
        changed (groups, ranks, every event so far, which ranks run two clocks): then going on from here
        gives what replaying ``graph`` from the start would (a rank's times depend only on its events so far
        and the ops it met, module docstring)."""
        old = self.g
        if graph.fold is not None or old.groups != graph.groups or old.events.keys() != graph.events.keys():
            return False
        for r, evs in old.events.items():
            new = graph.events[r]
            if len(new) < len(evs) or new[:len(evs)] != evs:
                return False
            if any(type(a) is Mark and a.attrs != b.attrs for a, b in zip(evs, new, strict=False)):
                return False  # a marker's attributes (its iteration's number) are not part of its equality
            if not self.two_clock[r] and any(isinstance(e, CpuSync) or (isinstance(e, Compute) and e.gpu is not None)
                                             for e in new[len(evs):]):
                return False
        return True

    def go_on(self, graph: Graph) -> list[int]:
        """Continue into ``graph`` (``grows_into`` it); the ranks left short of their end."""
        for r, evs in graph.events.items():
            grown = len(evs) - len(self.g.events[r])
            self.ready[r].extend([math.nan] * grown)
            self.done_t[r].extend([math.nan] * grown)
        self.g = graph
        return self._advance()

    def run(self) -> ReplayResult:
        stuck = self._advance()
        if stuck:
            raise DeadlockError(self._deadlock_report(stuck))
        undone = [op for op in self.ops.values() if not op.done]
        if undone:
            lines = [f"  {op.kind} on group {op.group} {op.key[2:]}: issued by {sorted(op.issue)}, missing "
                     f"{self._missing(op)}" for op in undone[:20]]
            raise GraphError(f"{self.g.source}: {len(undone)} op(s) never matched:\n" + "\n".join(lines))
        self.end = {r: max(self.clock[r], self.stream[r]) for r in self.g.ranks}  # exit waits for the device
        makespan = max(self.end.values(), default=0.0)
        for r in self.g.ranks:
            if self.two_clock[r]:
                self._hide_behind_host(r)
            if self.end[r] < makespan:
                self.segments[r].append(_segment(r, "bubble", self.end[r], makespan, "idle"))
            self.segments[r].sort(key=lambda s: (s.start, s.kind == "comm"))
        times = {r: list(zip(self.ready[r], self.done_t[r], strict=True)) for r in self.g.ranks}
        return ReplayResult(self.g, makespan, dict(self.end), dict(self.segments), self.ops, self.marks,
                            self._critical_path(), times)

    def _hide_behind_host(self, rank: int) -> None:
        """Re-label the exposed_comm of two-clock ``rank`` that the host's issuing hid (module docstring).

        Walks the rank's own segments in the order it made them (its ops' in-flight "comm" segments,
        made by whichever member completed the op, are left alone). Comm waits pend until the device
        next waits for the host (all hidden) or the host for the device (hidden beyond that wait).
        """
        segs = self.segments[rank]
        waits = self.host_waits.get(rank, [])
        out: list[Segment] = []
        pending: list[int] = []  # indices into ``out`` of exposed_comm since the last coupling

        def settle(exposed: float) -> None:
            """Keep the last ``exposed`` seconds of the pending waits exposed; the rest waited for the host."""
            hidden = sum(out[j].duration for j in pending) - exposed
            for j in pending:
                if hidden <= 0:
                    break
                seg = out[j]
                cut = min(hidden, seg.duration)
                hidden -= cut
                if cut >= seg.duration:
                    out[j] = _segment(rank, "compute", seg.start, seg.end, "host", {"hidden_comm": seg.label})
                else:
                    out[j] = _segment(rank, "compute", seg.start, seg.start + cut, "host", {"hidden_comm": seg.label})
                    out.append(_segment(rank, "exposed_comm", seg.start + cut, seg.end, seg.label, seg.args))
            pending.clear()

        w = 0
        for i, seg in enumerate(segs):
            while w < len(waits) and waits[w][0] <= i:
                settle(waits[w][1])
                w += 1
            if seg.kind == "exposed_comm":
                pending.append(len(out))
            elif seg.kind == "compute" and seg.label == "host" and seg.end > seg.start:
                settle(0.0)
            out.append(seg)
        while w < len(waits):
            settle(waits[w][1])
            w += 1
        settle(max(self.stream[rank] - self.clock[rank], 0.0))
        self.segments[rank] = out

    def _missing(self, op: OpResult) -> str:
        """The ranks an op still waits for, the first 16 of them (groups of thousands at scale)."""
        missing = sorted(r for r in set(op.ranks) - set(op.issue) if self.live is None or r in self.live)
        return str(missing) if len(missing) <= 16 else f"{missing[:16]} and {len(missing) - 16} more"

    def _deadlock_report(self, stuck: list[int]) -> str:
        lines = []
        for r in stuck:
            i = self.pc[r]
            ev = self.g.events[r][i]
            keys = [self.keys[r][i]] if isinstance(ev, Comm) else [self.keys[r][j] for j in ev.refs]
            waits = []
            for k in keys:
                op = self.ops[k]
                if not op.done:
                    missing = self._missing(op)
                    j = op.event[r] if r in op.event else i
                    waits.append(f"{_describe(r, j, self.g.events[r][j])} waits for rank(s) {missing}")
            lines.append("  " + ("; ".join(waits) or _describe(r, i, ev)))
        return (f"{self.g.source}: deadlock: {len(stuck)} rank(s) can never proceed:\n" + "\n".join(lines))

    def _critical_path(self) -> list[PathStep]:
        """Walk back from the last rank to finish, each time along what its time was the max of.

        A node is an op or (clock, rank, i): the rank's "stream" or "host" clock just after event i
        (a one-clock rank stays on "stream"). A compute ends on the stream when the device finished
        its work (then back to the stream, or to the host if the device had waited for it) or when
        the host finished issuing it (then back to the host); a CpuSync takes the host to the
        stream; a blocking op or wait that held the stream goes to its latest op, and an op goes to
        the rank that issued it last (its stream) or to the group's previous op.
        """
        if not self.g.events:
            return []
        rank = max(self.g.ranks, key=lambda r: (self.end[r], -r))
        node: tuple = ("stream", rank, len(self.g.events[rank]) - 1)  # the stream ends last (see _compute)
        path: list[PathStep] = []
        seen = 0
        while True:
            seen += 1
            if seen > 10 * (len(self.ops) + sum(len(e) for e in self.g.events.values())) + 10:
                raise RuntimeError("internal: critical path walk does not terminate")
            if node[0] == "op":
                op = self.ops[node[1]]
                path.append(PathStep(op.kind, op.ranks, op.start, op.end, op.label))
                if op.why[0] == "group":
                    node = ("op", op.why[1])
                else:
                    _, r, i = op.why
                    node = ("stream", r, i - 1)
                continue
            chain, r, i = node
            if i < 0:
                break
            ev = self.g.events[r][i]
            ready, done = self.ready[r][i], self.done_t[r][i]
            node = (chain, r, i - 1)
            if isinstance(ev, Compute):
                start, busy, after = self.span[r][i]
                if chain == "host":
                    step = (ready, done)
                elif after > busy:  # the device waited for the host to issue the segment
                    step, node = (ready, after), ("host", r, i - 1)
                else:
                    step = (start, after)
                if step[1] > step[0]:
                    path.append(PathStep("compute", (r,), step[0], step[1], ev.label))
            elif isinstance(ev, CpuSync):
                if chain == "host" and done > ready:
                    node = ("stream", r, i - 1)
            elif isinstance(ev, (Comm, Wait)) and chain == "stream" and done > ready:
                keys = [self.keys[r][i]] if isinstance(ev, Comm) else [self.keys[r][j] for j in ev.refs]
                node = ("op", max(keys, key=lambda k: self.ops[k].end))
        path.reverse()
        return path


class ResumableReplay:
    """Replays a graph that grows by whole iterations, each time going on where the last stopped.

    The live prediction replays the trace so far at every logged iteration; from the start, its cost
    grows with the iterations run, and the logging rank waits for it. The graph of the trace cut at
    iteration N is the one cut at N-1 with iteration N's events appended (host times pool only earlier
    iterations: replay.gpu_segments), so the replay's state after N-1 goes on into N and gives the same
    times as a replay from the start. Where the new graph is not such a growth (a folded graph, an event
    so far that changed), it replays from the start.
    """

    def __init__(self, cost: CostFn = zero_cost, *, serialize_group_collectives: bool = True) -> None:
        self.cost, self.serialize = cost, serialize_group_collectives
        self._state: _Replay | None = None
        #: whether the last ``iterations`` went on from the replay before it (False: from the start)
        self.resumed = False

    @paused()
    def iterations(self, graph: Graph) -> list[Iteration]:
        """The iterations of ``graph``'s replay, as ``replay(graph, cost).iterations()`` gives them (and the
        same errors: a deadlock, ops never matched)."""
        state, self._state = self._state, None
        if graph.fold is not None:
            self.resumed = False
            return replay(graph, self.cost, serialize_group_collectives=self.serialize).iterations()
        graph.validate()
        self.resumed = state is not None and state.grows_into(graph)
        if self.resumed:
            stuck = state.go_on(graph)
        else:
            state = _Replay(graph, self.cost, self.serialize)
            stuck = state._advance()
        if stuck or any(not op.done for op in state.ops.values()):
            return _Replay(graph, self.cost, self.serialize).run().iterations()  # raises, naming what
        self._state = state
        return iterations_of(state.marks)


@paused()
def replay(graph: Graph, cost: CostFn = zero_cost, *, serialize_group_collectives: bool = True,
           fold_method: str = "auto") -> ReplayResult:
    """Replay ``graph`` with communication costed by ``cost``; raise DeadlockError on a deadlock.

    A folded graph is replayed by ``fold_method`` (replay.folded.FOLD_METHODS; ``auto``: the fastest
    that is exact for it); the result's ``method`` says which.
    """
    graph.validate()
    if graph.fold is not None:
        from .folded import replay_folded

        return replay_folded(graph, cost, fold_method, serialize_group_collectives)
    return _Replay(graph, cost, serialize_group_collectives).run()
