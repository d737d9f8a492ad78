"""What an emulated rank does before the user's script runs (the launcher's ``rank_setup``)."""

from __future__ import annotations

from prism_megatron.megatron import cpu_mode
from prism_megatron.megatron.megatron_lm import ensure_megatron_training

__all__ = ["install_patches", "rank_setup"]


def install_patches() -> None:
    """Every seam prism hooks in an emulated run; each fails loudly if Megatron moved it."""
    from prism_megatron.patches import arguments, cpu_trainer, dataset_helpers, ddp, p2p, schedules, training_loop

    arguments.install()
    dataset_helpers.install()
    if cpu_mode.cpu_mode_active():
        cpu_trainer.install()
    schedules.install()
    training_loop.install()
    p2p.install()
    ddp.install()


def rank_setup() -> None:
    """CPU mode where there is no GPU (idempotent: usually inherited from the template), the patches."""
    if not cpu_mode.cpu_mode_active() and not cpu_mode._gpu_present():
        cpu_mode.enable_cpu_mode()
    ensure_megatron_training()
    install_patches()
