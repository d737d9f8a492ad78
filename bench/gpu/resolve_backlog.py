"""Re-solve a GPU trace's plain host times with the device backlog a segment after a marker starts with.

The capture (``runtime.gpu_timing.pair``) turns each plain segment's measured time into host time through
the replay's model of the segment. Until the backlog was modelled it assumed every segment started on an
empty device queue, true after an op (the runtime waits for the device) but not after a marker: there the
device still runs what the segments before queued, and a wait in the segment (Megatron's gradient check
after the last backward) waited for that too, which the solve took for host time. A trace written before
the fix holds the solved rows; their model end is the plain time measured (the solve matched it), so the
rows can be solved again with the backlog and replayed, communication free, beside the trace as it was:

  python bench/gpu/resolve_backlog.py TRACE_DIR [TRACE_DIR ...]

Prints per trace the replay's median iteration (iterations after the first two) before and after.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import pyarrow as pa

from prism_megatron.replay import graph_from_trace, replay, zero_cost
from prism_megatron.runtime.gpu_timing import SegmentTiming, host_end, solve_segment
from prism_megatron.trace import read_trace

WARMUP = 2


def resolved(trace) -> pa.Table:
    """The trace's gpu table with each rank's plain host times solved again, the backlog carried from a
    segment that ended at a marker to the next."""
    marks = defaultdict(set)
    for m in trace.marks.to_pylist():
        marks[m["rank"]].add(round(m["compute_clock"], 9))
    rows = trace.gpu.to_pylist()
    by_rank = defaultdict(list)
    for i, r in enumerate(rows):
        by_rank[r["rank"]].append(i)
    for rank, idx in by_rank.items():
        backlog = 0.0
        for i in sorted(idx, key=lambda i: rows[i]["clock_end"]):
            r = rows[i]
            syncs = r["syncs"] if isinstance(r["syncs"], list) else json.loads(r["syncs"])
            seg = SegmentTiming(r["clock_start"], r["clock_end"], r["cpu"], r["gpu"], [tuple(s) for s in syncs])
            plain = host_end(seg, 1.0)  # what the old solve matched
            scale, left = solve_segment(seg, plain, backlog)
            rows[i] = dict(r, cpu=seg.cpu * scale, syncs=json.dumps([[o * scale, b] for o, b in seg.syncs]))
            backlog = left if round(r["clock_end"], 9) in marks[rank] else 0.0  # a marker: no runtime wait
    return pa.Table.from_pylist(rows, schema=trace.gpu.schema)


def predicted(trace) -> float:
    result = replay(graph_from_trace(trace), zero_cost)
    times = [it.time for it in result.iterations() if it.number > WARMUP]
    return statistics.median(times) * 1e3


def main(paths: list[str]) -> int:
    for p in paths:
        trace = read_trace(Path(p))
        before = predicted(trace)
        after = predicted(replace(trace, gpu=resolved(trace)))
        print(f"{Path(p).parent.name}/{Path(p).name}: predicted {before:.1f} ms as captured, {after:.1f} ms with "
              f"the backlog ({after / before - 1:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
