"""What the rank's memory probe costs a host-bound forward, by itself (issue 21).

An emulated rank on a GPU runs ``memory.probe.MemoryProbe.install`` on its main thread before the program:
``torch.cuda.set_per_process_memory_fraction`` (the target's cap) and
``torch.cuda.memory._record_memory_history(**HISTORY)`` (every allocation and free, no tracebacks). Recording
also adds a RecordFunction callback local to the thread that turned it on (torch's memory snapshot
annotations): the program's main thread, where the forward runs, and not the autograd engine's thread, where
the backward runs. The one-GPU truth runs find the rank's forward slower than the real program's on the main
thread only (docs/measurements.md, runs 36-42), so this times a small host-bound model's forward and backward in
fresh processes with each part of the probe on or off, interleaved, side by side.

Usage: python bench/gpu/memory_probe_cost.py [--rounds 3] [--iters 30] [--layers 16] [--hidden 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_REPO / "bench"))
from interleaved import interleave, ratios  # noqa: E402

#: each variant: (fraction cap on, history recorded on, history turned off again before the timed iterations)
VARIANTS = {"plain": (False, False, False), "fraction": (True, False, False), "history": (False, True, False),
            "probe": (True, True, False), "history-off": (False, True, True)}


def child(variant: str, iters: int, layers: int, hidden: int) -> dict[str, float]:
    """One process: a small host-bound model (many small kernels per forward), its forward and backward timed
    on the host after a warm-up, with the variant's part of the probe installed first, as the rank does."""
    import torch

    sys.path.insert(0, str(_REPO))
    from prism_megatron.memory.probe import HISTORY

    fraction, history, off = VARIANTS[variant]
    torch.cuda.init()
    if fraction:
        torch.cuda.set_per_process_memory_fraction(0.5, 0)
    if history:
        torch.cuda.memory._record_memory_history(**HISTORY)
    if off:
        torch.cuda.memory._record_memory_history(enabled=None)
    blocks = [torch.nn.Sequential(torch.nn.LayerNorm(hidden), torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                  torch.nn.Linear(4 * hidden, hidden)) for _ in range(layers)]
    model = torch.nn.ModuleList(blocks).cuda()
    x = torch.randn(8, hidden, device="cuda")
    forward, backward = [], []
    for i in range(iters + 5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = x
        for b in model:
            h = h + b(h)
        loss = h.square().mean()
        t1 = time.perf_counter()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 5:
            forward.append((t1 - t0) * 1e3)
            backward.append((t2 - t1) * 1e3)
    return {"forward_ms": statistics.median(forward), "backward_ms": statistics.median(backward)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds over every variant, interleaved (default 3)")
    p.add_argument("--iters", type=int, default=30, help="timed iterations per process (default 30)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--child", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, a.iters, a.layers, a.hidden)))
        return 0
    print(ratios(interleave(__file__, list(VARIANTS), a.rounds, ["--iters", str(a.iters), "--layers",
                                                                  str(a.layers), "--hidden", str(a.hidden)])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
