"""A script under bench/ loaded as a module, so tests can call its functions (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_bench(relpath: str) -> ModuleType:
    """``bench/<relpath>`` executed as a fresh module named after its file (listed in ``sys.modules`` while it
    runs, as an import would: dataclasses look their module up there)."""
    path = ROOT / "bench" / relpath
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module
