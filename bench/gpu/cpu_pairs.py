"""Which of this machine's CPUs slow each other down: a fixed loop of work on CPU ``a`` timed alone and
again while CPU ``b`` runs the same loop, for every ``b``. A ratio well above 1 marks ``b`` as ``a``'s
hidden hyperthread sibling (a guest's topology files may show none) or a core sharing what ``a`` needs.

    python bench/gpu/cpu_pairs.py [--base 0,1] [--work 3000000]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import multiprocessing.queues
import multiprocessing.synchronize
import os
import time


def _spin(cpu: int, work: int, start: multiprocessing.synchronize.Event,
          out: multiprocessing.queues.Queue | None) -> None:
    os.sched_setaffinity(0, {cpu})
    start.wait()
    t = time.perf_counter()
    x = 0
    for i in range(work):
        x += i * i
    if out is not None:
        out.put(time.perf_counter() - t)


def _timed(a: int, b: int | None, work: int) -> float:
    start, out = mp.Event(), mp.Queue()
    procs = [mp.Process(target=_spin, args=(a, work, start, out))]
    if b is not None:
        procs.append(mp.Process(target=_spin, args=(b, work * 2, start, None)))  # outlasts a's loop
    for p in procs:
        p.start()
    time.sleep(0.2)
    start.set()
    seconds = out.get()
    for p in procs:
        p.join()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="0,1", help="the CPUs timed, comma-separated")
    ap.add_argument("--work", type=int, default=3_000_000, help="loop iterations per timing")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    bases = [int(c) for c in args.base.split(",")]
    if missing := [a for a in bases if a not in cpus]:
        raise SystemExit(f"--base {args.base}: CPU(s) {missing} not among this process's CPUs {cpus}")
    for a in bases:
        alone = min(_timed(a, None, args.work) for _ in range(3))
        ratios = {b: min(_timed(a, b, args.work) for _ in range(2)) / alone for b in cpus if b != a}
        print(f"cpu {a}: alone {alone * 1e3:.1f} ms; with another CPU busy, time / alone: "
              + " ".join(f"{b}:{r:.2f}" for b, r in ratios.items()), flush=True)


if __name__ == "__main__":
    main()
