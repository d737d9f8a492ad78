"""How fast this machine's host issues work: what a host-bound prediction moves with (issues 20, 21).

A rank whose GPU waits for its host (Megatron's per-expert loop, small layers) is predicted from the host
time the emulating machine measured, so the same job predicts differently on another machine (Qwen3-30B-A3B
with the loop: 55.4-79.9 s on three H200 machines, 93.1 and 124 s on two H100 ones). To learn whether a
machine's own speed explains that, each target run records this probe beside its prediction
(``run_target.sh``): the host cost of one operation at three depths, median and minimum over repeats.
- python: an empty Python function call (the interpreter);
- aten-cpu: ``torch.add(a, b, out=c)`` on one-element CPU tensors (the dispatcher, no device);
- cuda-launch: the same on one-element CUDA tensors, the host's time to issue them (no synchronisation
  inside a repeat; the device catches up between repeats), where a GPU is visible.

Usage: python bench/gpu/host_probe.py [--ops N] [--repeats R] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from prism_megatron.launcher.config import cpu_model  # noqa: E402 - the name reports give the machine


def _per_op_us(step: Callable[[], object], ops: int, repeats: int, sync: Callable[[], object] | None = None
               ) -> tuple[float, float]:
    """(median, minimum) microseconds per call of ``step`` over ``repeats`` runs of ``ops`` calls."""
    for _ in range(min(ops, 1000)):  # warm-up: caches, the allocator, lazy initialisation
        step()
    if sync:
        sync()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(ops):
            step()
        runs.append((time.perf_counter() - t0) / ops * 1e6)
        if sync:
            sync()  # outside the timed part: the host's issue rate, not the device's
    return statistics.median(runs), min(runs)


def probe(ops: int, repeats: int) -> dict[str, object]:
    """The three measures (None where no GPU is visible) and the machine they ran on."""
    import torch

    def empty() -> None:
        return None

    out: dict[str, object] = {"cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                              "ops": ops, "repeats": repeats, "threads": torch.get_num_threads()}
    out["python_us"] = _per_op_us(empty, ops, repeats)
    a, b, c = torch.ones(1), torch.ones(1), torch.empty(1)
    out["aten_cpu_us"] = _per_op_us(lambda: torch.add(a, b, out=c), ops, repeats)
    if torch.cuda.is_available():
        ga, gb, gc = (torch.ones(1, device="cuda") for _ in range(3))
        out["gpu"] = torch.cuda.get_device_name()
        out["cuda_launch_us"] = _per_op_us(lambda: torch.add(ga, gb, out=gc), ops, repeats, torch.cuda.synchronize)
    else:
        out["gpu"], out["cuda_launch_us"] = None, None
    return out


def lines(result: dict[str, object]) -> list[str]:
    head = (f"host probe: {result['cpu']} ({result['cores']} cores), torch {result['torch']}, "
            f"{result['ops']} ops x {result['repeats']} repeats")
    rows = [head]
    for key, what in (("python_us", "python"), ("aten_cpu_us", "aten-cpu"), ("cuda_launch_us", "cuda-launch")):
        value = result[key]
        if value is None:
            rows.append(f"  {what:12s} no GPU visible")
        else:
            med, low = value
            rows.append(f"  {what:12s} {med:8.3f} us per op (median; minimum {low:.3f})")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="host_probe.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=20000, help="calls per repeat (20000)")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per measure (5)")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    a = ap.parse_args(argv)
    if a.ops < 1 or a.repeats < 1:
        ap.error(f"--ops {a.ops} and --repeats {a.repeats}: expected at least 1 each")
    result = probe(a.ops, a.repeats)
    print(json.dumps(result) if a.json else "\n".join(lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
