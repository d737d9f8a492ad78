"""The report step of a run timed on one trace, side by side, each run in a fresh process (issue 20: a
thousand-rank job's report took minutes after its captures). Two comparisons:

    python bench/targets/report_time.py TRACE_DIR [--out DIR] [--repeats N]
        this tree's report with Python's cyclic collector paused, as the product pauses it, against the same
        with it left running (as before ``replay.collector``)
    python bench/targets/report_time.py TRACE_DIR --against TREE [--repeats N]
        this tree's report against another checkout's (``git worktree add TREE COMMIT``), both as each ships

Runs alternate (A, B, A, B, ...) so that a shared machine's drift falls on both. Prints each run's steps as
``make_report`` says them, its wall time and peak resident memory, then the ratio of the medians.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
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

HERE = Path(__file__).resolve().parents[2]


def run(mode: str, tree: Path, trace: Path, out: Path) -> tuple[float, list[str], int]:
    """(wall s, the steps said, peak resident KiB) of one report of ``trace`` by ``tree``'s code in a fresh
    process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(trace), str(out)], capture_output=True, text=True,
                          env=env, cwd=tree)
    wall = time.monotonic() - t0
    if done.returncode != 0:
        sys.exit(f"report ({mode}, {tree}) failed: exit {done.returncode}\n{done.stderr[-2000:]}")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the largest child so far
    return wall, done.stdout.splitlines(), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="where the reports go (default: a temporary directory)")
    ap.add_argument("--against", type=Path, default=None,
                    help="another checkout of prism-megatron: its report against this tree's (both paused)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each, alternated (default 1)")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, not {args.repeats}")
    if args.against is not None and not (args.against / "prism_megatron" / "__init__.py").is_file():
        ap.error(f"--against {args.against}: not a checkout of prism-megatron (no prism_megatron/__init__.py)")
    root = args.out or Path(tempfile.mkdtemp(prefix="report-time-"))
    if args.against is None:
        sides = {"collector running": ("running", HERE), "collector paused": ("paused", HERE)}
    else:
        sides = {f"other tree ({args.against})": ("paused", args.against.resolve()), "this tree": ("paused", HERE)}
    walls: dict[str, list[float]] = {name: [] for name in sides}
    for k in range(args.repeats):
        for n, (name, (mode, tree)) in enumerate(sides.items()):
            wall, said, peak = run(mode, tree, args.trace.resolve(), root.resolve() / f"{n}-{k}")
            walls[name].append(wall)
            print(f"== {name}, run {k + 1}: {wall:.1f} s (largest process so far: {peak / 2**20:.1f} GiB)", flush=True)
            for line in said:
                print(f"   {line}")
    (a, wa), (b, wb) = walls.items()
    print(f"medians: {a} {statistics.median(wa):.1f} s, {b} {statistics.median(wb):.1f} s; "
          f"{b} / {a}: {statistics.median(wb) / statistics.median(wa):.2f}")


if __name__ == "__main__":
    main()
