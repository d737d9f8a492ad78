"""Every cyclic garbage collection of this process, to ``$GC_CENSUS_DIR/gc-PID.txt`` (bench only).

Put this directory first on ``PYTHONPATH`` of a run (``one_gpu_truth.py``'s ``+gc`` steps do) to learn how
much of a rank's host time Python's collector takes and when: a collection while the device waits for the
host is device idle in the real job, and host time the emulation measures. Lines: ``start_monotonic_s
seconds generation collected``, after a first line with the command; CLOCK_MONOTONIC is one clock for every
process of the machine, so the collections line up with the run's log. Shadows any other sitecustomize.
"""

import gc
import os
import sys
import time

_DIR = os.environ.get("GC_CENSUS_DIR")
if _DIR:
    os.makedirs(_DIR, exist_ok=True)
    _log = open(os.path.join(_DIR, f"gc-{os.getpid()}.txt"), "a", buffering=1)  # noqa: SIM115 - lives with the process
    _log.write("# " + " ".join(sys.argv[:6]) + "\n")
    _start = [0.0]

    def _census(phase: str, info: dict) -> None:
        if phase == "start":
            _start[0] = time.monotonic()
        else:
            _log.write(f"{_start[0]:.6f} {time.monotonic() - _start[0]:.6f} {info['generation']} {info['collected']}\n")

    gc.callbacks.append(_census)
