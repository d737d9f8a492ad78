"""``PRISM_MEMORY_SNAPSHOT=PREFIX``: a rank's CUDA allocator history, dumped as PREFIX-rankR.pickle.

A diagnostic for telling two runs' memory apart allocation by allocation (``bench/gpu/snapshot_diff.py``
reads two dumps): prism's emulated rank against the same rank under Megatron's fake process group or a
real process. Recording stacks costs host time at every allocation, so timings of a recorded run are not
the job's. Off the GPU (or without the variable) it does nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable

ENV = "PRISM_MEMORY_SNAPSHOT"
MAX_ENTRIES = 400_000  # events kept (the latest); a longer run keeps its end, where steady-state peaks are


def start_from_env() -> Callable[[], str | None]:
    """Start recording where ``PRISM_MEMORY_SNAPSHOT`` is set and a GPU is in use; returns the dump
    function, which writes PREFIX-rankR.pickle (R: the RANK variable) and returns its path."""
    prefix = os.environ.get(ENV)
    if not prefix:
        return lambda: None
    import torch

    from prism_megatron.megatron import cpu_mode

    if cpu_mode.cpu_mode_active() or not torch.cuda.is_available():
        return lambda: None
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)

    def dump() -> str:
        path = f"{prefix}-rank{os.environ.get('RANK', '0')}.pickle"
        tmp = f"{path}.tmp"
        torch.cuda.memory._dump_snapshot(tmp)
        os.replace(tmp, path)
        return path

    return dump
