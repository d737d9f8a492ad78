"""Seam: ``megatron.core.datasets.utils.compile_helpers`` - use the wheel's prebuilt dataset helpers.

Megatron-LM's ``initialize_megatron`` runs ``make`` in ``megatron/core/datasets`` on rank 0 and
exits when that fails; the megatron-core wheel ships ``helpers_cpp`` already compiled and no
Makefile, so with a wheel install every run would stop there. When ``helpers_cpp`` imports, the
compile step is skipped (the original runs otherwise). ``_compile_dependencies`` imports the name
at call time, so replacing the module attribute hooks it.
Checked against the supported releases (``megatron.versions``).
"""

from __future__ import annotations

import functools
import importlib.util

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table


@once
def install() -> None:
    import megatron.core.datasets.utils as utils

    original = seam(utils, "compile_helpers", CHECKED)

    @functools.wraps(original)
    def compile_helpers() -> None:
        if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is not None:
            return None
        return original()

    utils.compile_helpers = compile_helpers
