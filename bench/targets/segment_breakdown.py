"""Where a captured rank's compute goes: host and device seconds per micro-batch and per segment kind.

Reads a prism trace (the directory, or a results tarball unpacked into one) with prism's trace reader
and prints, for the timed iterations of one rank (those with gpu rows: host time from plain iterations,
device time from profiled ones):

- per iteration, micro-batch and phase: compute-clock seconds, host seconds, device seconds, waits
  for the device inside segments;
- per segment kind for one micro-batch: segments named by the op before and the op after them
  (``a2a[tokens]`` is an all_to_all whose tensors have the hidden size as last dimension,
  ``a2a[probs]`` a one-dimensional one, ``ag[counts]`` the all-gather of per-expert token counts),
  summed over the micro-batch;
- wall seconds of the ops (issue to completion: the runtime's answers, off the compute clock) per
  micro-batch, and the tokens each token all_to_all received (from its splits).

    python bench/targets/segment_breakdown.py TRACE_DIR [--rank 0] [--microbatch 1]
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))
from prism_megatron.trace import read_trace  # noqa: E402

_TOL = 1e-7


def op_name(op: dict, hidden: int | None) -> str:
    """A short name for an op: token/probs all_to_all, counts all-gather, or kind:label."""
    shapes = json.loads(op["shapes"]) if op["shapes"] else []
    if op["kind"] in ("all_to_all", "all_to_all_single") and shapes:
        return "a2a[tokens]" if len(shapes[0]) == 2 and (hidden is None or shapes[0][-1] == hidden) else "a2a[probs]"
    if op["kind"] == "all_gather" and shapes and len(shapes[0]) == 1 and op["label"] == "":
        return "ag[counts]"
    return op["kind"] + (f":{op['label']}" if op["label"] else "")


def windows(marks: list[dict]) -> list[tuple[int, int, str, float, float, float, float]]:
    """(iteration, microbatch, phase, clock begin, clock end, t begin, t end) of forward/backward marks."""
    out = []
    for i, m in enumerate(marks):
        if m["phase"] == "B" and m["name"] in ("forward", "backward"):
            a = json.loads(m["attrs"])
            end = next(x for x in marks[i + 1:] if x["name"] == m["name"] and x["phase"] == "E")
            out.append((a["iteration"], a["microbatch"], m["name"], m["compute_clock"], end["compute_clock"],
                        m["t"], end["t"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--microbatch", type=int, default=1, help="micro-batch whose segment kinds are listed")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (tells token from probs all_to_all)")
    args = ap.parse_args()

    trace = read_trace(args.trace)
    ops = trace.ops_for_rank(args.rank)
    clock = 0.0
    for op in ops:  # an op's place on the compute clock: the running sum of compute_before
        clock += op["compute_before"]
        op["clock"] = clock
    clocks = [op["clock"] for op in ops]
    marks = sorted((m for m in trace.marks.to_pylist() if m["rank"] == args.rank), key=lambda m: m["t"])
    rows = sorted((r for r in trace.gpu.to_pylist() if r["rank"] == args.rank), key=lambda r: r["clock_start"])
    starts = [r["clock_start"] for r in rows]

    def segs(c0: float, c1: float) -> list[dict]:
        lo, hi = bisect.bisect_left(starts, c0 - _TOL), bisect.bisect_right(starts, c1 + _TOL)
        return [r for r in rows[lo:hi] if r["clock_end"] <= c1 + _TOL]

    def before(c: float) -> str:
        i = bisect.bisect_right(clocks, c + _TOL) - 1
        return op_name(ops[i], args.hidden) if i >= 0 else "start"

    def after(c: float) -> str:
        i = bisect.bisect_left(clocks, c - _TOL)
        return op_name(ops[i], args.hidden) if i < len(ops) else "end"

    wins = windows(marks)
    timed = sorted({w[0] for w in wins if segs(w[3], w[4])})
    print(f"trace {trace.path.name}: rank {args.rank}, {len(ops)} ops, {len(rows)} gpu rows; timed iterations {timed}")
    print("iteration mb phase     clock s   host s  device s  waits  wall s")
    for it, mb, phase, c0, c1, t0, t1 in wins:
        s = segs(c0, c1)
        waits = sum(len(json.loads(r["syncs"]) if isinstance(r["syncs"], str) and r["syncs"] else r["syncs"] or [])
                    for r in s)
        host = sum(r["cpu"] for r in s) if s else float("nan")
        dev = sum(r["gpu"] for r in s) if s else float("nan")
        print(f"{it:9d} {mb:2d} {phase:8s} {c1 - c0:8.3f} {host:8.3f} {dev:9.3f} {waits:6d} {t1 - t0:7.2f}")

    for it in timed:
        for phase in ("forward", "backward"):
            w = [x for x in wins if x[0] == it and x[1] == args.microbatch and x[2] == phase]
            if not w:
                continue
            _, _, _, c0, c1, t0, t1 = w[0]
            kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
            for r in segs(c0, c1):
                if r["cpu"] <= 0 and r["gpu"] <= 0:
                    continue
                k = kinds[f"{before(r['clock_start'])} -> {after(r['clock_end'])}"]
                k[0] += 1
                k[1] += r["cpu"]
                k[2] += r["gpu"]
            print(f"\niteration {it}, micro-batch {args.microbatch}, {phase}: segment kind (op before -> op after)")
            print(f"  {'kind':52s} {'n':>4s} {'host s':>8s} {'device s':>9s} {'host/dev':>8s}")
            for name, (n, host, dev) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
                ratio = f"{host / dev:8.1f}" if dev > 0 else "       -"
                print(f"  {name:52s} {n:4d} {host:8.3f} {dev:9.4f} {ratio}")
            wall: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
            for op in ops:
                if t0 <= op["t_issue"] <= t1:
                    x = wall[op_name(op, args.hidden)]
                    x[0] += 1
                    x[1] += op["t_complete"] - op["t_issue"]
            print(f"  wall {t1 - t0:.2f} s, compute clock {c1 - c0:.3f} s; ops issue->complete: "
                  + ", ".join(f"{k} {n} x, {s:.2f} s" for k, (n, s) in sorted(wall.items())))

    received = []
    for op in ops:
        if op_name(op, args.hidden) == "a2a[tokens]" and op["splits"]:
            shapes = json.loads(op["shapes"])
            row = int(op["bytes"] // max(shapes[0][0], 1)) or 1  # bytes per token row
            received.append([b // row for b in json.loads(op["splits"])[1]])
    if received:
        totals = [sum(r) for r in received]
        peers = [x for r in received for x in r]
        print(f"\ntoken all_to_all: {len(received)} ops; tokens received per op min {min(totals)} max {max(totals)}; "
              f"per peer min {min(peers)} median {statistics.median(peers):.0f} max {max(peers)}")


if __name__ == "__main__":
    main()
