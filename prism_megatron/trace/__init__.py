"""PrismTrace: the trace format (schema, writer, reader, Chrome export) and the marker API.

Stands alone: imports neither torch, Megatron nor the prism runtime. The markers are imported
eagerly (they are stdlib-only and used inside every logical rank); everything that needs pyarrow
is imported on first use, so ``from prism_megatron.trace import span`` stays cheap in a rank.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .markers import get_sink, mark, set_sink, span

if TYPE_CHECKING:
    from .chrome import to_chrome, write_chrome
    from .reader import PrismTrace, read_trace
    from .schema import FORMAT, VERSION, TraceFormatError
    from .writer import atomic_write_text, write_trace

_LAZY = {
    "FORMAT": "schema",
    "VERSION": "schema",
    "TraceFormatError": "schema",
    "PrismTrace": "reader",
    "read_trace": "reader",
    "write_trace": "writer",
    "atomic_write_text": "writer",
    "to_chrome": "chrome",
    "write_chrome": "chrome",
}

__all__ = [
    "mark",
    "span",
    "set_sink",
    "get_sink",
    "FORMAT",
    "VERSION",
    "TraceFormatError",
    "PrismTrace",
    "read_trace",
    "write_trace",
    "atomic_write_text",
    "to_chrome",
    "write_chrome",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
