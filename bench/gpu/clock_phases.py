"""A real run's iterations beside the GPU's clocks and power (issue 21: why a real run's iterations switch
between two steady levels, ~300 and ~330 ms for dense-bf16-mbs4-h4096).

Reads the ``gpu-clocks.csv`` that ``one_gpu_truth.sh`` samples every 0.5 s and the real runs' logs (Megatron's
timestamped "iteration N/M ... elapsed time per iteration (ms): X" lines) from a run's traces archive or OUT
directory; prints each iteration with the first sample at or after its end, then per run the mean SM clock and
power over its slow iterations (above the run's fast level by more than ``--slow`` %) and over the others.
Where the slow level draws less power at the same clocks, the GPU idles more in it: the host is late, not the
device slow.

    python bench/gpu/clock_phases.py bench/gpu/results/2026-12-04-one-gpu-truth-h200-run20-gpu-clocks.csv \
        bench/gpu/results/2026-12-04-one-gpu-truth-h200-run20-traces.tar.gz
"""

from __future__ import annotations

import argparse
import bisect
import csv
import datetime as dt
import re
import statistics
import tarfile
from pathlib import Path

ITERATION = re.compile(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+)\] iteration +(\d+)/.*?elapsed time per iteration "
                       r"\(ms\): ([\d.]+)")
FIRST = 3  # iterations 1 and 2 are the warm-up (one_gpu_truth.WARMUP)


def samples(path: Path) -> list[tuple[dt.datetime, int, float, str]]:
    """(time, SM clock MHz, power W, throttle reasons) per row of nvidia-smi's CSV."""
    out = []
    with path.open(newline="") as f:
        rows = csv.reader(f)
        header = next(rows)
        if len(header) < 6 or "clocks.current.sm" not in header[1]:
            raise SystemExit(f"{path}: not one_gpu_truth.sh's clock samples (header {header!r})")
        for r in rows:
            when = dt.datetime.strptime(r[0].strip(), "%Y/%m/%d %H:%M:%S.%f")
            out.append((when, int(r[1].split()[0]), float(r[3].split()[0]), r[5].strip()))
    return out


def real_logs(source: Path) -> dict[str, str]:
    """Log name -> text of each real run (``NN-real.log``) in an OUT directory or a traces archive."""
    if source.is_dir():
        return {p.name: p.read_text(errors="replace") for p in sorted(source.rglob("*-real.log"))}
    with tarfile.open(source) as tar:
        return {Path(m.name).name: tar.extractfile(m).read().decode(errors="replace")
                for m in sorted(tar.getmembers(), key=lambda m: m.name) if m.name.endswith("-real.log")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("clocks", type=Path, help="gpu-clocks.csv")
    p.add_argument("runs", type=Path, help="the call's OUT directory or its traces .tar.gz")
    p.add_argument("--slow", type=float, default=5.0, help="%% above the run's fast level that counts as slow")
    a = p.parse_args()
    rows = samples(a.clocks)
    times = [r[0] for r in rows]
    for name, text in real_logs(a.runs).items():
        its = [(dt.datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S.%f"), int(m[2]), float(m[3]))
               for m in ITERATION.finditer(text) if int(m[2]) >= FIRST]
        if not its:
            print(f"{name}: no timed iterations")
            continue
        fast = statistics.median(sorted(ms for _, _, ms in its)[:max(1, len(its) // 4)])
        print(f"{name} (fast level {fast:.0f} ms: the median of its quickest quarter)")
        levels: dict[bool, list[tuple[int, float]]] = {True: [], False: []}
        for when, k, ms in its:
            i = min(bisect.bisect_left(times, when), len(rows) - 1)
            _, sm, watts, why = rows[i]
            slow = ms > fast * (1 + a.slow / 100)
            levels[slow].append((sm, watts))
            print(f"  iteration {k:3d} {ms:6.0f} ms {'slow' if slow else '    '}  SM {sm:4d} MHz  {watts:5.0f} W  "
                  f"reasons {why}")
        for slow, got in levels.items():
            if got:
                sm, watts = statistics.mean(s for s, _ in got), statistics.mean(w for _, w in got)
                print(f"  {'slow' if slow else 'fast'}: {len(got)} iteration(s), mean SM clock {sm:.0f} MHz, "
                      f"mean power {watts:.0f} W")


if __name__ == "__main__":
    main()
