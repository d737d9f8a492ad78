"""What the first host calls cost right after a CUDA profiler session ends with CUPTI torn down, as a GPU-timed
rank ends each profiled iteration (runtime.gpu_timing): each call timed alone, after a profiled stretch of work,
after a plain one, and after a profiled one followed by a warm-up launch.

    TEARDOWN_CUPTI=1 python bench/gpu/cupti_teardown_cost.py [--trials 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

CALLS = ("python", "cpu_op", "launch", "launch_again", "marker", "event", "item", "sync")


def _calls(x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Microseconds of each call, in order: pure Python, a CPU op, two kernel launches, the marker kernel, an
    event record, a blocking copy, a synchronize."""
    out: dict[str, float] = {}
    steps = (("python", lambda: sum(range(20000))), ("cpu_op", lambda: y + 1), ("launch", lambda: x + 1),
             ("launch_again", lambda: x * 2),
             ("marker", lambda: torch.cuda._sleep(1)), ("event", lambda: torch.cuda.Event().record()),
             ("item", lambda: x[0, 0].item()), ("sync", torch.cuda.synchronize))
    for name, call in steps:
        t = time.perf_counter()
        call()
        out[name] = (time.perf_counter() - t) * 1e6
    return out


def _work(x: torch.Tensor) -> None:
    for _ in range(20):
        x = x @ x.T
        x = x / x.norm()
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    args = ap.parse_args()
    x, y = torch.randn(1024, 1024, device="cuda"), torch.randn(64, 64)
    _work(x)
    rows: dict[str, list[dict[str, float]]] = {"after plain work": [], "after profiled work": [],
                                                "after profiled work, one warm-up launch": []}
    for _ in range(args.trials):
        for case in rows:
            profiled = case.startswith("after profiled")
            p = profile(activities=[ProfilerActivity.CUDA]) if profiled else None
            if p is not None:
                p.start()
            _work(x)
            if p is not None:
                p.stop()
                p.profiler.kineto_results.events()
                del p
            if case.endswith("warm-up launch"):
                torch.cuda._sleep(1)
                torch.cuda.synchronize()
            time.sleep(0.01)
            rows[case].append(_calls(x, y))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; median microseconds of each call over "
          f"{args.trials} trials (first trial's in brackets)")
    for case, trials in rows.items():
        print(f"{case:>42}: " + ", ".join(
            f"{c} {statistics.median(t[c] for t in trials):.0f} [{trials[0][c]:.0f}]" for c in CALLS))


if __name__ == "__main__":
    main()
