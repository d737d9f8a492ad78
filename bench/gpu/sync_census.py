"""Which host calls wait for the GPU in one iteration of a real (NCCL) run, and under which ops.

The two-clock replay makes the host wait wherever the program waited for the device; the emulated
DP2 job showed ~250 such waits per iteration. This counts them in the real job: iteration 4 of the
core driver under torch.profiler (CPU + CUDA), rank 0 writes $SYNC_CENSUS/census.txt.

  torchrun --nproc-per-node 2 bench/gpu/sync_census.py CORE-DRIVER-FLAGS...
"""

from __future__ import annotations

import os
import runpy
from pathlib import Path
from typing import Any

from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT
from prism_megatron.trace.markers import set_sink

WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaFree")
ITERATION = 4


class _Census:
    def __init__(self) -> None:
        self.current = 0
        self.prof: Any = None

    def record_mark(self, name: str, phase: str, attrs: dict[str, Any]) -> None:
        if name != "iteration":
            return
        from torch.profiler import ProfilerActivity, profile

        if phase == "B":
            self.current = int(attrs["iteration"])
            if self.current == ITERATION:
                self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.prof.start()
        elif self.prof is not None:
            self.prof.stop()
            self.write()
            self.prof = None

    def write(self) -> None:
        events = self.prof.events()
        counts: dict[str, int] = {}
        parents: dict[str, int] = {}
        for e in events:
            if e.name in WAITS:
                counts[e.name] = counts.get(e.name, 0) + 1
                p = e.cpu_parent
                chain = []
                while p is not None and len(chain) < 3:
                    chain.append(p.name)
                    p = p.cpu_parent
                key = " < ".join(chain) or "(no op)"
                parents[key] = parents.get(key, 0) + 1
        lines = [f"rank {os.environ.get('RANK')} iteration {ITERATION}: host calls that wait for the GPU"]
        lines += [f"  {n}: {c}" for n, c in sorted(counts.items(), key=lambda kv: -kv[1])]
        lines.append("  under (op < parent < grandparent):")
        lines += [f"    {c:5d}  {k}" for k, c in sorted(parents.items(), key=lambda kv: -kv[1])[:25]]
        out = Path(os.environ.get("SYNC_CENSUS", ".")) / f"census-rank{os.environ.get('RANK', '0')}.txt"
        out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    set_sink(_Census())
    runpy.run_path(str(CORE_DRIVER_SCRIPT), run_name="__main__")
