"""A folded pipeline stage's own program, rebuilt from its representative's scheduling units.

A class-depth fold keeps one live middle pipeline stage q for every middle stage p of its class. The
stages hold the same layers, so stage p's forward (or backward) of microbatch i computes what q's
unit of the same microbatch computed; but they do not run the same program. Under Megatron's
non-interleaved 1F1B (``forward_backward_pipelining_without_interleaving``) pipeline rank p runs
``w = min(warmup[p], M)`` warm-up forwards, then M - w steady forward/backward pairs, then w
cool-down backwards, where ``warmup`` is the fold plan's (``Fold.warmup``: Megatron's own count per
pipeline rank) and M the iteration's microbatches. :func:`restage` rebuilds stage p's program:

- q's events are cut into *units* (a ``forward``/``backward`` marker span of the trace, with its
  microbatch) and the pipeline p2p ops between them. Each p2p op goes with the unit it belongs to:
  the k-th receive from the previous stage is forward k's input, the k-th send to the next stage its
  output; the k-th receive from the next stage is backward k's output gradient, the k-th send to the
  previous stage its input gradient. Compute and markers in the gaps go with the op or unit they
  precede.
- The units and ops are put in stage p's order, the p2p ops in the calls Megatron makes there
  (``recv_forward``, ``send_forward``, ``send_forward_recv_backward``, ``send_backward_recv_forward``,
  ``recv_backward``, ``send_backward``; the ops of a call in the order Megatron's batched p2p posts
  them: send/recv to the previous stage, then to the next), each call waited at its end as Megatron's
  p2p waits on its requests, for the ops the representative's trace shows waited before its next
  unit; an op the trace awaited later (graph_from_trace leaves out a wait that found its op already
  complete) keeps that later wait where it still follows the op, as the representative's did.
- Events before the iteration's first unit and after its last (optimizer, data-parallel gradient
  reduction, embedding all-reduce) keep their place; sequence numbers of ops that moved are renumbered
  per group in the new order (every member of such a group is a lockstep peer that moves alike: a
  group with members on other stages is an error, as is anything else that does not fit the schedule).

Iterations without backward units (forward-only: evaluation) run the same program on every stage and
are kept. The representative's own order is checked against the schedule for its stage first, so a
trace whose program is not the one the plan names is an error, never a silent reorder.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .graph import Comm, Event, GraphError, Mark, Wait

if TYPE_CHECKING:
    from ..trace.fold import Fold

#: The marker names of scheduling units (patches.schedules): a span per forward / backward of a microbatch.
UNITS = ("forward", "backward")
#: The four pipeline p2p streams of a stage: receive from the previous / next stage, send to either.
RECV_PREV, SEND_NEXT, RECV_NEXT, SEND_PREV = "recv_prev", "send_next", "recv_next", "send_prev"


class ScheduleError(GraphError):
    """A folded stage's own program cannot be rebuilt from its representative's trace."""


def one_f_one_b(warmup: int, microbatches: int) -> list[tuple[str, int]]:
    """The order of units of a non-interleaved 1F1B stage with ``warmup`` warm-up forwards (already
    capped at ``microbatches``, as Megatron's schedule caps it): ("F" | "B", microbatch)."""
    w, m = warmup, microbatches
    out = [("F", i) for i in range(w)]
    for i in range(m - w):
        out += [("F", w + i), ("B", i)]
    return out + [("B", m - w + i) for i in range(w)]


@dataclass(eq=False)
class _WaitOn:
    """A wait in the rebuilt program on the representative's ops at these (old) indices (none: left out)."""

    refs: list[int]


@dataclass
class _Block:
    """One iteration's units and pipeline p2p ops of the representative (indices into its events)."""

    iteration: object
    start: int  # the region [start, end) that is rebuilt
    end: int
    order: list[tuple[str, int]] = field(default_factory=list)
    units: dict[tuple[str, int], tuple[list[int], range]] = field(default_factory=dict)  # lead, body
    ops: dict[tuple[str, int], tuple[list[int], int]] = field(default_factory=dict)  # lead, op index


class _Restager:
    def __init__(self, events: Sequence[Event], fold: Fold, rep: int, group_members: dict[int, Sequence[int]],
                 source: str) -> None:
        self.ev, self.fold, self.rep, self.source = events, fold, rep, source
        self.group_members = group_members
        self.pp_axis = fold.axes.index("pp")
        self.stages = fold.sizes[self.pp_axis]
        self.stage = fold.coords[rep][self.pp_axis]

    def _where(self) -> str:
        return f"{self.source}: rank {self.rep} (pipeline stage {self.stage})"

    def stream(self, i: int) -> str | None:
        """Which pipeline p2p stream op ``i`` belongs to; None for anything that is not such an op."""
        ev = self.ev[i]
        if type(ev) is not Comm or not ev.is_p2p:
            return None
        peer = self.fold.coords[ev.peer][self.pp_axis]
        if peer == (self.stage - 1) % self.stages:
            return RECV_PREV if ev.kind == "recv" else SEND_PREV
        if peer == (self.stage + 1) % self.stages:
            return RECV_NEXT if ev.kind == "recv" else SEND_NEXT
        raise ScheduleError(f"{self._where()} event {i} ({ev.kind} with rank {ev.peer}, stage {peer}) is a p2p op "
                            "with a rank that is not a neighbouring stage: not a 1F1B pipeline's")

    # --- reading the representative ---------------------------------------------------------------
    def _unit_end(self, i: int) -> int:
        name, depth = self.ev[i].name, 0
        for j in range(i, len(self.ev)):
            ev = self.ev[j]
            if type(ev) is Mark and ev.name == name:
                depth += 1 if ev.phase == "B" else -1 if ev.phase == "E" else 0
                if depth == 0:
                    return j
        raise ScheduleError(f"{self._where()} event {i}: the {name} unit never ends")

    def blocks(self) -> list[_Block]:
        """The iterations to rebuild: consecutive training units of one iteration."""
        ev = self.ev
        spans = []  # (iteration, eval, start, end inclusive)
        i = 0
        while i < len(ev):
            e = ev[i]
            if type(e) is Mark and e.phase == "B" and (e.name in UNITS or e.name == "forward_backward"):
                if e.name == "forward_backward":
                    raise ScheduleError(f"{self._where()} event {i}: a combined forward_backward unit (Megatron's "
                                        "combined 1F1B); a folded stage's order of such units is not rebuilt")
                j = self._unit_end(i)
                spans.append((e.attrs.get("iteration"), bool(e.attrs.get("eval")), i, j))
                i = j + 1
                continue
            i += 1
        if not spans:
            raise ScheduleError(f"{self._where()}: its trace has no scheduling units (forward/backward markers, "
                                "which Megatron's schedules emit); a folded pipeline stage's own order of units "
                                "cannot be rebuilt without them, so this program's middle pipeline stages cannot be "
                                "folded (fold at replica depth, or capture every stage)")
        out: list[_Block] = []
        run: list[tuple] = []
        for s in [*spans, None]:
            if run and (s is None or (s[0], s[1]) != (run[0][0], run[0][1])):
                if not run[0][1] and any(ev[a].name == "backward" for _, _, a, _ in run):
                    out.append(self._block(run))
                run = []
            if s is not None:
                run.append(s)
        return out

    def _block(self, run: list[tuple]) -> _Block:
        ev = self.ev
        start, end = run[0][2], run[-1][3] + 1

        def passable(k: int) -> bool:  # what may lie between the iteration's edge units and their p2p ops
            e = ev[k]
            return type(e) is not Comm and not (type(e) is Mark and e.name in (*UNITS, "iteration"))

        k = start - 1  # the first forward's input receive precedes it
        while k >= 0 and (passable(k) or self.stream(k) == RECV_PREV):
            if self.stream(k) == RECV_PREV:
                start = k
            k -= 1
        k = end  # the last backward's input-gradient send follows it
        while k < len(ev) and (passable(k) or self.stream(k) == SEND_PREV):
            if self.stream(k) == SEND_PREV:
                end = k + 1
            k += 1
        block = _Block(run[0][0], start, end)
        lead: list[int] = []
        counts: dict[str, int] = defaultdict(int)
        i = start
        while i < end:
            e = ev[i]
            if type(e) is Mark and e.phase == "B" and e.name in UNITS:
                j = self._unit_end(i)
                mb, chunk = e.attrs.get("microbatch"), e.attrs.get("chunk") or 0
                key = ("F" if e.name == "forward" else "B", mb)
                if not isinstance(mb, int) or chunk != 0 or key in block.units:
                    raise ScheduleError(f"{self._where()} event {i}: {e.name} unit of microbatch {mb!r}, chunk "
                                        f"{chunk!r}, iteration {block.iteration!r}: not a non-interleaved 1F1B unit "
                                        "(each microbatch once, chunk 0)")
                for b in range(i, j + 1):
                    if self.stream(b) is not None:
                        raise ScheduleError(f"{self._where()} event {b}: a pipeline p2p op inside a {e.name} unit")
                block.units[key] = (lead, range(i, j + 1))
                block.order.append(key)
                lead = []
                i = j + 1
                continue
            s = self.stream(i)
            if s is not None:
                block.ops[(s, counts[s])] = (lead, i)
                counts[s] += 1
                lead = []
            elif type(e) is Comm:
                raise ScheduleError(f"{self._where()} event {i} ({e.kind} on group {e.group}) lies between "
                                    f"scheduling units of iteration {block.iteration!r} and is not a pipeline p2p "
                                    "op: it has no place in another stage's order of units")
            else:
                lead.append(i)
            i += 1
        m = sum(1 for kind, _ in block.order if kind == "F")
        if sorted(block.order) != sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)]):
            raise ScheduleError(f"{self._where()}, iteration {block.iteration!r}: its units {block.order[:8]}... "
                                "are not one forward and one backward of microbatches 0..M-1")
        for s in (RECV_PREV, SEND_NEXT, RECV_NEXT, SEND_PREV):
            if counts[s] != m:
                raise ScheduleError(f"{self._where()}, iteration {block.iteration!r}: {counts[s]} {s} p2p op(s) for "
                                    f"{m} microbatches; a middle 1F1B stage has one per microbatch")
        want = one_f_one_b(min(self.fold.warmup[self.stage], m), m)
        if block.order != want:
            at = next(i for i, (a, b) in enumerate(zip(block.order, want, strict=True)) if a != b)
            raise ScheduleError(f"{self._where()}, iteration {block.iteration!r}: its units run in an order that is "
                                f"not the plan's 1F1B schedule for its stage (warm-up {self.fold.warmup[self.stage]}): "
                                f"unit {at} is {block.order[at]}, the schedule's {want[at]}")
        return block

    # --- writing stage p ------------------------------------------------------------------------
    def program(self, stage: int, blocks: list[_Block]) -> list[Event]:
        ev = self.ev
        moved: set[int] = set()  # the p2p ops of rebuilt regions
        for b in blocks:
            moved.update(i for _, i in b.ops.values())
        prompt = self._prompt(moved)
        call_of: dict[int, _WaitOn] = {}  # a moved op -> the wait at the end of its call in stage p's program
        slots: list[int | _WaitOn] = []  # an old event index, or a wait on old op indices
        at = 0
        for b in blocks:
            slots.extend(range(at, b.start))
            slots.extend(self._region(b, stage, prompt, call_of))
            at = b.end
        slots.extend(range(at, len(ev)))

        order = {s: n for n, s in enumerate(slots) if isinstance(s, int)}
        for n, s in enumerate(slots):  # the trace's own waits: what they waited for that did not move, and
            if not isinstance(s, int) or type(ev[s]) is not Wait:  # the deferred ops that still precede them
                continue
            keep = []
            for x in ev[s].refs:
                if x not in moved:
                    keep.append(x)
                elif x not in prompt:
                    if order[x] < n:
                        keep.append(x)
                    else:  # its wait would come before it in stage p's order: wait at the end of its call
                        call_of[x].refs.append(x)
            slots[n] = _WaitOn(keep)
        kept = [s for s in slots if not isinstance(s, _WaitOn) or s.refs]
        pos = {s: n for n, s in enumerate(kept) if isinstance(s, int)}
        seqs: dict[tuple, list[int]] = defaultdict(list)
        for e in ev:
            if type(e) is Comm:
                seqs[self._seq_key(e)].append(e.seq)
        for v in seqs.values():
            v.sort()
        taken: dict[tuple, int] = defaultdict(int)
        out: list[Event] = []
        for n, s in enumerate(kept):
            if isinstance(s, _WaitOn):
                new = tuple(sorted(pos[x] for x in s.refs))
                if any(x >= n for x in new):
                    raise ScheduleError(f"{self._where()}: a wait on its events {s.refs} would precede them in stage "
                                        f"{stage}'s order of units")
                out.append(Wait(new))
                continue
            e = ev[s]
            if type(e) is Comm:
                key = self._seq_key(e)
                seq = seqs[key][taken[key]]
                taken[key] += 1
                if seq != e.seq:
                    self._check_moves(s, e, stage)
                    e = Comm(e.kind, e.group, seq, e.peer, e.root, e.nbytes, e.dtype, e.async_op, e.label)
            out.append(e)
        return out

    def _prompt(self, moved: set[int]) -> set[int]:
        """The moved async ops the trace shows waited before the next unit began (Megatron's p2p calls
        wait at once; graph_from_trace leaves out a wait that found its op complete and awaits the op
        later, and the rebuilt program keeps that as the trace has it)."""
        ev = self.ev
        units = [0] * (len(ev) + 1)  # unit beginnings before each index
        for i, e in enumerate(ev):
            units[i + 1] = units[i] + (type(e) is Mark and e.phase == "B" and e.name in UNITS)
        out = set()
        for j, e in enumerate(ev):
            if type(e) is Wait:
                out.update(x for x in e.refs if x in moved and units[j] == units[x])
        return out

    @staticmethod
    def _seq_key(e: Comm) -> tuple:
        return (e.group, e.kind, e.peer) if e.is_p2p else (e.group,)

    def _check_moves(self, i: int, e: Comm, stage: int) -> None:
        """An op whose sequence number changes must be on a group of lockstep peers (they move alike)."""
        members = self.group_members[e.group]
        others = sorted({self.fold.coords[x][self.pp_axis] for x in members} - {self.stage})
        if e.is_p2p or others:
            raise ScheduleError(f"{self._where()} event {i} ({e.kind} on group {e.group}) moves in stage {stage}'s "
                                f"order of units, but the group has members on other stages {others[:8]} "
                                "whose order does not change: the op cannot be renumbered")

    def _region(self, b: _Block, stage: int, prompt: set[int], call_of: dict[int, _WaitOn]) -> list[int | _WaitOn]:
        """Stage ``stage``'s calls and units of block ``b`` (see the module docstring)."""
        ev = self.ev
        m = sum(1 for kind, _ in b.order if kind == "F")
        w = min(self.fold.warmup[stage], m)
        out: list[int | _WaitOn] = []

        def call(*ops: tuple[str, int]) -> None:
            wait = _WaitOn([])
            for key in ops:
                lead, i = b.ops[key]
                out.extend(lead)
                out.append(i)
                call_of[i] = wait
                if ev[i].async_op and i in prompt:
                    wait.refs.append(i)
            out.append(wait)

        def unit(key: tuple[str, int]) -> None:
            lead, body = b.units[key]
            out.extend(lead)
            out.extend(body)

        for i in range(w):  # warm-up
            call((RECV_PREV, i))
            unit(("F", i))
            call((SEND_NEXT, i))
        if m > w:
            call((RECV_PREV, w))
        for i in range(m - w):  # steady 1F1B
            unit(("F", w + i))
            call((SEND_NEXT, w + i), (RECV_NEXT, i))  # send_forward_recv_backward
            unit(("B", i))
            if i == m - w - 1:
                call((SEND_PREV, i))  # send_backward
            else:
                call((SEND_PREV, i), (RECV_PREV, w + i + 1))  # send_backward_recv_forward
        for i in range(m - w, m):  # cool-down
            call((RECV_NEXT, i))
            unit(("B", i))
            call((SEND_PREV, i))
        return out


def restage(events: Sequence[Event], fold: Fold, rep: int, stage: int, group_members: dict[int, Sequence[int]],
            source: str = "<graph>") -> list[Event]:
    """The events of pipeline stage ``stage`` folded onto rank ``rep`` (another stage of its class), in the
    representative's frame (peers and groups not yet translated): see the module docstring.
    ``group_members``: group id -> member ranks. ScheduleError where the program cannot be rebuilt."""
    if fold.schedule != "1f1b":
        what = {"": "names no pipeline schedule (a plan written before plans recorded it)",
                "interleaved": "names Megatron's interleaved schedule, whose per-stage order is not rebuilt yet"}
        raise ScheduleError(f"{source}: rank {rep}'s virtual pipeline stage {stage} runs its own order of units, but "
                            f"the fold plan {what.get(fold.schedule, f'names schedule {fold.schedule!r}')}: "
                            "fold at replica depth (or re-plan and recapture)")
    r = _Restager(events, fold, rep, group_members, source)
    blocks = r.blocks()
    m = [sum(1 for kind, _ in b.order if kind == "F") for b in blocks]
    if all(min(fold.warmup[stage], n) == min(fold.warmup[r.stage], n) for n in m):
        return list(events)  # the same order of units: the representative's program as it ran
    return r.program(stage, blocks)
