"""Every op kind, defined once: what its members must agree on, its result, the result of a group of
one, how the cost model costs it (what a virtual member contributes is nccl_prune.contributions's).

In the spirit of PyTorch's multi-threaded process group: one object per kind, whose ``work`` takes
the members' inputs in group-rank order and returns their outputs in that order. The tensor math is
in ``runtime.collectives``, imported at first use: the cost model reads this table, and calibration
and replay import no torch.

Members are the coordinator's ``runtime.matching.Member`` (anything with ``rank``, ``msg``,
``in_bytes()`` and ``out_bytes()``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def _math() -> Any:
    from prism_megatron.runtime import collectives

    return collectives


@dataclass
class CollectiveCall:
    """One collective's data, every member's part in group-rank order."""

    ins: list[list[Any]]  # ins[i]: member i's input tensors (flat)
    redop: str | None = None
    factor: float | None = None
    root: int | None = None
    in_splits: list[list[int]] | None = None  # all_to_all: member i's bytes for each member
    #: (member, output index, like) -> the tensor that member's output lives in, or None: lets a
    #: reduction write its result straight into shared memory
    out_view: Callable[[int, int, Any], Any] | None = None
    #: a folded group (Phase 2): its ``nccl_prune.GroupPlan``; ``ins`` then hold the live members' inputs,
    #: in live-position order, and the result is theirs
    fold: Any = None
    #: outputs as they stand, per live member (empty where not sent): an in-place all_gather's (its virtual
    #: chunks are kept), a broadcast's at the mirror of a virtual root (the data that root sends)
    current: list[list[Any]] | None = None
    in_place: bool = False  # an all_gather whose input is the member's own chunk of its output
    #: inputs of virtual positions taken from a recording instead of the mirror (a serial capture's reduction
    #: over another class's members: nccl_prune.RECORDED_REDUCTION_RULE)
    recorded: dict[int, list[Any]] | None = None


@dataclass(frozen=True)
class OpKind:
    """One op kind. ``cost_family``: the formula family of ``calibration.costmodel`` that costs it.
    ``paired``: its recorded shapes are inputs then as many outputs (else ``layout`` gives the counts).
    ``data_sized``: its sizes follow the data (uneven all_to_all splits, object collectives' pickles), so
    ranks that run the same program on the same shapes may issue it with different byte counts."""

    name: str
    cost_family: str
    reducing: bool = False
    p2p: bool = False
    paired: bool = False
    data_sized: bool = False

    def check(self, ms: list, n: int) -> list[str]:
        """Disagreements between the members' sizes (after kind, reduce op, root and dtypes agreed)."""
        return []

    def work(self, call: CollectiveCall) -> list[list[Any]]:
        """Every member's outputs, in member order, from every member's inputs."""
        raise NotImplementedError(f"op {self.name!r} is not a collective")

    def run(self, call: CollectiveCall) -> list[list[Any]]:
        """The one entry point: ``work`` for a full group, the pruned execution for a folded one."""
        return self.work(call) if call.fold is None else self.folded(call)

    def folded(self, call: CollectiveCall) -> list[list[Any]]:
        """The live members' outputs (live-position order) of an op on a folded group, answered by
        ``nccl_prune.host`` from the live members' inputs: each virtual member mirrors its
        representative (its contribution weighted, never materialised) or, in an in-place all_gather,
        keeps what the live member's output holds; ``call.recorded`` replaces a virtual member's mirror with
        its recorded inputs."""
        import torch

        from nccl_prune.host import execute

        plan = call.fold
        live = plan.live_positions
        ins = call.ins
        splits = None
        if call.in_splits is not None:  # the runtime's splits are bytes: exchange bytes
            ins = [[t.reshape(-1).view(torch.uint8) for t in x] for x in ins]
            splits = dict(zip(live, call.in_splits, strict=True))
        inputs = dict(zip(live, ins, strict=True))
        out = None
        if self.name == "all_reduce" and call.out_view is not None:
            out = [call.out_view(0, j, t) for j, t in enumerate(ins[0])]
        current = dict(zip(live, call.current, strict=True)) if call.current is not None else None
        if self.name == "broadcast" and current is not None:  # a virtual root: its mirror's buffer
            inputs = {p: x or current[p] for p, x in inputs.items()}
        res = execute(self.name, plan, inputs, op=call.redop, factor=call.factor, root=call.root,
                      in_splits=splits, in_place=call.in_place, current=current if call.in_place else None,
                      recorded=call.recorded, out=out)
        return [res[p] for p in live]

    def local(self, ins: list[Any], outs: list[Any], redop: str | None, factor: float | None) -> None:
        """The result of a group of one, written where the tensors are (as NCCL does on the device):
        each output is its input (times the factor of a premul_sum)."""
        for i, o in zip(ins, outs, strict=True):
            _math().copy_local(i, o, factor if self.reducing and redop == "premul_sum" else None)

    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        """(inputs, outputs) a member of a group of ``size`` passes, for kinds that are not ``paired``."""
        raise NotImplementedError(self.name)


def _equal_ins_problems(ms: list) -> list[str]:
    ins = [m.in_bytes() for m in ms]
    if len({len(x) for x in ins}) > 1:
        return ["different numbers of tensors"]
    if len({tuple(x) for x in ins}) > 1:
        return ["different sizes"]
    return []


def _out_size_problems(ms: list, n: int, kind: str, want: Callable[[int], int], divides: bool = False) -> list[str]:
    """Each output of each member must hold ``want(input bytes)``; ``divides``: the input splits evenly."""
    for m in ms:
        for i, o in zip(m.in_bytes(), m.out_bytes(), strict=False):
            if o != want(i) or (divides and i % n):
                return [f"rank {m.rank}'s output holds {o} bytes, {kind} of {i} bytes over {n} ranks needs {want(i)}"]
    return []


class _AllReduce(OpKind):
    def check(self, ms: list, n: int) -> list[str]:
        return _equal_ins_problems(ms) or _out_size_problems(ms, n, self.name, lambda i: i)

    def work(self, call: CollectiveCall) -> list[list[Any]]:
        # into the first member's output, copied from there to the others
        ins, n = call.ins, len(call.ins)
        r = [_math().reduce([ins[i][j] for i in range(n)], call.redop, call.factor,
                            out=call.out_view(0, j, ins[0][j]) if call.out_view else None)
             for j in range(len(ins[0]))]
        return [r for _ in range(n)]


class _AllGather(OpKind):
    def check(self, ms: list, n: int) -> list[str]:
        return _equal_ins_problems(ms) or _out_size_problems(ms, n, self.name, lambda i: i * n)

    def work(self, call: CollectiveCall) -> list[list[Any]]:
        ins, n = call.ins, len(call.ins)
        r = [_math().concat_bytes([ins[i][j] for i in range(n)]) for j in range(len(ins[0]))]
        return [r for _ in range(n)]


class _ReduceScatter(OpKind):
    def check(self, ms: list, n: int) -> list[str]:
        return _equal_ins_problems(ms) or _out_size_problems(ms, n, self.name, lambda i: i // n, divides=True)

    def work(self, call: CollectiveCall) -> list[list[Any]]:
        ins, n = call.ins, len(call.ins)
        chunks = [_math().reduce_scatter([ins[i][j] for i in range(n)], call.redop, call.factor)
                  for j in range(len(ins[0]))]
        return [[c[i] for c in chunks] for i in range(n)]


class _Rooted(OpKind):
    """reduce and broadcast: every tensor of every member has one size."""

    def check(self, ms: list, n: int) -> list[str]:
        sizes = {b for m in ms for b in m.in_bytes() + m.out_bytes()}
        return ["different sizes"] if len(sizes) > 1 else []


class _Reduce(_Rooted):
    def work(self, call: CollectiveCall) -> list[list[Any]]:
        ins, n = call.ins, len(call.ins)
        r = [_math().reduce([ins[i][j] for i in range(n)], call.redop, call.factor) for j in range(len(ins[0]))]
        return [r if i == call.root else [] for i in range(n)]

    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        return (1, 1) if is_root else (1, 0)


class _Broadcast(_Rooted):
    def work(self, call: CollectiveCall) -> list[list[Any]]:
        return [[] if i == call.root else [call.ins[call.root][0]] for i in range(len(call.ins))]

    def local(self, ins: list[Any], outs: list[Any], redop: str | None, factor: float | None) -> None:
        """The root of a broadcast of one receives nothing."""

    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        return (1, 0) if is_root else (0, 1)


class _AllGatherList(OpKind):
    def check(self, ms: list, n: int) -> list[str]:
        firsts = [m.in_bytes()[0] for m in ms]
        for m in ms:
            if len(m.out_bytes()) != n or m.out_bytes() != firsts:
                return [f"rank {m.rank}'s outputs do not match the inputs' sizes"]
        return []

    def work(self, call: CollectiveCall) -> list[list[Any]]:
        n = len(call.ins)
        return [[call.ins[i][0] for i in range(n)] for _ in range(n)]

    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        return (1, size)


class _ReduceScatterList(OpKind):
    def check(self, ms: list, n: int) -> list[str]:
        ins = [m.in_bytes() for m in ms]
        for j, m in enumerate(ms):
            if len(ins[j]) != n or any(ins[k][j] != m.out_bytes()[0] for k in range(n)):
                return [f"inputs for rank {m.rank} do not match its output size"]
        return []

    def work(self, call: CollectiveCall) -> list[list[Any]]:
        return [[r] for r in _math().reduce_scatter_lists(call.ins, call.redop, call.factor)]

    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        return (size, 1)


class _Gather(OpKind):
    def check(self, ms: list, n: int) -> list[str]:
        root_outs, ins = ms[ms[0].msg.get("root")].out_bytes(), [m.in_bytes()[0] for m in ms]
        return [] if root_outs == ins else ["the root's outputs do not match the inputs' sizes"]

    def work(self, call: CollectiveCall) -> list[list[Any]]:
        n = len(call.ins)
        return [[call.ins[i][0] for i in range(n)] if j == call.root else [] for j in range(n)]

    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        return (1, size) if is_root else (1, 0)


class _Scatter(OpKind):
    """gather's mirror: the root's inputs, one to each member."""

    def check(self, ms: list, n: int) -> list[str]:
        root_ins, outs = ms[ms[0].msg.get("root")].in_bytes(), [m.out_bytes()[0] for m in ms]
        return [] if root_ins == outs else ["the root's inputs do not match the outputs' sizes"]

    def work(self, call: CollectiveCall) -> list[list[Any]]:
        return [[call.ins[call.root][j]] for j in range(len(call.ins))]

    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        return (size, 1) if is_root else (0, 1)


class _AllToAllList(OpKind):
    def check(self, ms: list, n: int) -> list[str]:
        ins = [m.in_bytes() for m in ms]
        outs = [m.out_bytes() for m in ms]
        for i in range(n):
            for j in range(n):
                if len(ins[i]) != n or len(outs[j]) != n or ins[i][j] != outs[j][i]:
                    return [f"rank {ms[i].rank} sends {ins[i][j] if len(ins[i]) == n else '?'} bytes to rank "
                            f"{ms[j].rank}, which expects {outs[j][i] if len(outs[j]) == n else '?'}"]
        return []

    def work(self, call: CollectiveCall) -> list[list[Any]]:
        n = len(call.ins)
        return [[call.ins[i][j] for i in range(n)] for j in range(n)]

    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        return (size, size)


class _AllToAll(OpKind):
    """all_to_all_single: one tensor each way, split by byte counts the members name (in_splits/out_splits)."""

    def check(self, ms: list, n: int) -> list[str]:
        for i in range(n):
            for j in range(n):
                s, r = ms[i].msg["in_splits"][j], ms[j].msg["out_splits"][i]
                if s != r:
                    return [f"rank {ms[i].rank} sends {s} bytes to rank {ms[j].rank}, which expects {r}"]
        return []

    def work(self, call: CollectiveCall) -> list[list[Any]]:
        pieces = [_math().split_bytes(x[0], splits) for x, splits in zip(call.ins, call.in_splits, strict=True)]
        n = len(call.ins)
        return [[_math().concat_bytes([pieces[i][j] for i in range(n)])] for j in range(n)]


class _Barrier(OpKind):
    def work(self, call: CollectiveCall) -> list[list[Any]]:
        return [[] for _ in call.ins]

    def local(self, ins: list[Any], outs: list[Any], redop: str | None, factor: float | None) -> None:
        """Nothing to compute."""

    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        return (0, 0)


class _Send(OpKind):
    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        return (1, 0)


class _Recv(OpKind):
    def layout(self, size: int, is_root: bool) -> tuple[int, int]:
        return (0, 1)


OPS: dict[str, OpKind] = {k.name: k for k in (
    _AllReduce("all_reduce", "all_reduce", reducing=True, paired=True),
    _Reduce("reduce", "reduce", reducing=True),
    _ReduceScatter("reduce_scatter", "reduce_scatter", reducing=True, paired=True),
    _ReduceScatterList("reduce_scatter_list", "reduce_scatter", reducing=True),
    _AllGather("all_gather", "all_gather", paired=True),
    # object collectives gather pickles and their sizes: data a program branches on
    _AllGatherList("all_gather_list", "all_gather", data_sized=True),
    _Gather("gather", "all_gather"),
    _Scatter("scatter", "reduce_scatter"),
    _Broadcast("broadcast", "broadcast"),
    _AllToAll("all_to_all", "all_to_all", paired=True, data_sized=True),
    _AllToAllList("all_to_all_list", "all_to_all", data_sized=True),
    _Barrier("barrier", "all_reduce"),
    _Send("send", "p2p", p2p=True),
    _Recv("recv", "p2p", p2p=True),
)}

#: kinds whose members' dtypes must agree and whose reduce op applies
REDUCING_KINDS = frozenset(k.name for k in OPS.values() if k.reducing)
P2P_KINDS = frozenset(k.name for k in OPS.values() if k.p2p)
DATA_SIZED_KINDS = frozenset(k.name for k in OPS.values() if k.data_sized)


def op_kind(name: str) -> OpKind:
    """The op kind ``name``; ValueError naming it when prism does not know it."""
    try:
        return OPS[name]
    except KeyError:
        raise ValueError(f"op {name!r} is not supported by prism (known: {', '.join(sorted(OPS))})") from None
