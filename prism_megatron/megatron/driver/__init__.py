"""Entry scripts for tests and the demo; run them by path (``DRIVER_SCRIPT``), not by import."""

from pathlib import Path

DRIVER_SCRIPT: Path = Path(__file__).resolve().parent / "pretrain_gpt_mini.py"

__all__ = ["DRIVER_SCRIPT"]
