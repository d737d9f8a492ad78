"""The report step of a run timed on one trace, Python's cyclic collector paused as the product pauses it and left
running (as before ``replay.collector``), side by side, each in a fresh process (issue 20: a thousand-rank job's
report took minutes after its captures).

    python bench/targets/report_time.py TRACE_DIR [--out DIR]

Prints each run's steps as ``make_report`` says them, its wall time and peak resident memory, and the ratio.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import gc, sys
if sys.argv[1] == "running":
    gc.disable = lambda: None  # paused() then leaves the collector running
from prism_megatron.report import make_report
make_report(sys.argv[2], sys.argv[3], say=lambda m: print(m, flush=True))
"""


def run(mode: str, trace: Path, out: Path) -> tuple[float, list[str], int]:
    """(wall s, the steps said, peak resident KiB) of one report of ``trace`` in a fresh process."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(trace), str(out)], capture_output=True, text=True)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        sys.exit(f"report ({mode}) failed: exit {done.returncode}\n{done.stderr[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far
    return wall, done.stdout.splitlines(), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="where the reports go (default: a temporary directory)")
    args = ap.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="report-time-"))
    walls = {}
    for mode in ("running", "paused"):
        wall, said, peak = run(mode, args.trace, root / mode)
        walls[mode] = wall
        print(f"== collector {mode}: {wall:.1f} s (largest process so far: {peak / 2**20:.1f} GiB)")
        for line in said:
            print(f"   {line}")
    print(f"paused / running: {walls['paused'] / walls['running']:.2f}")


if __name__ == "__main__":
    main()
