"""Seam: ``megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator`` - label pipeline p2p ops.

The schedules move activations and gradients between stages only through these methods, so
wrapping them names every send/recv in the trace (``label`` column) after the method that issued
it: ``send_forward``, ``recv_forward``, ``send_backward_recv_forward``, ... (with overlapped p2p the
ops are issued inside the call and complete later; the label is attached at issue). Checked
against the supported releases (``megatron.versions``).
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table
_MODULE = "megatron.core.pipeline_parallel.p2p_communication"
METHODS = ("recv_forward", "recv_backward", "send_forward", "send_backward", "send_forward_recv_backward",
           "send_backward_recv_forward", "send_forward_recv_forward", "send_backward_recv_backward",
           "send_forward_backward_recv_forward_backward")


def _labelled(method: Any, label: str) -> Any:
    from prism_megatron.runtime.backend import op_label

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with op_label(label):
            return method(*args, **kwargs)

    return wrapper


@once
def install() -> None:
    import importlib

    cls = seam(importlib.import_module(_MODULE), "P2PCommunicator", CHECKED)
    for name in METHODS:
        setattr(cls, name, _labelled(seam(cls, name, CHECKED), name))
