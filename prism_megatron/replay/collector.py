"""Python's cyclic garbage collector paused while a replay builds and walks its graph.

A thousand-rank job's replay allocates millions of long-lived objects (events, ops, segments) that form
no garbage cycles: each of the collector's full passes re-traverses all of them, a large share of such a
job's report step (docs/measurements.md, "The report step"). Reference counting still frees everything;
cycles made meanwhile are collected once the collector runs again.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused"]


@contextmanager
def paused() -> Iterator[None]:
    """The cyclic collector off inside the block, back as it was after (nested blocks leave it to the outer)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
