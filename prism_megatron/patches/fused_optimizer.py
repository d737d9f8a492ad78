"""Seam: Megatron's optimizer fallbacks without Transformer Engine or apex - the target's fused step, rendered.

A target's stack has Transformer Engine, so Megatron's Adam is TE's FusedAdam and its grad-norm clip and
main-grad copies run TE's ``multi_tensor_scale`` / ``multi_tensor_l2norm``: fused kernels that allocate nothing
per tensor. Without TE or apex (this emulation machine), Megatron falls back to torch's Adam/AdamW (foreach on
a GPU: one fp32 temporary per updated parameter during the step), to ``local_multi_tensor_scale`` (a temporary
per tensor: ``dst.copy_(src * scale)``) and to a local l2 norm that synchronises with the host once per
gradient (``megatron.run.OPTIMIZER_FALLBACK``). With ``--prism-optimizer fused`` the ranks run the closest
torch has to the target's step: torch's fused Adam/AdamW (one multi-tensor kernel, in place), the clip and
copies as in-place foreach ops, the norm as one foreach norm. Checked against the supported releases
(``megatron.versions``); other optimizers (SGD, precision-aware or CPU-offloaded Adam) are left as Megatron
builds them.
"""

from __future__ import annotations

from typing import Any

import torch

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table
ENV_VAR = "PRISM_OPTIMIZER"  # "fused": the ranks install this seam (megatron.run sets it)

__all__ = ["ENV_VAR", "FusedTorchAdam", "fused_adam_importable", "install", "l2_norm", "scale"]


def fused_adam_importable() -> bool:
    """Whether Megatron's optimizer finds a fused Adam in this environment: Transformer Engine's, else apex's,
    the two it imports before falling back to torch's (PyPI's ``apex`` is another package: no optimizers)."""
    import importlib.util

    for name in ("transformer_engine", "apex.optimizers"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def FusedTorchAdam(params: Any, adam_w_mode: bool = True, **kwargs: Any) -> torch.optim.Optimizer:  # noqa: N802
    """What Megatron builds as TE's ``FusedAdam(params, adam_w_mode=..., ...)``: torch's AdamW (decoupled weight
    decay) or Adam, fused. ``capturable`` (CUDA graphs of the step) is passed through as Megatron sets it."""
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    return cls(params, fused=True, **kwargs)


def scale(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], factor: float) -> None:
    """``multi_tensor_scale``'s contract (``dst = src * factor``, list by list) without a temporary per tensor
    where the step needs none: in place when the two lists are the same tensors (the clip), a plain copy for a
    factor of 1 (main-grad and parameter copies); otherwise as Megatron's local fallback computes it."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    with torch.no_grad():
        if all(s is d for s, d in zip(src, dst, strict=True)):
            torch._foreach_mul_(dst, factor)
        elif factor == 1.0:
            torch._foreach_copy_(dst, src)
        else:
            for s, d in zip(src, dst, strict=True):
                d.copy_(s * factor)


def l2_norm(chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool,
            *args: Any) -> tuple[torch.Tensor, None]:
    """``multi_tensor_l2norm``'s contract as Megatron's fallback returns it (the norm of every tensor of every
    list together, a one-element fp32 tensor on the tensors' device; no per-tensor norms) from one foreach norm,
    without a host synchronisation per tensor."""
    tensors = [t for group in tensor_lists for t in group]
    if not tensors:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        return torch.zeros(1, dtype=torch.float, device=device), None
    norms = torch._foreach_norm(tensors)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
    return total.reshape(1), None


@once
def install() -> None:
    import megatron.core.optimizer as optimizer_pkg
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer_mod

    if not seam(optimizer_pkg, "USING_PYTORCH_OPTIMIZER", CHECKED):
        return  # a fused Adam (TE's or apex's) is importable: Megatron runs the target's step already
    seam(optimizer_pkg, "Adam", CHECKED)
    optimizer_pkg.Adam = FusedTorchAdam
    optimizer_pkg.USING_PYTORCH_OPTIMIZER = False  # so Megatron passes adam_w_mode, as to TE's FusedAdam
    for mod in (clip_grads, optimizer_mod):
        seam(mod, "multi_tensor_scale_impl", CHECKED)
        mod.multi_tensor_scale_impl = scale
    seam(clip_grads, "l2_norm_impl", CHECKED)
    clip_grads.l2_norm_impl = l2_norm
