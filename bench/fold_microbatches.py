"""Micro-batch folding vs running every micro-batch: predictions, wall time and peak memory side by side.

Runs a tiny Megatron GPT (default ``tests/recipes/fold-microbatches-pp2.yaml``: TP1·PP2; ``--vpp``:
``tests/recipes/fold-microbatches-pp2vpp2.yaml``, TP1·PP2·VPP2, Megatron's interleaved schedule; its
global batch overridden by ``--global-batch-size`` to give M micro-batches per iteration)
``--repeats`` times each way on CPU with the core driver: ``--prism-fold-microbatches off`` (all M
run) and ``auto`` (the minimum m_c run, the rest replayed as copies of a steady micro-batch, or under
VPP of a steady group's units). Prints per run the command's
wall time (start-up included and, folded, one parse of the command by Megatron's parser), the
emulation's own (the launcher's job time), the predicted iteration time (median after the first
iteration, the recipe's cluster profile), tokens/s and each rank's peak allocated memory, then the
ratios of the medians. CPU compute times vary from run to run (more so on a shared machine): compare
the prediction ratio with the full runs' own spread. For every full capture it also prints ``refold``:
that same graph with each unit the fold replays as a copy given the compute of the unit it copies, of
the same rank and iteration (1F1B: micro-batches m_c - 1 .. M - 2 take micro-batch m_c - 2's; VPP: the
inserted groups take the steady group's, replay.microbatch_fold.interleaved_alignment), which is the
fold's own error without run-to-run noise.

    python bench/fold_microbatches.py                              # PP2, M = 32, 2 runs each way
    python bench/fold_microbatches.py --global-batch-size 64 --repeats 3
    python bench/fold_microbatches.py --vpp --global-batch-size 64 --train-iters 4   # PP2·VPP2, M = 64
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


def _capture(out: Path, recipe: str, mode: str, gbs: int, iters: int | None) -> tuple[Path, float]:
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--recipe", recipe, "--prism-driver", "core",
           "--prism-fold", "off", "--prism-fold-microbatches", mode, "--prism-track-memory", "on",
           "--prism-report", "off", "--prism-trace-dir", str(out), "--global-batch-size", str(gbs),
           *(("--train-iters", str(iters)) if iters else ())]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    wall = time.perf_counter() - t0
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return out, wall


def _copies(mb, m: int, ranks: list[int], stage_of: dict[int, int]) -> dict[int, dict[tuple, tuple]]:
    """Per rank: (unit name, micro-batch, chunk) of each unit the fold replays as a copy -> the unit it copies,
    in the full capture's numbering."""
    out: dict[int, dict[tuple, tuple]] = {}
    if not mb.interleaved:
        for r in ranks:
            out[r] = {(name, i, 0): (name, mb.captured - 2, 0) for name in ("forward", "backward")
                      for i in range(mb.captured - 1, m - 1)}
        return out
    from dataclasses import replace

    from prism_megatron.replay.microbatch_fold import interleaved_alignment
    from prism_megatron.replay.stage_schedule import interleaved_steps, schedule_table
    from prism_megatron.trace.microbatches import interleaved_cut

    table, target, pp = schedule_table(m, mb.chunks, mb.group), replace(mb, target=m), len(mb.warmup)
    for r in ranks:
        w = mb.warmup[stage_of[r]]
        _steps, units, _ops = interleaved_alignment(pp, stage_of[r], target)
        captured = interleaved_steps(pp, stage_of[r], mb.chunks, mb.group, mb.captured, w, mb.overlap_p2p,
                                     mb.wait_sends)
        cut = captured.index(("F", min(w, mb.captured * mb.chunks) + interleaved_cut(w, mb.chunks, mb.group,
                                                                                       mb.captured)))
        at = {step: i for i, step in enumerate(captured)}
        copies = {}
        for (kind, vid), (_, src) in units.items():
            if vid != src and at[(kind, src)] < cut:  # an inserted copy: the full run's unit at the source's place
                (i, c), (j, d) = table[vid], table[src]
                name = "forward" if kind == "F" else "backward"
                flip = (lambda x: x) if kind == "F" else (lambda x: mb.chunks - 1 - x)
                copies[(name, i, flip(c))] = (name, j, flip(d))
        out[r] = copies
    return out


def _refold(trace_dir: Path, mb, cluster: str) -> float:
    """The full capture's predicted iteration (median after the first) with every unit the fold replays as a
    copy given the compute of the unit it copies, of the same rank and iteration."""
    from prism_megatron.replay import graph_from_trace, replay
    from prism_megatron.replay.graph import Comm, Compute, Mark
    from prism_megatron.report.build import cost_model
    from prism_megatron.trace import read_trace

    graph = graph_from_trace(read_trace(trace_dir))
    stage_of = {}
    for r, events in graph.events.items():
        p2p = next((e for e in events if type(e) is Comm and e.is_p2p), None)
        stage_of[r] = 0 if p2p is None else list(graph.groups[p2p.group].ranks).index(r)
    spans: dict[int, dict[tuple, list[int]]] = {}
    for r, events in graph.events.items():
        spans[r] = {}
        key = None
        for i, e in enumerate(events):
            if type(e) is Mark and e.name in ("forward", "backward"):
                key = (e.attrs.get("iteration"), e.name, e.attrs.get("microbatch"), e.attrs.get("chunk") or 0) \
                    if e.phase == "B" else None
            elif key is not None and type(e) is Compute:
                spans[r].setdefault(key, []).append(i)
    m = 1 + max(k[2] for k in spans[next(iter(spans))])
    copies = _copies(mb, m, list(graph.events), stage_of)
    for r, events in graph.events.items():
        for (it, *unit), idx in spans[r].items():
            src = copies[r].get(tuple(unit))
            if src is None:
                continue
            source = spans[r][(it, *src)]
            if len(source) != len(idx):
                raise SystemExit(f"rank {r}: units {unit} and {src} differ")
            for i, j in zip(idx, source, strict=True):
                events[i] = events[j]
    its = replay(graph, cost_model(cluster, None)).iteration_times()
    return statistics.median(its[1:] or its)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default=None, help="default: tests/recipes/fold-microbatches-pp2.yaml (--vpp: "
                   "fold-microbatches-pp2vpp2.yaml)")
    p.add_argument("--vpp", action="store_true", help="the PP2·VPP2 recipe (Megatron's interleaved schedule)")
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--train-iters", type=int, default=None, help="default: the recipe's (the prediction is the "
                   "median of the iterations after the first)")
    p.add_argument("--cluster", default="h100-nvlink-ib400")
    a = p.parse_args()
    a.recipe = a.recipe or str(ROOT / "tests" / "recipes" / f"fold-microbatches-pp2{'vpp2' if a.vpp else ''}.yaml")
    from prism_megatron.report.build import build_report

    rows: dict[str, list[dict]] = {"off": [], "auto": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(a.repeats):
            for mode in ("off", "auto"):
                trace, wall = _capture(Path(tmp) / f"{mode}-{k}", a.recipe, mode, a.global_batch_size,
                                       a.train_iters)
                report = build_report(trace, a.cluster)
                pred = report["prediction"]
                its = pred["iteration_times_s"][1:] or pred["iteration_times_s"]
                peaks = {e["rank"]: e["max_allocated"] for e in report["memory"]["ranks"]}
                from prism_megatron.trace import read_trace

                job = read_trace(trace).manifest["job"]
                rows[mode].append({"trace": trace, "wall": wall, "emulation": job.get("wall_time_s", float("nan")),
                                   "pred": statistics.median(its), "tokens": pred["tokens_per_s"],
                                   "peaks": peaks, "provenance": pred["provenance"]})
        mb = read_trace(rows["auto"][0]["trace"]).microbatches
        for r in rows["off"]:
            r["refold"] = _refold(r["trace"], mb, a.cluster)
    recipe = Path(a.recipe).name
    iters = f", {a.train_iters} iterations" if a.train_iters else ""
    print(f"recipe {recipe}, global batch {a.global_batch_size}{iters}, cluster {a.cluster}, {a.repeats} run(s) "
          "each way")
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
