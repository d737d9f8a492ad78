"""A folded group's collective answered in the rank that is its only live member, on the tensors' device.

In a folded job (runtime.folding) a collective over a group with virtual members is answered by
``nccl_prune.host.execute`` from the live members' inputs. Where this rank is the group's only live
member (every other member mirrors it: its TP peers and DP replicas at class depth, every member in a
serial capture), nothing of another process enters the answer: the rank runs ``execute`` itself on its
own tensors (``into=``: results written into its output buffers, no temporary of their size) instead of
staging them through host memory to the coordinator and back. Same function, same arithmetic: the
results are bitwise the coordinator's. The coordinator still gets the op (kind, group, sizes, dtypes,
the small inputs the trace keeps; outputs ``("l", n)``) and completes it, so matching, the trace's
events and their timing rules, and the contribution counts (``Folding.count``) are those of the
coordinator path (``LOCAL_RULE``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from nccl_prune import GroupPlan, PruneError, plan_group
from nccl_prune.host import execute
from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.staging import host_bytes, local_descs, nbytes

#: "0": every collective of a folded group goes through the coordinator (to compare the two paths)
ENV = "PRISM_FOLD_LOCAL"


def enabled() -> bool:
    """Whether collectives are answered in the rank (``ENV``; read when a group is made, in the rank)."""
    return os.environ.get(ENV, "1") != "0"

#: kinds answered in the rank; the others keep the coordinator path
KINDS = frozenset({"all_reduce", "reduce_scatter", "reduce_scatter_list", "all_gather", "all_gather_list",
                   "broadcast", "barrier"})

LOCAL_RULE = """\
A collective is answered in the rank when the rank is the only live member of a folded group (every
other member mirrors it), its kind is all_reduce (coalesced too, every reduce op), reduce_scatter (tensor
or list), all_gather (tensor, list, coalesced, in place), barrier, or a broadcast whose root is the rank
and whose payload is larger than a serial capture records (runtime.folding.RECORD_MAX_BYTES: a smaller
one is kept for later captures, a virtual root may be answered from a recording), and its tensors are
contiguous with outputs of the inputs' dtype and the collective's sizes; not when an earlier op still
pending writes memory its outputs cover. Everything else (all_to_all, whose counts a MoE fold rotates;
reduce, gather, scatter; p2p; a group with two or more live members) goes through the coordinator.
PRISM_FOLD_LOCAL=0 sends every op through the coordinator."""


def lone_plan(ranks: Sequence[int], rep: Sequence[int] | None, me: int) -> GroupPlan | None:
    """The fold of a group whose only live member is group position ``me`` and which has virtual
    members; None otherwise, when answering in the rank is off, or when the group cannot be folded (the
    coordinator says why at registration). O(group size), once per group this rank makes."""
    if rep is None or not enabled():
        return None
    try:
        plan = plan_group(ranks, rep)
    except PruneError:
        return None
    if plan is None or plan.live_positions != (me,) or not plan.num_virtual:
        return None
    return plan


def answerable(plan: GroupPlan, kind: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
               params: dict) -> bool:
    """Whether op ``kind`` with these tensors is answered in the rank (``LOCAL_RULE``)."""
    if kind not in KINDS:
        return False
    me, n = plan.live_positions[0], plan.size
    tensors = [*ins, *outs, *params.get("current", ())]
    if any(not t.is_contiguous() for t in tensors):
        return False
    if kind == "broadcast":
        from prism_megatron.runtime.folding import RECORD_MAX_BYTES

        return params.get("root") == me and sum(nbytes(t) for t in ins) > RECORD_MAX_BYTES
    if kind == "barrier":
        return True
    if not ins:
        return False
    if kind in ("all_reduce", "reduce_scatter", "all_gather"):  # buffer j's result is of input j's dtype
        if len(outs) != len(ins) or any(i.dtype != o.dtype for i, o in zip(ins, outs, strict=True)):
            return False
    elif len({t.dtype for t in (*ins, *outs)}) != 1:
        return False
    sizes = [t.numel() for t in ins]
    if kind == "all_reduce":
        want = sizes
    elif kind == "reduce_scatter":
        if any(s % n for s in sizes):
            return False
        want = [s // n for s in sizes]
    elif kind == "reduce_scatter_list":
        if len(ins) != n:
            return False
        want = [sizes[me]]
    elif kind == "all_gather":
        want = [s * n for s in sizes]
    else:  # all_gather_list
        want = sizes * n if len(sizes) == 1 else None
    return want == [t.numel() for t in outs]


def descs(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[list, list]:
    """The op's descriptors for the coordinator: small inputs inline (the trace keeps those a program
    branches on, as for a staged op), the rest and every output ``("l", nbytes)``: they stay here."""
    in_descs = [(("i", host_bytes(t)), P.dtype_name(t.dtype), list(t.shape)) if nbytes(t) <= P.INLINE_LIMIT
                else local_descs([t])[0] for t in ins]
    return in_descs, local_descs(outs)


def answer(plan: GroupPlan, kind: str, ins: list[torch.Tensor], outs: list[torch.Tensor], *,
           redop: str | None = None, factor: float | None = None, in_place: bool = False,
           current: list[torch.Tensor] | None = None) -> None:
    """Write op ``kind``'s results into ``outs`` (``answerable`` said yes): ``nccl_prune.host.execute``
    on this rank's tensors, where they are. Waits for the device (the work is the runtime's, off the
    program's clock, as a staged op's result copies are)."""
    if kind in ("broadcast", "barrier"):  # the root of a broadcast receives nothing; a barrier has no data
        return
    me = plan.live_positions[0]
    with torch.no_grad():
        flat = [t.detach().view(-1) for t in ins]
        into = [t.detach().view(-1) for t in outs]
        cur = {me: [t.detach().view(-1) for t in current]} if in_place and current is not None else None
        execute(kind, plan, {me: flat}, op=redop, factor=factor, in_place=in_place, current=cur, into={me: into})
    if any(t.is_cuda for t in (*ins, *outs)):
        torch.cuda.current_stream().synchronize()
