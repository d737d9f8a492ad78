"""Entry scripts for tests and the demo; run them by path (``DRIVER_SCRIPT``), not by import."""

from pathlib import Path

DRIVER_SCRIPT: Path = Path(__file__).resolve().parent / "pretrain_gpt_mini.py"  # megatron.training's pretrain
CORE_DRIVER_SCRIPT: Path = Path(__file__).resolve().parent / "core_gpt.py"  # megatron.core only

__all__ = ["CORE_DRIVER_SCRIPT", "DRIVER_SCRIPT"]
