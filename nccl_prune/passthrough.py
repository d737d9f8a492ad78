"""Point-to-point with a virtual neighbour: virtual pipeline stages pass messages through unchanged.

A folded pipeline keeps its first and last stages live and folds middle stages of one class onto the
lowest of them, so a live stage may have a virtual neighbour. That neighbour's layers are stood in
for by the identity: what it would send on is what reached it. ``PASSTHROUGH_RULE`` says it in full;
``route_recv`` and ``route_send`` apply it to one p2p op in group positions (O(run of virtual
members) per call: a caller caches per (group, position, peer)).
"""

from __future__ import annotations

from dataclasses import dataclass

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
live rank on the ring) and a p2p with a virtual peer that is not a neighbour are refused."""


@dataclass(frozen=True)
class Route:
    """Where the messages of one pass-through stream go, in group positions.

    ``stream`` = (U, w): live U's sends to its virtual neighbour w, in issue order. ``consumer``: the
    live position that receives them (from its own virtual neighbour on the same side), None when no
    live rank will (the walk came back to U). ``step``: +1 forward (towards higher positions), -1 backward.
    """

    stream: tuple[int, int]
    consumer: int | None
    step: int

    @property
    def direction(self) -> str:
        return "forward" if self.step == 1 else "backward"


def route_recv(plan: GroupPlan, dst: int, src: int) -> Route:
    """Live position ``dst`` receives from virtual position ``src``: the stream that answers it."""
    step = _step(plan, src, dst, "receives from")
    u = _walk(plan, src, -step)
    if u == dst:
        raise PruneError(f"rank {plan.ranks[dst]} receives from virtual rank {plan.ranks[src]} on group "
                         f"{_show(plan.ranks)}, and the only live rank upstream is rank {plan.ranks[dst]} itself: "
                         f"its stand-in would be its own later send (one live rank on the ring; rule: "
                         f"{RULE_IN_SHORT}): not folded")
    return Route((u, (u + step) % plan.size), dst, step)


def route_send(plan: GroupPlan, src: int, dst: int) -> Route:
    """Live position ``src`` sends to virtual position ``dst``: its stream and who consumes it."""
    step = _step(plan, src, dst, "sends to")
    consumer = _walk(plan, dst, step)
    return Route((src, dst), None if consumer == src else consumer, step)


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

