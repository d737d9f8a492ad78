"""What a virtual member contributes to each op kind, defined once for both executors.

Four ways a virtual member takes part:
- *mirror*: it contributes its representative's input. A virtual rank runs its representative's
  program on the representative's data (that is what makes it foldable), so a data-parallel gradient
  reduction over a folded group returns what the full reduction of identical replicas returns, and
  every value the program branches on (loss scale, inf/NaN flags, grad norm, token counts) is a real
  value of the run, never a zero.
- *recorded*: it contributes a value recorded elsewhere (a calibration run, a prior full capture), for
  small inputs a program branches on where the mirror's value is not the one wanted. The caller
  supplies them per virtual position; they take the member's place verbatim. In a serial capture a small
  reduction over another class's members takes that class's recording (``RECORDED_REDUCTION_RULE``).
- *keep*: for an in-place all_gather (the input is the member's own chunk of the output, as the
  distributed optimizer's parameter all-gather does), a virtual member's chunk of a live member's
  output keeps what that buffer holds. The mirror's chunk would be its own shard: other parameters,
  of the right shape and the wrong meaning. The kept chunk is what the live member computed for that
  shard last (its initial or previously gathered values): the shard's parameters lag by the updates
  the virtual owner would have applied, the closest value the sandbox has.
- *passthrough*: a live rank's receive from a virtual pipeline neighbour gets what the nearest live
  rank upstream sent into the virtual stages (``passthrough.PASSTHROUGH_RULE``): virtual stages stand
  in as the identity. Counted once per answered receive.
- *self_mirror* (a serial capture: one live rank at a time, ``SELF_MIRROR_RULE``): a virtual member
  whose class has no live rank in this capture contributes what the capture's live member of the
  group contributes. Shapes are right by construction; values are a real value of the run, never zeros.
- *standin* (a serial capture): a receive from a virtual pipeline neighbour with no other live rank
  on the ring gets a seeded stand-in of the posted shape (``passthrough.STANDIN_RULE``). Counted once
  per answered receive.

Op kinds are the runtime's (the names its messages carry); see ``KINDS``. Personalised exchanges
(all_to_all, scatter lists) address pieces to group positions: ``A2A_RULE`` says which piece a live
member receives from a virtual one.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nccl_prune.plan import GroupPlan, PruneError, _show

if TYPE_CHECKING:
    import torch

MIRROR, RECORDED, KEEP, PASSTHROUGH = "mirror", "recorded", "keep", "passthrough"
SELF_MIRROR, STANDIN = "self_mirror", "standin"
#: every way a virtual member's contribution is made: the one list (the trace reader keeps an equal one)
HOWS = (MIRROR, RECORDED, KEEP, PASSTHROUGH, SELF_MIRROR, STANDIN)
#: the ways every count names; the serial capture's (self_mirror, standin) appear where they were made
COUNTED = HOWS[:4]

SELF_MIRROR_RULE = """\
In a serial capture only one live rank L runs; every other rank is virtual, the other live ranks of the
fold too. A virtual member whose own class's live rank is L mirrors L as in a fold captured together. A
virtual member whose class's live rank is another (not a process in this capture: e.g. the last stage in
the first stage's capture of the pipeline group, the embedding group or the model-parallel group) is
answered by self mirror: it contributes what L contributes to the same op. Shapes are right (a
collective's members post equal shapes); values are a real value of the run, never zeros: a grad-norm or
loss reduction over the pipeline group counts L's share once per member, an inf/NaN flag is L's own, a
broadcast from such a root sends L's buffer as it stands, unless the caller answers it with the root's
recorded bytes (a broadcast's root sends values its receivers branch on: prism records them in the
capture of the root's class and answers later captures from it, counted recorded). Members of L's own
class are never self mirrored: a MoE live rank's expert-parallel peers at class depth are of its class, so
its count exchange and token all-to-alls are answered by the translated mirror (A2A_RULE) as together.
Small reductions over members of another class are answered from that class's recording where an earlier
capture made one (RECORDED_REDUCTION_RULE)."""

#: the largest reduction (all its input tensors together, in bytes) a serial capture records for later captures
#: and answers from a recording (RECORDED_REDUCTION_RULE): what a program reads of a reduction over other classes
#: is a few elements (a grad norm, a count of zeros, a found-inf flag, a loss); 64 KiB is the size up to which a
#: payload rides inside the runtime's control message, so recording one costs no transfer the op does not make
RECORD_MAX_BYTES = 1 << 16
#: the reductions RECORDED_REDUCTION_RULE answers: every member's input enters the result a live member reads
RECORDED_KINDS = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_list"})

RECORDED_REDUCTION_RULE = f"""\
In a serial capture of live rank L, a reduction (all_reduce, coalesced too, reduce, reduce_scatter:
RECORDED_KINDS) of at most RECORD_MAX_BYTES ({RECORD_MAX_BYTES} bytes, all inputs together) over a group with
members of another class (answered by self mirror otherwise: SELF_MIRROR_RULE) takes from each such virtual
member what its class's live rank R contributed to the same op in R's own capture: the same group (name, member
ranks, incarnation) and the same sequence number within it, which every member of a group shares. Each capture
records its own inputs to such reductions, L's as the live rank of its class, marked *derived* where the capture
had given a stand-in without a recording before (STANDIN_RULE (3), (4): a first stage's gradients under a unit
fallback are off by the fallback's scale, so a grad norm built from them is further off than self mirror); a
later capture (or, taken again, an earlier one: SECOND_PASS_RULE) answers from a recording that is not derived,
counted *recorded*; members of L's own class keep their mirror. So a first stage's grad norm (Megatron sums
squared norms over the model-parallel group, TP x PP members) sums every stage's share as a capture together
does, once the stage's capture has run, instead of counting its own stage once per pipeline stage; num-zeros
counts and found-inf flags likewise. Where no capture recorded it, or only a derived recording exists (R is
captured later, or fell back, and the capture is not taken again), the member keeps self mirror and the op is
counted unrecorded. A recording whose tensors differ in number, dtype or size from L's inputs is refused: the
captures do not run the same program. Gathers keep self mirror: their result is each member's value side by
side, read for logging and consistency checks, and an object gather's sizes follow the values, so another
capture's recording need not fit this capture's shapes; all_to_all pieces are addressed by A2A_RULE within a
class; a broadcast's root has its own rule (recorded bytes). Larger reductions (gradients) keep self mirror: a
size check is all they cost."""

A2A_RULE = """\
A live member l receives from a virtual member v the piece that v's mirror m sends to l's counterpart:
the member x that v's translation carries onto l (v does what m does, translated into v's position).
With the fold's coordinates (``GroupPlan.untranslate``) x is l's coordinates less v's offset from m,
mod the grid's sizes, axis by axis (an expert-parallel group folded onto its ep = 0 rank maps onto
itself). Without coordinates x is the rank l - shift(v). When x is not in the group (the group spans
replicas and l's counterpart lies outside it), the counterpart is l itself: the piece m sends to l.
Translated mirror for MoE: a virtual expert rank at EP offset j sends the live expert rank at offset
0 the tokens its mirror routes to offset -j (mod EP; digit by digit where an EP position spans
several TP positions), so the live rank's experts receive, over all its peers, exactly the tokens
its own router sends out (as if every expert rank routed like it, translated); never zeros. The
count exchange that precedes it must say the same (peer j's per-expert counts are the live rank's,
blocks of local experts permuted by j's translation: the program's side, which knows what the
counts index): with none the splits disagree and the run stops; with another permutation the totals
agree and tokens are sorted to the wrong experts."""


@dataclass(frozen=True)
class OpKind:
    """One op kind: whose contributions reach live members (``reaches``) and the rule, said once.

    reaches: "all" (every member's input reaches every live member), "to_root" (reaches the root only),
    "from_root" (only the root sends), "none" (no data: barrier; p2p between live ranks only).
    """

    name: str
    reaches: str
    reducing: bool
    rule: str


KINDS: dict[str, OpKind] = {k.name: k for k in (
    OpKind("all_reduce", "all", True,
           "mirror; live result = multiplicity-weighted reduction of live inputs (coalesced: per tensor)"),
    OpKind("reduce", "to_root", True,
           "mirror; root's result as all_reduce; a virtual root: nothing reaches a live member"),
    OpKind("reduce_scatter", "all", True,
           "mirror; live member i gets chunk i of the multiplicity-weighted reduction"),
    OpKind("reduce_scatter_list", "all", True,
           "mirror; live member i gets the weighted reduction of the members' i-th inputs"),
    OpKind("all_gather", "all", False,
           "mirror (chunk of a virtual member = its mirror's input); keep when in place"),
    OpKind("all_gather_list", "all", False, "as all_gather, one output tensor per member"),
    OpKind("all_to_all", "all", False, "mirror, pieces addressed by A2A_RULE; uneven splits are the mirror's"),
    OpKind("all_to_all_list", "all", False, "as all_to_all, one tensor per peer"),
    OpKind("broadcast", "from_root", False,
           "a virtual root sends its mirror's data: the mirror's buffer as it stands at the op"),
    OpKind("scatter", "from_root", False,
           "a live root as usual; a virtual root only with recorded pieces (its mirror holds no list)"),
    OpKind("gather", "to_root", False, "mirror; a virtual root: nothing reaches a live member"),
    OpKind("barrier", "none", False, "live members only"),
    OpKind("send", "none", False, "to a live peer as usual; to a virtual neighbour: completes at once, its data "
           "kept until the live rank downstream receives them (PASSTHROUGH_RULE)"),
    OpKind("recv", "none", False, "from a live peer as usual; from a virtual neighbour: passthrough, the "
           "matching send of the nearest live rank upstream (PASSTHROUGH_RULE)"),
)}


def op_kind(kind: str) -> OpKind:
    try:
        return KINDS[kind]
    except KeyError:
        raise PruneError(f"op kind {kind!r} has no pruning rule (known: {', '.join(KINDS)})") from None


def how(plan: GroupPlan, pos: int, *, recorded: Collection[int] = (), keep: bool = False,
        self_mirror: Collection[int] = ()) -> str | None:
    """How member ``pos`` contributes: None when live, else mirror / recorded / keep / self_mirror
    (``self_mirror``: positions whose class has no live rank in a serial capture, SELF_MIRROR_RULE)."""
    if plan.mirror[pos] == pos:
        return None
    if pos in recorded:
        return RECORDED
    if keep:
        return KEEP
    return SELF_MIRROR if pos in self_mirror else MIRROR


def recordable(kind: str, nbytes: int) -> bool:
    """Whether op ``kind`` with ``nbytes`` of input (all tensors) falls under RECORDED_REDUCTION_RULE (O(1))."""
    return kind in RECORDED_KINDS and nbytes <= RECORD_MAX_BYTES


def other_classes(plan: GroupPlan, class_rep: Sequence[int]) -> dict[int, int]:
    """A serial capture's group: each virtual position whose class's live rank is not its mirror (answered by
    self mirror, SELF_MIRROR_RULE) -> that class's live rank (``class_rep``: every rank's, as captured
    together). Empty where every member is of the capture's class. O(group size), once per group."""
    return {q: int(class_rep[plan.ranks[q]]) for q in plan.virtual_positions
            if class_rep[plan.ranks[q]] != plan.ranks[plan.mirror[q]]}


def recorded_inputs(plan: GroupPlan, others: Mapping[int, int],
                    recordings: Mapping[int, Sequence[torch.Tensor]],
                    like: Sequence[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """RECORDED_REDUCTION_RULE: the inputs each other-class virtual position (``others``, from ``other_classes``)
    contributes — the recording of its class's live rank (``recordings[R]``) — for the positions whose class has
    one; the rest keep self mirror. ``like``: the live member's inputs, whose number, dtypes and sizes a recording
    must have (else PruneError naming the group, the rank and both)."""
    out: dict[int, list[torch.Tensor]] = {}
    want = [(t.dtype, t.numel()) for t in like]
    for q, r in others.items():
        rec = recordings.get(r)
        if rec is None:
            continue
        got = [(t.dtype, t.numel()) for t in rec]
        if got != want:
            raise PruneError(f"the reduction rank {r} contributed on group {_show(plan.ranks)}, as its capture "
                             f"recorded it, has tensors (dtype, elements) {got}; this capture's are {want}: the "
                             f"captures do not run the same program (RECORDED_REDUCTION_RULE)")
        out[q] = list(rec)
    return out


def virtual_contributions(kind: str, plan: GroupPlan, *, root: int | None = None, in_place: bool = False,
                          recorded: Collection[int] = (), self_mirror: Collection[int] = ()) -> dict[str, int]:
    """Virtual contributions one op makes that reach a live member, by how they are made."""
    k = op_kind(kind)
    counts = dict.fromkeys(COUNTED + ((SELF_MIRROR,) if self_mirror else ()), 0)
    keep = in_place and kind in ("all_gather", "all_gather_list")
    if k.reaches == "all" or (k.reaches == "to_root" and plan.is_live(_root(plan, root, kind))):
        for p in plan.virtual_positions:
            counts[how(plan, p, recorded=recorded, keep=keep, self_mirror=self_mirror)] += 1  # type: ignore[index]
    elif k.reaches == "from_root" and not plan.is_live(_root(plan, root, kind)):
        counts[how(plan, root, recorded=recorded, self_mirror=self_mirror)] += 1  # type: ignore[index, arg-type]
    return counts


def check_p2p(plan: GroupPlan, src: int, dst: int) -> None:
    """A send/recv between live ranks only (the executor over live members' communicators, which has no
    pass-through): a virtual peer has no process to pair with."""
    for p in (src, dst):
        if not plan.is_live(p):
            raise PruneError(f"p2p between rank {plan.ranks[src]} (sender) and rank {plan.ranks[dst]} "
                             f"(receiver): rank {plan.ranks[p]} is virtual (mirrors rank "
                             f"{plan.ranks[plan.mirror[p]]}); p2p with a virtual peer is not folded")


def _root(plan: GroupPlan, root: int | None, kind: str) -> int:
    if root is None or not 0 <= root < plan.size:
        raise PruneError(f"{kind} needs a root group position in [0, {plan.size}), got {root!r}")
    return root


class Contributions:
    """Running count of virtual contributions per op kind: the trace's ``"contributions"``.

    Each op adds one per virtual member whose contribution reaches a live member (one pass over the
    group's members: O(group size) per op, never O(world size))."""

    def __init__(self) -> None:
        self.counts: dict[str, dict[str, int]] = {}

    def add(self, kind: str, plan: GroupPlan, *, root: int | None = None, in_place: bool = False,
            recorded: Collection[int] = ()) -> None:
        self.add_counts(kind, virtual_contributions(kind, plan, root=root, in_place=in_place, recorded=recorded))

    def add_counts(self, kind: str, counts: Mapping[str, int]) -> None:
        """Add one op's counts (``virtual_contributions``) to ``kind``'s row."""
        row = self.counts.setdefault(kind, dict.fromkeys(COUNTED, 0))
        for h, n in counts.items():
            row[h] = row.get(h, 0) + n

    def add_passthrough(self, kind: str = "recv", n: int = 1, how: str = PASSTHROUGH) -> None:
        """Count ``n`` receives answered by the pass-through rule (``how``: passthrough, or standin)."""
        op_kind(kind)
        if how not in (PASSTHROUGH, STANDIN):
            raise ValueError(f"a receive from a virtual neighbour is answered by passthrough or standin, not {how!r}")
        self.add_counts(kind, {how: n})

    def to_json(self) -> dict[str, dict[str, int]]:
        return {k: dict(v) for k, v in sorted(self.counts.items())}

    @classmethod
    def from_json(cls, data: Mapping[str, Mapping[str, int]]) -> Contributions:
        c = cls()
        for k, row in data.items():
            op_kind(k)
            bad = set(row) - set(HOWS)
            if bad:
                raise ValueError(f"contributions[{k!r}]: unknown field(s) {sorted(bad)} (known: {HOWS})")
            c.counts[k] = {h: int(row.get(h, 0)) for h in HOWS if h in COUNTED or h in row}
        return c
