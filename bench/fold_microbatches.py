"""Micro-batch folding vs running every micro-batch: predictions, wall time and peak memory side by side.

Runs a tiny Megatron GPT (default ``tests/recipes/fold-microbatches-pp2.yaml``: TP1·PP2, its global
batch overridden by ``--global-batch-size`` to give M micro-batches per iteration) ``--repeats`` times
each way on CPU with the core driver: ``--prism-fold-microbatches off`` (all M run) and ``auto`` (the
minimum m_c run, the rest replayed as copies of a steady micro-batch). Prints per run the command's
wall time (start-up included and, folded, one parse of the command by Megatron's parser), the
emulation's own (the launcher's job time), the predicted iteration time (median after the first
iteration, the recipe's cluster profile), tokens/s and each rank's peak allocated memory, then the
ratios of the medians. CPU compute times vary from run to run (more so on a shared machine): compare
the prediction ratio with the full runs' own spread. For every full capture it also prints ``refold``:
that same graph with each unit of micro-batches m_c - 1 .. M - 2 given the compute of micro-batch
m_c - 2's unit of its iteration (what the fold replays), which is the fold's own error without
run-to-run noise.

    python bench/fold_microbatches.py                              # PP2, M = 32, 2 runs each way
    python bench/fold_microbatches.py --global-batch-size 64 --repeats 3
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


def _capture(out: Path, recipe: str, mode: str, gbs: int) -> tuple[Path, float]:
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--recipe", recipe, "--prism-driver", "core",
           "--prism-fold", "off", "--prism-fold-microbatches", mode, "--prism-track-memory", "on",
           "--prism-report", "off", "--prism-trace-dir", str(out), "--global-batch-size", str(gbs)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return out, wall


def _refold(trace_dir: Path, captured: int, cluster: str) -> float:
    """The full capture's predicted iteration (median after the first) with the units of micro-batches
    captured - 1 .. M - 2 replaced by micro-batch captured - 2's of the same rank and iteration."""
    from prism_megatron.replay import graph_from_trace, replay
    from prism_megatron.replay.graph import Compute, Mark
    from prism_megatron.report.build import cost_model
    from prism_megatron.trace import read_trace

    graph = graph_from_trace(read_trace(trace_dir))
    for r, events in graph.events.items():
        spans: dict[tuple, list[int]] = {}
        key = None
        for i, e in enumerate(events):
            if type(e) is Mark and e.name in ("forward", "backward"):
                key = (e.name, e.attrs.get("iteration"), e.attrs.get("microbatch")) if e.phase == "B" else None
            elif key is not None and type(e) is Compute:
                spans.setdefault(key, []).append(i)
        m = 1 + max(k[2] for k in spans)
        for (name, it, mb), idx in spans.items():
            if captured - 1 <= mb < m - 1:
                source = spans[(name, it, captured - 2)]
                if len(source) != len(idx):
                    raise SystemExit(f"rank {r}: {name} units of micro-batches {mb} and {captured - 2} differ")
                for i, j in zip(idx, source, strict=True):
                    events[i] = events[j]
    its = replay(graph, cost_model(cluster, None)).iteration_times()
    return statistics.median(its[1:] or its)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=str(ROOT / "tests" / "recipes" / "fold-microbatches-pp2.yaml"))
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--cluster", default="h100-nvlink-ib400")
    a = p.parse_args()
    from prism_megatron.report.build import build_report

    rows: dict[str, list[dict]] = {"off": [], "auto": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(a.repeats):
            for mode in ("off", "auto"):
                trace, wall = _capture(Path(tmp) / f"{mode}-{k}", a.recipe, mode, a.global_batch_size)
                report = build_report(trace, a.cluster)
                pred = report["prediction"]
                its = pred["iteration_times_s"][1:] or pred["iteration_times_s"]
                peaks = {e["rank"]: e["max_allocated"] for e in report["memory"]["ranks"]}
                from prism_megatron.trace import read_trace

                job = read_trace(trace).manifest["job"]
                rows[mode].append({"trace": trace, "wall": wall, "emulation": job.get("wall_time_s", float("nan")),
                                   "pred": statistics.median(its), "tokens": pred["tokens_per_s"],
                                   "peaks": peaks, "provenance": pred["provenance"]})
        captured = read_trace(rows["auto"][0]["trace"]).microbatches.captured
        for r in rows["off"]:
            r["refold"] = _refold(r["trace"], captured, a.cluster)
    recipe = Path(a.recipe).name
    print(f"recipe {recipe}, global batch {a.global_batch_size}, cluster {a.cluster}, {a.repeats} run(s) each way")
    said = rows["auto"][0]["provenance"]
    print("  " + said[said.index("micro-batches:"):])
    print(f"  {'run':<10} {'wall s':>8} {'emul. s':>8} {'pred ms':>9} {'tokens/s':>10}  peak allocated per rank (B)")
    for mode, name in (("off", "full"), ("auto", "folded")):
        for k, r in enumerate(rows[mode]):
            peaks = ", ".join(f"{rank}: {b}" for rank, b in sorted(r["peaks"].items()))
            print(f"  {name + ' ' + str(k):<10} {r['wall']:>8.1f} {r['emulation']:>8.1f} {r['pred'] * 1e3:>9.1f} "
                  f"{r['tokens']:>10.1f}  {peaks}")
    for k, r in enumerate(rows["off"]):
        print(f"  refold {k}: {r['refold'] * 1e3:.1f} ms predicted, {r['refold'] / r['pred']:.3f} of full {k}'s")
    med = {m: (statistics.median(r["pred"] for r in rows[m]), statistics.median(r["wall"] for r in rows[m]),
               statistics.median(r["emulation"] for r in rows[m])) for m in rows}
    spread = [r["pred"] for r in rows["off"]]
    print(f"  folded / full: prediction {med['auto'][0] / med['off'][0]:.3f} (full runs' own spread "
          f"{min(spread) * 1e3:.1f}-{max(spread) * 1e3:.1f} ms), wall time {med['auto'][1] / med['off'][1]:.3f} "
          f"(emulation alone {med['auto'][2] / med['off'][2]:.3f})")
    for rank in sorted(rows["off"][0]["peaks"]):
        full = {r["peaks"][rank] for r in rows["off"]}
        fold = {r["peaks"][rank] for r in rows["auto"]}
        print(f"  rank {rank} peak allocated: full {sorted(full)} B, folded {sorted(fold)} B, "
              f"difference {max(full) - max(fold)} B")


if __name__ == "__main__":
    main()
