"""The ``--prism-*`` flags: one table, used by ``prism-megatron run`` and added to Megatron's parser.

Megatron parses strictly, so a flag it does not know aborts the run; ``patches.arguments`` adds
this table to the parser Megatron builds, which makes the flags legal on the script's own command
line and visible in ``args`` (and therefore in Megatron's W&B config). Later issues add rows.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["PRISM_FLAGS", "add_prism_arguments", "flag_takes_value", "prism_parser"]

# flag -> argparse keyword arguments (dest is derived by argparse: --prism-x-y -> prism_x_y)
PRISM_FLAGS: dict[str, dict[str, Any]] = {
    "--prism-emulate": dict(action="store_true",
                            help="Emulate the target job with prism (without it nothing is patched)."),
    "--prism-world-size": dict(type=int, default=None,
                               help="Ranks of the target job (a recipe gives it; else required)."),
    "--prism-devices": dict(type=str, default="cpu", help="'cpu' or CUDA device indices, e.g. 0 or 0,1."),
    "--prism-slots-per-device": dict(type=int, default=1, help="Ranks that compute at once on each device."),
    "--prism-trace-dir": dict(type=str, default="prism-trace", help="Where the PrismTrace goes."),
    "--prism-hang-timeout": dict(type=float, default=120.0,
                                 help="Seconds with every rank blocked before the job is declared hung."),
    "--prism-log-ranks": dict(type=str, default="last",
                              help="Ranks whose output reaches the terminal ('0,last', 'all', ...); "
                                   "Megatron prints iteration lines on the last rank."),
    "--prism-gpus-per-node": dict(type=int, default=8, help="GPUs per node of the target cluster."),
    "--prism-threads-per-rank": dict(type=int, default=1, help="torch threads per emulated rank."),
    "--prism-recipe": dict(type=str, default=None, help="Recipe name or file (also --recipe)."),
    "--prism-driver": dict(type=str, default="auto", choices=["auto", "core", "training"],
                           help="GPT driver a recipe runs: 'training' (Megatron-LM's pretrain, needs "
                                "megatron.training), 'core' (megatron.core only), 'auto' (training if "
                                "importable, else core)."),
    "--prism-target-gpu": dict(type=str, default=None,
                               help="GPU of the target cluster (h100-80gb, h200-141gb, a100-80gb, ... or a capacity "
                                    "in GiB): each rank is capped at its memory, so an OOM it would hit happens "
                                    "here and is reported as a prediction."),
    "--prism-target-context": dict(type=float, default=None,
                                   help="GiB a rank of the target holds outside PyTorch's allocator (CUDA "
                                        "context, cuBLAS, NCCL buffers); default 3.5 (measured on H200s)."),
    "--prism-track-memory": dict(type=str, default="auto", choices=["auto", "on", "off"],
                                 help="Per-rank memory figures: 'auto' is on for GPUs and for a capped CPU run "
                                      "(the CPU byte accountant costs ~12 us per op)."),
    "--prism-gpu-timing": dict(type=str, default="auto", choices=["auto", "on", "off"],
                               help="On GPUs, each compute segment's host time and device busy time (CUDA "
                                    "profiler), so the prediction lets the host run ahead as with NCCL; 'auto' "
                                    "is on for GPUs."),
    "--prism-calibrate": dict(type=str, default="off", choices=["off", "on"],
                              help="After the run, calibrate: re-run the job once per slice (coupled groups such "
                                   "as TP kept whole) with the slice's ranks computing for real and the others "
                                   "replayed; the report then predicts from the calibrated graph."),
    "--prism-calibrate-ranks-per-device": dict(type=int, default=2,
                                               help="Slice ranks computing at once on each device while "
                                                    "calibrating (a slice holds devices x this)."),
    "--prism-report": dict(type=str, default="on", choices=["on", "off"],
                           help="After the run: the report (terminal, report.json/html, timeline) and W&B."),
    "--prism-anchor-fake-pg": dict(action="store_true",
                                   help="After the run, also run one rank per class alone under Megatron's "
                                        "--fake-process-group and show its peak memory beside ours in the report."),
    "--prism-swap": dict(type=str, default="auto", choices=["auto", "none", "checkpoint"],
                         help="Move blocked ranks' GPU state to host memory when a device is full (CUDA process "
                              "checkpoint, which excludes GPU timing). 'auto': swap in set-up and iteration 1 if "
                              "needed; a device whose ranks needed none is then timed and swaps no more."),
    "--prism-staging": dict(type=str, default="auto", choices=["auto", "pageable"],
                            help="GPU ranks' staging memory for collectives: 'auto' page-locks it (copies between "
                                 "the GPU and the coordinator several times faster); 'pageable' does not."),
    "--prism-device-memory": dict(type=float, default=None,
                                  help="GiB per device that ranks' state may take (default: the GPU's total)."),
    "--prism-host-memory": dict(type=float, default=None,
                                help="GiB of host RAM swapped-out GPU state may take (default: 90%% of the RAM "
                                     "available at start)."),
    "--prism-cluster": dict(type=str, default=None,
                            help="Cluster profile that costs communication in the prediction "
                                 "(prism-megatron cluster list); default: free communication."),
}


def add_prism_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the prism group to ``parser`` (Megatron's or ours); returns it, as Megatron's providers do."""
    group = parser.add_argument_group(title="prism", description="prism-megatron emulation")
    for flag, kwargs in PRISM_FLAGS.items():
        group.add_argument(flag, **kwargs)
    return parser


def prism_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prism-megatron run", add_help=False, allow_abbrev=False)
    return add_prism_arguments(parser)


def flag_takes_value(flag: str) -> bool:
    return PRISM_FLAGS[flag].get("action") != "store_true"
