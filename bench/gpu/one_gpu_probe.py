"""A real one-GPU run of the training driver whose iterations test, one by one, what GPU timing does to them.

The emulation measures each compute segment's device time in iterations run under the CUDA profiler
and its host time in the plain iterations between (``runtime.gpu_timing``); the prediction is only as
good as those plain iterations are like the real job's. This runs the job for real (one process, no
prism) and changes one thing per phase of iterations (Megatron's numbering, from 1); the first four take turns
(``CYCLE``), the profiled ones come last:

- ``plain``: nothing (the profiler never ran yet): the reference;
- ``synced``: ``torch.cuda.synchronize()`` before every collective, as the emulation's data plane does;
- ``history``: the CUDA allocator's history recorded as an emulated GPU rank records it
  (``memory.probe.HISTORY``: every allocation and free, no tracebacks);
- ``blocked``: synchronised, then the thread asleep ``BLOCK_S`` at every collective, as an emulated rank
  waits for the coordinator's grant at a synchronous op (its core idles, its caches go to others);
- ``prof-teardown`` / ``after-teardown``: a profiled iteration with ``TEARDOWN_CUPTI=1`` (kineto detaches
  CUPTI at the stop, as prism's GPU-timed ranks do), then three plain ones: the plain iterations whose host
  time an emulated rank measures come after such a session.

Per iteration it writes the wall time of ``train_step`` (device synchronised before and after, the
profiler started and stopped outside it), the time the probe's own additions took in it (its syncs and
sleeps: ``added_ms``; the wall less them is what an emulated rank's clock would measure), the mean SM clock
over it (NVML) and, for profiled ones, the device busy time (union of kernels and copies) and the number of
device activities, to ``$PROBE_OUT`` (JSON).

  RANK=0 WORLD_SIZE=1 ... python bench/gpu/one_gpu_probe.py TRAINING-DRIVER-FLAGS...
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from prism_megatron.megatron.driver import DRIVER_SCRIPT

#: the phases that change nothing lasting, taken in turn ROUNDS times, ROUND_ITERATIONS iterations each: a host whose
#: speed drifts within the run (the H200 machine's did by 10 % in a minute) falls on each of them alike
CYCLE = ("plain", "synced", "blocked", "history")
ROUNDS, ROUND_ITERATIONS = 3, 2
#: (first iteration, phase) in order; a phase lasts until the next one begins. The profiled ones come last: a profiler
#: session may leave the process changed (CUPTI attached, or the device's idle time gone: docs/measurements.md)
PHASES = ((1, "warmup"),
          *((3 + ROUND_ITERATIONS * i, CYCLE[i % len(CYCLE)]) for i in range(ROUNDS * len(CYCLE))),
          (3 + ROUND_ITERATIONS * ROUNDS * len(CYCLE), "prof-teardown"),
          (7 + ROUND_ITERATIONS * ROUNDS * len(CYCLE), "prof-teardown"))
ITERATIONS = PHASES[-1][0] + 3
#: how long a ``blocked`` collective sleeps (an emulated rank's round trip to the coordinator is of this order)
BLOCK_S = 0.0005
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "_reduce_scatter_base", "_all_gather_base", "broadcast", "all_to_all", "all_to_all_single",
                "barrier", "reduce")


def phase_of(iteration: int) -> tuple[str, bool]:
    """(phase name, profiled?) of an iteration: the first of each profiler phase is profiled."""
    name, first = "warmup", 1
    for start, phase in PHASES:
        if iteration >= start:
            name, first = phase, start
    if name.startswith("prof-"):
        profiled = iteration == first
        return (name if profiled else "after-" + name.split("-", 1)[1]), profiled
    return name, False


class _Syncing:
    """Collectives that first finish the device's queued work (the emulation's data plane does), and with
    ``sleep`` then wait that long asleep (an emulated rank blocked for its grant); ``added`` sums the seconds."""

    def __init__(self) -> None:
        import threading

        import torch
        import torch.distributed as dist

        self.on = False
        self.sleep = 0.0
        self.count = 0
        self.added = 0.0
        self._asleep = threading.Event()  # never set: a timed futex wait, as threading.Event.wait(timeout) is
        for name in _COLLECTIVES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            setattr(dist, name, self._wrap(original, torch))

    def _wrap(self, original: Any, torch: Any) -> Any:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.on:
                t0 = time.perf_counter()
                torch.cuda.synchronize()
                if self.sleep:
                    self._asleep.wait(self.sleep)
                self.added += time.perf_counter() - t0
                self.count += 1
            return original(*args, **kwargs)
        return call


class _Clocks:
    """Mean SM clock (MHz) of GPU 0 over a stretch, sampled every 5 ms by NVML in a thread: whether two
    iterations of the same work ran at the same clock (a device-bound job flipped between ~490 and ~550 ms
    per iteration on the H200 machine while its profiled iterations' busy time stayed at 470 ms)."""

    def __init__(self) -> None:
        import threading

        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001 - no NVML: the rows go without clocks
            self._nvml = None
        self._samples: list[int] = []
        self._on = threading.Event()
        if self._nvml is not None:
            threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        import time as _time

        while True:
            self._on.wait()
            try:
                self._samples.append(self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM))
            except Exception:  # noqa: BLE001
                return
            _time.sleep(0.005)

    def start(self) -> None:
        self._samples = []
        self._on.set()

    def stop(self) -> float | None:
        self._on.clear()
        return sum(self._samples) / len(self._samples) if self._samples else None


def _busy(events: Any) -> tuple[float, int]:
    """(device busy seconds: the union of kernels, copies and memsets; their number)."""
    from prism_megatron.runtime.gpu_timing import _union, activities

    device = [a for a in activities(events) if a.device]
    return _union([(a.start, a.end) for a in device]) / 1e9, len(device)


def _gaps(events: Any, least_ms: float = 0.5) -> list[dict]:
    """The device's idle stretches of at least ``least_ms`` in a profiled iteration: where each begins
    (ms after the iteration's first device activity), how long, and the activities either side (names
    cut to 60 characters): where the real run's idle time sits, to set beside the emulation's waits."""
    from prism_megatron.runtime.gpu_timing import activities

    device = sorted((a for a in activities(events) if a.device), key=lambda a: a.start)
    if not device:
        return []
    out, end, before, t0 = [], device[0].end, device[0].name, device[0].start
    for a in device[1:]:
        if (a.start - end) / 1e6 >= least_ms:
            out.append({"at_ms": round((end - t0) / 1e6, 3), "idle_ms": round((a.start - end) / 1e6, 3),
                        "after": before[:60], "before": a.name[:60]})
        if a.end > end:
            end, before = a.end, a.name
    out.append({"span_ms": round((end - t0) / 1e6, 3)})
    return out


def main() -> None:
    from prism_megatron.megatron.megatron_lm import ensure_megatron_training
    from prism_megatron.memory.probe import HISTORY

    ensure_megatron_training()  # as the driver does: stand-ins for the trainer's unused imports
    import megatron.training.training as training
    import torch
    from torch.profiler import ProfilerActivity, profile

    out = Path(os.environ["PROBE_OUT"])
    rows: list[dict[str, Any]] = []
    syncing = _Syncing()
    clocks = _Clocks()
    original = training.train_step
    last_stop = ["1"]
    recording = [False]

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        iteration = int(kwargs.get("iteration", len(rows))) + 1
        phase, profiled = phase_of(iteration)
        syncing.on = phase in ("synced", "blocked")
        syncing.sleep = BLOCK_S if phase == "blocked" else 0.0
        if (phase == "history") != recording[0]:  # the allocator's history on for this phase only
            recording[0] = phase == "history"
            torch.cuda.memory._record_memory_history(**(HISTORY if recording[0] else {"enabled": None}))
        before, added = syncing.count, syncing.added
        prof = None
        if profiled:
            # at the start as at the last stop: "1" after a teardown lets kineto re-initialise CUPTI; "1"
            # while CUPTI is still attached from a kept session recorded nothing (H200, torch 2.11)
            os.environ["TEARDOWN_CUPTI"] = last_stop[0]
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.start()
        torch.cuda.synchronize()
        clocks.start()
        t0 = time.perf_counter()
        result = original(*args, **kwargs)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        row = {"iteration": iteration, "phase": phase, "wall_ms": wall * 1e3, "syncs_added": syncing.count - before,
               "added_ms": (syncing.added - added) * 1e3, "sm_clock_mhz": clocks.stop()}
        if prof is not None:
            last_stop[0] = os.environ["TEARDOWN_CUPTI"] = "1" if phase.endswith("teardown") else "0"  # read at stop
            prof.stop()
            busy, n = _busy(prof.profiler.kineto_results.events())
            row.update(device_busy_ms=busy * 1e3, device_activities=n,
                       idle_gaps=_gaps(prof.profiler.kineto_results.events()))
        rows.append(row)
        out.write_text(json.dumps(rows, indent=1))
        print(f"probe: {json.dumps(row)}", flush=True)
        return result

    training.train_step = train_step
    sys.argv = [str(DRIVER_SCRIPT), *sys.argv[1:]]
    runpy.run_path(str(DRIVER_SCRIPT), run_name="__main__")


if __name__ == "__main__":
    main()
