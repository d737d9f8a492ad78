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

Under Megatron's interleaved schedule (``forward_backward_pipelining_with_interleaving``, plan
schedule "interleaved") a stage runs T = M·chunks *virtual microbatches*: forwards in the order of
Megatron's schedule table (:func:`schedule_table`), backwards in the same order with the chunk
reversed, ``min(warmup[p], T)`` warm-up forwards then forward/backward pairs then cool-down backwards
(:func:`interleaved_steps`: the units, p2p calls and waits of any stage, with p2p batched or
overlapped with compute as the plan says). On a middle stage every unit has its p2p op in each
direction, so the k-th op of each stream goes with the k-th virtual microbatch, and the same
rebuilding applies with units keyed by virtual microbatch (their (microbatch, chunk) from the
table). With overlapped p2p the waits on the moved ops are the schedule's own (a receive waited
before the unit that needs it, a send when the next one of its direction is posted), in place of
the representative's, whose positions belong to its own order.

Data-parallel collectives issued within the schedule (``--overlap-grad-reduce --overlap-param-gather``
with the distributed optimizer) go with units as :func:`walk_units` attaches them (the micro-batch fold's
too): one inside a unit is copied with it (a 1F1B chunk's param gathers from the forward pre-hook in its
first forward, the pre-hook's waits); one directly following a unit (only compute and markers between) is
that unit's, as is one directly preceding a unit (only compute, markers and such collectives before its
begin marker). Under the interleaved schedule their place depends on the stage: with Megatron-LM's aligned
grad sync (``backward_step_helper_postprocess``) chunk c's grad sync follows backward last(c) + p on stage p,
and with its aligned param gather (``forward_step_helper_preprocess``, ``param_sync_func``) chunk c + 1's
gather precedes forward first(c) - p, so stage p's program moves them by p - q virtual microbatches from
q's places (the microbatch group >= PP keeps each within the schedule; the chunks a stage syncs after the
schedule are the same on every middle stage: chunk 0's). Non-interleaved 1F1B issues none between units
(its grad sync follows the cool-down): one there, one on the wrong kind of unit, or one the move would
take outside the schedule is a ScheduleError when the stage's program is rebuilt.

Iterations without backward units (forward-only: evaluation) run the same program on every stage and
are kept. The representative's own order is checked against the schedule for its stage first, so a
trace whose program is not the one the plan names is an error, never a silent reorder.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .graph import Comm, Event, GraphError, Mark, Wait

if TYPE_CHECKING:
    from ..trace.fold import Fold

#: The marker names of scheduling units (patches.schedules): a span per forward / backward of a microbatch.
UNITS = ("forward", "backward")
#: The kinds of unit in an order of units: a forward or a backward.
UNIT_KINDS = ("F", "B")
#: The four pipeline p2p streams of a stage: receive from the previous / next stage, send to either.
RECV_PREV, SEND_NEXT, RECV_NEXT, SEND_PREV = "recv_prev", "send_next", "recv_next", "send_prev"


class ScheduleError(GraphError):
    """A folded stage's own program cannot be rebuilt from its representative's trace."""


def unit_end(events: Sequence[Event], i: int, where: str) -> int:
    """The index of the marker that ends the unit ``events[i]`` begins (units of one name may nest)."""
    name, depth = events[i].name, 0
    for j in range(i, len(events)):
        ev = events[j]
        if type(ev) is Mark and ev.name == name:
            depth += 1 if ev.phase == "B" else -1 if ev.phase == "E" else 0
            if depth == 0:
                return j
    raise ScheduleError(f"{where} event {i}: the {name} unit never ends")


def unit_spans(events: Sequence[Event], where: str, combined: str) -> list[tuple[object, bool, int, int]]:
    """(iteration, eval, first index, last index) of every scheduling unit of a rank's events, in order.
    A combined ``forward_backward`` unit (Megatron's combined 1F1B) is a ScheduleError ending in ``combined``
    (what the caller cannot do with it)."""
    spans = []
    i = 0
    while i < len(events):
        e = events[i]
        if type(e) is Mark and e.phase == "B" and (e.name in UNITS or e.name == "forward_backward"):
            if e.name == "forward_backward":
                raise ScheduleError(f"{where} event {i}: a combined forward_backward unit (Megatron's combined "
                                    f"1F1B); {combined}")
            j = unit_end(events, i, where)
            spans.append((e.attrs.get("iteration"), bool(e.attrs.get("eval")), i, j))
            i = j + 1
            continue
        i += 1
    return spans


def schedule_table(microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """Megatron's interleaved schedule table (``get_schedule_table`` in
    ``megatron.core.pipeline_parallel.schedules``): per virtual microbatch, its (microbatch, chunk).
    Microbatches go in groups of ``group`` (``microbatch_group_size_per_vp_stage``), each group through
    every chunk in turn; the last group takes the remaining microbatches."""
    out: list[tuple[int, int]] = []
    for low in range(0, microbatches, group):
        high = microbatches if low + group >= microbatches else low + group
        out += [(mb, c) for c in range(chunks) for mb in range(low, high)]
    return out


#: One step of a stage's interleaved program: ("F" | "B", virtual microbatch) for a unit; ("call", ops)
#: for a p2p call, ``ops`` its (stream, index) in the order Megatron posts them, index counting that
#: stream's ops from 0; ("wait", ops) where Megatron waits on ops it posted.
Step = tuple


def interleaved_steps(stages: int, stage: int, chunks: int, group: int, microbatches: int,
                      warmup: int, overlap: bool = False, wait_sends: bool = False) -> list[Step]:
    """Stage ``stage``'s units, p2p calls and waits in one training iteration of Megatron's interleaved
    schedule (``forward_backward_pipelining_with_interleaving``; ``warmup`` its
    ``get_pp_rank_microbatches`` count before the cap at T = M·chunks).

    Without p2p overlap (``overlap_p2p_comm`` off) every call is waited at once: ``recv_forward``, per
    warm-up forward ``send_forward_recv_forward`` (the last one
    ``send_forward_backward_recv_forward_backward`` when steady pairs follow), per steady pair
    ``send_forward_backward_recv_forward_backward``, per cool-down backward
    ``send_backward_recv_backward``. With ``overlap`` (Megatron-LM's default under VPP; the warm-up
    flush variant is not modelled) the warm-up's calls are still waited at once, the last followed by a
    ``send_backward_recv_backward`` that only posts the first output-gradient receive; each steady pair
    posts ``send_forward_recv_forward`` after its forward and ``send_backward_recv_backward`` after its
    backward, each then waiting the previous send in its direction; a unit first waits the oldest
    pending receive of its direction (except the first stage's chunk-0 forward and the last stage's
    last-chunk backward, which receive nothing); the cool-down waits the pending receive before each
    backward but its own calls at once, and the last input-gradient send is waited at the end.

    Which ops a call posts follows Megatron's ``recv_tensor_from_previous_stage`` and its
    first/last-stage rules (no send of the last chunk's output on the last stage, nor of the first
    chunk's input gradient on the first); in what order: without overlap Megatron-LM batches p2p
    (``batch_p2p_comm``, ``_batched_p2p_ops``: send/receive to the previous stage, then the next), with
    overlap it does not (``_p2p_ops``: even pipeline ranks post send-next, receive-previous,
    send-previous, receive-next; odd ones receive-previous, send-next, receive-next, send-previous)."""
    pp, t = stages, microbatches * chunks
    if chunks < 2 or group < pp or group > microbatches or 0 < microbatches % group < pp:
        raise ScheduleError(f"interleaved schedule over PP{pp} with {chunks} chunks, {microbatches} microbatches and "
                            f"microbatch group {group}: Megatron's interleaved schedule refuses it (group in [PP, M], "
                            "remainder of M by the group 0 or >= PP)")
    table = schedule_table(microbatches, chunks, group)
    w = min(warmup, t)
    first, last = stage == 0, stage == pp - 1
    count: dict[str, int] = defaultdict(int)
    out: list[Step] = []
    if not overlap:  # batch_p2p_comm (Megatron-LM: not overlap_p2p_comm): _batched_p2p_ops' order
        posting = (SEND_PREV, RECV_PREV, SEND_NEXT, RECV_NEXT)
    elif stage % 2 == 0:  # _p2p_ops: even pipeline ranks send first, odd ones receive first
        posting = (SEND_NEXT, RECV_PREV, SEND_PREV, RECV_NEXT)
    else:
        posting = (RECV_PREV, SEND_NEXT, RECV_NEXT, SEND_PREV)

    def chunk(vid: int, forward: bool) -> int:
        c = table[vid % t][1]
        return c if forward else chunks - 1 - c

    def receives(vid: int, forward: bool) -> bool:  # Megatron's recv_tensor_from_previous_stage
        if not (first if forward else last):
            return True
        if vid < pp - 1:
            return False
        return chunk(vid - (pp - 1), forward) != (chunks - 1 if forward else 0)

    def sends_next(vid: int) -> bool:
        return not (last and chunk(vid, True) == chunks - 1)

    def sends_prev(vid: int) -> bool:
        return not (first and chunk(vid, False) == 0)

    def call(send_prev: bool, recv_prev: bool, send_next: bool, recv_next: bool, wait: bool = True) -> dict:
        ops = {}
        wanted = {SEND_PREV: send_prev, RECV_PREV: recv_prev, SEND_NEXT: send_next, RECV_NEXT: recv_next}
        for name in posting:
            on = wanted[name]
            if on:
                ops[name] = (name, count[name])
                count[name] += 1
        if ops:
            out.append(("call", tuple(ops.values())))
            if wait:
                out.append(("wait", tuple(ops.values())))
        return ops

    pending: dict[str, list] = {RECV_PREV: [], RECV_NEXT: []}
    sending: dict[str, tuple | None] = {SEND_NEXT: None, SEND_PREV: None}

    def unit(kind: str, vid: int) -> None:
        stream = RECV_PREV if kind == "F" else RECV_NEXT
        edge = (first and chunk(vid, True) == 0) if kind == "F" else (last and chunk(vid, False) == chunks - 1)
        if overlap and not edge and pending[stream]:
            out.append(("wait", (pending[stream].pop(0),)))
        out.append((kind, vid))

    def posted(ops: dict, send: str, recv: str) -> None:  # an overlapped call: wait the previous send
        if sending[send] is not None:
            out.append(("wait", (sending[send],)))
        sending[send] = ops.get(send)
        if recv in ops:
            pending[recv].append(ops[recv])
        if wait_sends and send == SEND_NEXT and sending[send] is not None:
            out.append(("wait", (sending[send],)))
            sending[send] = None

    call(False, not first, False, False)  # recv_forward
    for k in range(w):
        unit("F", k)
        recv_prev = receives(k, True) and k != t - 1
        if k == w - 1 and w < t and overlap:
            call(False, recv_prev, sends_next(k), False)
            posted(call(False, False, False, not last, wait=False), SEND_PREV, RECV_NEXT)
        elif k == w - 1 and w < t:  # send_forward_backward_recv_forward_backward
            call(False, recv_prev, sends_next(k), not last)
        else:  # send_forward_recv_forward
            call(False, recv_prev, sends_next(k), False)
    for k in range(t - w):
        recv_prev = receives(w + k, True) and k != t - w - 1
        if overlap:
            unit("F", w + k)
            posted(call(False, recv_prev, sends_next(w + k), False, wait=False), SEND_NEXT, RECV_PREV)
            unit("B", k)
            posted(call(sends_prev(k), False, False, receives(k, False), wait=False), SEND_PREV, RECV_NEXT)
            continue
        unit("F", w + k)
        unit("B", k)
        call(sends_prev(k), recv_prev, sends_next(w + k), receives(k, False))
    if w == t:
        call(False, False, False, not last)  # recv_backward
    for k in range(t - w, t):  # cool-down: send_backward_recv_backward
        if k == 0:  # Megatron waits no pending receive before the first backward of the cool-down
            out.append(("B", k))
        else:
            unit("B", k)
        call(sends_prev(k), False, False, receives(k, False) and k != t - 1)
    if overlap and sending[SEND_PREV] is not None:
        out.append(("wait", (sending[SEND_PREV],)))
    return out


def one_f_one_b(warmup: int, microbatches: int) -> list[tuple[str, int]]:
    """The order of units of a non-interleaved 1F1B stage with ``warmup`` warm-up forwards (already
    capped at ``microbatches``, as Megatron's schedule caps it): ("F" | "B", microbatch)."""
    return [s for s in one_f_one_b_steps(warmup, microbatches) if s[0] in UNIT_KINDS]


def one_f_one_b_steps(warmup: int, microbatches: int) -> list[Step]:
    """:func:`one_f_one_b`'s units with the p2p calls Megatron's non-interleaved schedule makes between
    them, as :data:`Step` s (ops indexed by microbatch): ``recv_forward``, ``send_forward``,
    ``send_forward_recv_backward``, ``send_backward_recv_forward``, ``recv_backward``, ``send_backward``,
    each waited at its end. Every stream is named; a first or last stage posts only its own."""
    w, m = warmup, microbatches
    out: list[Step] = []

    def call(*ops: tuple[str, int]) -> None:
        out.extend((("call", ops), ("wait", ops)))

    for i in range(w):  # warm-up
        call((RECV_PREV, i))
        out.append(("F", i))
        call((SEND_NEXT, i))
    if m > w:
        call((RECV_PREV, w))
    for i in range(m - w):  # steady 1F1B
        out.append(("F", w + i))
        call((SEND_NEXT, w + i), (RECV_NEXT, i))  # send_forward_recv_backward
        out.append(("B", i))
        if i == m - w - 1:
            call((SEND_PREV, i))  # send_backward
        else:
            call((SEND_PREV, i), (RECV_PREV, w + i + 1))  # send_backward_recv_forward
    for i in range(m - w, m):  # cool-down
        call((RECV_NEXT, i))
        out.append(("B", i))
        call((SEND_PREV, i))
    return out


def passable(events: Sequence[Event], k: int, waits: bool = True) -> bool:
    """Whether event ``k`` may lie between a unit and the ops that go with it: computation or a marker
    other than a unit's or an iteration's, or (``waits``) a wait."""
    e = events[k]
    return (type(e) is not Comm and (waits or type(e) is not Wait)
            and not (type(e) is Mark and e.name in (*UNITS, "iteration")))


def precedes_unit(events: Sequence[Event], i: int) -> bool:
    """Whether only computation, markers and other data-parallel collectives lie between collective ``i``
    and a unit's begin marker (Megatron dispatches a chunk's param all-gather right before a forward)."""
    j = i + 1
    while j < len(events) and (passable(events, j, waits=False)
                               or (type(events[j]) is Comm and not events[j].is_p2p)):
        j += 1
    return j < len(events) and type(events[j]) is Mark and events[j].phase == "B" and events[j].name in UNITS


def iterations(events: Sequence[Event], spans: Sequence[tuple[object, bool, int, int]]
               ) -> list[tuple[list[tuple[object, bool, int, int]], bool]]:
    """:func:`unit_spans` grouped into iterations (consecutive units of one iteration and eval flag), each
    with whether it trains (not evaluation, with backward units)."""
    out = []
    run: list[tuple[object, bool, int, int]] = []
    for s in [*spans, None]:
        if run and (s is None or (s[0], s[1]) != (run[0][0], run[0][1])):
            out.append((run, not run[0][1] and any(events[a].name == "backward" for _, _, a, _ in run)))
            run = []
        if s is not None:
            run.append(s)
    return out


def iteration_region(events: Sequence[Event], run: Sequence[tuple[object, bool, int, int]],
                     receives_prev: Callable[[int], bool], sends_prev: Callable[[int], bool],
                     trailing_dp: bool) -> tuple[int, int]:
    """[start, end) of the events an iteration's units ``run`` (of :func:`iterations`) rebuild: its units,
    widened back to the first forward's input receive and on to the last backward's input-gradient send
    (``receives_prev`` / ``sends_prev``: whether an event is such an op), across only computation, markers
    and waits. ``trailing_dp``: the end first moves past the data-parallel collectives that directly follow
    the last unit (only computation and markers between), which then go with it: the micro-batch fold keeps
    them with that unit, which it replays once (on any stage: a first stage sends nothing after it).
    :func:`restage` does not: it rebuilds middle stages, whose last backward is followed by its
    input-gradient send, and a collective before that send leaves the send out of the region, which its
    count of p2p ops refuses; collectives after the send stay after the stage's schedule."""
    start, end = run[0][2], run[-1][3] + 1
    while trailing_dp:
        j = end
        while j < len(events) and passable(events, j, waits=False):
            j += 1
        if not (j < len(events) and type(events[j]) is Comm and not events[j].is_p2p):
            break
        end = j + 1
    k = start - 1  # the first forward's input receive precedes it
    while k >= 0 and (passable(events, k) or receives_prev(k)):
        if receives_prev(k):
            start = k
        k -= 1
    k = end  # the last backward's input-gradient send follows it
    while k < len(events) and (passable(events, k) or sends_prev(k)):
        if sends_prev(k):
            end = k + 1
        k += 1
    return start, end


@dataclass
class UnitWalk:
    """An iteration's scheduling units and pipeline p2p ops as :func:`walk_units` cuts them (indices into
    the rank's events; units and ops keyed as the caller keys them)."""

    order: list = field(default_factory=list)  # the units' keys in the trace's order
    #: unit -> (lead, body): the computation and markers since the previous unit or op, and its span
    units: dict = field(default_factory=dict)
    ops: dict = field(default_factory=dict)  # op -> (lead, its index)
    #: data-parallel collectives (with the events between) directly preceding a unit after its lead (a param
    #: gather), directly following it (a grad sync), by unit
    before: dict = field(default_factory=dict)
    after: dict = field(default_factory=dict)
    counts: dict = field(default_factory=lambda: defaultdict(int))  # p2p ops by stream
    steps: int = 0  # units and ops so far


def walk_units(events: Sequence[Event], start: int, end: int, *, stream: Callable[[int], str | None],
               unit_key: Callable[[UnitWalk, int], object], where: Callable[[object], str],
               stray: Callable[[int], str], admit: Callable[[UnitWalk, object, int], None] | None = None,
               op_key: Callable[[UnitWalk, int, str], object] | None = None) -> UnitWalk:
    """Cut ``events[start:end]`` (an :func:`iteration_region`) into units, pipeline p2p ops and the
    data-parallel collectives at unit boundaries (replay.microbatch_fold and :func:`restage` alike).

    ``stream(i)``: op ``i``'s p2p stream, None for what is not a pipeline p2p op. ``unit_key(walk, i)``:
    the key of the unit that event ``i`` begins (a ScheduleError for one that does not fit), checked to hold no
    p2p op (``where(microbatch)`` names the rank in the error), then ``admit(walk, key, i)`` (which may
    refuse it). ``op_key(walk, i, stream)``: an op's key, by default (stream, its index in the stream).
    A collective that neither directly follows a unit (only computation and markers between) nor directly
    precedes one (:func:`precedes_unit`) is a ScheduleError saying ``stray(i)``."""
    walk = UnitWalk()
    lead: list[int] = []
    last = None  # the unit that nothing but compute and markers follow yet
    i = start
    while i < end:
        e = events[i]
        if type(e) is Mark and e.phase == "B" and e.name in UNITS:
            j = unit_end(events, i, where(None))
            key = unit_key(walk, i)
            for x in range(i, j + 1):
                if stream(x) is not None:
                    raise ScheduleError(f"{where(e.attrs.get('microbatch'))} event {x}: a pipeline p2p op inside a "
                                        f"{e.name} unit")
            if admit is not None:
                admit(walk, key, i)
            dp = next((x for x, y in enumerate(lead) if type(events[y]) is Comm), len(lead))
            if dp < len(lead):  # data-parallel collectives directly preceding the unit
                walk.before[key] = lead[dp:]
            walk.units[key] = (lead[:dp], range(i, j + 1))
            walk.order.append(key)
            walk.steps += 1
            lead, last = [], key
            i = j + 1
            continue
        s = stream(i)
        if s is not None:
            walk.ops[op_key(walk, i, s) if op_key is not None else (s, walk.counts[s])] = (lead, i)
            walk.counts[s] += 1
            walk.steps += 1
            lead, last = [], None
        elif type(e) is Comm:
            if last is not None and not any(type(events[x]) is Wait for x in lead):
                walk.after.setdefault(last, []).extend([*lead, i])  # Megatron's grad sync after a backward
                lead = []
            elif precedes_unit(events, i):  # a param all-gather the next unit's schedule step dispatches
                lead.append(i)
            else:
                raise ScheduleError(stray(i))
        else:
            lead.append(i)
        i += 1
    return walk


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
    microbatches: int = 0  # M (units are keyed by virtual microbatch: M·chunks of them)
    #: data-parallel collectives (with the compute and markers before them) directly following a unit (grad
    #: sync) / directly preceding one (param gather), by unit
    after: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    before: dict[tuple[str, int], list[int]] = field(default_factory=dict)


class _Restager:
    def __init__(self, events: Sequence[Event], fold: Fold, rep: int, group_members: dict[int, Sequence[int]],
                 source: str) -> None:
        self.ev, self.fold, self.rep, self.source = events, fold, rep, source
        self.group_members = group_members
        self._other_stages: dict[int, list[int]] = {}  # group -> the stages of its members but this one's
        self.pp_axis = fold.axes.index("pp")
        self.stages = fold.sizes[self.pp_axis]
        self.stage = fold.coords[rep][self.pp_axis]
        self.interleaved = fold.schedule == "interleaved"
        self.explicit_waits = self.interleaved and fold.overlap_p2p  # waits placed by the schedule, not the trace

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
    def blocks(self) -> list[_Block]:
        """The iterations to rebuild: consecutive training units of one iteration."""
        ev = self.ev
        spans = unit_spans(ev, self._where(), "a folded stage's order of such units is not rebuilt")
        if not spans:
            raise ScheduleError(f"{self._where()}: its trace has no scheduling units (forward/backward markers, "
                                "which Megatron's schedules emit); a folded pipeline stage's own order of units "
                                "cannot be rebuilt without them, so this program's middle pipeline stages cannot be "
                                "folded (fold at replica depth, or capture every stage)")
        return [self._block(run) for run, trains in iterations(ev, spans) if trains]

    def _block(self, run: list[tuple]) -> _Block:
        ev = self.ev
        start, end = iteration_region(ev, run, lambda k: self.stream(k) == RECV_PREV,
                                      lambda k: self.stream(k) == SEND_PREV, trailing_dp=False)
        block = _Block(run[0][0], start, end)
        chunks = self.fold.chunks if self.interleaved else 1

        def unit_key(walk: UnitWalk, i: int) -> tuple[str, int, int]:  # (F | B, microbatch, chunk)
            e = ev[i]
            mb, chunk = e.attrs.get("microbatch"), e.attrs.get("chunk") or 0
            key = ("F" if e.name == "forward" else "B", mb, chunk)
            if not isinstance(mb, int) or not isinstance(chunk, int) or not 0 <= chunk < chunks or key in walk.units:
                what = f"an interleaved unit (each microbatch once per chunk 0..{chunks - 1})" \
                    if self.interleaved else "a non-interleaved 1F1B unit (each microbatch once, chunk 0)"
                raise ScheduleError(f"{self._where()} event {i}: {e.name} unit of microbatch {mb!r}, chunk "
                                    f"{chunk!r}, iteration {block.iteration!r}: not {what}")
            return key

        def stray(i: int) -> str:
            return (f"{self._where()} event {i} ({ev[i].kind} on group {ev[i].group}) lies between scheduling units "
                    f"of iteration {block.iteration!r}, is not a pipeline p2p op and neither directly follows nor "
                    "directly precedes a unit: it has no place in another stage's order of units")

        walk = walk_units(ev, start, end, stream=self.stream, unit_key=unit_key, where=lambda _: self._where(),
                          stray=stray)
        raw, counts = walk.order, walk.counts  # the units' (F | B, microbatch, chunk) in the trace's order
        block.ops = walk.ops
        n = sum(1 for kind, _, _ in raw if kind == "F")
        m = n // chunks
        table = schedule_table(m, chunks, self.fold.group) if self.interleaved and m else [(x, 0) for x in range(m)]
        vid = {("F", mb, c): k for k, (mb, c) in enumerate(table)}
        vid.update({("B", mb, chunks - 1 - c): k for k, (mb, c) in enumerate(table)})
        if n % chunks or sorted(raw) != sorted(vid):
            what = f"one forward and one backward of microbatches 0..M-1 in each of {chunks} chunks" \
                if self.interleaved else "one forward and one backward of microbatches 0..M-1"
            raise ScheduleError(f"{self._where()}, iteration {block.iteration!r}: its units {raw[:8]}... "
                                f"are not {what}")
        for key in raw:
            block.units[(key[0], vid[key])] = walk.units[key]
            block.order.append((key[0], vid[key]))
            if key in walk.after:
                block.after[(key[0], vid[key])] = walk.after[key]
            if key in walk.before:
                block.before[(key[0], vid[key])] = walk.before[key]
        block.microbatches = m
        for s in (RECV_PREV, SEND_NEXT, RECV_NEXT, SEND_PREV):
            if counts[s] != n:
                raise ScheduleError(f"{self._where()}, iteration {block.iteration!r}: {counts[s]} {s} p2p op(s) for "
                                    f"{n} {'virtual microbatches' if self.interleaved else 'microbatches'}; a middle "
                                    f"{'interleaved' if self.interleaved else '1F1B'} stage has one per "
                                    f"{'virtual microbatch' if self.interleaved else 'microbatch'}")
        want = one_f_one_b(min(self.fold.warmup[self.stage], n), n)
        if block.order != want:
            at = next(i for i, (a, b) in enumerate(zip(block.order, want, strict=True)) if a != b)
            name = "interleaved" if self.interleaved else "1F1B"
            raise ScheduleError(f"{self._where()}, iteration {block.iteration!r}: its units run in an order that is "
                                f"not the plan's {name} schedule for its stage "
                                f"(warm-up {self.fold.warmup[self.stage]}): "
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
                elif self.explicit_waits:
                    continue  # the schedule's own waits (interleaved_steps) stand for the trace's
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
                    e = e.but(seq=seq)
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
        others = self._other_stages.get(e.group)
        if others is None:  # per group, not per op: a thousand-rank job's rewrite checks millions of ops
            members = self.group_members[e.group]
            others = self._other_stages[e.group] = sorted({self.fold.coords[x][self.pp_axis] for x in members}
                                                          - {self.stage})
        if e.is_p2p or others:
            raise ScheduleError(f"{self._where()} event {i} ({e.kind} on group {e.group}) moves in stage {stage}'s "
                                f"order of units, but the group has members on other stages {others[:8]} "
                                "whose order does not change: the op cannot be renumbered")

    def _dp_shift(self, b: _Block, stage: int) -> tuple[dict, dict]:
        """Stage ``stage``'s data-parallel collectives of block ``b``: by the unit they directly precede, and by
        the unit they directly follow there (see the module docstring)."""
        d, t = stage - self.stage, len(b.order) // 2
        before = {(kind, k - d): ops for (kind, k), ops in b.before.items()}
        after = {(kind, k + d): ops for (kind, k), ops in b.after.items()}
        if not d or not (before or after):
            return before, after
        odd = [("before", key, ops) for key, ops in b.before.items() if key[0] != "F" or not self.interleaved]
        odd += [("after", key, ops) for key, ops in b.after.items() if key[0] != "B" or not self.interleaved]
        if odd:
            where, key, ops = odd[0]
            x = next(x for x in ops if type(self.ev[x]) is Comm)
            what = "none between its units (its grad sync follows the cool-down)" if not self.interleaved else \
                "a param gather before a forward, a grad sync after a backward, and no other"
            raise ScheduleError(f"{self._where()}, iteration {b.iteration!r}: event {x} ({self.ev[x].kind} on group "
                                f"{self.ev[x].group}) lies directly {where} unit {key}, where Megatron's "
                                f"{'interleaved' if self.interleaved else 'non-interleaved 1F1B'} schedule issues "
                                f"{what}: it has no place in stage {stage}'s order of units")
        out = [k for _, k in (*before, *after) if not 0 <= k < t]
        if out:  # Megatron's microbatch group >= PP keeps every shifted sync within the schedule
            raise ScheduleError(f"{self._where()}, iteration {b.iteration!r}: on stage {stage} a param gather or "
                                f"grad sync of its units would go with virtual microbatch {out[0]}, outside the "
                                f"schedule's 0..{t - 1}")
        return before, after

    def _region(self, b: _Block, stage: int, prompt: set[int], call_of: dict[int, _WaitOn]) -> list[int | _WaitOn]:
        """Stage ``stage``'s calls and units of block ``b`` (see the module docstring)."""
        ev = self.ev
        before, after = self._dp_shift(b, stage)
        if self.interleaved:
            if stage in (0, self.stages - 1):
                raise ScheduleError(f"{self._where()}: pipeline stage {stage} is a first or last stage, whose "
                                    "interleaved p2p calls differ from a middle stage's; it cannot be folded")
            steps = interleaved_steps(self.stages, stage, self.fold.chunks, self.fold.group, b.microbatches,
                                      self.fold.warmup[stage], self.fold.overlap_p2p, self.fold.wait_sends)
        else:
            m = sum(1 for kind, _ in b.order if kind == "F")
            steps = one_f_one_b_steps(min(self.fold.warmup[stage], m), m)
        out: list[int | _WaitOn] = []
        for step in steps:
            if step[0] in UNIT_KINDS:
                lead, body = b.units[step]
                out.extend(lead)
                out.extend(before.get(step, ()))
                out.extend(body)
                out.extend(after.get(step, ()))
            elif step[0] == "call":
                wait = _WaitOn([])
                for key in step[1]:
                    lead, i = b.ops[key]
                    out.extend(lead)
                    out.append(i)
                    call_of[i] = wait
                    if ev[i].async_op and (self.explicit_waits or i in prompt):
                        wait.refs.append(i)
                if not self.explicit_waits:
                    out.append(wait)  # waited at the call's end, as the trace waited it
            elif self.explicit_waits:  # Megatron's own wait on ops posted earlier
                out.append(_WaitOn([b.ops[key][1] for key in step[1] if ev[b.ops[key][1]].async_op]))
        return out


def restage(events: Sequence[Event], fold: Fold, rep: int, stage: int, group_members: dict[int, Sequence[int]],
            source: str = "<graph>") -> list[Event]:
    """The events of pipeline stage ``stage`` folded onto rank ``rep`` (another stage of its class), in the
    representative's frame (peers and groups not yet translated): see the module docstring.
    ``group_members``: group id -> member ranks. ScheduleError where the program cannot be rebuilt."""
    if fold.schedule not in ("1f1b", "interleaved") or (fold.schedule == "interleaved" and fold.chunks < 2):
        what = {"": "names no pipeline schedule (a plan written before plans recorded it)",
                "interleaved": "names Megatron's interleaved schedule without its chunks and microbatch group (a "
                               "plan written before plans recorded them)"}
        raise ScheduleError(f"{source}: rank {rep}'s virtual pipeline stage {stage} runs its own order of units, but "
                            f"the fold plan {what.get(fold.schedule, f'names schedule {fold.schedule!r}')}: "
                            "fold at replica depth (or re-plan and recapture)")
    r = _Restager(events, fold, rep, group_members, source)
    blocks = r.blocks()
    m = [sum(1 for kind, _ in b.order if kind == "F") for b in blocks]  # virtual microbatches
    # unbatched p2p (interleaved with overlap) posts a call's ops in an order that depends on the stage's parity
    parity = not (r.interleaved and fold.overlap_p2p) or stage % 2 == r.stage % 2
    shifted = r.interleaved and any(b.before or b.after for b in blocks)  # DP ops placed by the stage
    if parity and not shifted and all(min(fold.warmup[stage], n) == min(fold.warmup[r.stage], n) for n in m):
        return list(events)  # the same order of units and calls: the representative's program as it ran
    return r.program(stage, blocks)
