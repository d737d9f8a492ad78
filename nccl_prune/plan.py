"""Who in a group is live, and whose input each virtual member stands in with.

A target job of W ranks runs only its live ranks (the sandbox); every rank r has a representative
``rep[r]`` (``rep[l] == l`` for a live l). A virtual member of a group does what its representative
does, so its contribution to a collective is its representative's — *mirrored* — which needs the
representative to be a member of the same group. A group with no live member never exists at run time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property


class PruneError(ValueError):
    """A group, op or p2p that the fold cannot answer faithfully (the message names the ranks)."""


@dataclass(frozen=True)
class GroupPlan:
    """The fold of one group, in group positions (index into ``ranks``).

    ``mirror[p]`` is the position whose input member p contributes (p itself when live);
    ``multiplicity[p]`` is how many members contribute live member p's input (itself included; 0 at a
    virtual position); ``shift[p] = ranks[p] - rep[ranks[p]]`` (0 when live).
    ``untranslate(v, y)``, where the fold translates by coordinates: the rank that virtual rank v's
    representative plays where v plays y (``coords[y] - (coords[v] - coords[rep[v]])``, mod the grid's
    sizes); None: translate by ``shift`` (see ``counterpart``).
    """

    ranks: tuple[int, ...]
    live_positions: tuple[int, ...]
    mirror: tuple[int, ...]
    multiplicity: tuple[int, ...]
    shift: tuple[int, ...]
    position: dict[int, int] = field(repr=False, compare=False)
    _live_index: dict[int, int] = field(repr=False, compare=False, default_factory=dict)
    untranslate: Callable[[int, int], int] | None = field(repr=False, compare=False, default=None)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @cached_property
    def virtual_positions(self) -> tuple[int, ...]:
        return tuple(p for p, m in enumerate(self.mirror) if m != p)

    @cached_property
    def members_of(self) -> dict[int, tuple[int, ...]]:
        """For each live position, the positions that contribute its input (itself first, then the
        virtual members mirroring it, in position order)."""
        out: dict[int, list[int]] = {p: [p] for p in self.live_positions}
        for q in self.virtual_positions:
            out[self.mirror[q]].append(q)
        return {p: tuple(v) for p, v in out.items()}

    @property
    def num_virtual(self) -> int:
        return len(self.ranks) - len(self.live_positions)

    def is_live(self, pos: int) -> bool:
        return self.mirror[pos] == pos

    def live_index(self, pos: int) -> int:
        """Rank of live position ``pos`` in a process group of the live members (in position order)."""
        try:
            return self._live_index[pos]
        except KeyError:
            raise PruneError(f"group position {pos} (rank {self.ranks[pos]}) of group {_show(self.ranks)} "
                             f"is virtual") from None

    def counterpart(self, live_pos: int, src_pos: int) -> int:
        """Position whose piece of ``mirror[src_pos]``'s input live member ``live_pos`` receives from
        ``src_pos`` in a personalised exchange (all_to_all, scatter lists): see contributions.A2A_RULE."""
        if self.mirror[src_pos] == src_pos:
            return live_pos
        if self.untranslate is not None:
            there = self.position.get(self.untranslate(self.ranks[src_pos], self.ranks[live_pos]))
        else:
            there = self.position.get(self.ranks[live_pos] - self.shift[src_pos])
        return live_pos if there is None else there


def plan_group(group_ranks: Sequence[int], rep: Sequence[int],
               untranslate: Callable[[int, int], int] | None = None) -> GroupPlan | None:
    """Fold one group: None when no member is live (the group is never materialised).
    ``untranslate``: the fold's translation by coordinates (``GroupPlan.untranslate``), or None.

    O(len(group_ranks)): ``rep`` is only indexed. Raises PruneError for a virtual member whose
    representative is not in the group (or is not itself live) while the group has live members, and
    for a rank out of range or listed twice.
    """
    ranks = tuple(int(r) for r in group_ranks)
    if not ranks:
        raise PruneError("an empty group")
    position: dict[int, int] = {}
    for p, r in enumerate(ranks):
        if not 0 <= r < len(rep):
            raise PruneError(f"rank {r} of group {_show(ranks)} is outside the world of {len(rep)} ranks")
        if r in position:
            raise PruneError(f"rank {r} is listed twice in group {_show(ranks)}")
        position[r] = p
    live = tuple(p for p, r in enumerate(ranks) if rep[r] == r)
    if not live:
        return None
    mirror = list(range(len(ranks)))
    multiplicity = [0] * len(ranks)
    shift = [0] * len(ranks)
    for p, r in enumerate(ranks):
        rr = int(rep[r])
        m = position.get(rr)
        if m is None or rep[rr] != rr:
            why = "is not a member of the group" if m is None else "is not live (its own rep is " f"{rep[rr]})"
            raise PruneError(f"virtual rank {r} of group {_show(ranks)} mirrors rank {rr}, which {why}: "
                             f"its contribution cannot be mirrored (the group has live members "
                             f"{[ranks[q] for q in live][:8]})")
        mirror[p] = m
        multiplicity[m] += 1
        shift[p] = r - rr
    return GroupPlan(ranks=ranks, live_positions=live, mirror=tuple(mirror), multiplicity=tuple(multiplicity),
                     shift=tuple(shift), position=position,
                     _live_index={p: i for i, p in enumerate(live)}, untranslate=untranslate)


def _show(ranks: Sequence[int]) -> str:
    if len(ranks) > 8:
        return f"[{', '.join(map(str, ranks[:4]))}, ..., {', '.join(map(str, ranks[-2:]))}] ({len(ranks)} ranks)"
    return str(list(ranks))
