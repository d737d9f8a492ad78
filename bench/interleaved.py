"""Variants of one measurement, each in a fresh process, interleaved over rounds (bench only).

A host's speed drifts within minutes on the machines these benches run on (docs/measurements.md, "The canary"),
so variants are compared side by side: round after round, every variant once, each in its own process (no
state carried between them), and each figure's median over rounds set against the ``plain`` variant's.

A script that uses this runs itself with ``--child VARIANT`` and the given arguments; that child prints one JSON
line of figures (name -> number) last.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Sequence


def interleave(script: str, variants: Sequence[str], rounds: int, args: Sequence[str] = ()
               ) -> dict[str, list[dict[str, float]]]:
    """Per variant, its child's figures in each round (printed as they come)."""
    if rounds < 1:
        raise SystemExit(f"--rounds {rounds}: expected at least 1")
    got: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(rounds):
        for v in variants:
            run = subprocess.run([sys.executable, script, "--child", v, *args], capture_output=True, text=True,
                                 check=False)
            if run.returncode != 0:
                raise SystemExit(f"variant {v!r} failed:\n{run.stderr[-2000:]}")
            got[v].append(json.loads(run.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {v:16s} " + "  ".join(f"{k} {x:.3f}" for k, x in got[v][-1].items()), flush=True)
    return got


def ratios(got: dict[str, list[dict[str, float]]], base: str = "plain") -> str:
    """Each variant's figures, median over rounds, and their ratio to ``base``'s, a line per variant."""
    ref = {k: statistics.median(g[k] for g in got[base]) for k in got[base][0]}
    lines = []
    for v, runs in got.items():
        medians = {k: statistics.median(g[k] for g in runs) for k in ref}
        lines.append(f"{v:16s} " + "  ".join(f"{k} {m:.3f} ({m / ref[k]:.2f}x {base})" for k, m in medians.items()))
    return "\n".join(lines)
