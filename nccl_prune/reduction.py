"""Reductions in which one input stands for several identical members (multiplicity-weighted).

A folded group of n members has fewer distinct inputs than members: a live member's input counts
once for itself and once for every virtual member that mirrors it. ``term(x, m, op)`` is what m
identical copies of x contribute; ``reduce_terms`` combines the terms of the contributors in group
position order, accumulating in the tensors' own dtype. With every multiplicity 1 it performs the same
tensor operations in the same order as the runtime's full reduction (so a fold with no virtual
member gives bitwise the runtime's result); with larger multiplicities the sum of m copies is one
product, exact for integer dtypes and within the rounding of the additions it replaces for floats.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

REDUCE_OPS = ("sum", "avg", "min", "max", "product", "premul_sum", "band", "bor", "bxor")
#: ops where another copy of the same input changes nothing (x op x == x)
IDEMPOTENT_OPS = frozenset({"min", "max", "band", "bor"})


def effective_op(op: str, dtype: torch.dtype) -> str:
    """The op as the runtime applies it to ``dtype``: on bool, sum/max are OR and min/product are AND."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unsupported reduce op {op!r} (one of {', '.join(REDUCE_OPS)})")
    if dtype == torch.bool and op in ("sum", "max"):
        return "bor"
    if dtype == torch.bool and op in ("min", "product"):
        return "band"
    return op


def term(x: torch.Tensor, m: int, op: str, factor: float | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """What ``m`` members holding ``x`` contribute to a reduction by ``op`` (may return ``x`` itself).

    sum/avg: m·x (a sum of m copies; bool adds as OR, so x); premul_sum: (x·factor)·m (each member
    pre-multiplies, as NCCL does); product: x**m; bxor: x for odd m, else zeros (x ^ x == 0, exact);
    min/max/band/bor: x (idempotent).
    ``out``: write the term there (it may be ``x`` itself) instead of into a new tensor: the same
    elementwise operations, so the same bits, without a temporary of x's size.
    """
    if m < 1:
        raise ValueError(f"a reduction term needs a multiplicity >= 1, got {m}")
    eop = effective_op(op, x.dtype)
    if eop == "premul_sum":
        t = x * factor if out is None else torch.mul(x, factor, out=out)
        return t if m == 1 else t.mul_(m)
    if m == 1 or eop in IDEMPOTENT_OPS or (x.dtype == torch.bool and eop == "avg"):
        return x if out is None or _same(out, x) else out.copy_(x)
    if eop in ("sum", "avg"):
        return x * m if out is None else torch.mul(x, m, out=out)
    if eop == "product":
        return torch.pow(x, m) if out is None else torch.pow(x, m, out=out)
    if eop == "bxor":
        if m % 2:
            return x if out is None or _same(out, x) else out.copy_(x)
        return torch.zeros_like(x) if out is None else out.zero_()
    raise AssertionError(eop)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape


def reduce_terms(terms: Sequence[torch.Tensor], op: str, group_size: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Combine ``terms`` (from ``term``, in group position order) by ``op``; avg divides by ``group_size``
    (all members, virtual included). Returns a new tensor, or ``out`` (which may be the first term's
    memory, never another's) written with the result. premul_sum terms are already multiplied."""
    first = terms[0]
    eop = effective_op(op, first.dtype)
    if eop == "premul_sum":
        # the term is a fresh product (``term``), or ``out`` itself where it was written there
        acc = first if out is None or out.data_ptr() == first.data_ptr() else out.copy_(first)
        for t in terms[1:]:
            acc.add_(t)
        return acc
    if out is None:
        acc = first.clone()
    else:
        acc = out if out.data_ptr() == first.data_ptr() else out.copy_(first)
    for t in terms[1:]:
        if eop in ("sum", "avg"):
            acc.add_(t)
        elif eop == "min":
            torch.minimum(acc, t, out=acc)
        elif eop == "max":
            torch.maximum(acc, t, out=acc)
        elif eop == "product":
            acc.mul_(t)
        elif eop == "band":
            acc.bitwise_and_(t)
        elif eop == "bor":
            acc.bitwise_or_(t)
        elif eop == "bxor":
            acc.bitwise_xor_(t)
    if eop == "avg":
        acc = finish_avg(acc, group_size, out)
    return acc


def finish_avg(acc: torch.Tensor, group_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A sum turned into the average over ``group_size`` members: floats divide; integers (and bool)
    truncate, as the runtime does."""
    if acc.is_floating_point() or acc.is_complex():
        return acc.div_(group_size)
    r = torch.div(acc, group_size, rounding_mode="trunc").to(acc.dtype)
    return out.copy_(r) if out is not None else r
