"""Every rank's program at the target's M micro-batches, from a capture of m_c of them per iteration.

A micro-batch-folded trace (trace.microbatches) ran m_c of the target's M micro-batches per training
iteration. :func:`expand_microbatches` rebuilds each rank's iterations at M, before rank-fold synthesis
(so live, synthesised and unfolded ranks alike); under Megatron's non-interleaved schedules:

- A rank's pipeline stage and PP are its place in the group of its pipeline p2p ops (Megatron
  builds that group in stage order); a rank without p2p ops is PP1.
- Each training iteration's units (``forward``/``backward`` spans with their micro-batch) and
  pipeline p2p ops are cut by replay.stage_schedule.walk_units, on any stage: the k-th receive from
  the previous stage is forward k's input, the k-th send to the next its output, the k-th receive
  from the next backward k's output gradient, the k-th send to the previous its input gradient (a
  first stage has no previous, a last no next). Compute and markers in the gaps go with the unit or
  op they precede. The captured order must be the plan's 1F1B for the stage at m_c
  (``one_f_one_b(min(warmup, m_c), m_c)``).
- Target micro-batch i takes the units and ops of captured micro-batch ``MicrobatchFold.source(i)``
  (its own for i < m_c - 1, the steady m_c - 2 for the extra ones, the captured last for M - 1), in
  the stage's order ``one_f_one_b(min(warmup, M), M)`` and Megatron's p2p calls (``recv_forward``,
  ``send_forward``, ``send_forward_recv_backward``, ``send_backward_recv_forward``, ``recv_backward``,
  ``send_backward``; the ops of a call in replay.stage_schedule's order), each call waited at its
  end as Megatron's non-interleaved p2p waits on its requests. A wait of the trace on a p2p op of
  the iteration is that call-end wait; a wait inside a unit on an op of the same unit is copied with
  it; a wait inside the iteration on anything else is an error.
- Copied ops get fresh sequence numbers: every op of a group (p2p: of a group and peer) that a copy
  touches is renumbered in program order from the group's first number, so peers that copy alike
  still match; a group whose numbers the trace did not give contiguously is an error.

Under Megatron's interleaved schedule (record schedule "interleaved") a stage's units are keyed by
virtual microbatch (the schedule table's (microbatch, chunk)); its captured iteration must be
replay.stage_schedule.interleaved_steps at m_c unit for unit and p2p op for op (each op's stream follows
from its place there, checked against its kind and peer: at PP2 the previous and the next stage are
one rank), and the iteration at M is interleaved_steps at M, each unit and op from the captured one
:func:`interleaved_alignment` names, each wait the schedule's own on the target's ops.

Data-parallel ops within the schedule (``--overlap-grad-reduce``, ``--overlap-param-gather``) belong to
the first and last units, which the fold keeps, never to the steady units it copies: megatron-core's
DDP gathers a chunk's parameters from a forward pre-hook (``finish_param_sync``), so in the chunk's
first forward (its bucket group's gather is dispatched once per iteration, ``param_gather_dispatched``;
without aligned param gather the hook dispatches the next bucket group's too, still in that forward).
Under the interleaved schedule Megatron-LM aligns the param gather (``align_param_gather``,
``config.param_sync_func``: the pre-hook then only awaits): the schedule dispatches chunks 0 and 1
before its first receive, and chunk c + 1 > 1 in ``forward_step_helper_preprocess`` of forward k, right
before that unit, when k + stage is chunk c's first forward (and ``is_first_microbatch_for_model_chunk``),
a unit of the warm-up that the fold keeps. It starts a bucket
group's grad reduce-scatter / all-reduce only while ``is_last_microbatch`` holds (the schedules
disable grad sync, ``no_sync``, for every other micro-batch): from the grad hooks in the last
backward (in the first batch finalize_model_grads starts them, after the schedule), or through
``grad_sync_func`` (align-grad-reduce, as Megatron-LM's train sets it) after the cool-down (1F1B)
or, interleaved, right after backward k when k - stage is a chunk's last backward
(``backward_step_helper_postprocess``), the others after the schedule. Several
buckets change nothing: each starts when its last grad is ready, still within that backward. So a
collective inside a unit is copied with it; one that directly follows a unit (only computation
and markers between) joins that unit; one that does not but directly precedes a unit (only computation,
markers and other such collectives before the unit's begin marker) joins that unit's lead, and the
chunk's wait on it in a later unit waits that one copy; the target's order places it at M where
Megatron does, since
the units that issue these ops are replayed once, at the same place relative to the iteration's start
or end. A unit issuing a collective that the other units of its kind (and chunk) do not issue, which
the target replays more than once, or one neither following nor preceding a unit, is a ScheduleError
naming it.

Forward-only iterations (evaluation) and anything that does not fit (a missing unit, an op that does
not attach, an order that is not the plan's) are a ScheduleError naming the rank and micro-batch.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .graph import Comm, Event, Graph, Group, Mark, Wait
from .stage_schedule import (
    RECV_NEXT,
    RECV_PREV,
    SEND_NEXT,
    SEND_PREV,
    UNIT_KINDS,
    ScheduleError,
    Step,
    UnitWalk,
    interleaved_steps,
    iteration_region,
    iterations,
    one_f_one_b,
    one_f_one_b_steps,
    schedule_table,
    unit_spans,
    walk_units,
)

if TYPE_CHECKING:
    from ..trace.microbatches import MicrobatchFold

_STREAMS = (RECV_PREV, SEND_NEXT, RECV_NEXT, SEND_PREV)

#: a slot of the rebuilt program: (old event index, instance), the instance a target unit/op key or None
Slot = tuple[int, object]


@dataclass(eq=False)
class _CallWait:
    """The wait at the end of a p2p call, on the async ops it posted."""

    refs: list[Slot] = field(default_factory=list)


@dataclass
class _Block:
    iteration: object
    start: int
    end: int
    order: list[tuple[str, int]] = field(default_factory=list)
    units: dict[tuple[str, int], tuple[list[int], range]] = field(default_factory=dict)
    ops: dict[tuple[str, int], tuple[list[int], int]] = field(default_factory=dict)


def expand_microbatches(graph: Graph, mb: MicrobatchFold) -> Graph:
    """``graph`` (a capture of ``mb.captured`` micro-batches per iteration) with every rank's training
    iterations at ``mb.target`` (see the module docstring); its notes say what was folded."""
    events = {r: expand_rank(evs, graph.groups, r, mb, graph.source) for r, evs in graph.events.items()}
    return Graph(graph.groups, events, graph.source, [*graph.notes, mb.describe()], graph.fold)


def expand_rank(events: Sequence[Event], groups: dict[int, Group], rank: int, mb: MicrobatchFold,
                source: str = "<graph>") -> list[Event]:
    """Rank ``rank``'s program with its training iterations at ``mb.target`` micro-batches."""
    return (_Interleaved if mb.interleaved else _Expander)(events, groups, rank, mb, source).run()


class _Expander:
    def __init__(self, events: Sequence[Event], groups: dict[int, Group], rank: int, mb: MicrobatchFold,
                 source: str) -> None:
        self.ev, self.groups, self.rank, self.mb, self.source = events, groups, rank, mb, source
        self.stage, self.pp, self.pp_group = self._place()
        if self.pp != len(mb.warmup):
            raise ScheduleError(f"{self._where()}: its pipeline has {self.pp} stage(s), the micro-batch fold's "
                                f"warm-up names {len(mb.warmup)}")
        self.warmup = mb.warmup[self.stage]
        self.streams = tuple(s for s in _STREAMS if (s in (RECV_PREV, SEND_PREV) and self.stage > 0)
                             or (s in (SEND_NEXT, RECV_NEXT) and self.stage < self.pp - 1))

    def _where(self, microbatch: int | None = None) -> str:
        mbs = f", micro-batch {microbatch}" if microbatch is not None else ""
        return f"{self.source}: rank {self.rank}{mbs}"

    def _place(self) -> tuple[int, int, int | None]:
        """(stage, PP, group) from the rank's pipeline p2p ops (Megatron may post them on more than one
        group of the pipeline's ranks: megatron-core's interleaved schedule at PP2 does)."""
        found = sorted({ev.group for ev in self.ev if type(ev) is Comm and ev.is_p2p})
        if not found:
            return 0, 1, None
        # at PP2 Megatron posts one direction of its p2p on the world group, which with DP > 1 holds more
        # ranks than the pipeline's: the pipeline is the least group, the others hold it
        gid = min(found, key=lambda g: (len(self.groups[g].ranks), g))
        ranks = list(self.groups[gid].ranks)
        if any(not set(ranks) <= set(self.groups[g].ranks) for g in found):
            raise ScheduleError(f"{self._where()}: p2p ops on groups {found[:4]}, not all holding group {gid}'s "
                                "ranks: not one pipeline's")
        if self.rank not in ranks:
            raise ScheduleError(f"{self._where()}: p2p ops on group {gid}, which does not hold it")
        return ranks.index(self.rank), len(ranks), gid

    def stream(self, i: int) -> str | None:
        ev = self.ev[i]
        if type(ev) is not Comm or not ev.is_p2p:
            return None
        ranks = self.groups[self.pp_group].ranks if self.pp_group is not None else ()
        peer = ranks.index(ev.peer) if ev.peer in ranks else -1
        if peer == self.stage - 1:
            return RECV_PREV if ev.kind == "recv" else SEND_PREV
        if peer == self.stage + 1:
            return RECV_NEXT if ev.kind == "recv" else SEND_NEXT
        raise ScheduleError(f"{self._where()} event {i} ({ev.kind} with rank {ev.peer}) is a p2p op with a rank that "
                            f"is not a neighbouring stage of stage {self.stage}: not a non-interleaved pipeline's")

    # --- reading ------------------------------------------------------------------------------
    def blocks(self) -> list[_Block]:
        ev = self.ev
        spans = unit_spans(ev, self._where(),
                           "its micro-batches are not folded (run with --prism-fold-microbatches off)")
        if not spans:
            raise ScheduleError(f"{self._where()}: its trace has no scheduling units (forward/backward markers); its "
                                "iterations cannot be given the target's micro-batches")
        out: list[_Block] = []
        for run, trains in iterations(ev, spans):
            if not trains:
                raise ScheduleError(f"{self._where()}: iteration {run[0][0]!r} runs forward units only "
                                    "(evaluation), captured with the folded micro-batch count: run with "
                                    "--eval-iters 0 or --prism-fold-microbatches off")
            out.append(self._block(run))
        return out

    def _block(self, run: list[tuple]) -> _Block:
        """An iteration's units and p2p ops (stage_schedule.walk_units), a data-parallel collective with the unit
        it directly follows (Megatron issues a grad sync right after the backward that readies it) or in the
        lead of the unit it directly precedes (a param all-gather dispatched right before a forward)."""
        ev = self.ev
        start, end = iteration_region(ev, run, self._receives_prev, self._sends_prev, trailing_dp=True)
        b = _Block(run[0][0], start, end)

        def stray(i: int) -> str:
            return (f"{self._where()} event {i} ({ev[i].kind} on group {ev[i].group}) lies between the units of "
                    f"iteration {b.iteration!r}, is not a pipeline p2p op and does not directly follow a unit nor "
                    "precede one: it has no place in the target's order of units")

        walk = walk_units(ev, start, end, stream=self.stream, where=self._where, stray=stray,
                          unit_key=lambda walk, i: self._unit_key(b, walk, i),
                          admit=lambda walk, key, i: self._admit(b, walk, key, i),
                          op_key=lambda walk, i, s: self._op_key(b, walk, i, s))
        b.order, b.ops = walk.order, walk.ops
        for key in walk.order:  # a unit's lead takes the collectives before it, its body those after it
            lead, body = walk.units[key]
            after = walk.after.get(key)
            b.units[key] = ([*lead, *walk.before.get(key, ())], range(body.start, after[-1] + 1) if after else body)
        self._check_block(b, walk)
        return b

    def _receives_prev(self, k: int) -> bool:
        return self.stream(k) == RECV_PREV

    def _sends_prev(self, k: int) -> bool:
        return self.stream(k) == SEND_PREV

    def _unit_key(self, b: _Block, walk: UnitWalk, i: int) -> tuple:
        e, m_c = self.ev[i], self.mb.captured
        mbn, chunk = e.attrs.get("microbatch"), e.attrs.get("chunk") or 0
        key = ("F" if e.name == "forward" else "B", mbn)
        if not isinstance(mbn, int) or chunk != 0 or key in walk.units or not 0 <= mbn < m_c:
            raise ScheduleError(f"{self._where(mbn)} event {i}: {e.name} unit (chunk {chunk!r}) of iteration "
                                f"{b.iteration!r} is not a non-interleaved unit of a captured micro-batch "
                                f"0..{m_c - 1} seen once")
        return key

    def _admit(self, b: _Block, walk: UnitWalk, key: tuple, i: int) -> None:
        """A unit whose key fits (_unit_key) in its place: the interleaved schedule checks that place."""

    def _op_key(self, b: _Block, walk: UnitWalk, i: int, stream: str) -> tuple[str, int]:
        return stream, walk.counts[stream]

    def _check_block(self, b: _Block, walk: UnitWalk) -> None:
        """Every captured micro-batch's units and p2p ops, in the plan's 1F1B order for the stage."""
        m_c, counts = self.mb.captured, walk.counts
        n = sum(1 for kind, _ in b.order if kind == "F")
        for kind in ("F", "B"):
            missing = [x for x in range(m_c) if (kind, x) not in b.units]
            if missing:
                raise ScheduleError(f"{self._where(missing[0])}, iteration {b.iteration!r}: no "
                                    f"{'forward' if kind == 'F' else 'backward'} unit; the fold captured {m_c} "
                                    f"micro-batches per iteration (the trace shows {n} forwards)")
        for s in _STREAMS:
            want = m_c if s in self.streams else 0
            if counts[s] != want:
                raise ScheduleError(f"{self._where(min(counts[s], want))}, iteration {b.iteration!r}: {counts[s]} {s} "
                                    f"p2p op(s) for {m_c} captured micro-batches; stage {self.stage} of {self.pp} has "
                                    f"{want}: the ops do not attach to its units")
        want_order = one_f_one_b(min(self.warmup, m_c), m_c)
        if b.order != want_order:
            at = next(x for x, (a, c) in enumerate(zip(b.order, want_order, strict=True)) if a != c)
            raise ScheduleError(f"{self._where(b.order[at][1])}, iteration {b.iteration!r}: its units run in an order "
                                f"that is not 1F1B for stage {self.stage} (warm-up {self.warmup}): unit {at} is "
                                f"{b.order[at]}, the schedule's {want_order[at]}")

    def _unit_class(self, key: tuple) -> tuple:
        """Units alike but for the micro-batch: same kind (and chunk)."""
        return (key[0],)

    def _check_extra_ops(self, b: _Block, uses: dict[int, list[object]]) -> None:
        """A unit's collectives that not every unit of its class issues (data-parallel ops of a first or last
        micro-batch) must be replayed once: a unit carrying them that the target repeats is an error."""
        sigs: dict[tuple, Counter] = {}
        for key, (lead, body) in b.units.items():
            sigs[key] = Counter((self.ev[x].kind, self.ev[x].group) for x in (*lead, *body)
                                if type(self.ev[x]) is Comm and not self.ev[x].is_p2p)
        common: dict[tuple, Counter] = {}
        for key, sig in sigs.items():
            cls = self._unit_class(key)
            common[cls] = common[cls] & sig if cls in common else sig
        for key, sig in sigs.items():
            extra = sig - common[self._unit_class(key)]
            n = len(uses[b.units[key][1].start])
            if extra and n != 1:
                kind, group = next(iter(extra))
                raise ScheduleError(f"{self._where()}, iteration {b.iteration!r}: captured unit {key} issues "
                                    f"{kind} on group {group}, which the other units of its kind do not (a "
                                    f"data-parallel op Megatron issues in a first or last micro-batch), and the "
                                    f"target's order replays that unit {n} times: the op has no one place at M")

    # --- writing ------------------------------------------------------------------------------
    def run(self) -> list[Event]:
        ev = self.ev
        blocks = self.blocks()
        in_block: dict[int, _Block] = {}
        body_of: dict[int, tuple[str, int]] = {}  # event index -> the captured unit whose body holds it
        p2p: set[int] = set()
        for b in blocks:
            for i in range(b.start, b.end):
                in_block[i] = b
            for key, (_, body) in b.units.items():
                for i in body:
                    body_of[i] = key
            p2p.update(i for _, i in b.ops.values())
        slots: list[Slot | _CallWait] = []
        at = 0
        for b in blocks:
            slots.extend((i, None) for i in range(at, b.start))
            slots.extend(self._region(b))
            at = b.end
        slots.extend((i, None) for i in range(at, len(ev)))

        insts: dict[int, list[object]] = defaultdict(list)  # old index -> the instances it appears as
        for s in slots:
            if not isinstance(s, _CallWait):
                insts[s[0]].append(s[1])
        for b in blocks:
            self._check_extra_ops(b, insts)
        pos: dict[Slot, int] = {}
        kept: list[Slot | _CallWait] = []
        for s in slots:
            if isinstance(s, _CallWait):
                if s.refs:
                    kept.append(s)
                continue
            i, inst = s
            e = ev[i]
            if type(e) is Wait:
                refs: list[Slot] = []
                for x in e.refs:
                    if x in p2p:
                        continue  # waited at the end of its call
                    if x not in in_block:
                        refs.append((x, None))
                    elif inst is not None and x in body_of and body_of.get(i) == body_of[x]:
                        refs.append((x, inst))  # an op of its own unit, copied with it
                    elif i not in in_block and i > x and x in body_of:
                        refs.extend((x, y) for y in insts[x])  # after the iteration: every copy of the op
                    elif i > x and type(ev[x]) is Comm and not ev[x].is_p2p and len(insts[x]) == 1:
                        refs.append((x, insts[x][0]))  # a DP op of a unit replayed once (a param all-gather)
                    else:
                        raise ScheduleError(f"{self._where()} event {i}: a wait on event {x}, an op of another "
                                            f"unit of iteration {in_block[x].iteration!r}: it cannot be placed among "
                                            "the target's copies of the units")
                if refs:
                    kept.append(_CallWait(refs))
                continue
            pos[s] = len(kept)
            kept.append(s)

        # sequence numbers: every key with an op in an iteration region is renumbered in program order
        touched = {self._seq_key(ev[i]) for i in in_block if type(ev[i]) is Comm}
        first: dict[tuple, int] = {}
        seen: dict[tuple, list[int]] = defaultdict(list)
        for e in ev:
            if type(e) is Comm:
                key = self._seq_key(e)
                if key in touched:
                    seen[key].append(e.seq)
        for key, seqs in seen.items():
            if seqs != list(range(seqs[0], seqs[0] + len(seqs))):
                peer = f" with rank {key[2]}" if len(key) > 1 else ""
                raise ScheduleError(f"{self._where()}: ops on group {key[0]}{peer} "
                                    f"have sequence numbers {seqs[:6]}... that are not contiguous: copies cannot be "
                                    "numbered")
            first[key] = seqs[0]
        taken: dict[tuple, int] = defaultdict(int)
        out: list[Event] = []
        for n, s in enumerate(kept):
            if isinstance(s, _CallWait):
                new = tuple(sorted(pos[x] for x in s.refs))
                if any(x >= n for x in new):
                    raise ScheduleError(f"{self._where()}: a wait on its events {[x for x, _ in s.refs]} would precede "
                                        "them in the target's order")
                out.append(Wait(new))
                continue
            i, inst = s
            e = ev[i]
            if type(e) is Comm:
                key = self._seq_key(e)
                if key in first:
                    seq = first[key] + taken[key]
                    taken[key] += 1
                    if seq != e.seq:
                        e = e.but(seq=seq)
            elif type(e) is Mark and inst is not None and isinstance(e.attrs.get("microbatch"), int):
                target = self._microbatch(inst)
                if target is not None and e.attrs["microbatch"] != target:
                    e = Mark(e.name, e.phase, {**e.attrs, "microbatch": target})
            out.append(e)
        return out

    @staticmethod
    def _seq_key(e: Comm) -> tuple:
        return (e.group, e.kind, e.peer) if e.is_p2p else (e.group,)

    @staticmethod
    def _microbatch(inst: object) -> int | None:
        """The target micro-batch of an instance (a unit's or a p2p op's key) whose markers say one."""
        return inst[1]  # type: ignore[index]

    def _steps(self) -> list[Step]:
        """The stage's units and p2p calls at M, with Megatron's waits on them: 1F1B's, each call waited at its
        end, on the streams the stage has."""
        m = self.mb.target
        return [s if s[0] in UNIT_KINDS else (s[0], tuple(op for op in s[1] if op[0] in self.streams))
                for s in one_f_one_b_steps(min(self.warmup, m), m)]

    def _unit_source(self, step: Step) -> tuple:
        """The captured unit that target unit ``step`` replays."""
        return step[0], self.mb.source(step[1])

    def _op_source(self, op: tuple[str, int]) -> tuple[str, int]:
        """The captured p2p op that target op ``op`` replays."""
        return op[0], self.mb.source(op[1])

    def _region(self, b: _Block) -> list[Slot | _CallWait]:
        """The iteration at M: the stage's units and p2p calls at M (_steps), from the captured ones."""
        ev = self.ev
        out: list[Slot | _CallWait] = []
        for step in self._steps():
            if step[0] in UNIT_KINDS:
                lead, body = b.units[self._unit_source(step)]
                out.extend((x, step) for x in lead)
                out.extend((x, step) for x in body)
            elif step[0] == "call":
                for op in step[1]:
                    lead, i = b.ops[self._op_source(op)]
                    out.extend((x, op) for x in lead)
                    out.append((i, op))
            else:
                refs = [(b.ops[self._op_source(op)][1], op) for op in step[1]]
                out.append(_CallWait([r for r in refs if ev[r[0]].async_op]))
        return out


def interleaved_alignment(stages: int, stage: int, mb: MicrobatchFold) -> tuple[list[Step], dict, dict]:
    """(stage ``stage``'s interleaved steps at ``mb.target``, the captured unit each target unit replays,
    the captured p2p op each target op replays): units ("F" | "B", virtual microbatch), ops (stream,
    index), keyed as replay.stage_schedule.interleaved_steps keys them.

    The target's steps up to the forward of pair k0 (trace.microbatches.interleaved_cut) are the
    capture's; then come x = (M - m_c) / group copies of the capture's steps from the forward of pair
    k0 - U to that of k0 (U = chunks·group); then the capture's steps from the forward of pair k0 on.
    Each copy must have the period's steps kind for kind (units of the same chunk, calls on the same
    streams, waits on as many ops of the same streams): a ScheduleError otherwise."""
    from ..trace.microbatches import interleaved_cut

    w, v, g, m, m_c = mb.warmup[stage], mb.chunks, mb.group, mb.target, mb.captured
    where = f"stage {stage} of the interleaved PP{stages} x {v} chunks (groups of {g})"
    k0 = interleaved_cut(w, v, g, m_c)
    if k0 is None or (m - m_c) % g:
        raise ScheduleError(f"{where}: {m_c} captured micro-batches have no steady group to stand for the other "
                            f"{m - m_c} (it needs target {m} less a multiple of {g}, and more steady pairs)")
    args = (stages, stage, v, g)
    steps_t = interleaved_steps(*args, m, w, mb.overlap_p2p, mb.wait_sends)
    steps_c = interleaved_steps(*args, m_c, w, mb.overlap_p2p, mb.wait_sends)
    table_t, table_c = schedule_table(m, v, g), schedule_table(m_c, v, g)
    w, u, x = min(w, m_c * v), v * g, (m - m_c) // g

    def at(steps: list[Step], vid: int) -> int:
        return steps.index(("F", vid))

    cut_c, period_c = at(steps_c, w + k0), at(steps_c, w + k0 - u)
    pieces = [(steps_t[:cut_c], steps_c[:cut_c])]
    for j in range(x):
        pieces.append((steps_t[at(steps_t, w + k0 + j * u):at(steps_t, w + k0 + (j + 1) * u)],
                       steps_c[period_c:cut_c]))
    pieces.append((steps_t[at(steps_t, w + k0 + x * u):], steps_c[cut_c:]))
    units: dict[Step, Step] = {}
    ops: dict[tuple[str, int], tuple[str, int]] = {}
    for piece, (mine, theirs) in enumerate(pieces):
        if len(mine) != len(theirs):
            raise ScheduleError(f"{where}: piece {piece} of its program at M = {m} has {len(mine)} steps, the "
                                f"capture's at {m_c} {len(theirs)}: the schedule does not repeat by group")
        for a, b in zip(mine, theirs, strict=True):
            same = a[0] == b[0]
            if same and a[0] in UNIT_KINDS:
                same = table_t[a[1]][1] == table_c[b[1]][1]
                units[a] = b
            elif same:
                same = [s for s, _ in a[1]] == [s for s, _ in b[1]]
                if a[0] == "call":
                    ops.update(zip(a[1], b[1], strict=True))
            if not same:
                raise ScheduleError(f"{where}: step {a} of its program at M = {m} stands where the capture's at "
                                    f"{m_c} has {b}: the schedule does not repeat by group")
    return steps_t, units, ops


class _Interleaved(_Expander):
    """The expansion of a stage of Megatron's interleaved schedule (see interleaved_alignment)."""

    def __init__(self, events: Sequence[Event], groups: dict[int, Group], rank: int, mb: MicrobatchFold,
                 source: str) -> None:
        super().__init__(events, groups, rank, mb, source)
        ranks = list(groups[self.pp_group].ranks) if self.pp_group is not None else [rank]
        self.prev, self.next = ranks[(self.stage - 1) % self.pp], ranks[(self.stage + 1) % self.pp]
        self.table_c = schedule_table(mb.captured, mb.chunks, mb.group)
        self.table_t = schedule_table(mb.target, mb.chunks, mb.group)
        self.vid = {("F", *x): k for k, x in enumerate(self.table_c)}
        self.vid.update({("B", mbn, mb.chunks - 1 - c): k for k, (mbn, c) in enumerate(self.table_c)})
        self.steps_c = interleaved_steps(self.pp, self.stage, mb.chunks, mb.group, mb.captured, self.warmup,
                                         mb.overlap_p2p, mb.wait_sends)
        self.steps_t, self.unit_src, self.op_src = interleaved_alignment(self.pp, self.stage, mb)
        #: the captured iteration's units and p2p ops in the order interleaved_steps gives them
        self.want = [(s[0], s[1]) if s[0] in UNIT_KINDS else op for s in self.steps_c if s[0] != "wait"
                     for op in ((s,) if s[0] in UNIT_KINDS else s[1])]

    def _where(self, microbatch: int | None = None) -> str:
        stage = getattr(self, "stage", None)  # not yet known while the rank's place is found
        return f"{super()._where(microbatch)} ({'' if stage is None else f'stage {stage}, '}interleaved)"

    def stream(self, i: int) -> str | None:
        """Any pipeline p2p op; which stream it is follows from its place in the captured program."""
        ev = self.ev[i]
        return "p2p" if type(ev) is Comm and ev.is_p2p else None

    def _is(self, k: int, kind: str, peer: int) -> bool:
        e = self.ev[k]
        return type(e) is Comm and e.is_p2p and e.kind == kind and e.peer == peer

    def _receives_prev(self, k: int) -> bool:
        return self._is(k, "recv", self.prev)

    def _sends_prev(self, k: int) -> bool:
        return self._is(k, "send", self.prev)

    def _unit_key(self, b: _Block, walk: UnitWalk, i: int) -> tuple:
        e, m_c, chunks = self.ev[i], self.mb.captured, self.mb.chunks
        mbn, chunk = e.attrs.get("microbatch"), e.attrs.get("chunk") or 0
        got = self.vid.get(("F" if e.name == "forward" else "B", mbn, chunk))
        if got is None:
            raise ScheduleError(f"{self._where(mbn)} event {i}: {e.name} unit of chunk {chunk!r}, iteration "
                                f"{b.iteration!r}, is not a unit of a captured micro-batch 0..{m_c - 1} in "
                                f"chunks 0..{chunks - 1}")
        return "F" if e.name == "forward" else "B", got

    def _admit(self, b: _Block, walk: UnitWalk, key: tuple, i: int) -> None:
        """The unit is the next step of the captured interleaved_steps."""
        e, want, n = self.ev[i], self.want, walk.steps
        mbn, chunk = e.attrs.get("microbatch"), e.attrs.get("chunk") or 0
        if n >= len(want) or want[n] != key:
            expect = want[n] if n < len(want) else "the iteration's end"
            raise ScheduleError(f"{self._where(mbn)}, iteration {b.iteration!r}: its {e.name} unit of chunk "
                                f"{chunk} stands where Megatron's interleaved schedule at {self.mb.captured} "
                                f"micro-batches (warm-up {self.warmup}) has {expect}")

    def _op_key(self, b: _Block, walk: UnitWalk, i: int, stream: str) -> tuple[str, int]:
        """The next step of the captured interleaved_steps, which must be an op of this kind and peer."""
        e, want, n = self.ev[i], self.want, walk.steps
        op = want[n] if n < len(want) else None
        if op is None or op[0] in UNIT_KINDS or not self._is(
                i, "recv" if op[0] in (RECV_PREV, RECV_NEXT) else "send",
                self.prev if op[0] in (RECV_PREV, SEND_PREV) else self.next):
            raise ScheduleError(f"{self._where()} event {i} ({e.kind} with rank {e.peer}), iteration "
                                f"{b.iteration!r}: stands where Megatron's interleaved schedule at {self.mb.captured} "
                                f"micro-batches (warm-up {self.warmup}) has {op or 'the iteration end'}")
        return op

    def _check_block(self, b: _Block, walk: UnitWalk) -> None:
        n, want = walk.steps, self.want
        if n != len(want):
            raise ScheduleError(f"{self._where()}, iteration {b.iteration!r}: {n} units and p2p ops where Megatron's "
                                f"interleaved schedule at {self.mb.captured} micro-batches has {len(want)}; next: "
                                f"{want[n]}")

    def _unit_class(self, key: tuple) -> tuple:
        return (key[0], self.table_c[key[1]][1])

    def _microbatch(self, inst: object) -> int | None:
        kind, k = inst  # type: ignore[misc]
        return self.table_t[k][0] if kind in UNIT_KINDS else None

    def _steps(self) -> list[Step]:
        return self.steps_t

    def _unit_source(self, step: Step) -> tuple:
        return self.unit_src[step]

    def _op_source(self, op: tuple[str, int]) -> tuple[str, int]:
        return self.op_src[op]
