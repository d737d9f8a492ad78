"""Where two runs' peak memory differs: live allocations at each run's peak, grouped by Python stack.

Usage: python bench/gpu/snapshot_diff.py REAL.pickle EMULATED.pickle   (from bench/gpu/memory_diag.sh,
which dumps ``torch.cuda.memory._dump_snapshot`` pickles via PRISM_MEMORY_SNAPSHOT). Prints both peaks,
the program point of each and the stacks whose live bytes at the peak differ most — how the Work <->
Future reference cycle (+80..176 MiB on TP2) was found.
"""

from __future__ import annotations

import collections
import pickle
import sys

MiB = 1 << 20


def peak(path: str) -> tuple[int, int, dict, list]:
    """(peak bytes, event index, live blocks at the peak by address, the device's trace)."""
    with open(path, "rb") as f:
        trace = next(t for t in pickle.load(f)["device_traces"] if t)
    live: dict[int, dict] = {}
    cur = best = best_i = 0
    best_live: dict[int, dict] = {}
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, best_i, best_live = cur, i, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    return best, best_i, best_live, trace


def stack(e: dict, depth: int = 4) -> str:
    frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in e.get("frames", [])
              if f["filename"].endswith(".py")]
    return " < ".join(frames[:depth])


def main(real: str, emulated: str) -> None:
    by_stack = {}
    for name, path in (("real", real), ("emulated", emulated)):
        best, i, live, trace = peak(path)
        print(f"{name}: peak {best / MiB:.2f} MiB at event {i} of {len(trace)} ({stack(trace[i])})")
        totals: collections.Counter = collections.Counter()
        for e in live.values():
            totals[stack(e)] += e["size"]
        by_stack[name] = totals
    keys = set(by_stack["real"]) | set(by_stack["emulated"])
    rows = sorted(((by_stack["emulated"][k] - by_stack["real"][k], k) for k in keys), key=lambda r: -abs(r[0]))
    for diff, k in rows[:12]:
        print(f"{diff / MiB:+9.2f} MiB  real {by_stack['real'][k] / MiB:8.2f}  emulated "
              f"{by_stack['emulated'][k] / MiB:8.2f}  {k[:200]}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
