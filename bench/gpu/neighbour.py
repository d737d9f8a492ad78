"""A process that wakes as an emulation's coordinator does, for the real program to run beside (bench only).

Inside an emulated rank's forward, the compiled-call frames cost 2.5-4.6 times the real program's, while the same
calls at the forward's start cost the same in both processes (docs/measurements.md, run 54). What the rank has
there that the real program has not is the coordinator's process answering the forward's marks and collectives
(~130 wake-ups and 84-103 ms of CPU per iteration in run 41) on a host whose vCPUs share physical cores. This
process does Python work of that pattern (a message built, pickled and read back, for ``--work-ms`` at each of
``--per-second`` wake-ups) until it is stopped, so that ``one_gpu_truth.py``'s ``real-spans-neighbour`` step can
tell whether such a neighbour alone gives the real program the rank's excess.

    python bench/gpu/neighbour.py [--per-second 130] [--work-ms 0.7]
"""

from __future__ import annotations

import argparse
import pickle
import time

#: what a coordinator's message looks like, roughly: an op of a rank with its tensor's description
MESSAGE = {"t": "op", "rank": 0, "op": "all_reduce", "group": [0], "label": "loss", "shape": [1, 2048],
           "dtype": "float32", "device": "cuda:0", "attrs": {"iteration": 1, "microbatch": 0, "chunk": 0}}


def work(ms: float) -> int:
    """Python work of a message handler's kind for ``ms`` milliseconds; returns how many messages it handled."""
    end = time.perf_counter() + ms / 1000
    handled = 0
    while time.perf_counter() < end:
        pickle.loads(pickle.dumps(MESSAGE))
        handled += 1
    return handled


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--per-second", type=float, default=130.0, help="wake-ups per second")
    p.add_argument("--work-ms", type=float, default=0.7, help="milliseconds of Python work at each wake-up")
    a = p.parse_args(argv)
    if a.per_second <= 0 or a.work_ms < 0:
        p.error(f"--per-second must be above 0 (got {a.per_second}) and --work-ms at least 0 (got {a.work_ms})")
    period = 1 / a.per_second
    while True:
        began = time.perf_counter()
        work(a.work_ms)
        time.sleep(max(0.0, period - (time.perf_counter() - began)))


if __name__ == "__main__":
    raise SystemExit(main())
