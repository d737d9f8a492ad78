"""The megatron-core versions prism supports: the one place that says which, on what, and how.

Read by the seams' version checks (``prism_megatron.patches`` and ``cpu_mode`` name these versions
when a seam moved), by ``prism-megatron run``'s ``--prism-driver auto``, by ``setup.py`` (the
``megatron-core`` requirement) and by CI (``.ci/run`` pins the second stack from here); the README's
"tested" line is :func:`tested_line` (a test keeps them equal). Standard library only: ``setup.py``
and ``.ci/run`` load this file by path, before anything is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SUPPORTED", "TORCH_TESTED", "MegatronSupport", "auto_driver", "checked_versions", "requirement",
           "support_for", "tested_line"]


@dataclass(frozen=True)
class MegatronSupport:
    """One supported megatron-core release."""

    version: str  # the release the seams and drivers were checked against
    python: str  # the Python CI runs it on (megatron-core 0.17+ requires Python >= 3.12)
    auto_driver: str  # what ``--prism-driver auto`` takes: "training" (when importable) or "core"
    why: str  # why that driver
    checked: str  # what was run with it


#: torch release both stacks are tested with.
TORCH_TESTED = "2.13.0"

SUPPORTED: tuple[MegatronSupport, ...] = (
    MegatronSupport(
        version="0.16.1", python="3.11", auto_driver="training",
        why="megatron.training is importable (a Megatron-LM checkout: the wheel lacks it)",
        checked="the whole suite on CPU (the training driver where a core_v0.16.1 checkout is found); "
                "both drivers on an H200"),
    MegatronSupport(
        version="0.19.2", python="3.12", auto_driver="training",
        why="megatron.training ships in the wheel",
        checked="the Megatron tests on CPU (both drivers); both drivers on an H200 "
                "(bench/gpu/training_driver.sh)"),
)


def checked_versions() -> tuple[str, ...]:
    """Every supported release, as the seams name them."""
    return tuple(s.version for s in SUPPORTED)


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def support_for(version: str) -> MegatronSupport | None:
    """The table's row for ``version``'s major.minor (0.19.x reads as 0.19.2), or None."""
    for row in SUPPORTED:
        if _minor(row.version) == _minor(version):
            return row
    return None


def auto_driver(version: str | None) -> tuple[str, str]:
    """``(driver, why)`` that ``auto`` takes for an installed megatron-core ``version`` (None: unknown)."""
    row = support_for(version) if version else None
    if row is None:
        known = ", ".join(checked_versions())
        return "core", f"megatron-core {version or '(version unknown)'} is not a supported release ({known})"
    return row.auto_driver, row.why


def requirement() -> str:
    """The ``megatron-core`` requirement: from the oldest supported minor to the next after the newest."""
    low = min(_minor(s.version) for s in SUPPORTED)
    high = max(_minor(s.version) for s in SUPPORTED)
    return f"megatron-core>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"


def tested_line() -> str:
    """The README's one-line statement of what is tested."""
    stacks = "; ".join(f"megatron-core {s.version} on Python {s.python}" for s in SUPPORTED)
    return f"Tested with torch {TORCH_TESTED}: {stacks}."
