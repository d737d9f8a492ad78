"""Seam: ``megatron.core.transformer.torch_norm.WrappedTorchNorm`` - norms under sequence parallelism.

A target job runs Transformer Engine's (or apex's) norms, which take sequence-parallel input. Rendered
with ``--transformer-impl local`` and neither installed, Megatron builds ``WrappedTorchNorm``, which
refuses ``config.sequence_parallel`` outright, so every target with tensor parallelism and sequence
parallelism (all of NVIDIA's dense recipes from TP2 up) would fail to build its model. The refusal is
not about the arithmetic: a norm is per token, and torch's LayerNorm/RMSNorm compute on the
sequence-sharded tokens exactly as on whole sequences. What sequence parallelism adds is that each TP
rank's norm weights see only its shard of the tokens, so their gradients must be summed over the TP
group; TE and apex mark such parameters ``sequence_parallel = True`` and Megatron's
``finalize_model_grads`` all-reduces every parameter so marked. This seam builds the torch norm and
marks its parameters the same way: values, gradients and memory are those of TE's norm on the same
tokens (the fused kernel's own workspace aside). Without ``sequence_parallel`` nothing changes.
Checked against the supported releases (``megatron.versions``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

__all__ = ["install", "sequence_parallel_new"]

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table


def sequence_parallel_new(original_new: Callable[..., Any]) -> Callable[..., Any]:
    """``WrappedTorchNorm.__new__`` that takes ``config.sequence_parallel``: the torch norm, its
    parameters marked ``sequence_parallel`` so their gradients are all-reduced over the TP group."""

    def new(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, *args, **kwargs)
        config.sequence_parallel = False  # only the refusal reads it; restored before anyone else does
        try:
            norm = original_new(cls, config, *args, **kwargs)
        finally:
            config.sequence_parallel = True
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new.__prism_sequence_parallel__ = True  # type: ignore[attr-defined]
    return new


@once
def install() -> None:
    cls = seam("megatron.core.transformer.torch_norm", "WrappedTorchNorm", CHECKED)
    original = cls.__new__
    if getattr(original, "__prism_sequence_parallel__", False):  # CPU mode installed it already
        return
    cls.__new__ = staticmethod(sequence_parallel_new(original))
