"""Point-to-point with a virtual neighbour: virtual pipeline stages pass messages through unchanged.

A folded pipeline keeps its first and last stages live and folds middle stages of one class onto the
lowest of them, so a live stage may have a virtual neighbour. That neighbour's layers are stood in
for by the identity: what it would send on is what reached it. ``PASSTHROUGH_RULE`` says it in full;
``route_recv`` and ``route_send`` apply it to one p2p op in group positions (O(run of virtual
members) per call: a caller caches per (group, position, peer)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nccl_prune.plan import GroupPlan, PruneError, _show

RULE_IN_SHORT = "virtual pipeline stages between two live stages pass messages through unchanged"
PASSTHROUGH_RULE = """\
Virtual pipeline stages between two live stages pass messages through unchanged (an identity stand-in
for the layers they hold). A live rank L receiving from a virtual neighbour V (adjacent in the p2p
group's rank order: V just before L is the forward direction, just after L backward; the order wraps
around, a ring, as interleaved pipelines use it) gets the n-th message that the nearest live rank U
upstream of V (walking from V against the flow) sent to its virtual neighbour on the same side, where
n counts L's receives from V. A send from a live rank to a virtual neighbour completes at once; its
data are kept only when a live rank downstream will consume them, until it does. The stand-in must
have the dtype and shape L posted. A receive whose stand-in would be L's own later send (L is the only
live rank on the ring) and a p2p with a virtual peer that is not a neighbour are refused, except in a
serial capture, where STANDIN_RULE answers the former."""
STANDIN_SEED = 20260  # the stand-ins' generator seed: the same values in every run, on every machine
STANDIN_RULE = f"""\
In a serial capture (one live rank at a time) a live rank L's receive from a virtual pipeline
neighbour whose walk upstream comes back to L (no other live rank on the ring in this capture) gets a
stand-in: a tensor of the dtype and shape L posted, its direction standard normal values from a generator
seeded with {STANDIN_SEED} (the same direction for every receive of that dtype and shape), its L2 norm, in
this order of preference:
(1) *recorded*: the norm of the message a capture together would deliver there, the n-th message that the
nearest live rank of the fold upstream (walking from the virtual neighbour against the flow, as
PASSTHROUGH_RULE does together) sent on that side, n counting L's receives from that neighbour, as an
earlier capture recorded it (every capture records the norm of each floating-point message it sends to a
virtual neighbour, and whether it sent it after a stand-in of that direction had to fall back below (1)
or (2): such a recording is *derived*, its scale possibly the fallback's);
(2) *own scale*: the norm of L's own first message of that direction and size in this capture, when not
derived (a residual stream's activations and gradients change little in scale from stage to stage, so a
stage's neighbour sends what the stage itself sends, in size);
(3) a derived recording; (4) the *unit fallback*: L2 norm 1 for a gradient, standard normal values for
an activation.
The direction of a receive is its op label's (a backward receive), else its position. Captures run first
stage first, so forward receives find (1); the gradients entering an earlier stage, and the wrap-around of
an interleaved pipeline, are sent by later captures: a capture that fell back to (3) or (4) is captured again
(SECOND_PASS_RULE). The norm is what steers the program downstream (LayerNorm divides by the activation's
scale; a stage's weight gradients, hence the grad norm and gradient clipping, are linear in the gradient it
receives): a stand-in of another scale puts the grad norm off by the ratio of the scales, and a unit is far
from a real activation's size or from the gradient of a mean loss over many tokens and micro-batches. Values
are never zeros, and are not the neighbour's (their direction is not). Sends from L to a virtual neighbour
complete at once and are dropped (no live rank downstream consumes them in that capture) once their norm is
recorded. A p2p with a live rank of the fold captured in another capture that is not L's neighbour in the
group's order (Megatron's overlapped p2p sends one direction of a two-stage pipeline over the world group, by
global rank; together it is a p2p between live ranks) is answered the same way: its receive gets a stand-in,
its direction the op label's (without a label that names one: refused), its send is dropped. An integer
tensor (a shape exchange: values that steer the program) gets no stand-in: refused."""
SECOND_PASS_RULE = """\
A serial capture that gave a stand-in a derived recording's norm or the unit fallback (STANDIN_RULE (3), (4)),
or answered a small reduction's member of another class by self mirror for want of a recording
(RECORDED_REDUCTION_RULE), is captured again after the first pass, latest first, with every recording made so
far (the second pass's own included), and the captures merged are the latest of each live rank. A pipeline
without wrap-around then has every stand-in recorded: the last stage's forward receives were recorded by the
first pass, each earlier stage's backward receives by the stage after it, captured again before it. In an
interleaved pipeline the last capture of the first pass takes its wrap-around gradients at its own scale. A
capture whose latest take still found no usable recording for a reduction (the classes it lacked were taken
again after it) is taken once more after that, first stage first, where another capture was taken after it: at
most 3k-2 captures for k live ranks. The norms and the reductions steer values (the grad norm, gradient
clipping, losses); shapes, the op sequence, time and memory follow them only through MoE routing (tokens per
expert follow activation values). So the launcher's option (--prism-fold-second-pass) takes the second pass
always (on), never (off), or only for a fold with MoE layers (auto, the default; also where the plan does not
say), and a capture that needed one and was not taken again is named as such in the launcher's output, the
merged trace and the report. Under auto the pass also stops at the first capture whose take again routed every
token as its take before did (each all-to-all's split sizes equal, in order): the norms a take adds scale the
gradients that carry them, and Adam's update is blind to a gradient's scale, so where they flipped no routing
decision the takes left would change only the values logged."""


@dataclass(frozen=True)
class Route:
    """Where the messages of one pass-through stream go, in group positions.

    ``stream`` = (U, w): live U's sends to its virtual neighbour w, in issue order. ``consumer``: the
    live position that receives them (from its own virtual neighbour on the same side), None when no
    live rank will (the walk came back to U). ``step``: +1 forward (towards higher positions), -1 backward.
    """

    stream: tuple[int, int]
    consumer: int | None
    step: int  # 0: a stand-in from a peer that is not a neighbour in the group's order (its label gives the direction)
    standin: bool = False  # answered by STANDIN_RULE (serial capture: no other live rank upstream)

    @property
    def direction(self) -> str:
        return "forward" if self.step == 1 else "backward"


def route_recv(plan: GroupPlan, dst: int, src: int, standin: bool = False, elsewhere: bool = False) -> Route:
    """Live position ``dst`` receives from virtual position ``src``: the stream that answers it
    (``standin``: a serial capture, where a walk back to ``dst`` itself is answered by STANDIN_RULE;
    ``elsewhere``: ``src`` is a live rank of the fold captured in another capture, a p2p between live ranks
    when captured together: answered by a stand-in whatever its position in the group's order, with step 0
    where it is not ``dst``'s neighbour: no direction by position, the op's label must give it)."""
    if standin and elsewhere and plan.live_positions == (dst,) and not _adjacent(plan, src, dst):
        return Route((dst, src), dst, 0, standin=True)
    step = _step(plan, src, dst, "receives from")
    u = _walk(plan, src, -step)
    if u == dst and standin:
        return Route((u, (u + step) % plan.size), dst, step, standin=True)
    if u == dst:
        raise PruneError(f"rank {plan.ranks[dst]} receives from virtual rank {plan.ranks[src]} on group "
                         f"{_show(plan.ranks)}, and the only live rank upstream is rank {plan.ranks[dst]} itself: "
                         f"its stand-in would be its own later send (one live rank on the ring; rule: "
                         f"{RULE_IN_SHORT}): not folded")
    return Route((u, (u + step) % plan.size), dst, step)


def route_send(plan: GroupPlan, src: int, dst: int, standin: bool = False, elsewhere: bool = False) -> Route:
    """Live position ``src`` sends to virtual position ``dst``: its stream and who consumes it (``standin`` and
    ``elsewhere``: a serial capture's send to a live rank of the fold captured in another capture, which no one
    consumes here, whatever its position in the group's order)."""
    if standin and elsewhere and plan.live_positions == (src,) and not _adjacent(plan, src, dst):
        return Route((src, dst), None, 0)
    step = _step(plan, src, dst, "sends to")
    consumer = _walk(plan, dst, step)
    return Route((src, dst), None if consumer == src else consumer, step)


def _adjacent(plan: GroupPlan, a: int, b: int) -> bool:
    """Whether positions ``a`` and ``b`` are neighbours in the group's (cyclic) order."""
    return (a - b) % plan.size in (1, plan.size - 1)


def _step(plan: GroupPlan, sender: int, receiver: int, verb: str) -> int:
    """+1 when ``receiver`` follows ``sender`` in the group's order (cyclically), -1 when it precedes it."""
    n = plan.size
    live, virtual = (sender, receiver) if plan.is_live(sender) else (receiver, sender)
    if plan.is_live(virtual) or not plan.is_live(live):
        raise PruneError(f"internal: pass-through between group positions {sender} and {receiver} needs one "
                         f"live and one virtual member")
    if (receiver - sender) % n == 1:
        return 1
    if (sender - receiver) % n == 1:
        return -1
    me, other = (sender, receiver) if verb == "sends to" else (receiver, sender)
    raise PruneError(f"rank {plan.ranks[me]} {verb} virtual rank {plan.ranks[other]} on group {_show(plan.ranks)}, "
                     f"which is not its neighbour in the group's order (positions {me} and {other} of "
                     f"{n}): only a neighbour's messages pass through; p2p with a virtual peer elsewhere "
                     f"is not folded")


def _walk(plan: GroupPlan, start: int, step: int) -> int:
    """The first live position from ``start`` (virtual) going ``step`` at a time, cyclically."""
    n = plan.size
    pos = start
    for _ in range(n):
        pos = (pos + step) % n
        if plan.is_live(pos):
            return pos
    raise AssertionError("a folded group has a live member")



def standin_values(dtype: torch.dtype, numel: int, backward: bool = False, norm: float | None = None) -> torch.Tensor:
    """STANDIN_RULE's values: ``numel`` seeded standard normal values of ``dtype`` (flat, host) scaled to the
    L2 norm ``norm`` (the recorded norm), or without one the unit fallback: L2 norm 1 for a ``backward``
    (gradient) receive, as drawn for an activation; PruneError for an integer or boolean dtype (values that
    steer the program get no stand-in) or a negative norm. An infinite or NaN recorded norm (the sender's
    message held inf/NaN) gives inf/NaN values, as the message would: inf/NaN checks downstream see them."""
    if not (dtype.is_floating_point or dtype.is_complex):
        raise PruneError(f"a stand-in for a {dtype} receive (rule: {STANDIN_RULE.splitlines()[0]} ...): integer "
                         "values steer the program (a shape exchange), so a serial capture does not invent them; "
                         "capture this fold together (--prism-fold-capture together)")
    if norm is not None and norm < 0:
        raise PruneError(f"a stand-in's recorded norm is {norm!r}: an L2 norm is >= 0 (STANDIN_RULE)")
    g = torch.Generator().manual_seed(STANDIN_SEED)
    work = torch.float64 if dtype.itemsize >= 8 else torch.float32
    values = torch.randn(numel, generator=g, dtype=work)
    if numel and (norm is not None or backward):
        values *= (1.0 if norm is None else norm) / values.norm()
    return values.to(dtype)


def recorded_stream(ranks: list[int] | tuple[int, ...], sandbox: frozenset[int], receiver: int, sender: int,
                    step: int) -> tuple[int, int]:
    """STANDIN_RULE's recording that answers group position ``receiver``'s receive from ``sender``: the
    (sender, to) global ranks of the stream a capture together delivers from. ``step``: +1 forward, -1
    backward along the group's order, 0 for a peer that is not a neighbour (a p2p between two live ranks
    together: its own stream). Walks from ``sender`` against the flow to the first member in ``sandbox``
    (the fold's live ranks), cyclically; PruneError when none is (no capture records that stream)."""
    n = len(ranks)
    if step == 0:
        return ranks[sender], ranks[receiver]
    pos = sender
    for _ in range(n):
        if ranks[pos] in sandbox:
            return ranks[pos], ranks[(pos + step) % n]
        pos = (pos - step) % n
    raise PruneError(f"no live rank of the fold {sorted(sandbox)[:8]} is on the ring {_show(list(ranks))}: no "
                     "capture records what reaches its members (STANDIN_RULE)")
