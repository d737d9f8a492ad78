"""The process groups the ranks created, and the order of their ops: a collective is the k-th op of
each member on the same group; a send and a receive match per (src, dst) pair in issue order."""

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

    def missing(self, seq: int) -> int:
        """Members that have not posted collective ``seq`` (0 once it ran)."""
        slot = self.pending.get(seq)
        return sum(1 for m in slot if m is None) if slot else 0


class GroupTable:
    """Every group by the name its members know it by, and by the id the trace gives it."""

    def __init__(self) -> None:
        self.by_name: dict[str, Group] = {}
        self.by_id: dict[int, Group] = {}

    def __iter__(self) -> Iterator[Group]:
        return iter(sorted(self.by_name.values(), key=lambda g: g.id))

    def register(self, rank: int, name: str, ranks: list[int], backend: str) -> str | None:
        """``rank`` created group ``name`` of ``ranks``: None, or the problem when another member
        created it with other ranks."""
        g = self.by_name.get(name)
        if g is None:
            g = Group(len(self.by_name), name, list(ranks), backend)
            g.next_seq = [0] * len(g.ranks)
            g.grank = {r: i for i, r in enumerate(g.ranks)}
            self.by_name[g.name] = g
            self.by_id[g.id] = g
        elif g.ranks != list(ranks):
            return f"process group {g.name!r}: rank {rank} created it with ranks {ranks}, another member with {g.ranks}"
        return None

    def named(self, name: str) -> Group:
        """The group an op message names."""
        return self.by_name[name]

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
