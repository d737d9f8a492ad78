"""A byte budget for ranks that have no GPU allocator (CPU execution mode).

On a GPU the caching allocator counts and caps a rank's memory; on CPU nothing does, so this
dispatch mode counts the bytes of every tensor storage the rank's ops create, frees them when the
storage dies (PyTorch keeps a storage's Python object alive exactly as long as the storage, so a
``weakref.finalize`` on it fires on the real free), and raises ``torch.OutOfMemoryError`` when an op
takes the rank over its cap — the same exception a capped CUDA allocator raises, so the OOM path is
the one a GPU run takes. Figures are live storage bytes: "reserved" equals "allocated" (there is no
cache). Storages the prism runtime creates for its own staging are not counted (``untracked``).
Costs a few microseconds per op, which is why it is on only where memory figures are asked for.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_local = threading.local()


@contextmanager
def untracked() -> Iterator[None]:
    """Storages created inside are not the program's (the runtime's staging copies)."""
    prev = getattr(_local, "off", False)
    _local.off = True
    try:
        yield
    finally:
        _local.off = prev


class ByteAccountant(TorchDispatchMode):
    """Counts live storage bytes created under it; raises OutOfMemoryError above ``cap``."""

    def __init__(self, cap: int | None = None) -> None:
        super().__init__()
        self.cap = cap
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self.failed: int | None = None  # bytes of the allocation that broke the cap, once it did

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if getattr(_local, "off", False):
            return out
        before = self.current
        prior: dict[int, int | None] = {}  # this op's storages: their counted bytes before it
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
                continue
            key, n = id(storage), storage.nbytes()
            old = self._live.get(key)
            prior.setdefault(key, old)
            if old is None:
                self._live[key] = n
                self.current += n
                weakref.finalize(storage, self._freed, key)
            elif old != n:  # resize_/set_ grew or shrank a storage in place
                self._live[key] = n
                self.current += n - old
        if self.cap is not None and self.current > self.cap and self.current > before:
            requested = self.failed = self.current - before
            # the outputs die with the exception, never held: uncounted now, not when the traceback lets them go
            # (the OOM mark, taken meanwhile, would count the failed allocation as held)
            for key, old in prior.items():
                if old is None:
                    self._live.pop(key, None)
                else:
                    self._live[key] = old
            self.current = before
            raise torch.OutOfMemoryError(
                f"prism CPU-mode budget: tried to allocate {requested / 2**20:.2f} MiB in {func}; "
                f"this rank holds {before / 2**20:.2f} MiB of its {self.cap / 2**20:.2f} MiB cap")
        if self.current > self.peak:
            self.peak = self.current
        return out
