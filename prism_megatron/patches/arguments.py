"""Seam: ``megatron.training.arguments.add_megatron_arguments`` - the parser accepts ``--prism-*``.

Megatron builds its parser in ``parse_args`` by calling ``add_megatron_arguments`` (a module
global, looked up at call time) and parses strictly, so an unknown ``--prism-*`` flag would abort
the run. The wrapper adds the ``prism`` group (``prism_megatron.megatron.flags``) to every parser
Megatron builds, so the flags parse and land in ``args`` (and Megatron's W&B config) whatever
``extra_args_provider`` the script passes. Checked against the supported releases (``megatron.versions``).
"""

from __future__ import annotations

import argparse
import functools

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table


@once
def install() -> None:
    import megatron.training.arguments as arguments

    from prism_megatron.megatron.flags import PRISM_FLAGS, add_prism_arguments

    seam(arguments, "parse_args", CHECKED, ("extra_args_provider", "ignore_unknown_args"))
    original = seam(arguments, "add_megatron_arguments", CHECKED, ("parser",))

    @functools.wraps(original)
    def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser = original(parser)
        known = {opt for action in parser._actions for opt in action.option_strings}
        if not known & set(PRISM_FLAGS):
            add_prism_arguments(parser)
        return parser

    arguments.add_megatron_arguments = add_megatron_arguments
