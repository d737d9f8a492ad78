"""The coordinator's side of a folded job: which ranks are live, each group's fold, and the count of
virtual contributions the trace records.

Only live ranks are processes. When a live rank registers a group, the group is folded once
(``nccl_prune.plan_group``: O(group size)); a group without virtual members keeps the runtime's own
path and numerics, a folded one completes when its live members have posted an op and is answered by
``nccl_prune.host`` (``ops.OpKind.run``); a p2p with a virtual neighbour is passed through
(runtime.passthrough). Knows ranks, not Megatron: the fold arrives as the plan's JSON (``trace.fold``
reads the same).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from nccl_prune import Contributions, PruneError, plan_group
from nccl_prune.contributions import HOWS, virtual_contributions
from prism_megatron.runtime.dataplane import DataPlane
from prism_megatron.runtime.groups import Group
from prism_megatron.runtime.matching import Member
from prism_megatron.runtime.passthrough import PassThrough


class Folding:
    """A folded job's live ranks and representatives, with the groups' folds and contribution counts."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan_json = plan
        self.rep: list[int] = [int(x) for x in plan["rep"]]
        self.live: list[int] = [int(x) for x in plan["live"]]
        self.contributions = Contributions()
        self.passthrough = PassThrough(self.contributions)
        self._planned: set[int] = set()  # group ids folded already
        # per (group, kind, root, in place): the counts one op adds (an op's count is O(group), once)
        self._per_op: dict[tuple, dict[str, int]] = {}
        self.untranslate = _untranslate(plan)


    def fold_group(self, g: Group) -> str | None:
        """Fold ``g`` at its first registration: None, or why it cannot be folded (a live rank made it,
        so it has live members; a virtual member whose representative is outside it cannot be mirrored)."""
        if g.id in self._planned:
            return None
        self._planned.add(g.id)
        try:
            p = plan_group(g.ranks, self.rep, self.untranslate)
        except PruneError as e:
            return f"process group {g.name!r}: {e}"
        if p is None:  # cannot happen for a group a live rank registered: the rank is a member
            return f"process group {g.name!r} (ranks {g.ranks[:8]}) has no live member but was registered"
        g.fold = p if p.num_virtual else None  # no virtual member: exactly the unfolded path
        return None

    def virtual_peer(self, g: Group, msg: dict) -> bool:
        """Whether a send or receive names a virtual group rank (answered by ``pass_through``)."""
        peer = msg.get("peer")
        return g.fold is not None and peer is not None and msg["kind"] in ("send", "recv") and not g.fold.is_live(peer)

    def pass_through(self, g: Group, m: Member, data: DataPlane, deliver: Callable[..., None]) -> str | None:
        """Answer live ``m``'s send to / receive from a virtual neighbour: None, or the fatal problem."""
        return self.passthrough.handle(g, m, data, deliver)

    def finish(self) -> None:
        """At the end of the job: say what pass-through streams still hold (a live receiver never took
        what its virtual neighbour would have sent on: in the full job that send stays unmatched)."""
        for line in self.passthrough.leftovers():
            print(f"prism coordinator: pass-through: {line}", file=sys.stderr, flush=True)

    def count(self, g: Group, kind: str, root: int | None, in_place: bool) -> None:
        """Add one op's virtual contributions (cached per group and op shape: O(1) per op after the first)."""
        key = (g.id, kind, root, in_place)
        c = self._per_op.get(key)
        if c is None:
            c = self._per_op[key] = virtual_contributions(kind, g.fold, root=root, in_place=in_place)
        row = self.contributions.counts.setdefault(kind, dict.fromkeys(HOWS, 0))
        for how, n in c.items():
            row[how] += n

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``job.fold``: the plan plus the contributions counted so far."""
        return {**self.plan_json, "contributions": self.contributions.to_json()}


def _untranslate(plan: dict[str, Any]) -> Callable[[int, int], int] | None:
    """A version-2 plan's translation by coordinates, inverted (``nccl_prune.GroupPlan.untranslate``):
    the rank that v's representative plays where v plays y; None for a plan without coordinates."""
    coords, sizes = plan.get("coords"), plan.get("sizes")
    if not coords or not sizes:
        return None
    rep = [int(x) for x in plan["rep"]]
    at = {tuple(c): r for r, c in enumerate(coords)}

    def untranslate(v: int, y: int) -> int:
        cv, cm, cy = coords[v], coords[rep[v]], coords[y]
        return at[tuple((a - (b - c)) % n for a, b, c, n in zip(cy, cv, cm, sizes, strict=True))]

    return untranslate
