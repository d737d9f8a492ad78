"""Phase 2 against full capture on one device: the same Megatron job captured whole and folded.

For each job (a dense GPT at TP2·PP2·DP(W/4) and a MoE GPT at PP2·EP4·DP(W/2), W = 16 ranks by default, run by the
core driver), one run with every rank (``--prism-fold off``) and one with only the sandbox
(``--prism-fold on``). Prints, side by side: per rank class the max allocated and max reserved bytes
(equal on dense: a folded rank runs exactly the program a full-capture rank runs), the predicted
iteration time of each (replayed with the cluster profile), the losses, and each run's wall time.

    python bench/gpu/fold_consistency.py --devices 0 --out DIR            # on the GPU machine
    python bench/gpu/fold_consistency.py --devices cpu --hidden 64 --out DIR   # a quick check on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CORE = "prism_megatron/megatron/driver/core_gpt.py"


def _flags(a: argparse.Namespace, moe: bool, dp: int) -> list[str]:
    gbs = dp * a.mbs * 2  # two micro-batches per rank
    flags = (f"--num-layers {a.layers} --hidden-size {a.hidden} --num-attention-heads {a.heads} "
             f"--seq-length {a.seq} --max-position-embeddings {a.seq} --tokenizer-type NullTokenizer "
             f"--vocab-size 32000 --mock-data --micro-batch-size {a.mbs} --global-batch-size {gbs} "
             f"--train-iters {a.iters} --lr 0.0001 --seed 1234 --transformer-impl local "
             f"--no-gradient-accumulation-fusion --log-interval 1 --eval-iters 0 --eval-interval 1000 "
             "--pipeline-model-parallel-size 2").split()
    if a.bf16:
        flags += ["--bf16", "--no-masked-softmax-fusion"]
    if moe:
        flags += ["--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "4",
                  "--moe-token-dispatcher-type", "alltoall"]
    else:
        flags += ["--tensor-model-parallel-size", "2"]
    return flags


def _run(a: argparse.Namespace, name: str, fold: str, flags: list[str]) -> dict:
    trace = Path(a.out) / f"trace-{name}-fold-{fold}"
    metrics = Path(a.out) / f"{name}-fold-{fold}.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    env = dict(os.environ, PRISM_MEGATRON_METRICS=str(metrics), CUDA_DEVICE_MAX_CONNECTIONS="1",
               WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--prism-emulate", "--prism-world-size", str(a.world),
           "--prism-devices", a.devices, "--prism-driver", "core", "--prism-fold", fold, "--prism-fold-depth", a.depth,
           "--prism-swap", "none",
           "--prism-report", "off", "--prism-track-memory", "on", "--prism-log-ranks", "none",
           "--prism-trace-dir", str(trace), CORE, *flags]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.timeout)
    wall = time.perf_counter() - t0
    (Path(a.out) / f"{name}-fold-{fold}.log").write_text(p.stdout + p.stderr)
    out = {"name": name, "fold": fold, "rc": p.returncode, "wall_s": wall}
    if p.returncode != 0:
        out["error"] = (p.stdout + p.stderr)[-1500:]
        return out
    from prism_megatron.report.build import build_report

    report = build_report(trace, cluster=a.cluster)
    out["ranks"] = {r["rank"]: {"max_allocated": r["max_allocated"], "max_reserved": r["max_reserved"],
                                "class": r["class"]} for r in report["memory"]["ranks"]}
    fold_plan = json.loads((trace / "manifest.json").read_text())["job"].get("fold")
    out["rep"] = fold_plan["rep"] if fold_plan else None
    pred = report["prediction"] or {}
    out["iteration_s"] = pred.get("iteration_time_s")
    out["iteration_times_s"] = pred.get("iteration_times_s")
    losses = {}
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if "lm loss" in row.get("loss", {}):
                losses.setdefault(row["iteration"], []).append(row["loss"]["lm loss"])
    out["losses"] = {k: statistics.mean(v) for k, v in sorted(losses.items()) if v}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="0")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cluster", default="h200-nvlink-ib400")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mbs", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--jobs", default="dense,moe")
    ap.add_argument("--world", type=int, default=16,
                    help="ranks of each job (dense DP = world / 4, MoE DP = world / 2)")
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--depth", default="replica", choices=("auto", "replica", "class"),
                    help="--prism-fold-depth of the folded run")
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    rows = []
    for name in a.jobs.split(","):
        flags = _flags(a, name == "moe", a.world // 2 if name == "moe" else a.world // 4)
        for fold in ("off", "on"):
            r = _run(a, name, fold, flags)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "error"}), flush=True)
            if "error" in r:
                print(r["error"], flush=True)
    (Path(a.out) / "fold_consistency.json").write_text(json.dumps(rows, indent=1))
    print("\njob    live rank (its class)                          full max alloc   fold max alloc   diff B   "
          "full max resv   fold max resv")
    for name in a.jobs.split(","):
        full = next((r for r in rows if r["name"] == name and r["fold"] == "off" and "ranks" in r), None)
        fold = next((r for r in rows if r["name"] == name and r["fold"] == "on" and "ranks" in r), None)
        if full is None or fold is None or not fold["rep"]:
            print(f"{name}: a run failed or did not fold (see its log)")
            continue
        # a live rank of the fold against the ranks it stands for in the full run (its class there)
        for live, m in sorted(fold["ranks"].items()):
            members = [r for r, rep in enumerate(fold["rep"]) if rep == live and r in full["ranks"]]
            f = {k: max(full["ranks"][r][k] for r in members) for k in ("max_allocated", "max_reserved")}
            label = f"rank {live} ({m['class']}; {len(members)} ranks)"
            print(f"{name:6} {label:30} {f['max_allocated']:>15,} {m['max_allocated']:>15,} "
                  f"{m['max_allocated'] - f['max_allocated']:>8,} {f['max_reserved']:>15,} {m['max_reserved']:>15,}")
        fi, fo = full["iteration_s"], fold["iteration_s"]
        ratio = f"{fo / fi:.3f}" if fi and fo else "n/a"
        print(f"{name:6} predicted iteration: full {fi} s, fold {fo} s (fold/full {ratio}); wall full "
              f"{full['wall_s']:.1f} s, fold {fold['wall_s']:.1f} s; losses full {full['losses']} "
              f"fold {fold['losses']}")


if __name__ == "__main__":
    main()
