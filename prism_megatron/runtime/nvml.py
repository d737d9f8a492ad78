"""NVML's word on what each process holds on the GPU: the cross-check of the footprints ranks report.

A rank reports its footprint as its caching allocator's reserved bytes plus an estimate of what the
process holds beyond them (`staging.CONTEXT_BYTES`: the CUDA context, cuBLAS workspaces). A checkpoint
moves, and a restore needs, what the driver holds for the process, which is what NVML lists per process.
NVML names our processes by their own PIDs, and what it lists beyond reserved differs by what the
process ran (a matmul loads cuBLAS); one query over all processes is cheap but not free. So the
coordinator samples NVML at most once a second and plans swaps with its figure for every rank whose
report is current (the probe's figures: docs/history.md).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

ProcessMemory = Callable[[], dict[int, int]]  # pid -> bytes the driver holds for it, over all GPUs
GAP_WARN = 1 << 30  # a rank NVML sees this far from its report is said (once) in the log


class NvmlUnavailable(RuntimeError):
    """NVML cannot be read here; the message says why."""


def nvml_process_memory() -> ProcessMemory:
    """A reader of every compute process's GPU memory on this host (nvidia-ml-py's pynvml)."""
    try:
        import pynvml
    except ImportError as e:
        raise NvmlUnavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from e
    try:
        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as e:
        raise NvmlUnavailable(f"NVML did not start: {e}") from e

    def read() -> dict[int, int]:
        out: dict[int, int] = {}
        for h in handles:
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if isinstance(p.usedGpuMemory, int):  # None where the driver withholds it
                    out[p.pid] = out.get(p.pid, 0) + p.usedGpuMemory
        return out

    return read


@dataclass
class FootprintCheck:
    """NVML sampled at most every ``interval`` seconds; per rank, its last (reported, NVML) pair."""

    read: ProcessMemory
    interval: float = 1.0
    clock: Callable[[], float] = time.monotonic
    samples: int = 0
    pairs: dict[int, tuple[int, int]] = field(default_factory=dict)
    failed: str = ""  # why NVML stopped answering mid-run, if it did (then no more samples)
    _last: float = float("-inf")
    _warned: bool = False

    def sample(self) -> dict[int, int] | None:
        """NVML's figures if a sample is due; None if not, or once NVML failed (said once: the ranks'
        own reports plan from there)."""
        if self.failed or self.clock() - self._last < self.interval:
            return None
        self._last = self.clock()
        self.samples += 1
        try:
            return self.read()
        except Exception as e:  # NVML went away mid-run
            self.failed = f"{type(e).__name__}: {e}"
            print(f"prism: reading NVML failed ({self.failed}); swaps plan with the ranks' own reports from here",
                  file=sys.stderr, flush=True)
            return None

    def record(self, rank: int, reported: int, nvml: int, device: str) -> None:
        """Keep a rank's (reported, NVML) pair; the first gap over GAP_WARN is said in the log."""
        self.pairs[rank] = (reported, nvml)
        if abs(nvml - reported) > GAP_WARN and not self._warned:
            self._warned = True
            print(f"prism: rank {rank} holds {nvml / 2**30:.2f} GiB on {device} by NVML, "
                  f"{(nvml - reported) / 2**30:+.2f} GiB off its report (allocator reserved + context estimate): "
                  "swaps plan with NVML's figures (said once; the trace's job.footprint_check sums them up)",
                  file=sys.stderr, flush=True)

    def summary(self) -> dict:
        """For the trace: how far the ranks' reports were from NVML (GiB; positive: NVML saw more)."""
        failed = {"failed": self.failed} if self.failed else {}
        if not self.pairs:
            return {"source": "nvml", "samples": self.samples, "ranks_checked": 0, **failed}
        gaps = sorted(((nv - rep) / 2**30, r) for r, (rep, nv) in self.pairs.items())
        worst = max(gaps, key=lambda g: abs(g[0]))
        return {"source": "nvml", "samples": self.samples, "ranks_checked": len(gaps),
                "gap_gib_median": round(gaps[len(gaps) // 2][0], 3), "gap_gib_worst": round(worst[0], 3),
                "rank_of_worst": worst[1], **failed}
