"""A command's Megatron args, as Megatron's own parser makes them, without running the command.

The script decides the parser, as it does when the ranks run: the core driver (``core_gpt.py``)
parses with its own parser; any other script (the training driver, a user's ``pretrain_gpt.py``)
with Megatron-LM's ``megatron.training.arguments`` (``parse_args`` + ``validate_args``, or 0.19's
``parse_and_validate_args``), as rank 0 of ``WORLD_SIZE`` ranks would. Parsing runs in a child
process: the core driver switches on CPU mode when imported, and Megatron-LM's parser keeps global
state and needs the stand-ins of ``megatron_lm``; none of that may touch the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ArgsError", "parse_megatron_args", "padded_vocab", "ESTIMATE_KEY"]

#: key of the parsed args that holds Megatron's theoretical memory of the most loaded shard
#: (``workload.megatron_estimate``, computed in the child where megatron.training is imported)
ESTIMATE_KEY = "prism_megatron_estimate"

_MARK = "PRISM-MEGATRON-ARGS "


class ArgsError(ValueError):
    """Megatron's parser refused the command; the message carries its words."""


def parse_megatron_args(script: Path, script_args: list[str], world_size: int,
                        env: dict[str, str] | None = None, timeout: float = 300.0) -> argparse.Namespace:
    """Megatron's parsed args for ``script script_args`` at ``world_size`` ranks (values that are not
    JSON, such as dtypes, come back as their ``repr``)."""
    child_env = {**os.environ, **(env or {}), "WORLD_SIZE": str(world_size), "RANK": "0", "LOCAL_RANK": "0"}
    cmd = [sys.executable, "-W", "ignore", "-m", __name__, str(script), str(world_size), *script_args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=child_env, timeout=timeout)
    line = next((x for x in reversed(out.stdout.splitlines()) if x.startswith(_MARK)), None)
    if out.returncode != 0 or line is None:
        tail = "\n".join((out.stderr.strip() or out.stdout.strip()).splitlines()[-6:])
        raise ArgsError(f"Megatron's parser refused the command for {Path(script).name}: {tail}")
    return argparse.Namespace(**json.loads(line[len(_MARK):]))


def _parse_here(script: Path, argv: list[str]) -> argparse.Namespace:
    from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT, DRIVER_SCRIPT

    if script.resolve() == CORE_DRIVER_SCRIPT:
        import importlib.util

        spec = importlib.util.spec_from_file_location("prism_core_gpt", CORE_DRIVER_SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.parse_args(argv)
    from prism_megatron.megatron import cpu_mode
    from prism_megatron.megatron.flags import add_prism_arguments
    from prism_megatron.megatron.megatron_lm import ensure_megatron_training

    if not cpu_mode.cpu_mode_active() and not cpu_mode._gpu_present():
        cpu_mode.enable_cpu_mode()  # validate_args asks torch.cuda for the device's architecture, as ranks do
    ensure_megatron_training()
    from megatron.training import arguments

    defaults = {"tokenizer_type": "NullTokenizer"} if script.resolve() == DRIVER_SCRIPT else {}
    sys.argv = [str(script), *argv]
    if hasattr(arguments, "parse_and_validate_args"):  # 0.19.x
        return arguments.parse_and_validate_args(extra_args_provider=add_prism_arguments, args_defaults=defaults)
    args = arguments.parse_args(extra_args_provider=add_prism_arguments, ignore_unknown_args=False)
    return arguments.validate_args(args, defaults)


def padded_vocab(args: argparse.Namespace) -> int | None:
    """The padded vocabulary Megatron builds: ``padded_vocab_size`` where the parser set it, else a
    NullTokenizer's (one EOD id added) padded to ``make_vocab_size_divisible_by`` x TP as Megatron pads
    it; None where only the tokenizer knows it."""
    import math

    vocab = getattr(args, "padded_vocab_size", None)
    if vocab is None and getattr(args, "tokenizer_type", None) == "NullTokenizer" and getattr(args, "vocab_size", None):
        multiple = (getattr(args, "make_vocab_size_divisible_by", None) or 128) * args.tensor_model_parallel_size
        vocab = math.ceil((args.vocab_size + 1) / multiple) * multiple
    return vocab


def _estimate(args: argparse.Namespace, world: int) -> dict:
    """Megatron's theoretical memory (``workload.megatron_estimate``) for the job's sizes, or why none."""
    from prism_megatron.megatron.megatron_lm import ensure_megatron_training, training_available
    from prism_megatron.megatron.workload import megatron_estimate

    if training_available():
        try:
            ensure_megatron_training()
        except Exception as e:  # the formula only: the plan goes on without it, saying why
            return {"error": f"megatron.training does not import ({type(e).__name__}: {e})"}
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    dp = world // (tp * pp * (getattr(args, "context_parallel_size", None) or 1))
    vocab = padded_vocab(args)
    if vocab is None:
        return {"error": "the padded vocabulary is known only once the tokenizer is built (not a NullTokenizer)"}
    micro = args.global_batch_size // (args.micro_batch_size * dp) if dp else 0
    if micro < 1:
        return {"error": f"global batch {args.global_batch_size} < micro batch {args.micro_batch_size} x DP{dp}"}
    return megatron_estimate(args, vocab, data_parallel_size=dp, num_microbatches=micro) | {"vocab": vocab}


def _main(argv: list[str]) -> int:
    script, world, rest = Path(argv[0]), int(argv[1]), argv[2:]
    os.environ["WORLD_SIZE"] = str(world)
    try:
        args = _parse_here(script, rest)
    except AssertionError as e:  # validate_args' checks
        print(f"validate_args: {e}", file=sys.stderr)
        return 2
    out = vars(args)
    out[ESTIMATE_KEY] = _estimate(args, world)
    print(_MARK + json.dumps(out, default=repr), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
