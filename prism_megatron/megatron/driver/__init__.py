"""Entry scripts for tests and the demo; run them by path (``DRIVER_SCRIPT``), not by import."""

from pathlib import Path

DRIVER_SCRIPT: Path = Path(__file__).resolve().parent / "pretrain_gpt_mini.py"  # megatron.training's pretrain
CORE_DRIVER_SCRIPT: Path = Path(__file__).resolve().parent / "core_gpt.py"  # megatron.core only

#: the training driver's argument defaults (Megatron's ``args_defaults``): what another script given a
#: recipe's flags (Megatron-LM's pretrain_gpt.py, which defaults to a GPT-2 tokenizer and no evaluation
#: interval) needs as flags to run the same job
DRIVER_ARG_DEFAULTS: dict = {"tokenizer_type": "NullTokenizer", "eval_interval": 1000}

__all__ = ["CORE_DRIVER_SCRIPT", "DRIVER_ARG_DEFAULTS", "DRIVER_SCRIPT"]
