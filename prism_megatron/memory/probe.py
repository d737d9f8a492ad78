"""A rank's own memory: measured (and capped) where it runs, reported as trace marks.

Runs inside each logical rank. On a GPU the caching allocator is the truth: its peaks are the
figures, and ``set_per_process_memory_fraction`` caps it at the target GPU's usable bytes, so an
allocation the target could not serve fails here too. On CPU the ``ByteAccountant`` plays the
allocator. The marks (``memory`` after each iteration and at the end, ``oom`` once) are what the
report reads; their attributes are documented in ``prism_megatron.report``'s contract.
"""

from __future__ import annotations

import re
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from prism_megatron.memory.accountant import ByteAccountant
from prism_megatron.trace.markers import mark

#: How a capped rank records its allocator's history for the OOM snapshot: every allocation and free
#: (sizes, addresses, the timeline PyTorch's memory viz draws), no stack traces (``context=None``).
HISTORY: dict[str, Any] = {"enabled": "all", "context": None, "max_entries": 100_000}

#: prism's package directory: its frames are machinery (the launcher, the CPU mode's device redirection, the
#: byte accountant that raised), not an allocation's site, except those of ``_PROGRAM_PARTS``
_PACKAGE = Path(__file__).resolve().parent.parent
#: the parts of prism that are the program a rank runs: its patches render the target's kernels, its drivers
#: are pretrain scripts
_PROGRAM_PARTS = ("patches", "megatron/driver")

_REQUESTED = re.compile(r"Tried to allocate ([0-9.]+) (bytes|KiB|MiB|GiB|TiB)")
_UNIT = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def requested_bytes(message: str) -> int | None:
    """The failing allocation's size from a CUDA OOM message ("Tried to allocate 20.00 MiB")."""
    m = _REQUESTED.search(message)
    return int(float(m.group(1)) * _UNIT[m.group(2)]) if m else None


#: Frames kept in an OOM's allocation site: the innermost of the program's own, outermost first.
SITE_FRAMES = 4


def oom_of(error: BaseException) -> BaseException | None:
    """torch's OOM behind ``error``: itself, or what a caller re-raised it as (Megatron wraps some errors in
    RuntimeError); None if there is none."""
    seen: BaseException | None = error
    while seen is not None and not isinstance(seen, torch.OutOfMemoryError):
        seen = seen.__cause__ or seen.__context__
    return seen


def allocation_site(error: BaseException, depth: int = SITE_FRAMES) -> list[str]:
    """Where the failing allocation was asked for: the innermost ``depth`` frames of the OOM's traceback
    that are the program's ("megatron/core/tensor_parallel/layers.py:725 (backward)"), outermost first.

    The allocator's history is recorded without stack traces (``HISTORY``), so the exception's own
    traceback is the one free record of the site. Frames of torch itself, of the interpreter's script
    runner and of prism's machinery (``_PACKAGE``) are dropped; prism's patches and drivers stay: they are
    the program. Paths are shown from their import root (the ``sys.path`` entry
    holding them), so a report names no machine's directories. Where Megatron re-raised the OOM, the
    OOM's own traceback (its cause or context) is read.
    """
    oom = oom_of(error) or error
    roots = sorted({str(Path(p).resolve()) for p in sys.path if p}, key=len, reverse=True)
    torch_dir = str(Path(torch.__file__).resolve().parent)
    program = [str(_PACKAGE / sub) for sub in _PROGRAM_PARTS]
    site = []
    for frame in traceback.extract_tb(oom.__traceback__):
        if frame.filename.startswith("<frozen "):  # the interpreter's own (runpy running the script)
            continue
        path = str(Path(frame.filename).resolve())
        if path.startswith(torch_dir + "/"):
            continue
        if path.startswith(str(_PACKAGE) + "/") and not any(path.startswith(p + "/") for p in program):
            continue
        root = next((r for r in roots if path.startswith(r + "/")), None)
        shown = path[len(root) + 1:] if root else Path(path).name
        site.append(f"{shown}:{frame.lineno} ({frame.name})")
    return site[-depth:]


class MemoryProbe:
    """Measure, cap and report one rank's device memory."""

    def __init__(self, rank: int, on_gpu: bool, cap: int | None, snapshot_dir: Path | None) -> None:
        self.rank = rank
        self.on_gpu = on_gpu
        self.cap = cap
        self.snapshot_dir = snapshot_dir
        self.accountant: ByteAccountant | None = None
        self.note: str | None = None  # why the cap could not be applied, if so

    def install(self) -> None:
        if not self.on_gpu:
            self.accountant = ByteAccountant(self.cap)
            self.accountant.__enter__()  # active for the rest of the process
            return
        if self.cap is not None:
            device = torch.cuda.current_device()
            total = torch.cuda.get_device_properties(device).total_memory
            if self.cap > total:
                self.note = (f"the target's {self.cap / 2**30:.2f} GiB per rank exceed this GPU's "
                             f"{total / 2**30:.2f} GiB: not capped here, verdict from the measured peak")
            else:
                torch.cuda.set_per_process_memory_fraction(self.cap / total, device)
            if self.snapshot_dir is not None:
                # events only: a traceback per allocation and free (the default context) is host work
                # inside every measured compute segment, thousands of times per micro-batch; the
                # target's program does not pay it
                torch.cuda.memory._record_memory_history(**HISTORY)

    def stats(self) -> dict[str, Any]:
        if self.on_gpu:
            return {"allocated": int(torch.cuda.memory_allocated()), "reserved": int(torch.cuda.memory_reserved()),
                    "max_allocated": int(torch.cuda.max_memory_allocated()),
                    "max_reserved": int(torch.cuda.max_memory_reserved()), "source": "cuda", "cap": self.cap}
        acc = self.accountant
        return {"allocated": acc.current, "reserved": acc.current, "max_allocated": acc.peak,
                "max_reserved": acc.peak, "source": "cpu-accountant", "cap": self.cap}

    def record(self, iteration: int | None) -> None:
        """A ``memory`` mark: current and peak figures after ``iteration`` (None: the script ended)."""
        mark("memory", iteration=iteration, **self.stats())

    def physical(self, error: BaseException) -> dict[str, Any] | None:
        """The figures of an OOM that is the physical GPU's, not the target's (None when the target's
        cap was hit): bytes this rank held (allocator reserved + context estimate), asked for, and the
        driver's free and total.

        Ranks share the physical GPU: one may find it full while still under its own cap. That says
        nothing about the target and must not become a verdict.
        """
        if not self.on_gpu:
            return None
        from prism_megatron.runtime.staging import CONTEXT_BYTES

        requested = requested_bytes(str(error)) or 0
        reserved = int(torch.cuda.memory_reserved())
        free, total = torch.cuda.mem_get_info()
        device_full = free < requested + (2 << 20)  # the allocator rounds to 2 MiB blocks at least
        if self.cap is None or self.note or (device_full and reserved + requested <= self.cap):
            return {"held": reserved + CONTEXT_BYTES, "requested": requested, "free": int(free), "total": int(total),
                    "cap": self.cap}
        return None

    def out_of_memory(self, error: BaseException) -> dict[str, Any]:
        """Record the OOM as a prediction: figures, failing size and site, a snapshot for PyTorch's memory viz."""
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        snapshot = None
        if self.on_gpu and self.snapshot_dir is not None:
            path = self.snapshot_dir / f"oom-rank-{self.rank}.pickle"
            try:
                torch.cuda.memory._dump_snapshot(str(path))
                snapshot = path.name
            except Exception as e:  # a missing snapshot must not hide the verdict
                message += f" (memory snapshot failed: {e})"
        requested = requested_bytes(str(error)) if self.on_gpu else self.accountant.failed
        attrs = {**self.stats(), "requested": requested, "message": message, "snapshot": snapshot,
                 "where": allocation_site(error)}
        mark("oom", **attrs)
        return attrs
