"""Whether pooling host times over every earlier iteration makes a prediction trail a host time that moves.

The replay gives each GPU-timed segment the median host time of the same segment over the iterations so far
(``replay.gpu_segments.typical_host_times``). Where a rank's host time falls or rises through a run (an MoE
job's routing settling, a host whose speed drifts), that median trails it. This replays one-GPU truth traces
with the pool cut to the latest K like iterations, side by side with the product's pooling, and prints each
prediction's median over the measured iterations (communication free, as one_gpu_truth.py scores them).

    python bench/gpu/host_pool_window.py TRACES.tar.gz [--from 9] [--windows 4,2]

TRACES.tar.gz: a one_gpu_truth.sh archive (``work/CONFIG/trace-NN-emuW`` inside); every emulation trace in
it is replayed.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE))

from prism_megatron.replay import gpu_segments  # noqa: E402


def predicted(trace: Path, first: int) -> float:
    """The replay's median iteration (ms) from iteration ``first`` on, communication free."""
    from one_gpu_truth import replay_times

    period = replay_times(trace)["period"]
    return statistics.median(period[i] for i in period if i >= first) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("archive", type=Path)
    p.add_argument("--from", dest="first", type=int, default=9, help="first measured iteration (default 9)")
    p.add_argument("--windows", default="4,2", help="pool sizes to compare with every earlier iteration")
    a = p.parse_args(argv)
    windows = [int(w) for w in a.windows.split(",")]
    product = gpu_segments.typical_host_times
    with tempfile.TemporaryDirectory(prefix="host-pool-") as tmp:
        with tarfile.open(a.archive) as tar:
            tar.extractall(tmp, filter="data")
        traces = sorted(t for t in Path(tmp).glob("work/*/trace-*") if (t / "manifest.json").is_file())
        if not traces:
            raise SystemExit(f"{a.archive}: no work/CONFIG/trace-* directory inside")
        print(f"{'trace':48s} {'all so far':>10s} " + " ".join(f"{'latest ' + str(k):>10s}" for k in windows)
              + f"   (ms, median of iterations {a.first}+)")
        for trace in traces:
            row = [predicted(trace, a.first)]
            for k in windows:
                gpu_segments.typical_host_times = functools.partial(product, window=k)
                try:
                    row.append(predicted(trace, a.first))
                finally:
                    gpu_segments.typical_host_times = product
            print(f"{trace.parent.name + '/' + trace.name:48s} " + " ".join(f"{x:10.1f}" for x in row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
