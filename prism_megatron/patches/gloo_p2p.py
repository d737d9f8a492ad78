"""Seam: ``megatron.core.pipeline_parallel.p2p_communication._p2p_ops`` - for the gloo reference.

Only for real-process CPU runs on gloo (the numerics contract's reference), never under prism.
With overlapped p2p (the interleaved schedule's default) Megatron issues ``isend`` through
``_p2p_ops`` and, before the send completes, frees the output through ``deallocate_output_tensor``
(``out.data = torch.empty(1)``). On a GPU, NCCL's stream ordering and the caching allocator keep
the bytes valid; gloo sends from host memory in a background thread, so it may ship freed or
reused memory: PP2·VPP2 runs gave different losses run to run, once NaN. Sending private copies
restores GPU semantics. Prism needs none of this (it stages the bytes when the op is submitted).
``_communicate`` looks ``_p2p_ops`` up at call time. Checked against the supported releases (``megatron.versions``).
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table
_MODULE = "megatron.core.pipeline_parallel.p2p_communication"


@once
def install() -> None:
    import importlib

    p2p = importlib.import_module(_MODULE)
    original = seam(p2p, "_p2p_ops", CHECKED, ("tensor_send_prev", "tensor_send_next"))

    @functools.wraps(original)
    def _p2p_ops(**kwargs: Any) -> Any:
        for name in ("tensor_send_prev", "tensor_send_next"):
            if kwargs.get(name) is not None:
                kwargs[name] = kwargs[name].detach().clone()
        return original(**kwargs)

    p2p._p2p_ops = _p2p_ops
