"""The coordinator's side of a folded job: which ranks are live, each group's fold, and the count of
virtual contributions the trace records.

Only live ranks are processes. When a live rank registers a group, the group is folded once
(``nccl_prune.plan_group``: O(group size)); a group without virtual members keeps the runtime's own
path and numerics, a folded one completes when its live members have posted an op and is answered by
``nccl_prune.host`` (``ops.OpKind.run``); a p2p with a virtual neighbour is passed through
(runtime.passthrough). Knows ranks, not Megatron: the fold arrives as the plan's JSON (``trace.fold``
reads the same).

One capture of a serial run (``capture.part`` in the plan: one live rank L, every other rank's rep L)
answers a virtual member whose class has its live rank elsewhere by self mirror, and a receive with no
other live rank upstream by a stand-in; the counts say which (``nccl_prune.SELF_MIRROR_RULE``,
``nccl_prune.STANDIN_RULE``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from nccl_prune import Contributions, PruneError, plan_group
from nccl_prune.contributions import virtual_contributions
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
        part = (plan.get("capture") or {}).get("part")
        # a serial capture: every rank's class representative in the fold captured together (the plan's own
        # rep is the capture's one live rank for every rank)
        self.class_rep: list[int] | None = [int(x) for x in part["class_rep"]] if part else None
        self.passthrough = PassThrough(self.contributions, standin=part is not None)
        self._self_mirror: dict[int, frozenset[int]] = {}  # group id -> positions answered by self mirror
        self._planned: set[int] = set()  # group ids folded already
        # per (group, kind, root, in place): the counts one op adds (an op's count is O(group), once)
        self._per_op: dict[tuple, dict[str, int]] = {}

    def fold_group(self, g: Group) -> str | None:
        """Fold ``g`` at its first registration: None, or why it cannot be folded (a live rank made it,
        so it has live members; a virtual member whose representative is outside it cannot be mirrored)."""
        if g.id in self._planned:
            return None
        self._planned.add(g.id)
        try:
            p = plan_group(g.ranks, self.rep)
        except PruneError as e:
            return f"process group {g.name!r}: {e}"
        if p is None:  # cannot happen for a group a live rank registered: the rank is a member
            return f"process group {g.name!r} (ranks {g.ranks[:8]}) has no live member but was registered"
        g.fold = p if p.num_virtual else None  # no virtual member: exactly the unfolded path
        if self.class_rep is not None and g.fold is not None:
            self._self_mirror[g.id] = frozenset(q for q in p.virtual_positions
                                                if self.class_rep[p.ranks[q]] != p.ranks[p.mirror[q]])
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
            c = self._per_op[key] = virtual_contributions(kind, g.fold, root=root, in_place=in_place,
                                                          self_mirror=self._self_mirror.get(g.id, ()))
        self.contributions.add_counts(kind, c)

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``job.fold``: the plan plus the contributions counted so far."""
        return {**self.plan_json, "contributions": self.contributions.to_json()}
