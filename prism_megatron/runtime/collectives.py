"""Host-memory semantics of every collective, on the members' tensors in group-rank order.

Reductions run in one fixed order — member 0, then 1, 2, ... accumulated in the tensors' own dtype
(as NCCL does) — so results are deterministic run to run, whatever order ranks arrived in.
The op kinds (prism_megatron.ops) call these on the members' tensors; no transport here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nccl_prune.reduction import REDUCE_OPS, reduce_terms, term

__all__ = ["REDUCE_OPS", "reduce", "reduce_scatter", "reduce_scatter_lists"]


def reduce(tensors: Sequence[torch.Tensor], op: str, factor: float | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce equally sized tensors in member order; returns a new tensor, or ``out`` written with the
    result (it may be the first input's memory, never another's: saves an allocation and a copy).

    One definition with a folded group's reduction (``nccl_prune.reduction``): every member counts once."""
    if op not in REDUCE_OPS:
        raise ValueError(f"unsupported reduce op {op!r}")
    return reduce_terms([term(t, 1, op, factor) for t in tensors], op, len(tensors), out)


def reduce_scatter(ins: Sequence[torch.Tensor], op: str, factor: float | None) -> list[torch.Tensor]:
    """Member i gets chunk i of the reduction of all (flat, equal chunks)."""
    r = reduce([t.reshape(-1) for t in ins], op, factor)
    return list(r.chunk(len(ins)))


def reduce_scatter_lists(ins: Sequence[Sequence[torch.Tensor]], op: str, factor: float | None) -> list[torch.Tensor]:
    """Member i gets the reduction over members of their i-th input (uneven sizes allowed)."""
    n = len(ins)
    return [reduce([ins[m][i].reshape(-1) for m in range(n)], op, factor) for i in range(n)]


def concat_bytes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The members' tensors' bytes one after the other, in member order (all_gather's result)."""
    return torch.cat([t.view(torch.uint8) for t in tensors])


def split_bytes(t: torch.Tensor, splits: Sequence[int]) -> list[torch.Tensor]:
    """``t``'s bytes cut into pieces of ``splits`` bytes (all_to_all_single's per-member parts)."""
    raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
    return list(raw.split(list(splits)))


def copy_local(src: torch.Tensor, out: torch.Tensor, factor: float | None = None) -> None:
    """A group of one's result: ``out`` becomes ``src`` (bytes, whatever the shapes), times ``factor``
    if given (premul_sum); nothing is copied where ``out`` is ``src``."""
    with torch.no_grad():
        if out.numel() and not (out.data_ptr() == src.data_ptr() and out.dtype == src.dtype
                                and out.shape == src.shape):
            out.copy_(src.detach().contiguous().reshape(-1).view(torch.uint8).view(out.dtype).view(out.shape))
        if factor is not None:
            out.mul_(factor)
