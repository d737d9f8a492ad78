"""Seam: ``megatron.training.training.train_step`` - per-iteration loss and grad norm at full precision.

Megatron prints the loss with 6 decimals on the last rank only; the numerics contract compares
runs exactly, so this wrapper appends every rank's ``train_step`` result to a JSON-lines file:
``{"rank", "iteration", "loss": {name: float}, "grad_norm": float | null}``. ``train`` looks
``train_step`` up in its module at each call, so replacing the module attribute hooks it.
Checked against the supported releases (``megatron.versions``).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import seam

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table
_MODULE = "megatron.training.training"
_installed_path: str | None = None


def _number(value: Any) -> float | None:
    if value is None:
        return None
    return float(value.item() if hasattr(value, "item") else value)


def install(path: str | os.PathLike[str]) -> None:
    """Record each iteration of this rank to ``path`` (appended, one JSON object per line)."""
    global _installed_path
    if _installed_path is not None:
        return
    import megatron.training.training as training
    import torch.distributed as dist

    original = seam(training, "train_step", CHECKED, ("forward_step_func", "data_iterator", "model", "optimizer"))
    counter = {"iteration": 0}

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        counter["iteration"] += 1
        loss_dict, grad_norm = result[0], result[5]
        record = {"rank": dist.get_rank() if dist.is_initialized() else 0, "iteration": counter["iteration"],
                  "loss": {k: _number(v) for k, v in loss_dict.items()}, "grad_norm": _number(grad_norm)}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return result

    training.train_step = train_step
    _installed_path = str(path)
