"""A script under bench/ loaded as a module, so tests can call its functions (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_bench(relpath: str) -> ModuleType:
    """``bench/<relpath>`` executed as a fresh module named after its file."""
    path = ROOT / "bench" / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
