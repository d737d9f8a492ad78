"""Megatron captures shared by the test files that read them (``megatron_runs`` fixture, conftest).

A ``prism-megatron run --recipe`` of a mini recipe on CPU takes 10-20 s on two cores, and several
files read the same one: the numerics contract (test_megatron_emulation) compares a full capture with
real gloo processes, the fold tests compare a folded run with that same full capture, the smoke
tests check that a shipped recipe trains. Each distinct command runs once per session.

Every capture has the per-rank metrics (``PRISM_MEGATRON_METRICS``) and no report (the report after a
run is test_publish's), and memory tracking on unless its readers read no memory figure: the CPU byte
accountant costs little on a mini recipe, much in the world-sized object gathers of a fold at thousands
of ranks. One command serves every reader.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def read_metrics(path: Path) -> dict[tuple[int, int], tuple[dict, float | None]]:
    """(rank, iteration) -> (losses by name, grad norm), as the ranks wrote them."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            out[(r["rank"], r["iteration"])] = (r["loss"], r["grad_norm"])
    return out


class Captures:
    """Runs each distinct ``run --recipe`` command at most once; keeps its exit code, output and metrics."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[tuple, dict] = {}

    def run(self, recipe: str, fold: str = "off", *extra: str, driver: str = "core", depth: str = "replica",
            memory: bool = True, timeout: int = 300, check: bool = True, env: dict[str, str] | None = None) -> dict:
        """``recipe`` (a name or a file) run with ``--prism-fold fold --prism-fold-depth depth`` and ``extra``
        flags, memory tracked (``memory``) or not: {"code", "output", "trace", "wall", "metrics"}; ``check``:
        the run must succeed; ``env``: more environment variables for the run."""
        key = (recipe, fold, depth, driver, memory, extra, tuple(sorted((env or {}).items())))
        if key not in self.done:
            out = self.root / f"run-{len(self.done)}"
            out.mkdir()
            cmd = [sys.executable, "-m", "prism_megatron", "run", "--recipe", recipe, "--prism-driver", driver,
                   "--prism-fold", fold, "--prism-fold-depth", depth, "--prism-report", "off",
                   "--prism-track-memory", "on" if memory else "off", "--prism-trace-dir", str(out / "trace"), *extra]
            full_env = dict(os.environ, PRISM_MEGATRON_METRICS=str(out / "metrics.jsonl"), PYTHONUNBUFFERED="1",
                            OMP_NUM_THREADS="1", **(env or {}))
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=out, capture_output=True, text=True, timeout=timeout, env=full_env)
            self.done[key] = {"code": proc.returncode, "output": proc.stdout + proc.stderr, "trace": out / "trace",
                              "wall": time.perf_counter() - t0, "metrics": read_metrics(out / "metrics.jsonl"),
                              "command": " ".join(cmd)}
        result = self.done[key]
        if check:
            assert result["code"] == 0, f"{result['command']} failed:\n{result['output'][-6000:]}"
        return result
