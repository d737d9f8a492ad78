"""Prism's per-class memory estimate (``prism_megatron.memory.estimate``) against measured peaks.

Two kinds of case, one row per rank class, estimate / measured as a ratio (Megatron's formula, the most
loaded shard, beside it where megatron.training imports):

- GPU: jobs measured on an H200 by the core driver (max allocated per rank, figures and the result file
  each came from below); the estimate is for a CUDA device.
- CPU: mini recipes captured here with the CPU byte accountant (``--capture``: runs each recipe, ~15 s
  each on two cores), or read from traces a run already wrote (``--traces DIR``: DIR/RECIPE/trace); the
  estimate is for CPU mode (dropout masks of the input's dtype, Adam tensor by tensor).

    PYTHONPATH=. python bench/memory_estimate.py --capture --out bench/results/memory_estimate-DATE.txt
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT  # noqa: E402

COMMON = ("--tokenizer-type NullTokenizer --vocab-size 32000 --mock-data --lr 0.0001 --seed 1234 "
          "--transformer-impl local --no-gradient-accumulation-fusion --log-interval 1 --eval-iters 0 --bf16 "
          "--no-masked-softmax-fusion")
# name, world size, core-driver flags, measured max allocated per class (bytes), where the figure is from
GPU_CASES = [
    ("fold-consistency dense TP2·PP2·DP2", 8,
     "--num-layers 4 --hidden-size 4096 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 "
     "--micro-batch-size 4 --global-batch-size 32 --train-iters 5 --pipeline-model-parallel-size 2 "
     "--tensor-model-parallel-size 2",
     {"first": 12_985_608_704, "last": 9_584_302_592}, "bench/gpu/results/2026-12-01-fold-consistency-dense-h200.txt"),
    ("fold-class small TP2·PP4", 8,
     "--num-layers 8 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --group-query-attention "
     "--num-query-groups 4 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 "
     "--global-batch-size 8 --train-iters 3 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4",
     {"first": 4_258_206_208, "middle@1": 2_947_280_896, "middle@2": 2_305_486_336, "last": 2_244_683_776},
     "bench/gpu/results/2026-12-01-fold-class-h200.txt"),
    ("memory-matrix TP2", 2,
     "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 "
     "--micro-batch-size 4 --global-batch-size 16 --train-iters 4 --hidden-dropout 0 --attention-dropout 0 "
     "--tensor-model-parallel-size 2", {"only": int(3877.89 * 2**20)},
     "bench/gpu/results/2026-11-30-memory-matrix-h200x2.txt (MiB to 2 decimals)"),
    ("memory-matrix PP2", 2,
     "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 "
     "--micro-batch-size 4 --global-batch-size 16 --train-iters 4 --hidden-dropout 0 --attention-dropout 0 "
     "--pipeline-model-parallel-size 2", {"first": int(6321.06 * 2**20), "last": int(4460.03 * 2**20)},
     "bench/gpu/results/2026-11-30-memory-matrix-h200x2.txt (MiB to 2 decimals)"),
    ("memory-matrix EP2 MoE", 2,
     "--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024 --max-position-embeddings 1024 "
     "--micro-batch-size 4 --global-batch-size 16 --train-iters 4 --hidden-dropout 0 --attention-dropout 0 "
     "--expert-model-parallel-size 2 --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
     "--moe-ffn-hidden-size 2048 --moe-aux-loss-coeff 0.0", {"only/ep0": int(8824.14 * 2**20),
                                                              "only/ep1": int(9186.22 * 2**20)},
     "bench/gpu/results/2026-11-30-memory-matrix-h200x2.txt (MiB to 2 decimals)"),
]
CPU_RECIPES = ["mini-dense-tp2pp2dp2", "mini-dense-pp2vpp2", "mini-dense-tp2-sp", "mini-dense-tp2dp2-distopt",
               "mini-moe-ep2"]


def estimate(script: Path, script_args: list[str], world: int, device: str, env: dict | None = None) -> tuple:
    """(fold plan, prism's estimate per class and per 'class@stage', Megatron's formula or None) for a command."""
    from prism_megatron.megatron.fold import build_fold_plan, layout_from_args
    from prism_megatron.megatron.megatron_args import ESTIMATE_KEY, padded_vocab, parse_megatron_args
    from prism_megatron.memory.estimate import class_estimate, estimate_classes, job_from_args

    args = parse_megatron_args(script, script_args, world, env)
    fold = build_fold_plan(layout_from_args(args, world), "replica")
    job = job_from_args(args, world, padded_vocab(args), device)
    formula = (getattr(args, ESTIMATE_KEY, None) or {}).get("total")
    est = estimate_classes(job, fold)
    for c in fold.classes:  # a class of several stages: each stage's own figure (its warm-up) too
        for p in c.coords["pp"]:
            est[f"{c.name}@{p}"] = class_estimate(job, c.coords["chunks"], fold.schedule["warmup"][p],
                                                  fold.schedule.get("group"))
    return fold, est, formula


def class_peaks(trace_dir: Path, fold) -> dict[str, int]:
    """Per class: the largest max-allocated of the trace's ranks in it."""
    from prism_megatron.report.build import build_report

    out: dict[str, int] = {}
    for entry in build_report(trace_dir)["memory"]["ranks"]:
        name = fold.classes[fold.class_of[entry["rank"]]].name
        out[name] = max(out.get(name, 0), entry["max_allocated"])
    return out


def capture(recipe: str, where: Path) -> Path:
    trace = where / recipe / "trace"
    trace.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--recipe", recipe, "--prism-driver", "core",
           "--prism-fold", "off", "--prism-report", "off", "--prism-track-memory", "on",
           "--prism-trace-dir", str(trace)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                                        os.environ.get("PYTHONPATH")])))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    return trace


def rows(case: str, est: dict, measured: dict, formula: int | None, source: str) -> list[str]:
    out = []
    for name, got in measured.items():
        e = est[name]
        f = "-" if formula is None else f"{formula / got:6.3f}"
        out.append(f"{case:<36} {name:<10} {e['total']:>15,} {got:>15,} {e['total'] / got:6.3f}  {f:>6}  "
                   f"{e['peak_at']:<14} {source}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capture", action="store_true", help="capture the CPU mini recipes now")
    ap.add_argument("--traces", help="read CPU captures from DIR/RECIPE/trace instead")
    ap.add_argument("--out", help="also write the table here")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")  # megatron-core's import-time notes (no apex, no TE)
    lines = ["# prism's memory estimate vs measured max allocated, per rank class",
             "# estimate/measured and Megatron's formula (most loaded shard, '-': megatron.training not importable)"
             "/measured", f"{'case':<36} {'class':<10} {'estimate B':>15} {'measured B':>15} {'ratio':>6}  "
             f"{'formula':>6}  {'peak at':<14} measured in"]
    print("\n".join(lines), flush=True)
    for case, world, flags, measured, source in GPU_CASES:
        _fold, est, formula = estimate(CORE_DRIVER_SCRIPT, (COMMON + " " + flags).split(), world, "cuda")
        for line in rows(case, est, measured, formula, source):
            print(line, flush=True)
            lines.append(line)
    if a.capture or a.traces:
        from prism_megatron.megatron.run import launch_config, parse_run_args

        where = Path(a.traces) if a.traces else Path(tempfile.mkdtemp(prefix="memory-estimate-"))
        for recipe in CPU_RECIPES:
            request = parse_run_args(["--recipe", recipe, "--prism-driver", "core"])
            cfg = launch_config(request)
            trace = capture(recipe, where) if a.capture else where / recipe / "trace"
            fold, est, formula = estimate(cfg.script, list(cfg.script_args), cfg.world_size, "cpu", request.env)
            for line in rows(f"CPU {recipe}", est, class_peaks(trace, fold), formula, "CPU byte accountant, this run"):
                print(line, flush=True)
                lines.append(line)
    if a.out:
        Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
