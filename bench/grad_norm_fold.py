"""Grad norm per iteration of one job captured in full, folded at replica depth, at class depth together and
at class depth serially: what the folds' answers (mirror, self mirror, stand-ins) do to a value that steers the
program (gradient clipping scales every update by it).

Runs a mini recipe on CPU with the core driver; every rank appends its per-iteration loss and grad norm
(``PRISM_MEGATRON_METRICS``); prints, per way, each live rank's grad norm per iteration (a serial capture's
ranks each report their own capture's value; a rank captured twice, its last capture's) and the last stage's loss.

    python bench/grad_norm_fold.py
    python bench/grad_norm_fold.py --recipe mini-dense-pp2vpp2
    python bench/grad_norm_fold.py --ways "class together" "class serial" "class serial, second pass on"
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

WAYS = {
    "full": ["--prism-fold", "off"],
    "replica": ["--prism-fold", "on", "--prism-fold-depth", "replica"],
    "class together": ["--prism-fold", "on", "--prism-fold-depth", "class"],
    "class serial": ["--prism-fold", "on", "--prism-fold-depth", "class", "--prism-fold-capture", "serial"],
    "class serial, second pass on": ["--prism-fold", "on", "--prism-fold-depth", "class", "--prism-fold-capture",
                                     "serial", "--prism-fold-second-pass", "on"],
}


def _run(recipe: str, flags: list[str], out: Path) -> tuple[dict, float]:
    out.mkdir(parents=True)
    metrics = out / "metrics.jsonl"
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--recipe", recipe, "--prism-driver", "core",
           "--prism-report", "off", "--prism-trace-dir", str(out / "trace"), *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PRISM_MEGATRON_METRICS=str(metrics)))
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    rows: dict[int, dict[int, tuple[float, float | None]]] = {}
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        loss = next(iter(r["loss"].values()), None) if r["loss"] else None
        rows.setdefault(r["iteration"], {})[r["rank"]] = (r["grad_norm"], loss)  # a later capture replaces
    return rows, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="mini-dense-tp2pp2dp2")
    ap.add_argument("--ways", nargs="*", choices=list(WAYS), default=list(WAYS))
    args = ap.parse_args()
    print(f"# {args.recipe}: grad norm per iteration (rank: value), last stage's loss")
    with tempfile.TemporaryDirectory(prefix="prism-grad-norm-") as tmp:
        for way in args.ways:
            rows, wall = _run(args.recipe, WAYS[way], Path(tmp) / way.replace(" ", "-"))
            print(f"{way} ({wall:.0f} s)")
            for it in sorted(rows):
                norms = " ".join(f"{r}: {g:.4f}" for r, (g, _) in sorted(rows[it].items()) if g is not None)
                losses = {round(v, 4) for _, v in rows[it].values() if v is not None}
                print(f"  iteration {it}: grad norm {norms}; loss {sorted(losses)}")


if __name__ == "__main__":
    main()
