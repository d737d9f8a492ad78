"""Folded Megatron runs: scale (1,024 and 8,192 target ranks) and consistency with full capture.

  python bench/fold_scale.py [--out FILE] [--skip-scale] [--skip-consistency] [--minis R,R] [--keep DIR]
                             [--depth replica|class|auto]   (--prism-fold-depth of every folded run; replica)

Scale: the tiny-shaped GPT recipes of ``tests/recipes/`` (TP2·PP4·DP128 = 1,024 and TP2·PP4·DP1024
= 8,192 ranks, 2 microbatches per rank, 2 iterations) run as ``prism-megatron run --prism-fold auto``
with the core driver: wall time of the whole command (plan, capture, report) and peak host memory,
the sum of the RSS of every process of the run (launcher, coordinator, ranks, the plan's parser)
sampled every 0.2 s; then the synthesised full graph's replay (``replay --full``) time.
Targets: 8,192 ranks in < 10 min and < 8 GB.

Consistency: the mini recipes folded (``--prism-fold on``) and fully captured (``off``): per class of
the fold, max allocated (CPU byte accountant) of each run and the difference; predicted iteration
time (symmetric replay, the recipe's cluster profile) of each and the ratio; the loss of the last
iteration (a fold's loss is replica 0's, the full run's the replicas' mean). Rows print as they
finish; ``--out`` also writes them (text).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCALE = [("fold-scale-tp2pp4dp128", 1024), ("fold-scale-tp2pp4dp1024", 8192)]
MINIS = ["mini-dense-tp2pp2dp2", "mini-dense-tp2pp2dp4", "mini-dense-pp2vpp2", "mini-dense-tp2dp2-distopt",
         "mini-moe-ep4-tp1pp2"]
CLUSTER = "h100-nvlink-ib400"


def _tree_rss(root: int) -> int:
    """Bytes of RSS of ``root`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ppid, pages = int(fields[1]), int(fields[21])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
        rss[int(d)] = pages * os.sysconf("SC_PAGE_SIZE")
    total, stack = 0, [root]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack += children.get(p, [])
    return total


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, float, int, str]:
    """(exit code, wall s, peak RSS of the process tree, output tail)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.communicate()[0]
    sampler.join()
    return proc.returncode, time.perf_counter() - t0, peak[0], out[-3000:]


def _prism(recipe: str, fold: str, out: Path, depth: str, report: bool = False) -> list[str]:
    return [sys.executable, "-m", "prism_megatron", "run", "--recipe", recipe, "--prism-driver", "core",
            "--prism-fold", fold, "--prism-fold-depth", depth,
            "--prism-report", "on" if report else "off", "--prism-track-memory", "on",
            "--prism-trace-dir", str(out / "trace")]


def _env(metrics: Path) -> dict[str, str]:
    return dict(os.environ, PRISM_MEGATRON_METRICS=str(metrics), OMP_NUM_THREADS="1", WANDB_MODE="offline")


def scale(work: Path, say, depth: str = "replica") -> None:
    say(f"{'target':<28} {'ranks':>6} {'live':>5} {'run wall s':>10} {'peak host GB':>12} {'replay --full s':>15} "
        f"{'predicted iter ms':>17}")
    for name, world in SCALE:
        out = work / name
        out.mkdir()
        recipe = str(ROOT / "tests" / "recipes" / f"{name}.yaml")
        code, wall, peak, tail = _run(_prism(recipe, "auto", out, depth, report=True), out, _env(out / "metrics.jsonl"))
        if code != 0:
            say(f"{name}: run failed (exit {code}):\n{tail}")
            continue
        t0 = time.perf_counter()
        rep = subprocess.run([sys.executable, "-m", "prism_megatron", "replay", "--full", str(out / "trace")],
                             capture_output=True, text=True)
        replay_s = time.perf_counter() - t0 if rep.returncode == 0 else float("nan")
        report = json.loads((out / "trace" / "report.json").read_text())
        live = len(json.loads((out / "trace" / "manifest.json").read_text())["job"]["fold"]["live"])
        t = report["prediction"]["iteration_time_s"]
        say(f"{name:<28} {world:>6} {live:>5} {wall:>10.1f} {peak / 1e9:>12.2f} {replay_s:>15.1f} "
            f"{t * 1e3 if t else float('nan'):>17.1f}")


def _summary(trace: Path, fold) -> tuple[dict[str, int], float | None]:
    from prism_megatron.report.build import build_report

    report = build_report(trace, cluster=CLUSTER)
    peaks: dict[str, int] = {}
    for e in report["memory"]["ranks"]:
        name = fold.class_name(e["rank"]) if fold is not None else str(e["rank"])
        peaks[name] = max(peaks.get(name, 0), e["max_allocated"])
    return peaks, report["prediction"]["iteration_time_s"]


def _last_loss(metrics: Path) -> float | None:
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    rows = [r for r in rows if r["loss"].get("lm loss") is not None]
    return max(rows, key=lambda r: r["iteration"])["loss"]["lm loss"] if rows else None


def consistency(work: Path, say, minis: list[str] = MINIS, depth: str = "replica") -> None:
    from prism_megatron.trace import read_trace

    say(f"{'recipe':<28} {'class':<8} {'fold max alloc':>14} {'full max alloc':>14} {'diff B':>7} "
        f"{'fold iter ms':>12} {'full iter ms':>12} {'ratio':>6} {'fold loss':>9} {'full loss':>9}")
    for recipe in minis:
        runs = {}
        for fold in ("on", "off"):
            out = work / f"{recipe}-{fold}"
            out.mkdir()
            code, wall, _, tail = _run(_prism(recipe, fold, out, depth), out, _env(out / "metrics.jsonl"))
            if code != 0:
                say(f"{recipe} --prism-fold {fold}: failed (exit {code}):\n{tail}")
                break
            runs[fold] = out
        if len(runs) < 2:
            continue
        plan = read_trace(runs["on"] / "trace").fold
        if plan is None:
            say(f"{recipe:<28} (not folded: the v1 sandbox, whole expert groups, is the whole job)")
            continue
        fold_peaks, fold_t = _summary(runs["on"] / "trace", plan)
        full_peaks, full_t = _summary(runs["off"] / "trace", plan)
        a, b = _last_loss(runs["on"] / "metrics.jsonl"), _last_loss(runs["off"] / "metrics.jsonl")
        for i, name in enumerate(sorted(full_peaks)):
            f, g = fold_peaks.get(name), full_peaks[name]
            times = (f"{fold_t * 1e3:>12.1f} {full_t * 1e3:>12.1f} {fold_t / full_t:>6.3f} {a:>9.4f} {b:>9.4f}"
                     if i == 0 and fold_t and full_t and a is not None and b is not None else "")
            diff = "" if f is None else f"{f - g:>7d}"
            say(f"{recipe if i == 0 else '':<28} {name:<8} {f if f is not None else '-':>14} {g:>14} {diff:>7} {times}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--skip-scale", action="store_true")
    ap.add_argument("--skip-consistency", action="store_true")
    ap.add_argument("--minis", default=",".join(MINIS), help="recipes of the consistency table, comma-separated")
    ap.add_argument("--keep", type=Path, help="run in this directory and keep the traces")
    ap.add_argument("--depth", default="replica", choices=("auto", "replica", "class"),
                    help="--prism-fold-depth of the folded runs (class depth needs the p2p rule for PP > 2)")
    args = ap.parse_args()
    lines: list[str] = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"prism-megatron bench/fold_scale.py on {os.cpu_count()} CPU core(s)")
    with tempfile.TemporaryDirectory(prefix="fold-scale-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        if not args.skip_scale:
            scale(work, say, args.depth)
        if not args.skip_consistency:
            say("")
            consistency(work, say, args.minis.split(","), args.depth)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
