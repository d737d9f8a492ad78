"""One rank's kind of CPU work, timed: what a core does alone versus with the other core busy too.

The CPU ground truth (2 gloo processes) computes on both cores at once; the 1-slot emulation that
predicts it measures each rank's compute with only one rank computing. If two single-thread
processes slow each other down (shared caches, memory bandwidth, the host's scheduling of this
VM's vCPUs), the prediction misses exactly that factor. ``run.py`` starts this script once alone
and twice at once, all spinning until the same start time, and compares the medians.

  python bench/accuracy/contention_probe.py START_EPOCH_SECONDS   # prints the median step in ms
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

STEPS = 50


def main(start: float) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    h, tokens = 256, 512  # the CPU rows' hidden size and micro-batch tokens: an MLP's forward + backward
    x = torch.randn(tokens, h, requires_grad=True)
    w1 = torch.randn(h, 4 * h, requires_grad=True)
    w2 = torch.randn(4 * h, h, requires_grad=True)

    def step() -> None:
        (torch.nn.functional.gelu(x @ w1) @ w2).sum().backward()

    for _ in range(3):
        step()
    while time.time() < start:
        time.sleep(0.001)
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(f"{statistics.median(times) * 1e3:.4f}")


if __name__ == "__main__":
    main(float(sys.argv[1]))
