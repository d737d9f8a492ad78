"""A class fold captured together vs serially (``--prism-fold-capture serial``): wall, peaks, predictions.

Runs one tiny Megatron GPT (default ``mini-dense-tp2pp2dp2``: TP2·PP2·DP2, class depth: live ranks 0 and
4; ``tests/recipes/fold-class-tp1pp4.yaml`` gives three live ranks) ``--repeats`` times each way on CPU
(core driver, memory tracked) and prints per run: the command's wall time, each class's max allocated
(CPU byte accountant), the predicted iteration times (replay with the cluster profile, ms) and their
median after the first. CPU compute times vary from run to run, so it also prints, for each serial run,
its merged graph replayed with the first together run's compute durations (``same compute``): what
the serial capture's structure alone changes in the prediction (its ops, groups and sequence numbers
are the together capture's, so 0 expected).

    python bench/fold_serial.py
    python bench/fold_serial.py --recipe tests/recipes/fold-class-tp1pp4.yaml --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "h100-nvlink-ib400"


def _capture(out: Path, recipe: str, capture: str) -> tuple[Path, float]:
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--recipe", recipe, "--prism-driver", "core",
           "--prism-fold", "on", "--prism-fold-depth", "class", "--prism-fold-capture", capture,
           "--prism-report", "off", "--prism-track-memory", "on", "--prism-trace-dir", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return out, wall


def _peaks(trace_dir: Path, fold) -> dict[str, int]:
    from prism_megatron.report.build import build_report

    out: dict[str, int] = {}
    for entry in build_report(trace_dir)["memory"]["ranks"]:
        name = fold.class_name(entry["rank"])
        out[name] = max(out.get(name, 0), entry["max_allocated"])
    return out


def _ms(graph, cost) -> list[float]:
    from prism_megatron.replay import replay

    return [t * 1e3 for t in replay(graph, cost).iteration_times()]


def _with_compute(graph, like):
    """``graph`` with every compute event taken from ``like`` (same event structure)."""
    from prism_megatron.replay.graph import Compute

    for r in graph.ranks:
        graph.events[r] = [x if isinstance(x, Compute) else y for x, y in zip(like.events[r], graph.events[r],
                                                                            strict=True)]
    return graph


def _line(what: str, wall: float, peaks: dict[str, int], times: list[float]) -> str:
    steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
    shown = ", ".join(f"{t:.1f}" for t in times)
    mem = ", ".join(f"{k} {v:,} B" for k, v in sorted(peaks.items()))
    return f"{what:<22} wall {wall:5.1f} s | max allocated {mem} | predicted ms [{shown}] median {steady:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="mini-dense-tp2pp2dp2")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from prism_megatron.calibration.costmodel import CollectiveCostModel
    from prism_megatron.calibration.profiles import load_profile
    from prism_megatron.replay import graph_from_trace
    from prism_megatron.trace import read_trace

    cost = CollectiveCostModel(load_profile(CLUSTER), gpus_per_node=8)
    print(f"recipe {args.recipe}, class depth, CPU (core driver), replay with {CLUSTER}; {args.repeats} run(s) "
          "each way")
    with tempfile.TemporaryDirectory() as tmp:
        base = None
        for i in range(args.repeats):
            for capture in ("together", "serial"):
                trace_dir, wall = _capture(Path(tmp) / f"{capture}-{i}", args.recipe, capture)
                trace = read_trace(trace_dir)
                if base is None:
                    print(f"live ranks {list(trace.fold.live)}, classes "
                          f"{[c.name for c in trace.fold.classes]}, {trace.fold.world_size} ranks")
                graph = graph_from_trace(trace)
                print(_line(f"{capture} #{i + 1}", wall, _peaks(trace_dir, trace.fold), _ms(graph, cost)))
                if capture == "together" and base is None:
                    base = (graph_from_trace(trace), _ms(graph, cost))
                if capture == "serial":
                    ways = trace.fold.contribution_counts()
                    same = _ms(_with_compute(graph_from_trace(trace), base[0]), cost)
                    diff = max(abs(a - b) for a, b in zip(same, base[1], strict=True))
                    print(f"{'':<22} same compute as together #1: max |difference| {diff:.2e} ms; "
                          f"self_mirror {ways.get('self_mirror', 0)}, standin {ways.get('standin', 0)} "
                          f"contributions")


if __name__ == "__main__":
    main()
