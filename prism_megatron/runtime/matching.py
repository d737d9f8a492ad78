"""Checks that the members of one collective agree, and FIFO matching of point-to-point ops.

NCCL semantics, not gloo's: a send and a receive match per communicator and per (src, dst) pair in
issue order; tags are ignored. A collective is the k-th op of each member on the same group.
Disagreement between members — the bug that silently hangs or corrupts NCCL jobs at scale — is
reported naming the ranks, the op and the shapes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from prism_megatron.ops import OPS


@dataclass
class Member:
    """One rank's half of an op, as the coordinator sees it."""

    rank: int  # global rank
    grank: int  # rank in the group
    msg: dict  # the request
    record: Any = None  # the trace record

    @property
    def kind(self) -> str:
        return self.msg["kind"]

    def in_bytes(self) -> list[int]:
        return [desc_bytes(d[0]) for d in self.msg["ins"]]

    def out_bytes(self) -> list[int]:
        return [desc_bytes(d[0]) for d in self.msg["outs"]]

    def dtypes(self) -> list[str]:
        return [d[1] for d in self.msg["ins"]] + [d[1] for d in self.msg["outs"]]

    def describe(self) -> str:
        ins = ", ".join(f"{d[1]}{list(d[2])}" for d in self.msg["ins"])
        outs = ", ".join(f"{d[1]}{list(d[2])}" for d in self.msg["outs"])
        extra = ""
        for key in ("redop", "root", "peer"):
            if self.msg.get(key) is not None:
                extra += f" {key}={self.msg[key]}"
        return f"rank {self.rank}: {self.kind}{extra} in=[{ins}] out=[{outs}]"


def desc_bytes(desc: tuple) -> int:
    """Bytes a payload descriptor stands for (see protocol.py)."""
    if desc[0] == "i":
        return len(desc[1])
    if desc[0] in ("r", "l"):
        return desc[1]
    return desc[3]


def check_collective(members: list[Member], size: int | None = None) -> str | None:
    """None when the members' ops fit together, else a description of the disagreement.

    ``size``: a folded group's member count when ``members`` are its live members only; the size
    checks that index members by group position are then left to the pruned execution (nccl_prune
    checks the sizes it reads)."""
    n = len(members) if size is None else size
    first = members[0]
    problems: list[str] = []
    kinds = {m.kind for m in members}
    if len(kinds) > 1:
        problems.append("different operations")
    else:
        kind = first.kind
        if len({m.msg.get("redop") for m in members}) > 1:
            problems.append("different reduce ops")
        if len({m.msg.get("root") for m in members}) > 1:
            problems.append("different roots")
        op = OPS.get(kind)  # an unknown kind is the coordinator's to refuse
        dts = {dt for m in members for dt in m.dtypes()}
        if op is not None and op.reducing and len(dts) > 1:
            problems.append(f"different dtypes {sorted(dts)}")
        if op is not None and (size is None or kind in _UNINDEXED_CHECKS):
            problems += op.check(members, n)
    if not problems:
        return None
    lines = [f"members disagree ({'; '.join(problems)}):"] + [f"  {m.describe()}" for m in members]
    return "\n".join(lines)


#: kinds whose size check reads no member by its group position (valid on a folded group's live members)
_UNINDEXED_CHECKS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast"})


def check_p2p(send: Member, recv: Member) -> str | None:
    s, r = send.in_bytes()[0], recv.out_bytes()[0]
    sd, rd = send.dtypes()[0], recv.dtypes()[0]
    if s != r or sd != rd:
        return (f"send/recv mismatch: rank {send.rank} sends {sd} of {s} bytes, rank {recv.rank} receives "
                f"{rd} of {r} bytes:\n  {send.describe()}\n  {recv.describe()}")
    return None


@dataclass
class P2PQueues:
    """Unmatched sends and receives of one group, FIFO per (src, dst) group-rank pair."""

    sends: dict[tuple[int, int], deque[Member]] = field(default_factory=dict)
    recvs: dict[tuple[int, int], deque[Member]] = field(default_factory=dict)
    any_recvs: dict[int, deque[Member]] = field(default_factory=dict)  # dst -> recvs from any source
    arrivals: int = 0

    def add_send(self, m: Member) -> tuple[Member, Member] | None:
        dst = m.msg["peer"]
        key = (m.grank, dst)
        m.msg["_order"] = self.arrivals
        self.arrivals += 1
        q = self.recvs.get(key)
        if q:
            return m, q.popleft()
        aq = self.any_recvs.get(dst)
        if aq:
            return m, aq.popleft()
        self.sends.setdefault(key, deque()).append(m)
        return None

    def add_recv(self, m: Member) -> tuple[Member, Member] | None:
        src = m.msg["peer"]
        if src is None:
            waiting = [(q[0].msg["_order"], key) for key, q in self.sends.items() if key[1] == m.grank and q]
            if waiting:
                _, key = min(waiting)
                return self.sends[key].popleft(), m
            self.any_recvs.setdefault(m.grank, deque()).append(m)
            return None
        key = (src, m.grank)
        q = self.sends.get(key)
        if q:
            return q.popleft(), m
        self.recvs.setdefault(key, deque()).append(m)
        return None
