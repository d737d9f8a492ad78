"""Capture wall time against the physical limit (issue 4's benchmark), side by side in one run.

The physical limit of an iteration is the compute all ranks did in it, summed, over what the
machine computes at once (GPUs; on CPU, slots = cores): what an emulation that cost nothing would
take. The ratio capture wall / limit is the emulation's overhead (target <= 1.5 where no swap is
needed). Runs the mini recipes emulated here, each with 1 and 2 slots, and prints a table.

  python bench/capture_overhead.py [recipe ...] [--devices cpu|0|0,1] [--iters N] [--larger] [--groups-of-one]

--larger runs the recipes with hidden 256 and sequence 256 (the mini recipes' compute is so small
that the runtime's per-op cost dominates; real jobs have far more compute per op).
--groups-of-one adds, for each row, the same run with ops of groups of one staged through the
coordinator as before they were done by the rank itself (PRISM_STAGE_GROUPS_OF_ONE=1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from prism_megatron.trace import read_trace  # noqa: E402
from prism_megatron.trace.summary import capture_efficiency, parallel_capacity  # noqa: E402

RECIPES = ["mini-dense-tp2pp2dp2", "mini-moe-ep2"]


LARGER = ["--hidden-size", "256", "--ffn-hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "256",
          "--max-position-embeddings", "256"]


def run(recipe: str, slots: int, devices: str, iters: int, work: Path, extra: list[str],
        staged: bool = False) -> tuple[float, float, int]:
    trace = work / f"{recipe}-{slots}-{len(extra)}-{int(staged)}"
    env = dict(os.environ, PRISM_STAGE_GROUPS_OF_ONE="1") if staged else None
    p = subprocess.run([sys.executable, "-m", "prism_megatron", "run", "--recipe", recipe, "--prism-devices", devices,
                        "--prism-slots-per-device", str(slots), "--prism-trace-dir", str(trace),
                        "--prism-report", "off", "--train-iters", str(iters), *extra], capture_output=True, text=True,
                       env=env)
    if p.returncode:
        raise SystemExit(f"{recipe} with {slots} slot(s) failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    t = read_trace(trace)
    eff = capture_efficiency(t)
    if not eff:
        raise SystemExit(f"{recipe}: the trace has no two iteration ends on every rank")
    return (statistics.median(w for _, w, _ in eff), statistics.median(lim for _, _, lim in eff),
            parallel_capacity(t.manifest))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="*", default=RECIPES)
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--larger", action="store_true", help="hidden 256, sequence 256")
    ap.add_argument("--groups-of-one", action="store_true", help="also staged ops of groups of one (as before)")
    a = ap.parse_args()
    extra = LARGER if a.larger else []
    print(f"capture wall vs physical limit per iteration (median of {a.iters - 1}; devices {a.devices}"
          f"{'; hidden 256, seq 256' if a.larger else ''})")
    print(f"  {'recipe':<24}{'slots':>6}{'wall s':>10}{'limit s':>10}{'ratio':>8}")
    with tempfile.TemporaryDirectory() as d:
        for recipe in a.recipes:
            for slots in (1, 2):
                wall, limit, cap = run(recipe, slots, a.devices, a.iters, Path(d), extra)
                line = f"  {recipe:<24}{slots:>6}{wall:>10.3f}{limit:>10.3f}{wall / limit:>8.2f}   (compute / {cap})"
                if a.groups_of_one:
                    w2, l2, _ = run(recipe, slots, a.devices, a.iters, Path(d), extra, staged=True)
                    line += f"; groups of one staged: wall {w2:.3f} s, limit {l2:.3f} s, ratio {w2 / l2:.2f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
