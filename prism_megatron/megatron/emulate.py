"""What an emulated rank does before the user's script runs (the launcher's ``rank_setup``)."""

from __future__ import annotations

import os

from prism_megatron.megatron import cpu_mode
from prism_megatron.megatron.megatron_lm import ensure_megatron_training, training_available

__all__ = ["TEMPLATE_IMPORTS", "TEMPLATE_TRAINING_IMPORTS", "install_patches", "install_rendering_patches",
           "rank_setup", "uses_training"]

#: what the launcher's template imports before it forks the ranks (``megatron.preload``): forked ranks share these
#: pages, so each starts in milliseconds; the trainer's only where the ranks run it (:func:`uses_training`)
TEMPLATE_IMPORTS = ("megatron.core.datasets.gpt_dataset", "megatron.core.distributed",
                    "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.optimizer",
                    "megatron.core.pipeline_parallel.schedules")
TEMPLATE_TRAINING_IMPORTS = ("megatron.training", "megatron.training.training")


def uses_training() -> bool:
    """Whether the ranks run Megatron-LM's trainer (``megatron.training``) or megatron.core only.

    ``PRISM_MEGATRON_DRIVER`` (set by ``prism-megatron run``) decides; without it, whether
    ``megatron.training`` is importable. The core-only path must never import the trainer.
    """
    driver = os.environ.get("PRISM_MEGATRON_DRIVER", "auto")
    if driver in ("core", "training"):
        return driver == "training"
    return training_available()


def install_patches(training: bool = True) -> None:
    """Every seam prism hooks in an emulated run; each fails loudly if Megatron moved it.

    With ``training=False`` only the megatron.core seams (schedules, p2p, DDP, dataset helpers):
    the trainer's seams (argument parser, ``initialize_megatron``, ``train_step``) do not exist.
    """
    from prism_megatron.patches import dataset_helpers, ddp, p2p, schedules

    dataset_helpers.install()
    if training:
        from prism_megatron.patches import arguments, cpu_trainer, training_loop

        arguments.install()
        if cpu_mode.cpu_mode_active():
            cpu_trainer.install()
        training_loop.install()
    schedules.install()
    p2p.install()
    ddp.install()
    install_rendering_patches()
    from prism_megatron.patches import moe_counts, moe_fold

    if os.environ.get(moe_fold.ENV_VAR):  # a fold whose expert peers are virtual (megatron.run sets it)
        moe_fold.install()  # the dispatcher's count all-gather
        moe_counts.install()  # the router's count reductions (aux losses, expert-bias update)
    from prism_megatron.patches import tp_fold_cross_entropy, tp_fold_embedding

    if os.environ.get(tp_fold_embedding.ENV_VAR):  # a fold whose TP peers mirror the live rank (megatron.run)
        tp_fold_embedding.install()  # the word embedding's tokens
        tp_fold_cross_entropy.install()  # the loss's targets, translated the same way
    from prism_megatron.launcher.serial import CAPTURE_ENV

    if os.environ.get(CAPTURE_ENV) == "serial":  # one capture of a serial run (the launcher sets it per rank)
        from prism_megatron.patches import serial_embedding

        serial_embedding.install()


def install_rendering_patches() -> list[str]:
    """The seams that make the program a rank runs (the model's modules), not how it communicates:
    what a rank run without prism (Megatron's ``--fake-process-group``: ``megatron.fake_pg_child``)
    installs so that its model is the one prism's ranks build. Returns the names of those installed."""
    from prism_megatron.patches import attention, mla_attention, norm

    norm.install()  # the local spec's torch norms under --sequence-parallel, as TE's and apex's take it
    mla_attention.install()  # the local core attention under multi-latent attention, as TE's takes it
    installed = ["norm", "mla_attention"]
    if os.environ.get(attention.ENV_VAR) == "sdpa":  # --prism-attention sdpa (megatron.run sets it)
        attention.install()
        installed.append("attention sdpa")
    from prism_megatron.patches import grouped_experts

    if os.environ.get(grouped_experts.ENV_VAR) == "grouped":  # --prism-experts grouped (megatron.run sets it)
        grouped_experts.install()
        installed.append("experts grouped")
    from prism_megatron.patches import fused_optimizer

    if os.environ.get(fused_optimizer.ENV_VAR) == "fused":  # --prism-optimizer fused (megatron.run sets it)
        fused_optimizer.install()
        installed.append("optimizer fused")
    return installed


def rank_setup() -> None:
    """CPU mode where there is no GPU (idempotent: usually inherited from the template), the patches."""
    if not cpu_mode.cpu_mode_active() and not cpu_mode._gpu_present():
        cpu_mode.enable_cpu_mode()
    training = uses_training()
    if training:
        ensure_megatron_training()
    install_patches(training)
