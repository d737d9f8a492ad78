"""Which process group a rank's group is: identity as torch has it.

torch names a group by a per-process counter (``new_group``) or by a hash of its ranks and of the
number of groups the process holds (``use_local_synchronization``, ``split_group``), and resets
the counter when the default group is destroyed. So one name may legally stand for different
groups: every rank making a group of itself alone (``new_group([rank])``), disjoint groups made
only by their members, groups made again in a later ``init_process_group`` after a full
``destroy_process_group()``. A group is what its members agree on:

* an *epoch* is a rank's count of default groups made so far (torch's counter restarts with each);
* within an epoch, the group a rank declares is (name, member ranks); the k-th time a rank
  declares the same one (a hashed name comes back when a group is destroyed and re-made) it
  means the k-th *incarnation* of it, which is what the other members' k-th declaration means;
* members disagree when, in one epoch and under one name, a rank declares a set of ranks while a
  member of that set declares another set, or the rank is a member of another declared set. A
  rank uses a name once per epoch (counter) or never for two sets (hash), so this never flags a
  program torch runs.
"""

from __future__ import annotations


class GroupMismatch(ValueError):
    """Members of a process group declared it with different ranks."""


class GroupTable:
    """Maps each rank's group handles to group ids; ids are dense, in order of first declaration."""

    def __init__(self) -> None:
        self._epoch: dict[int, int] = {}  # rank -> default groups it declared
        self._incarnations: dict[tuple, list[int]] = {}  # (epoch, name, ranks) -> group ids
        self._declared: dict[tuple, int] = {}  # (rank, epoch, name, ranks) -> times declared
        self._by_rank: dict[tuple[int, str], dict[int, tuple[int, ...]]] = {}  # (epoch, name) -> rank -> set
        self._containing: dict[tuple[int, str], dict[int, set[tuple[int, ...]]]] = {}  # ... member -> sets
        self._handles: dict[tuple[int, int], int] = {}  # (rank, rank's handle) -> group id
        self.n_groups = 0

    def declare(self, rank: int, handle: int, name: str, ranks: list[int], world: bool) -> tuple[int, bool]:
        """``rank`` made group ``name`` of ``ranks`` (``world``: the default group) and calls it ``handle``.

        Returns (group id, whether the id is new). Raises GroupMismatch when members disagree.
        """
        if world:
            self._epoch[rank] = self._epoch.get(rank, -1) + 1
        epoch = self._epoch.get(rank, 0)
        members = tuple(ranks)
        where = (epoch, name)
        self._check(rank, where, members)
        self._by_rank.setdefault(where, {})[rank] = members
        key = (epoch, name, members)
        k = self._declared.get((rank, *key), 0)
        self._declared[(rank, *key)] = k + 1
        ids = self._incarnations.setdefault(key, [])
        new = k == len(ids)
        if new:
            ids.append(self.n_groups)
            self.n_groups += 1
        self._handles[(rank, handle)] = ids[k]
        return ids[k], new

    def group_of(self, rank: int, handle: int) -> int:
        """The id of the group ``rank`` calls ``handle``."""
        return self._handles[(rank, handle)]

    def _check(self, rank: int, where: tuple[int, str], members: tuple[int, ...]) -> None:
        declared = self._by_rank.get(where, {})
        containing = self._containing.setdefault(where, {})
        for other in containing.get(rank, ()):
            if other != members:
                who = next(q for q, s in declared.items() if s == other)
                raise GroupMismatch(self._say(where, rank, members, who, other))
        sets = containing.get(members[0]) if members else None
        if sets is not None and members in sets:
            return  # declared before by a member: its members were checked then
        for q in members:
            other = declared.get(q)
            if other is not None and other != members:
                raise GroupMismatch(self._say(where, rank, members, q, other))
        for q in members:
            containing.setdefault(q, set()).add(members)

    @staticmethod
    def _say(where: tuple[int, str], rank: int, members: tuple[int, ...], other_rank: int,
             other: tuple[int, ...]) -> str:
        return (f"process group {where[1]!r}: rank {rank} created it with ranks {list(members)}, rank {other_rank} "
                f"with ranks {list(other)}; members of a group must create it with the same ranks")
