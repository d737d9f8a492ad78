"""Class depth with folded middle pipeline stages vs the full capture: predicted iteration times.

Under 1F1B each pipeline stage runs its own number of warm-up forwards; a class-depth fold keeps one
live middle stage and synthesis rebuilds every folded stage's own order of units from it
(``prism_megatron.replay.stage_schedule``). This runs a tiny Megatron GPT (default
``tests/recipes/fold-class-tp1pp5.yaml``: TP1·PP5, 8 microbatches; stages 2 and 3 folded onto stage
1) ``--repeats`` times each way, ``--prism-fold on --prism-fold-depth class`` and ``--prism-fold off``
(core driver, CPU), and prints per run the predicted iteration times (replay with the recipe's
cluster profile) and their median over the iterations after the first. CPU compute times vary from
run to run (more so on a shared machine), so it also prints, for every full capture, that same trace
folded at class depth and replayed (``refold``): the fold's own error, without run-to-run noise
(only the folded stages' compute and waits are the live stage's instead of their own). Each captured
run's line also gives the live ranks' compute per iteration (median after the first, from the trace's
markers): where fold and full differ, it says whether the captures' compute did.

    python bench/fold_class_schedule.py                        # TP1·PP5, 3 runs each way
    python bench/fold_class_schedule.py --recipe tests/recipes/fold-class-tp1pp4.yaml --repeats 2
    python bench/fold_class_schedule.py --recipe tests/recipes/fold-class-tp1pp4vpp2.yaml   # interleaved
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _capture(out: Path, recipe: str, fold: str) -> Path:
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--recipe", recipe, "--prism-driver", "core",
           "--prism-fold", fold, "--prism-fold-depth", "class", "--prism-report", "off",
           "--prism-trace-dir", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return out


def _times(graph, cost) -> list[float]:
    from prism_megatron.replay import replay

    return [t * 1e3 for t in replay(graph, cost).iteration_times()]


def _compute(trace, ranks) -> dict[int, float]:
    """Per rank: its compute (ms) per iteration, median after the first (marks' compute clock)."""
    out = {}
    for r in ranks:
        clocks = [m["compute_clock"] for m in trace.marks.to_pylist() if m["rank"] == r and m["name"] == "iteration"]
        its = [(b - a) * 1e3 for a, b in zip(clocks[0::2], clocks[1::2], strict=False)]
        out[r] = statistics.median(its[1:]) if len(its) > 1 else its[0]
    return out


def _row(name: str, times: list[float], compute: dict[int, float] | None = None) -> float:
    med = statistics.median(times[1:]) if len(times) > 1 else times[0]
    also = "   compute " + " ".join(f"r{r} {c:6.2f}" for r, c in compute.items()) if compute else ""
    print(f"  {name:<10} {' '.join(f'{t:8.2f}' for t in times)}   median after the first {med:8.2f} ms{also}",
          flush=True)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "tests" / "recipes" / "fold-class-tp1pp5.yaml"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cluster", default="h100-nvlink-ib400")
    args = ap.parse_args()

    from folding import fold_trace

    from prism_megatron.calibration.costmodel import CollectiveCostModel
    from prism_megatron.calibration.profiles import load_profile
    from prism_megatron.replay import graph_from_trace
    from prism_megatron.trace import read_trace

    cost = CollectiveCostModel(load_profile(args.cluster), gpus_per_node=8)
    medians: dict[str, list[float]] = {"fold": [], "full": [], "refold": []}
    with tempfile.TemporaryDirectory(prefix="prism-fold-class-") as tmp:
        work = Path(tmp)
        recipe = Path(args.recipe).resolve()
        shown = recipe.relative_to(ROOT) if recipe.is_relative_to(ROOT) else recipe
        print(f"{shown}: predicted iteration times (ms), cluster {args.cluster}")
        for i in range(args.repeats):
            folded = read_trace(_capture(work / f"fold{i}", args.recipe, "on"))
            f = folded.fold
            medians["fold"].append(_row(f"fold {i}", _times(graph_from_trace(folded), cost), _compute(folded, f.live)))
            full = _capture(work / f"full{i}", args.recipe, "off")
            trace = read_trace(full)
            medians["full"].append(_row(f"full {i}", _times(graph_from_trace(trace), cost), _compute(trace, f.live)))
            refold = fold_trace(full, work / f"refold{i}", f.rep, f.gpus_per_node, f.classes, f.class_of,
                                depth=f.depth, axes=f.axes, sizes=f.sizes, coords=f.coords, schedule=f.schedule,
                                warmup=f.warmup, chunks=f.chunks, group=f.group, overlap_p2p=f.overlap_p2p,
                                wait_sends=f.wait_sends)
            medians["refold"].append(_row(f"refold {i}", _times(graph_from_trace(read_trace(refold)), cost)))
        print(f"live ranks {list(f.live)} of {f.world_size}; warm-up per stage {list(f.warmup)}")
    m = {k: statistics.median(v) for k, v in medians.items()}
    print(f"median over runs: fold {m['fold']:.2f} ms, full {m['full']:.2f} ms "
          f"(fold/full {m['fold'] / m['full']:.3f}); "
          f"refold/full of the same traces "
          f"{', '.join(f'{a / b:.3f}' for a, b in zip(medians['refold'], medians['full'], strict=True))}; "
          f"full captures' spread {min(medians['full']):.2f}..{max(medians['full']):.2f} ms")


if __name__ == "__main__":
    main()
