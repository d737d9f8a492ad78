"""The replay's critical path per iteration, by kind, and how much of each iteration's compute ran on one clock.

The report shows the critical path of one window (the median-low timed iteration); this prints every
iteration's, so that an op kind on the path can be traced to the iterations, and to their clocks, that
put it there. An iteration whose compute lacks GPU times is replayed on one clock, where every op the
host waits for is exposed; on two clocks an op the host's issuing outlasts is hidden (replay.engine).

    python bench/targets/critical_path_by_iteration.py TRACE_DIR [--cluster NAME]

A step of the path counts in the iteration its midpoint falls in; "one clock" is the share of the
iteration's compute seconds (every rank's) without a measured GPU time: no gpu rows covered them
(replay.gpu_segments gives such a stretch its host length on the device too).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

from prism_megatron.replay.engine import replay  # noqa: E402
from prism_megatron.replay.graph import Compute, graph_from_trace  # noqa: E402
from prism_megatron.report.build import cost_model  # noqa: E402
from prism_megatron.report.costing import choose_costing  # noqa: E402
from prism_megatron.trace import read_trace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--cluster", default=None, help="profile costing communication (default: the trace's)")
    ap.add_argument("--top", type=int, default=5, help="kinds shown per iteration")
    a = ap.parse_args()
    trace = read_trace(a.trace)
    costing = choose_costing(a.cluster, trace)
    graph = graph_from_trace(trace)
    result = replay(graph, cost_model(costing.cluster, graph.fold, None), fold_method="auto")
    its = result.iterations()
    path: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for step in result.critical_path:
        mid = (step.start + step.end) / 2
        n = next((it.number for it in its if it.start <= mid <= it.end), 0)
        path[n][step.kind] += step.duration
    # iteration -> [host seconds on one clock, host seconds]; a Compute whose device time is its host time
    # to the last bit had no rows (a measured segment's two times never agree that closely)
    clocks: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for rank, events in result.graph.events.items():
        for ev, (t0, t1) in zip(events, result.event_times.get(rank, []), strict=False):
            if isinstance(ev, Compute) and ev.duration > 0:
                n = next((it.number for it in its if it.start <= (t0 + t1) / 2 <= it.end), 0)
                clocks[n][0] += ev.duration if ev.gpu is None or ev.gpu == ev.duration else 0.0
                clocks[n][1] += ev.duration
    print(f"critical path per iteration of {a.trace} (communication: {costing.cluster or 'free'})")
    for it in its:
        kinds = sorted(path[it.number].items(), key=lambda kv: -kv[1])[: a.top]
        one, total = clocks[it.number]
        share = f"{100 * one / total:.0f} %" if total else "-"
        print(f"  iteration {it.number}: {it.time:8.2f} s  one clock {share:>5}  path: "
              + ", ".join(f"{k} {v:.2f} s" for k, v in kinds))


if __name__ == "__main__":
    main()
