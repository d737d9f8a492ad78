"""The ``--prism-*`` flags: one table, used by ``prism-megatron run`` and added to Megatron's parser.

Megatron parses strictly, so a flag it does not know aborts the run; ``patches.arguments`` adds
this table to the parser Megatron builds, which makes the flags legal on the script's own command
line and visible in ``args`` (and therefore in Megatron's W&B config). The table is generated from
``prism_megatron.options``, where each option is defined once (``launch`` is generated from it too).
"""

from __future__ import annotations

import argparse
from typing import Any

from prism_megatron.options import JobOptions, Option, RunOnlyOptions, options_of

__all__ = ["PRISM_FLAGS", "add_prism_arguments", "flag_takes_value", "prism_parser", "run_options"]


def _argparse_kwargs(option: Option) -> dict[str, Any]:
    """argparse keywords for one option (argparse formats help with %, so a literal % is doubled)."""
    kwargs: dict[str, Any] = {"help": option.help.replace("%", "%%")}
    if option.is_switch:
        kwargs["action"] = "store_true"
        return kwargs
    kwargs.update(type=option.type, default=option.default)
    if option.choices is not None:
        kwargs["choices"] = list(option.choices)
    else:
        kwargs["metavar"] = option.type.__name__.upper()
    return kwargs


def run_options() -> tuple[Option, ...]:
    """``run``'s options in flag order: --prism-emulate, the job's options, then run's own."""
    run_only = options_of(RunOnlyOptions)
    return (*run_only[:1], *options_of(JobOptions), *run_only[1:])


# flag -> argparse keyword arguments (dest is derived by argparse: --prism-x-y -> prism_x_y)
PRISM_FLAGS: dict[str, dict[str, Any]] = {o.prism_flag: _argparse_kwargs(o) for o in run_options()}


def add_prism_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the prism group to ``parser`` (Megatron's or ours); returns it, as Megatron's providers do."""
    group = parser.add_argument_group(title="prism", description="prism-megatron emulation")
    for flag, kwargs in PRISM_FLAGS.items():
        group.add_argument(flag, **kwargs)
    return parser


def prism_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prism-megatron run", add_help=False, allow_abbrev=False,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    return add_prism_arguments(parser)


def flag_takes_value(flag: str) -> bool:
    return PRISM_FLAGS[flag].get("action") != "store_true"
