"""The shipped recipes (``mini/``) and cluster profiles (``clusters/``): YAML package data.

They travel inside the package (wheel, sdist, editable install alike), so ``prism-megatron recipe
list`` and ``run --recipe`` work from any directory after ``pip install``. Loaded by
``prism_megatron.recipe.load`` and ``prism_megatron.calibration.profiles`` from :data:`ROOT`.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["ROOT"]

#: The folder holding the YAML files (a real directory: the package is never installed zipped).
ROOT: Path = Path(str(files(__name__)))
