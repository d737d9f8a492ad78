"""The process groups the ranks created, and the order of their ops: a collective is the k-th op of
each member on the same group; a send and a receive match per (src, dst) pair in issue order.

Which group a rank's group is: identity as torch has it.

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

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from prism_megatron.runtime.matching import Member, P2PQueues
from prism_megatron.runtime.recorder import OpRecord


@dataclass
class Group:
    id: int
    name: str
    ranks: list[int]
    backend: str
    next_seq: list[int] = field(default_factory=list)
    pending: dict[int, list[Member | None]] = field(default_factory=dict)
    p2p: P2PQueues = field(default_factory=P2PQueues)
    p2p_seq: dict[tuple[int, int, str], int] = field(default_factory=dict)
    grank: dict[int, int] = field(default_factory=dict)  # global rank -> group rank (no list search per op)
    fold: Any = None  # nccl_prune.GroupPlan when some members are virtual: collectives wait for live members only
    passthrough: dict = field(default_factory=dict)  # (U, w) -> runtime.passthrough stream (virtual neighbours)

    def missing_note(self, rec: OpRecord) -> str:
        """What op ``rec`` still waits for, for a message: the members that did not post it, or the peer."""
        slot = self.pending.get(rec.seq) if rec.seq >= 0 and rec.peer < 0 else None
        if not slot:
            return f"; peer {rec.peer} did not post its part" if rec.peer >= 0 else ""
        members = self.ranks if self.fold is None else [self.ranks[p] for p in self.fold.live_positions]
        return f"; missing ranks {fmt_ranks([members[i] for i, m in enumerate(slot) if m is None])}"

    def missing(self, seq: int) -> int:
        """Members that have not posted collective ``seq`` (0 once it ran)."""
        slot = self.pending.get(seq)
        return sum(1 for m in slot if m is None) if slot else 0


class GroupMismatch(ValueError):
    """Members of a process group declared it with different ranks."""


class GroupTable:
    """Every group by the id the trace gives it (dense, in order of first declaration), and which
    group each rank's handle names."""

    def __init__(self) -> None:
        self.by_id: dict[int, Group] = {}
        self._epoch: dict[int, int] = {}  # rank -> default groups it declared
        self._incarnations: dict[tuple, list[int]] = {}  # (epoch, name, ranks) -> group ids
        self._declared: dict[tuple, int] = {}  # (rank, epoch, name, ranks) -> times declared
        self._by_rank: dict[tuple[int, str], dict[int, tuple[int, ...]]] = {}  # (epoch, name) -> rank -> set
        self._containing: dict[tuple[int, str], dict[int, set[tuple[int, ...]]]] = {}  # ... member -> sets
        self._handles: dict[tuple[int, int], int] = {}  # (rank, rank's handle) -> group id

    def __iter__(self) -> Iterator[Group]:
        return iter(sorted(self.by_id.values(), key=lambda g: g.id))

    def declare(self, rank: int, handle: int, name: str, ranks: list[int], world: bool,
                backend: str = "") -> tuple[int, bool]:
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
            g = Group(len(self.by_id), name, list(ranks), backend)
            g.next_seq = [0] * len(g.ranks)
            g.grank = {r: i for i, r in enumerate(g.ranks)}
            self.by_id[g.id] = g
            ids.append(g.id)
        self._handles[(rank, handle)] = ids[k]
        return ids[k], new

    def group_of(self, rank: int, handle: int) -> int:
        """The id of the group ``rank`` calls ``handle``."""
        return self._handles[(rank, handle)]

    def of(self, rank: int, handle: int) -> Group:
        """The group ``rank`` calls ``handle`` (what its op messages name)."""
        return self.by_id[self._handles[(rank, handle)]]

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

    @staticmethod
    def post_collective(g: Group, m: Member) -> list[Member] | None:
        """Member ``m``'s next collective on ``g`` (its record gets the sequence number); the members
        in group-rank order once all have posted it, else None."""
        seq = g.next_seq[m.grank]
        g.next_seq[m.grank] += 1
        m.record.seq = seq
        if g.fold is None:
            slot = g.pending.setdefault(seq, [None] * len(g.ranks))
            slot[m.grank] = m
        else:  # in live-position order
            slot = g.pending.setdefault(seq, [None] * len(g.fold.live_positions))
            slot[g.fold.live_index(m.grank)] = m
        if any(x is None for x in slot):
            return None
        del g.pending[seq]
        return slot  # type: ignore[return-value]

    @staticmethod
    def p2p_seq(g: Group, rec: OpRecord, src: int, dst: int) -> None:
        """Number a send or receive between group ranks ``src`` and ``dst`` in their issue order."""
        key = (src, dst, rec.kind)
        rec.seq = g.p2p_seq.get(key, 0)
        g.p2p_seq[key] = rec.seq + 1


def fmt_ranks(ranks: list[int]) -> str:
    """A group's ranks for a message: all of a small group, the ends of a large one."""
    if len(ranks) > 8:
        return f"{ranks[:4]}...{ranks[-2:]} ({len(ranks)} ranks)".replace("]...[", ", ..., ")
    return str(ranks)
