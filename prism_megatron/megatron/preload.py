"""Imported once by the launcher's template before it forks the ranks (``--preload``).

Forked ranks share these pages, so importing torch, megatron-core and Megatron-LM's trainer here
makes each rank start in milliseconds instead of seconds (the trainer is skipped for the
megatron.core-only driver: ``emulate.uses_training``). On a machine without a GPU, CPU mode is
enabled first - before Megatron's import-time code runs - and the forks inherit it.
"""

from __future__ import annotations

import importlib
import warnings

from prism_megatron.megatron import cpu_mode
from prism_megatron.megatron.megatron_lm import ensure_megatron_training

with warnings.catch_warnings():  # import-time notes (no apex, no TE...) once, not on the terminal
    warnings.simplefilter("ignore")
    if not cpu_mode.cpu_mode_active() and not cpu_mode._gpu_present():
        cpu_mode.enable_cpu_mode()
    from prism_megatron.megatron.emulate import (
        TEMPLATE_IMPORTS,
        TEMPLATE_TRAINING_IMPORTS,
        install_patches,
        uses_training,
    )

    _training = uses_training()  # False: the megatron.core-only driver; the trainer is never imported
    if _training:
        ensure_megatron_training()
    for _module in (*TEMPLATE_IMPORTS, *(TEMPLATE_TRAINING_IMPORTS if _training else ())):
        importlib.import_module(_module)

    install_patches(_training)
