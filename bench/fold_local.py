"""A folded collective answered in its one live rank (runtime.local_fold) vs through the coordinator
(``PRISM_FOLD_LOCAL=0``), side by side in one run.

- ops: all_reduce / reduce_scatter / all_gather / all_to_all_single (uneven splits) of 64 MiB and 1 GiB
  (fp32, bf16) over a group of 4 whose only live member is the rank (rep [0, 0, 0, 0]), ms per op
  measured in the program (issue to result written), both ways; ``--device cuda:0`` runs the rank on a
  GPU, ``--kinds`` picks the ops.
- megatron: a tiny Megatron GPT folded at class depth and captured serially (``--prism-fold-capture
  serial``), wall time of the command both ways, whether the merged traces agree in everything but
  times (ops, marks, groups, contributions) and whether the losses and grad norms are equal.

    python bench/fold_local.py                       # both parts, CPU
    python bench/fold_local.py ops --sizes 64 --reps 3 --kinds all_to_all
    python bench/fold_local.py megatron --recipe mini-moe-ep4-tp1pp2   # token all-to-alls
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAYS = (("coordinator", "0"), ("local", "1"))


def _ops(args: argparse.Namespace, tmp: Path) -> None:
    from prism_megatron.launcher.launch import LaunchConfig, launch
    from prism_megatron.trace import read_trace
    from prism_megatron.trace.fold import make_fold

    fold = make_fold([0, 0, 0, 0], 8).to_json()
    devices = [args.device.split(":")[1]] if args.device.startswith("cuda") else ["cpu"]
    got = {}
    for way, env in WAYS:
        os.environ["PRISM_FOLD_LOCAL"] = env
        cfg = LaunchConfig(script=ROOT / "bench" / "programs" / "fold_ops.py", devices=devices,
                           script_args=[args.sizes, str(args.reps), args.device, args.kinds],
                           world_size=4, trace_dir=tmp / f"ops-{way}", hang_timeout=600, fold=fold)
        if launch(cfg):
            sys.exit(f"the {way} run failed (logs in {tmp / f'ops-{way}.logs'})")
        marks = read_trace(tmp / f"ops-{way}").marks.to_pylist()
        got[way] = next(json.loads(m["attrs"])["ms_per_op"] for m in marks if m["name"] == "timing")
    print(f"folded ops over a group of 4 with one live member, {args.device}, ms per op ({args.reps} timed each)")
    print(f"{'op':<34} {'coordinator':>12} {'local':>10} {'speed-up':>9}")
    for key, ms in got["coordinator"].items():
        print(f"{key:<34} {ms:12.1f} {got['local'][key]:10.1f} {ms / got['local'][key]:8.1f}x")


def _megatron(args: argparse.Namespace, tmp: Path) -> None:
    from prism_megatron.trace import read_trace
    from prism_megatron.trace.untimed import untimed_differences

    traces, walls, metrics = {}, {}, {}
    for way, env in WAYS:
        out = tmp / f"mega-{way}"
        cmd = [sys.executable, "-m", "prism_megatron", "run", "--recipe", args.recipe, "--prism-driver", "core",
               "--prism-fold", "on", "--prism-fold-depth", "class", "--prism-fold-capture", "serial",
               "--prism-report", "off", "--prism-trace-dir", str(out)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PRISM_FOLD_LOCAL=env,
                                       PRISM_MEGATRON_METRICS=str(tmp / f"mega-{way}.metrics.jsonl")))
        walls[way] = time.perf_counter() - t0
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        traces[way] = read_trace(out)
        rows = [json.loads(line) for line in (tmp / f"mega-{way}.metrics.jsonl").read_text().splitlines()]
        metrics[way] = {(r["rank"], r["iteration"]): (r["loss"], r["grad_norm"]) for r in rows}
    a, b = traces["coordinator"], traces["local"]
    diff = untimed_differences(a, b)
    same = {"ops": "ops" not in diff, "marks": "marks" not in diff, "groups": "groups" not in diff,
            "contributions": a.fold.contribution_counts() == b.fold.contribution_counts()
            and a.manifest["job"]["fold"]["contributions"] == b.manifest["job"]["fold"]["contributions"]}
    print(f"recipe {args.recipe}, class depth, serial capture, CPU (core driver): {a.ops.num_rows} ops")
    for way, _ in WAYS:
        print(f"  {way:<12} wall {walls[way]:6.1f} s")
    print("  traces the same apart from times: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in same.items()))
    a2a = sum(1 for k in a.ops.column("kind").to_pylist() if k == "all_to_all")
    print(f"  all_to_all ops: {a2a}; losses and grad norms of {len(metrics['local'])} (rank, iteration) rows "
          f"equal: {'yes' if metrics['local'] == metrics['coordinator'] and metrics['local'] else 'NO'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", default=["ops", "megatron"], help="ops, megatron (default both)")
    ap.add_argument("--sizes", default="64,1024", help="MiB, comma-separated (default 64,1024)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kinds", default="all_reduce,reduce_scatter,all_gather,all_to_all",
                    help="ops part: comma-separated op kinds (default all four)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda:N")
    ap.add_argument("--recipe", default="mini-dense-tp2pp2dp2")
    ap.add_argument("--keep", type=Path, help="keep the traces in this directory (default: a temporary one)")
    args = ap.parse_args()
    if set(args.parts) - {"ops", "megatron"}:
        ap.error(f"parts are ops and megatron, not {sorted(set(args.parts) - {'ops', 'megatron'})}")
    with tempfile.TemporaryDirectory(prefix="fold-local-") as tmp:
        where = args.keep or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        for part in args.parts:
            (_ops if part == "ops" else _megatron)(args, where)


if __name__ == "__main__":
    main()
