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

#: kinds whose results ``execute`` can write into the live members' own buffers (``into=``)
INTO_KINDS = frozenset({"all_reduce", "reduce_scatter", "reduce_scatter_list", "all_gather", "all_gather_list",
                        "all_to_all", "all_to_all_list"})


def execute(kind: str, plan: GroupPlan, inputs: Inputs, *, op: str | None = None, factor: float | None = None,
            root: int | None = None, in_splits: Mapping[int, Sequence[int]] | None = None,
            in_place: bool = False, current: Inputs | None = None, recorded: Inputs | None = None,
            out: Sequence[torch.Tensor | None] | None = None,
            into: Mapping[int, Sequence[torch.Tensor]] | None = None) -> dict[int, list[torch.Tensor]]:
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
    into (``INTO_KINDS``): live member p's output buffers, flat and laid out as its results
    (all_gather_list, all_to_all_list: one per member; all_to_all: one, of its dtype: exchange bytes with
    byte splits), written with the results and returned; the same arithmetic, with no temporary of their
    size (the executor in a rank, on its device). A buffer may be p's own input (an in-place all_reduce, a
    reduce_scatter into p's own chunk, an all_to_all's input) or hold p's own chunk (an in-place
    all_gather), never another member's input.
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
    if into is not None:
        _check_into(kind, plan, inputs, into)
    if kind in ("all_reduce", "reduce"):
        if kind == "reduce" and not plan.is_live(_root(plan, root, kind)):
            return {p: [] for p in live}
        outs = out if kind == "all_reduce" and out is not None else [None] * len(inputs[live[0]])
        if kind == "all_reduce" and into is not None:
            outs = into[live[0]]
        res = [_reduce(plan, lambda p, j=j: src(p)[j], op, factor, recorded, outs[j])
               for j in range(len(inputs[live[0]]))]
        if kind == "reduce":
            return {p: (res if p == root else []) for p in live}
        if into is not None:  # every live member's buffers, once every reduction has read its inputs
            return {p: res if p == live[0] else [b.copy_(r) for b, r in zip(into[p], res, strict=True)]
                    for p in live}
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
                                      op, factor, recorded, None if into is None else into[p][j]))
        return out
    if kind == "reduce_scatter_list":
        return {p: [_reduce(plan, lambda q, p=p: src(q)[p].reshape(-1), op, factor, recorded,
                            None if into is None else into[p][0])] for p in live}
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
            if into is not None:
                res[p] = _gather_into(kind, per_buffer, into[p])
            else:
                res[p] = [torch.cat(c) for c in per_buffer] if kind == "all_gather" else per_buffer[0]
        return res
    if kind in ("all_to_all", "all_to_all_list"):
        pieces = {}
        for q in range(n):
            if how(plan, q, recorded=recorded) == RECORDED:
                pieces[q] = _pieces(kind, recorded[q], (in_splits or {}).get(q), n, q)
            elif plan.is_live(q):
                pieces[q] = _pieces(kind, inputs[q], (in_splits or {}).get(q), n, q)
        got = {p: [pieces[q][p] if q in pieces  # a virtual member: its mirror's piece for p's counterpart
                   else pieces[plan.mirror[q]][plan.counterpart(p, q)] for q in range(n)] for p in live}
        if into is not None:
            return _exchange_into(kind, got, into)
        return {p: [torch.cat(got[p])] if kind == "all_to_all" else got[p] for p in live}
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


def _gather_into(kind: str, per_buffer: list[list[torch.Tensor]], bufs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Write gathered chunks into a member's buffers (all_gather: chunk q of buffer j; all_gather_list:
    buffer q), skipping a chunk that already is the memory it goes to (its own chunk, a kept one)."""
    pairs = []
    for j, chunks in enumerate(per_buffer):
        if kind == "all_gather_list":
            pairs += list(zip(bufs, chunks, strict=True))
        else:
            c = bufs[j].numel() // len(chunks)
            pairs += [(bufs[j][q * c:(q + 1) * c], x) for q, x in enumerate(chunks)]
    for dst, x in pairs:
        if dst.data_ptr() != x.data_ptr() or dst.dtype != x.dtype:
            dst.copy_(x)
    return list(bufs)


def _exchange_into(kind: str, got: Mapping[int, list[torch.Tensor]],
                   into: Mapping[int, Sequence[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
    """Write the pieces each live member p receives (``got[p]``, views of the members' inputs) into its
    buffers: all_to_all one after the other into its one buffer, all_to_all_list piece q into buffer q, as
    the results without ``into`` are laid out. A piece in memory that some buffer covers is copied aside
    before any write (a member's own input may be its output), unless it already is where it goes;
    otherwise no temporary: each piece is copied once, straight into place."""
    dsts = {}
    for p, pieces in got.items():
        bufs = into[p]
        sizes = [x.numel() for x in pieces]
        want = [sum(sizes)] if kind == "all_to_all" else sizes
        if [b.numel() for b in bufs] != want or any(b.dim() != 1 or not b.is_contiguous() for b in bufs):
            raise PruneError(f"{kind}: the output buffers of position {p} hold {[b.numel() for b in bufs]} "
                             f"elements, the pieces it receives {want} (flat, contiguous)")
        if any(b.dtype != x.dtype for b in bufs for x in pieces):
            raise PruneError(f"{kind}: the output buffers of position {p} are not of the pieces' dtype "
                             f"(exchange bytes: pass both as uint8)")
        dsts[p] = list(bufs[0].split(sizes)) if kind == "all_to_all" else list(bufs)
    every = [b for bufs in into.values() for b in bufs]
    pairs = []
    for p, pieces in got.items():
        for d, x in zip(dsts[p], pieces, strict=True):
            if not d.numel() or d.data_ptr() == x.data_ptr():
                continue  # nothing to write, or already there
            pairs.append((d, x.clone() if any(_overlap(b, x) for b in every) else x))
    for d, x in pairs:
        d.copy_(x)
    return {p: list(into[p]) for p in got}


def _check_into(kind: str, plan: GroupPlan, inputs: Inputs, into: Mapping[int, Sequence[torch.Tensor]]) -> None:
    if kind not in INTO_KINDS:
        raise PruneError(f"{kind}: results cannot be written into the members' buffers (into=)")
    if set(into) != set(plan.live_positions):
        raise PruneError(f"{kind}: buffers for positions {sorted(into)}, expected the live positions "
                         f"{list(plan.live_positions)}")
    if kind in ("all_to_all", "all_to_all_list"):  # sizes follow the splits: checked with the pieces
        return
    n = plan.size
    for p, bufs in into.items():
        ins = inputs[p]
        if kind == "all_reduce":
            want = [x.numel() for x in ins]
        elif kind == "reduce_scatter":
            want = [x.numel() // n for x in ins]
        elif kind == "reduce_scatter_list":
            want = [ins[p].numel()]
        elif kind == "all_gather":
            want = [x.numel() * n for x in ins]
        else:
            want = [ins[0].numel()] * n
        got = [b.numel() for b in bufs]
        if got != want or any(b.dim() != 1 or not b.is_contiguous() for b in bufs):
            raise PruneError(f"{kind}: the output buffers of position {p} hold {got} elements, expected {want} "
                             f"(flat, contiguous)")


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
    multiplicity less the virtual members that contribute recorded inputs, each recorded input once.
    ``out`` gets the result; the first term is written straight into it where no input is read after
    that write (``out`` is that term's own input, or shares memory with no input)."""
    weight = list(plan.multiplicity)
    for v in recorded:
        weight[plan.mirror[v]] -= 1
        weight[v] += 1
    contributors = [p for p in range(plan.size) if weight[p] > 0]
    xs = [src(p) for p in contributors]
    first_into = None
    if out is not None:
        if _writable_first(out, xs, op):
            first_into = out
        elif any(_overlap(out, x) for x in xs):  # it holds an input still to be read: reduce, then copy
            terms = [term(x, weight[p], op, factor) for p, x in zip(contributors, xs, strict=True)]
            return out.copy_(reduce_terms(terms, op, plan.size))
    terms = [term(x, weight[p], op, factor, out=first_into if i == 0 else None)
             for i, (p, x) in enumerate(zip(contributors, xs, strict=True))]
    return reduce_terms(terms, op, plan.size, out)


def _writable_first(out: torch.Tensor, xs: Sequence[torch.Tensor], op: str) -> bool:
    first = xs[0]
    if out.dtype != first.dtype or out.shape != first.shape or (op == "premul_sum" and not first.is_floating_point()):
        return False
    if out.data_ptr() == first.data_ptr():
        return not any(_overlap(out, x) for x in xs[1:])
    return not any(_overlap(out, x) for x in xs)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors (contiguous, flat) share any byte."""
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    return a.data_ptr() < b.data_ptr() + b.nbytes and b.data_ptr() < a.data_ptr() + a.nbytes


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
