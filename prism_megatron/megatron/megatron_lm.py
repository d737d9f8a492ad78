"""Make Megatron-LM's ``megatron.training`` importable next to the installed megatron-core.

The megatron-core wheel (0.16.x) ships ``megatron.core`` only; ``megatron.training`` (the
trainer, argument parser, ``pretrain``) lives in an NVIDIA/Megatron-LM checkout. ``megatron`` is
a namespace package, so appending the checkout's root to ``sys.path`` adds ``megatron.training``
while ``megatron.core`` keeps coming from the installed wheel (with its compiled dataset
helpers). The checkout must be the tag matching the installed core (``core_v0.16.1`` here).

The trainer imports a few packages at module level that it never uses for GPT pretraining on
mock data with the null tokenizer (``six`` and ``regex`` for the BERT/GPT2 tokenizers,
``pydantic`` for the RL package, ``triton`` for batch-invariant kernels). When one is not
installed, an inert stand-in module is registered so the import succeeds; using it fails or does
nothing, which is fine for the features those packages serve. The stand-ins exist only while
the trainer's modules are imported.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["find_megatron_lm", "ensure_megatron_training", "training_available", "ENV_VAR", "DISABLE_VAR"]

ENV_VAR = "MEGATRON_LM_PATH"
# PRISM_MEGATRON_LM=none: behave as if megatron.training did not exist (no checkout search, an
# installed one ignored), to exercise the megatron.core-only path on a machine that has one.
DISABLE_VAR = "PRISM_MEGATRON_LM"
_REPO = Path(__file__).resolve().parents[2]
# Packages the trainer imports at module level but GPT pretraining on mock data never uses.
_OPTIONAL_IMPORTS = ("six", "regex", "pydantic")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ModuleNotFoundError, ValueError):
        return False


def _disabled() -> bool:
    return os.environ.get(DISABLE_VAR, "").lower() == "none"


def find_megatron_lm() -> Path | None:
    """The root of a Megatron-LM checkout (holding ``megatron/training``), or None.

    Looked for in ``$MEGATRON_LM_PATH``, ``third_party/Megatron-LM`` of this repository and
    ``Megatron-LM*`` folders beside the repository (how this machine keeps one); never with
    ``PRISM_MEGATRON_LM=none``.
    """
    if _disabled():
        return None
    candidates: list[Path] = []
    if os.environ.get(ENV_VAR):
        candidates.append(Path(os.environ[ENV_VAR]))
    candidates.append(_REPO / "third_party" / "Megatron-LM")
    candidates.extend(sorted(_REPO.parent.glob("Megatron-LM*"), reverse=True))
    for root in candidates:
        if (root / "megatron" / "training" / "arguments.py").is_file():
            return root.resolve()
    return None


class _Placeholder(type):
    """Any attribute of a stand-in module: a class that accepts anything (subclassable, callable)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__name__}.{name}")


def _placeholder(name: str) -> type:
    return _Placeholder(name, (), {
        "__init__": lambda self, *a, **k: None,
        "__call__": lambda self, *a, **k: None,
        "__init_subclass__": classmethod(lambda cls, **k: None),
    })


class _StandInModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``names`` (and their submodules) to stand-in modules; last on ``sys.meta_path``."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name, "prism: stand-in for a package megatron.training imports but "
                                           "GPT pretraining on mock data does not use")
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _check_version(root: Path) -> None:
    """The checkout's trainer must match the installed core (major.minor), or the seams differ."""
    import re
    from importlib.metadata import version

    info = root / "megatron" / "core" / "package_info.py"
    if not info.is_file():
        return
    text = info.read_text()
    found = [re.search(rf"^{key} = (\d+)", text, re.M) for key in ("MAJOR", "MINOR", "PATCH")]
    if not all(found):
        return
    checkout = ".".join(m.group(1) for m in found)
    installed = version("megatron-core")
    if checkout.split(".")[:2] != installed.split(".")[:2]:
        raise RuntimeError(f"prism: Megatron-LM at {root} is {checkout} but megatron-core {installed} is installed; "
                           f"point {ENV_VAR} at the matching tag (core_v{installed})")


@contextlib.contextmanager
def _stand_ins() -> Iterator[None]:
    """Stand-ins for the missing optional packages, only while the trainer is being imported.

    They are removed afterwards, so nothing else (torch's own triton probes included) mistakes
    them for installed packages. ``megatron.core`` is imported first, without them: its
    ``torch.compile`` decorators make torch probe for triton, and torch must see none.
    """
    import megatron.core  # noqa: F401

    missing = {name for name in _OPTIONAL_IMPORTS if not _installed(name)}
    finder = _StandInFinder(missing)
    added: dict[str, types.ModuleType] = {}
    if missing:
        sys.meta_path.append(finder)
    if not _installed("triton") and "triton" not in sys.modules:
        from prism_megatron.megatron.cpu_cuda_stubs import make_triton_stub

        added = make_triton_stub()
        sys.modules.update(added)
    try:
        yield
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        for name, module in added.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


def training_available() -> bool:
    """Whether ``megatron.training`` can be imported (installed, or from a checkout we would find).

    False with ``PRISM_MEGATRON_LM=none``. Decides the ``auto`` driver (``pretrain_gpt_mini.py``
    when True, the megatron.core-only ``core_gpt.py`` when False).
    """
    if _disabled():
        return False
    if "megatron.training.training" in sys.modules or _installed("megatron.training"):
        return True
    return find_megatron_lm() is not None


def ensure_megatron_training() -> Path | None:
    """Import ``megatron.training`` (and its trainer); returns the checkout used (None if installed).

    Raises ``RuntimeError`` naming ``$MEGATRON_LM_PATH`` when no Megatron-LM is found.
    """
    root = None
    if "megatron.training.training" in sys.modules:
        return None
    if _disabled():
        raise RuntimeError(f"prism: megatron.training is disabled ({DISABLE_VAR}=none); use the core driver "
                           "(--prism-driver core)")
    if not _installed("megatron.training"):
        root = find_megatron_lm()
        if root is None:
            raise RuntimeError(
                "prism: megatron.training is not installed (the megatron-core wheel does not ship it) "
                f"and no Megatron-LM checkout was found; set {ENV_VAR} to a checkout of NVIDIA/Megatron-LM "
                "at the tag matching megatron-core (core_v0.16.1 for 0.16.1)")
        _check_version(root)
        if str(root) not in sys.path:
            sys.path.append(str(root))  # after site-packages: megatron.core stays the installed one
        importlib.invalidate_caches()
    with _stand_ins():
        import megatron.training  # noqa: F401
        import megatron.training.training  # noqa: F401
    return root
