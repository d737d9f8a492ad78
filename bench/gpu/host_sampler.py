"""What the host's CPUs did while a one-GPU truth call ran: the share of each second they were busy and stolen.

A host-bound configuration's real runs have moved 1.5-3x within one call on every recent machine
(docs/measurements.md, runs 25-31), and the host probe's cost of a Python call with them. Whether that is
time the hypervisor took from this machine's CPUs (``steal`` in ``/proc/stat``), work of other processes on
the CPUs this process may use, or neither (a neighbour sharing caches and memory bandwidth, which no counter
here sees) decides what a quiet host can be selected by. Every ``--interval`` seconds this writes one CSV row
per CPU this process may run on, and one for all of them (``cpu`` = ``all``): the percentages of the interval
busy (user, nice, system, irq, softirq), stolen and idle (idle, iowait), and the mean clock ``/proc/cpuinfo``
gives (where it gives one; a virtual machine often shows a constant).

  python bench/gpu/host_sampler.py OUT.csv [--interval 1.0]      (runs until killed; each row flushed)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

#: /proc/stat's columns after the name, in order (man 5 proc)
_COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
_BUSY = ("user", "nice", "system", "irq", "softirq")


def read_stat(text: str) -> dict[str, dict[str, int]]:
    """``/proc/stat``'s cpu lines as {"all" or CPU index: {column: jiffies}}."""
    out: dict[str, dict[str, int]] = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        name, *values = line.split()
        key = "all" if name == "cpu" else name[3:]
        out[key] = dict(zip(_COLUMNS, (int(v) for v in values[:len(_COLUMNS)]), strict=False))
    return out


def shares(before: dict[str, int], after: dict[str, int]) -> tuple[float, float, float]:
    """(busy, steal, idle) percent of the jiffies between two readings of one CPU."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in _COLUMNS}
    total = sum(d.values())
    if total <= 0:
        return 0.0, 0.0, 0.0
    busy = sum(d[k] for k in _BUSY)
    return 100 * busy / total, 100 * d["steal"] / total, 100 * (d["idle"] + d["iowait"]) / total


def mean_mhz(text: str) -> float | None:
    """The mean of ``/proc/cpuinfo``'s "cpu MHz" lines; None where it has none."""
    mhz = [float(line.split(":")[1]) for line in text.splitlines() if line.startswith("cpu MHz")]
    return sum(mhz) / len(mhz) if mhz else None


def sampler_args(prog: str, doc: str, out_help: str, argv: list[str] | None) -> argparse.Namespace:
    """A sampler's command line (this one's and thread_sampler.py's): the file to write and a positive interval."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("out", type=Path, help=out_help)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples (1.0)")
    a = ap.parse_args(argv)
    if a.interval <= 0:
        ap.error(f"--interval {a.interval}: expected a positive number of seconds")
    return a


def main(argv: list[str] | None = None) -> int:
    a = sampler_args("host_sampler.py", __doc__, "the CSV to write", argv)
    mine = sorted(str(c) for c in os.sched_getaffinity(0))
    stat, cpuinfo = Path("/proc/stat"), Path("/proc/cpuinfo")
    before = read_stat(stat.read_text())
    with a.out.open("w") as f:
        f.write("time,cpu,busy_pct,steal_pct,idle_pct,mhz\n")
        while True:
            time.sleep(a.interval)
            now, after = time.time(), read_stat(stat.read_text())
            mhz = mean_mhz(cpuinfo.read_text())
            for cpu in ("all", *mine):
                if cpu in after and cpu in before:
                    busy, steal, idle = shares(before[cpu], after[cpu])
                    f.write(f"{now:.1f},{cpu},{busy:.1f},{steal:.1f},{idle:.1f},"
                            f"{'' if mhz is None else f'{mhz:.0f}'}\n")
            f.flush()
            before = after


if __name__ == "__main__":
    sys.exit(main())
