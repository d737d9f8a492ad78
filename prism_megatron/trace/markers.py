"""Scheduling-unit markers: the tiny API that hooks (and users) call from training code.

Training code calls ``mark``/``span`` unconditionally; whether anything is recorded depends on
the sink that the prism runtime installs in a logical rank. Without a sink (the program is not
running under prism) both are near-free no-ops, so hooks can stay in place. This module imports
nothing beyond the standard library, so importing it costs nothing in a rank.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class MarkSink(Protocol):
    """Receives markers; the runtime's implementation stamps time and compute clock."""

    def record_mark(self, name: str, phase: str, attrs: dict[str, Any]) -> None: ...


#: Spans of Megatron's training loop that its iteration timer (``interval-time``, which the logged
#: ``elapsed time per iteration`` reads) stops for: an evaluation, a checkpoint save. Recorded by
#: ``patches.training_loop``; the replay leaves them out of the iteration they fall in.
EVALUATE = "evaluate"
CHECKPOINT_SAVE = "checkpoint_save"
TIMER_PAUSES = (EVALUATE, CHECKPOINT_SAVE)

_sink: MarkSink | None = None


def set_sink(sink: MarkSink | None) -> MarkSink | None:
    """Install ``sink`` (None removes it); return the previous one so callers can restore it."""
    global _sink
    if sink is not None and not callable(getattr(sink, "record_mark", None)):
        raise TypeError(f"marker sink {sink!r} has no record_mark(name, phase, attrs) method")
    previous, _sink = _sink, sink
    return previous


def get_sink() -> MarkSink | None:
    """The installed sink, or None when markers are not being recorded."""
    return _sink


def mark(name: str, **attrs: Any) -> None:
    """Record an instant marker ``name`` with ``attrs`` (JSON-serialisable values)."""
    sink = _sink
    if sink is not None:
        sink.record_mark(name, "i", attrs)


class _Span:
    """Records B on entry and E on exit, both to the sink present at entry (so they pair up)."""

    __slots__ = ("_name", "_attrs", "_sink")

    def __init__(self, name: str, attrs: dict[str, Any]) -> None:
        self._name = name
        self._attrs = attrs
        self._sink: MarkSink | None = None

    def __enter__(self) -> _Span:
        sink = _sink
        if sink is not None:
            sink.record_mark(self._name, "B", self._attrs)
            self._sink = sink
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            # The span ends even when its body raises; say why, so a timeline shows the failure.
            sink.record_mark(self._name, "E", {} if exc_type is None else {"error": exc_type.__name__})


class _NoSpan:
    """Shared do-nothing context manager returned when no sink is installed."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN = _NoSpan()


def span(name: str, **attrs: Any) -> _Span | _NoSpan:
    """Context manager marking a scheduling unit: B on entry, E on exit (also on exceptions)."""
    if _sink is None:
        return _NO_SPAN
    return _Span(name, attrs)
