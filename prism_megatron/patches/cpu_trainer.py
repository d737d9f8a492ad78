"""Seam: ``megatron.training.training.initialize_megatron`` - let Megatron-LM's trainer start on CPU.

``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless ``allow_no_cuda=True``; CPU
mode keeps ``is_available()`` truthful (False), so ``pretrain`` would stop there. While CPU mode
is active, ``pretrain``'s call gets ``allow_no_cuda=True`` (that flag only skips the assert).
Seam: ``megatron.legacy.fused_kernels.load`` - it only probes ``$CUDA_HOME/bin/nvcc`` (and fails
without CUDA); in CPU mode it does nothing (0.19 has no ``megatron.legacy``, and no such load).
Never installed with a GPU: CPU mode refuses to engage there.
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
    """Patch the name ``pretrain`` calls (``megatron.training.training.initialize_megatron``)."""
    import megatron.training.training as training

    from prism_megatron.megatron.cpu_mode import cpu_mode_active

    original = seam(training, "initialize_megatron", CHECKED, ("allow_no_cuda",))

    @functools.wraps(original)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        if cpu_mode_active():
            kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)

    training.initialize_megatron = initialize_megatron

    try:
        import megatron.legacy.fused_kernels as fused_kernels
    except ModuleNotFoundError:  # megatron-core 0.19 ships no megatron.legacy: nothing loads fused kernels
        return

    original_load = seam(fused_kernels, "load", CHECKED, ("args",))

    @functools.wraps(original_load)
    def load(args: Any) -> None:
        if not cpu_mode_active():
            return original_load(args)
        return None

    fused_kernels.load = load
