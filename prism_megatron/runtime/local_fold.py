"""A folded group's collective answered in the rank that is its only live member, on the tensors' device.

In a folded job (runtime.folding) a collective over a group with virtual members is answered by
``nccl_prune.host.execute`` from the live members' inputs. Where this rank is the group's only live
member (every other member mirrors it: its TP peers and DP replicas at class depth, every member in a
serial capture), nothing of another process enters the answer: the rank runs ``execute`` itself on its
own tensors (``into=``: results written into its output buffers, no temporary of their size) instead of
staging them through host memory to the coordinator and back. Same function, same arithmetic: the
results are bitwise the coordinator's. The coordinator still gets the op (kind, group, sizes, dtypes,
the small inputs the trace keeps; outputs ``("l", n)``) and records its completion, so matching, the
trace's events and their timing rules, and the contribution counts (``Folding.count``) are those of the
coordinator path (``LOCAL_RULE``); the rank does not wait for it (``SETTLED_RULE``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from nccl_prune import GroupPlan, PruneError, other_classes, plan_group, recordable
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
                   "all_to_all", "all_to_all_list", "broadcast", "barrier"})

LOCAL_RULE = """\
A collective is answered in the rank when the rank is the only live member of a folded group (every
other member mirrors it), its kind is all_reduce (coalesced too, every reduce op), reduce_scatter (tensor
or list), all_gather (tensor, list, coalesced, in place), all_to_all (single, even or uneven splits, or
lists), barrier, or a broadcast whose root is the rank and whose payload is larger than a serial capture
records (runtime.folding.RECORD_MAX_BYTES: a smaller one is kept for later captures, a virtual root may be
answered from a recording), and its tensors are contiguous with outputs of the inputs' dtype and the
collective's sizes (an all_to_all exchanges bytes, as the coordinator does: its outputs hold the bytes of
the pieces the rank receives by the fold's translation, A2A_RULE, with the rank's plan built as the
coordinator's, coordinates included); not when an earlier op still pending writes memory its outputs
cover; nor, in a serial capture, a reduction small enough to be recorded (nccl_prune.RECORDED_REDUCTION_RULE:
at most RECORD_MAX_BYTES) on a group with members of another class: the coordinator records it and answers
those members from their class's recording. Everything else (reduce, gather, scatter; p2p; a group with two
or more live members) goes through the coordinator. A MoE fold's count exchange is an all_gather whose
rotation is the program's side (patches.moe_fold), so the token all_to_all needs only A2A_RULE's piece
selection.
PRISM_FOLD_LOCAL=0 sends every op through the coordinator."""

SETTLED_RULE = """\
A collective answered in the rank (a folded group's whose only live member it is, or any of a group of one,
OpKind.local) is settled there: its Work completes as soon as its results are written (a synchronous op is
waited at its issue, as on the coordinator path), and the rank sends the op (marked ``settled``) and goes on
computing without waiting for the coordinator's word or giving its slot back. The coordinator records it and
its completion as it records any op, and checks it as before (answered_in_rank); a problem it finds ends the
job at the rank's next call into the runtime. A round trip per op is what this saves, and a sleep: a thread
woken from one issues the work after it slower, and the rank's clock would take that for the program's
(docs/measurements.md, "Settled collectives on the GPU"). A serial capture of a large MoE rank answers
thousands of collectives per iteration in the rank, and a job of one rank per data-parallel group does all its
gradient and data reductions on groups of one. Where an earlier op still pending writes the outputs, the op is
not settled: it completes after that one, through the coordinator."""


def lone_plan(ranks: Sequence[int], rep: Sequence[int] | None, me: int,
              untranslate: Callable[[int, int], int] | None = None) -> GroupPlan | None:
    """The fold of a group whose only live member is group position ``me`` and which has virtual
    members; None otherwise, when answering in the rank is off, or when the group cannot be folded (the
    coordinator says why at registration). ``untranslate``: the fold's translation by coordinates, as the
    coordinator folds the group with (``folding.untranslation``; an all_to_all's pieces follow it).
    O(group size), once per group this rank makes."""
    if rep is None or not enabled():
        return None
    try:
        plan = plan_group(ranks, rep, untranslate)
    except PruneError:
        return None
    if plan is None or plan.live_positions != (me,) or not plan.num_virtual:
        return None
    return plan


def records(plan: GroupPlan | None, class_rep: Sequence[int] | None) -> bool:
    """Whether a lone plan's group, in a serial capture (``class_rep``: every rank's class representative, as
    captured together; None otherwise), has members of another class: its small reductions are the
    coordinator's (``answerable``). Once per group."""
    return plan is not None and class_rep is not None and bool(other_classes(plan, class_rep))


def answerable(plan: GroupPlan, kind: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
               params: dict, records: bool = False) -> bool:
    """Whether op ``kind`` with these tensors is answered in the rank (``LOCAL_RULE``). ``records``: a serial
    capture's group with members of another class (``other_classes``), whose small reductions the coordinator
    answers (a size check)."""
    if kind not in KINDS:
        return False
    if records and recordable(kind, sum(nbytes(t) for t in ins)):
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
    if kind in ("all_to_all", "all_to_all_list"):
        return _exchange_fits(plan, kind, ins, outs, params.get("in_splits"))
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


def _exchange_fits(plan: GroupPlan, kind: str, ins: list[torch.Tensor], outs: list[torch.Tensor],
                   in_splits: Sequence[int] | None) -> bool:
    """Whether the rank's outputs hold, byte for byte, the pieces it receives (A2A_RULE: from a virtual
    member v its own piece for its counterpart through v); else the coordinator answers (and says why)."""
    me, n = plan.live_positions[0], plan.size
    if kind == "all_to_all":
        if len(ins) != 1 or len(outs) != 1 or in_splits is None or len(in_splits) != n \
                or sum(in_splits) != nbytes(ins[0]):
            return False
        piece = list(in_splits)
        return sum(piece[plan.counterpart(me, q)] for q in range(n)) == nbytes(outs[0])
    if len(ins) != n or len(outs) != n:
        return False
    return all(nbytes(outs[q]) == nbytes(ins[plan.counterpart(me, q)]) for q in range(n))


def descs(ins: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[list, list]:
    """The op's descriptors for the coordinator: small inputs inline (the trace keeps those a program
    branches on, as for a staged op), the rest and every output ``("l", nbytes)``: they stay here."""
    in_descs = [(("i", host_bytes(t)), P.dtype_name(t.dtype), list(t.shape)) if nbytes(t) <= P.INLINE_LIMIT
                else local_descs([t])[0] for t in ins]
    return in_descs, local_descs(outs)


def answer(plan: GroupPlan, kind: str, ins: list[torch.Tensor], outs: list[torch.Tensor], *,
           redop: str | None = None, factor: float | None = None, in_place: bool = False,
           current: list[torch.Tensor] | None = None, in_splits: Sequence[int] | None = None) -> None:
    """Write op ``kind``'s results into ``outs`` (``answerable`` said yes): ``nccl_prune.host.execute``
    on this rank's tensors, where they are. An all_to_all exchanges bytes (``in_splits``: bytes per
    member), as the coordinator's path does. Waits for the device (the work is the runtime's, off the
    program's clock, as a staged op's result copies are)."""
    if kind in ("broadcast", "barrier"):  # the root of a broadcast receives nothing; a barrier has no data
        return
    me = plan.live_positions[0]
    exchange = kind in ("all_to_all", "all_to_all_list")
    with torch.no_grad():
        flat = [_flat(t, exchange) for t in ins]
        into = [_flat(t, exchange) for t in outs]
        cur = {me: [t.detach().view(-1) for t in current]} if in_place and current is not None else None
        execute(kind, plan, {me: flat}, op=redop, factor=factor, in_place=in_place, current=cur, into={me: into},
                in_splits={me: list(in_splits)} if in_splits is not None else None)
    if any(t.is_cuda for t in (*ins, *outs)):
        torch.cuda.current_stream().synchronize()


def _flat(t: torch.Tensor, as_bytes: bool) -> torch.Tensor:
    flat = t.detach().view(-1)
    return flat.view(torch.uint8) if as_bytes else flat
