"""Seam: ``megatron.core.distributed.param_and_grad_buffer._ParamAndGradBucketGroup`` - label bucket ops.

DDP and the distributed optimizer communicate gradients and parameters per bucket group through
``start_grad_sync`` (all-reduce, or reduce-scatter with the distributed optimizer) and
``start_param_sync`` (all-gather of updated parameters); their ops get the labels
``grad-reduce-scatter`` / ``grad-all-reduce`` and ``param-all-gather``. The gradient norm
(``clip_grads.get_grad_norm_fp32``, bound into the optimizer module) is labelled ``grad-norm``.
Checked against the supported releases (``megatron.versions``).
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table


@once
def install() -> None:
    import megatron.core.distributed.param_and_grad_buffer as buffers
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer

    from prism_megatron.runtime.backend import op_label

    group_cls = seam(buffers, "_ParamAndGradBucketGroup", CHECKED)
    grad_sync = seam(group_cls, "start_grad_sync", CHECKED, ("force_all_reduce",))
    param_sync = seam(group_cls, "start_param_sync", CHECKED, ("force_sync",))

    @functools.wraps(grad_sync)
    def start_grad_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        distributed = getattr(self.ddp_config, "use_distributed_optimizer", False)
        with op_label("grad-reduce-scatter" if distributed else "grad-all-reduce"):
            return grad_sync(self, *args, **kwargs)

    @functools.wraps(param_sync)
    def start_param_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        with op_label("param-all-gather"):
            return param_sync(self, *args, **kwargs)

    group_cls.start_grad_sync = start_grad_sync
    group_cls.start_param_sync = start_param_sync

    norm = seam(clip_grads, "get_grad_norm_fp32", CHECKED)

    @functools.wraps(norm)
    def get_grad_norm_fp32(*args: Any, **kwargs: Any) -> Any:
        with op_label("grad-norm"):
            return norm(*args, **kwargs)

    clip_grads.get_grad_norm_fp32 = get_grad_norm_fp32
    if getattr(optimizer, "get_grad_norm_fp32", None) is norm:
        optimizer.get_grad_norm_fp32 = get_grad_norm_fp32
