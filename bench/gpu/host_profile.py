"""Host CPU time per op in one iteration of the core driver, real (torchrun) or emulated (prism run).

An emulated rank's host time per iteration came out above the real job's (TP2 on the H200: ~400 ms
against ~316 ms, bench/gpu/results). Profiling the same iteration on both sides (CPU activity only,
every thread: the autograd engine runs the backward in its own thread on a GPU) tells whether the
same ops run slower (the machine: clocks, caches) or other work runs (our runtime's Python).
Iteration ``HOST_PROFILE_ITERATION`` (default 4) is profiled; each rank writes
``$HOST_PROFILE_DIR/rank-R.json``: the iteration's wall time and per op (count, self CPU us).
Compare two directories with ``bench/gpu/host_diff.py``.

  torchrun --nproc-per-node 2 bench/gpu/host_profile.py CORE-DRIVER-FLAGS...
  prism-megatron run --prism-emulate --prism-world-size 2 --prism-devices 0 bench/gpu/host_profile.py FLAGS...
"""

from __future__ import annotations

import json
import os
import runpy
import time
from pathlib import Path
from typing import Any

from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT
from prism_megatron.trace.markers import get_sink, set_sink

ITERATION = int(os.environ.get("HOST_PROFILE_ITERATION", "4"))


def _probe() -> dict[str, float]:
    """Fixed host work, timed before the profiled iteration: is this process slower at the same calls?

    Microseconds per small-kernel launch (queue never full), per caching-allocator round trip, and
    milliseconds of a pure-Python loop; the same figures on both sides say the process is not slower.
    """
    import torch

    x = torch.zeros(256, device="cuda")
    out = {}
    for _ in range(2):  # the second round is kept: the first warms caches
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5000):
            x.add_(1.0)
        out["launch_us"] = (time.perf_counter() - t) / 5000 * 1e6
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5000):
            torch.empty(4096, device="cuda")
        out["alloc_us"] = (time.perf_counter() - t) / 5000 * 1e6
        t = time.perf_counter()
        s = 0
        for i in range(1_000_000):
            s += i
        out["python_ms"] = (time.perf_counter() - t) * 1e3
    return out


class _Profiler:
    """Marker sink that profiles one iteration and passes every marker on (prism's sink, if any)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.prof: Any = None
        self.t0 = 0.0
        self.probe: dict[str, float] = {}

    def record_mark(self, name: str, phase: str, attrs: dict[str, Any]) -> None:
        if name == "iteration" and phase == "B" and int(attrs.get("iteration", 0)) == ITERATION:
            self.probe = _probe()
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.start()
            self.t0 = time.perf_counter()
        if self.inner is not None:
            self.inner.record_mark(name, phase, attrs)
        if name == "iteration" and phase == "E" and self.prof is not None:
            wall = time.perf_counter() - self.t0
            self.prof.stop()
            ops = {e.key: [e.count, e.self_cpu_time_total] for e in self.prof.key_averages()}
            out = Path(os.environ.get("HOST_PROFILE_DIR", ".")) / f"rank-{os.environ.get('RANK', '0')}.json"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"iteration": ITERATION, "wall_s": wall, "ops": ops, "probe": self.probe}))
            self.prof = None


if __name__ == "__main__":
    set_sink(_Profiler(get_sink()))
    runpy.run_path(str(CORE_DRIVER_SCRIPT), run_name="__main__")
