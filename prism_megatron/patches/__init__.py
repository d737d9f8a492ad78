"""The seams of Megatron that prism hooks: one small module per seam.

Each module names the megatron-core versions it was checked against (``CHECKED``) and calls
:func:`seam` for every attribute it replaces, so a moved seam fails at start-up with the module,
the attribute and the versions named, never silently mid-run. Each ``install`` is idempotent and
returns nothing; nothing is patched unless a caller installs it (``--prism-emulate`` does).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

__all__ = ["SeamMoved", "megatron_version", "once", "seam"]


def once(install: Callable[[], None]) -> Callable[[], None]:
    """Make a seam's ``install`` idempotent: it runs until it first succeeds, then never again."""
    done = False

    @functools.wraps(install)
    def wrapper() -> None:
        nonlocal done
        if not done:
            install()
            done = True

    return wrapper


class SeamMoved(RuntimeError):
    """A Megatron attribute prism hooks is gone or has another signature in this version."""


def megatron_version() -> str:
    try:
        from megatron.core.package_info import __version__
    except ImportError:  # pragma: no cover - no megatron at all
        return "unknown"
    return __version__


def seam(module: str | ModuleType, name: str, checked: tuple[str, ...], params: tuple[str, ...] = ()) -> Any:
    """``module.name``, checked to exist and (for callables) to take ``params``; else :class:`SeamMoved`."""
    mod = importlib.import_module(module) if isinstance(module, str) else module
    where = f"{mod.__name__}.{name}"
    if not hasattr(mod, name):
        raise SeamMoved(f"prism: Megatron seam {where} is gone in megatron-core {megatron_version()} "
                        f"(checked against {', '.join(checked)}); update prism_megatron.patches")
    value = getattr(mod, name)
    if params:
        target = getattr(value, "__wrapped__", value)
        have = set(inspect.signature(target).parameters)
        lost = [p for p in params if p not in have]
        if lost:
            raise SeamMoved(f"prism: Megatron seam {where} lost parameter(s) {', '.join(lost)} in megatron-core "
                            f"{megatron_version()} (checked against {', '.join(checked)}); update "
                            "prism_megatron.patches")
    return value
