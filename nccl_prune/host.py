"""Execute a folded op on host tensors: the live members' outputs from the live members' inputs.

The coordinator's executor. Inputs and outputs are keyed by live group position and laid out as the
runtime's messages are (a list of tensors per member; outputs flat). No virtual member's input is
ever materialised: reductions weight each live input by its multiplicity, gathers and exchanges read
the mirror's input where the virtual member's would be.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from nccl_prune.contributions import KEEP, RECORDED, how, op_kind
from nccl_prune.plan import GroupPlan, PruneError
from nccl_prune.reduction import reduce_terms, term

Inputs = Mapping[int, Sequence[torch.Tensor]]


def execute(kind: str, plan: GroupPlan, inputs: Inputs, *, op: str | None = None, factor: float | None = None,
            root: int | None = None, in_splits: Mapping[int, Sequence[int]] | None = None,
            in_place: bool = False, current: Inputs | None = None, recorded: Inputs | None = None,
            out: Sequence[torch.Tensor | None] | None = None) -> dict[int, list[torch.Tensor]]:
    """Outputs of op ``kind`` for every live position of ``plan``.

    inputs[p]: live member p's inputs as the runtime carries them — all_reduce/reduce/reduce_scatter/
    all_gather: one tensor per coalesced buffer; reduce_scatter_list/all_to_all_list/scatter (root): one
    per member; all_to_all: [flat tensor] with ``in_splits[p]`` (elements per destination, member
    order); broadcast: [data] at the root, and at a virtual root's mirror its buffer as it stands
    (that is the data a virtual root sends); gather: [tensor]; barrier: [].
    op/factor: the reduction (``reduction.REDUCE_OPS``); root: a group position.
    in_place (all_gather, all_gather_list): the inputs are the members' own chunks of their outputs, so
    virtual chunks are *kept*: ``current[p]`` holds live member p's output buffers as they stand.
    recorded[v]: inputs for virtual position v (laid out as a live member's), used instead of the mirror.
    out (all_reduce): ``out[j]`` receives reduction j (saves a copy into a member's output buffer); it
    may be the first live member's input j, never another member's.
    Outputs may share memory with inputs and with each other: do not write into them.
    """
    k = op_kind(kind)
    recorded = recorded or {}
    _check_inputs(kind, plan, inputs, recorded)
    if kind in ("send", "recv"):
        raise PruneError(f"{kind} is a p2p op: check it with contributions.check_p2p and move the data "
                         f"between the two live ranks")
    if k.reducing and op is None:
        raise PruneError(f"{kind} needs a reduce op")

    def src(p: int) -> Sequence[torch.Tensor]:  # the inputs member p contributes (mirror or recorded)
        return recorded[p] if how(plan, p, recorded=recorded) == RECORDED else inputs[plan.mirror[p]]

    live = plan.live_positions
    n = plan.size
    if kind in ("all_reduce", "reduce"):
        if kind == "reduce" and not plan.is_live(_root(plan, root, kind)):
            return {p: [] for p in live}
        outs = out if kind == "all_reduce" and out is not None else [None] * len(inputs[live[0]])
        res = [_reduce(plan, lambda p, j=j: src(p)[j], op, factor, recorded, outs[j])
               for j in range(len(inputs[live[0]]))]
        if kind == "reduce":
            return {p: (res if p == root else []) for p in live}
        return {p: res for p in live}
    if kind == "reduce_scatter":
        out: dict[int, list[torch.Tensor]] = {p: [] for p in live}
        for j in range(len(inputs[live[0]])):
            size = inputs[live[0]][j].numel()
            if size % n:
                raise PruneError(f"reduce_scatter input {j} of {size} elements does not split over {n} members")
            c = size // n
            for p in live:
                out[p].append(_reduce(plan, lambda q, j=j, p=p, c=c: src(q)[j].reshape(-1)[p * c:(p + 1) * c],
                                      op, factor, recorded))
        return out
    if kind == "reduce_scatter_list":
        return {p: [_reduce(plan, lambda q, p=p: src(q)[p].reshape(-1), op, factor, recorded)] for p in live}
    if kind in ("all_gather", "all_gather_list"):
        keep = in_place
        if keep and current is None:
            raise PruneError(f"an in-place {kind} keeps virtual members' chunks: pass the live members' "
                             f"current output buffers")
        res = {}
        for p in live:
            per_buffer = []
            for j in range(len(inputs[live[0]])):
                chunks = []
                for q in range(n):
                    if how(plan, q, recorded=recorded, keep=keep) == KEEP:
                        chunks.append(_kept_chunk(kind, current[p], j, q, n))  # type: ignore[index]
                    else:
                        chunks.append(src(q)[j].reshape(-1))
                per_buffer.append(chunks)
            res[p] = [torch.cat(c) for c in per_buffer] if kind == "all_gather" else per_buffer[0]
        return res
    if kind in ("all_to_all", "all_to_all_list"):
        pieces = {}
        for q in range(n):
            if how(plan, q, recorded=recorded) == RECORDED:
                pieces[q] = _pieces(kind, recorded[q], (in_splits or {}).get(q), n, q)
            elif plan.is_live(q):
                pieces[q] = _pieces(kind, inputs[q], (in_splits or {}).get(q), n, q)
        res = {}
        for p in live:
            got = []
            for q in range(n):
                if q in pieces:
                    got.append(pieces[q][p])
                else:  # a virtual member: its mirror's piece for p's counterpart
                    got.append(pieces[plan.mirror[q]][plan.counterpart(p, q)])
            res[p] = [torch.cat(got)] if kind == "all_to_all" else got
        return res
    if kind == "broadcast":
        r = _root(plan, root, kind)
        data = src(r)
        if not data:
            raise PruneError(f"broadcast from virtual rank {plan.ranks[r]}: its mirror, rank "
                             f"{plan.ranks[plan.mirror[r]]}, passed no buffer to send in its place")
        return {p: ([] if p == r else [data[0].reshape(-1)]) for p in live}
    if kind == "scatter":
        r = _root(plan, root, kind)
        if not plan.is_live(r) and r not in recorded:
            raise PruneError(f"scatter from virtual rank {plan.ranks[r]}: its mirror, rank "
                             f"{plan.ranks[plan.mirror[r]]}, holds no scatter list (a receiver); "
                             f"record the root's pieces")
        data = src(r)
        return {p: [data[p].reshape(-1)] for p in live}
    if kind == "gather":
        r = _root(plan, root, kind)
        return {p: ([src(q)[0].reshape(-1) for q in range(n)] if p == r else []) for p in live}
    if kind == "barrier":
        return {p: [] for p in live}
    raise AssertionError(kind)


def is_in_place_all_gather(output: torch.Tensor | Sequence[torch.Tensor], input: torch.Tensor,
                           position: int) -> bool:
    """Whether an all_gather's input is member ``position``'s own chunk of its output — the in-place
    form, whose output chunks of virtual members are *kept*. ``output`` is the gathered tensor
    (all_gather_into_tensor) or the list of per-member tensors (all_gather)."""
    if input.numel() == 0:
        return False
    if isinstance(output, torch.Tensor):
        return (input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()
                and input.is_contiguous() and output.is_contiguous()
                and input.data_ptr() == output.data_ptr() + position * input.nbytes)
    return output[position].data_ptr() == input.data_ptr()


def _reduce(plan: GroupPlan, src, op: str, factor: float | None, recorded: Inputs,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted reduction over the group in position order: each live input once with its
    multiplicity less the virtual members that contribute recorded inputs, each recorded input once."""
    weight = list(plan.multiplicity)
    for v in recorded:
        weight[plan.mirror[v]] -= 1
        weight[v] += 1
    terms = [term(src(p), weight[p], op, factor) for p in range(plan.size) if weight[p] > 0]
    return reduce_terms(terms, op, plan.size, out)


def _kept_chunk(kind: str, bufs: Sequence[torch.Tensor], j: int, q: int, n: int) -> torch.Tensor:
    """Member q's chunk of output buffer j as it stands (all_gather_list: output tensor q)."""
    if kind == "all_gather_list":
        return bufs[q].reshape(-1)
    flat = bufs[j].reshape(-1)
    c = flat.numel() // n
    return flat[q * c:(q + 1) * c]


def _pieces(kind: str, ins: Sequence[torch.Tensor], splits: Sequence[int] | None, n: int,
            q: int) -> list[torch.Tensor]:
    if kind == "all_to_all_list":
        return [t.reshape(-1) for t in ins]
    flat = ins[0].reshape(-1)
    if splits is None:
        if flat.numel() % n:
            raise PruneError(f"all_to_all input of member {q} ({flat.numel()} elements) does not split over {n}")
        splits = [flat.numel() // n] * n
    if len(splits) != n or sum(splits) != flat.numel():
        raise PruneError(f"all_to_all splits {list(splits)} of member {q} do not match {n} members and "
                         f"{flat.numel()} elements")
    return list(flat.split(list(splits)))


def _root(plan: GroupPlan, root: int | None, kind: str) -> int:
    if root is None or not 0 <= root < plan.size:
        raise PruneError(f"{kind} needs a root group position in [0, {plan.size}), got {root!r}")
    return root


def _check_inputs(kind: str, plan: GroupPlan, inputs: Inputs, recorded: Inputs) -> None:
    if set(inputs) != set(plan.live_positions):
        raise PruneError(f"{kind} on group {list(plan.ranks)[:8]}: inputs for positions {sorted(inputs)}, "
                         f"expected the live positions {list(plan.live_positions)}")
    for v in recorded:
        if not 0 <= v < plan.size or plan.is_live(v):
            raise PruneError(f"{kind}: recorded inputs for position {v}, which is not a virtual member")
