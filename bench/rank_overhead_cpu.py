"""What an emulated rank costs a host-bound job on CPU: the same Megatron job as a plain process and as a
prism W = 1 emulation, alternating, side by side in one run (issue 21's bias hunt).

A host-bound job on the GPU is predicted 9-21 % slow (docs/measurements.md, "One GPU"). Here there is no
GPU timing, CUPTI or CUDA events: what differs between the two sides is the rank's runtime itself (patches,
schedule hooks, markers, the coordinator's socket, the allocator's accounting). The shape is tiny (16 layers,
hidden 64, sequence 128, micro-batch 1, 8 micro-batches, fp32, one thread), so Python and ATen dispatch
dominate each iteration as the GPU's host does in the host-bound configs.

    python bench/rank_overhead_cpu.py [--pairs 3] [--iters 14]
    python bench/rank_overhead_cpu.py --threads [--pairs 3] [--iters 14]
    python bench/rank_overhead_cpu.py --gc [--iters 14]
    python bench/rank_overhead_cpu.py --calls [--iters 6]
    python bench/rank_overhead_cpu.py --times [--iters 6]

``--threads``: each run's busiest thread (the program's main thread) sampled every 0.25 s by
``bench/gpu/thread_sampler.py``: its time on a CPU per measured iteration against the wall, so a side that computes
longer (the code itself slower) is told from one that waits longer (preempted on this shared machine, or blocked).

``--gc``: instead, each side run twice, ``--iters`` and ``--iters`` + 16 iterations, with every garbage collection of
every process logged (``bench/gpu/gc_census``); the difference is the collector's milliseconds and collections per
steady iteration, the rank's (a forked rank logs into the process it was forked from) and the coordinator's apart.

``--calls``: instead, each side run once with every Python and C function of each forward past the warm-up counted
(``bench/gpu/forward_probe``): calls per forward on each side and the functions whose counts differ most.
``--times``: the same with each function's own time in each forward, and the functions whose own time differs most.

Needs megatron-core and Megatron-LM (MEGATRON_LM_PATH) as the driver does. Prints each run's iterations
after the warm-up, each side's median, and emulated / plain: the emulation's own wall ("emulation took") and
its prediction (Megatron's logged value); and each run's program time per iteration split into its micro-batches'
forward and backward spans and the rest (the plain side through ``bench/gpu/spans_driver.py``, the emulated from
its trace's compute clock), with emulated / plain per part.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu"))
from one_gpu_truth import (  # noqa: E402 - the truth runs' own readers
    _port,
    _run,
    _single,
    calls_text,
    census_env,
    host_threads,
    parse_log,
    read_census,
    read_probe,
    real_spans,
    split_text,
    step_threads,
    times_text,
    trace_spans,
)

from prism_megatron.megatron.driver import DRIVER_SCRIPT  # noqa: E402

FLAGS = ("--num-layers 16 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 128 "
         "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 8 --lr 0.0001 --seed 1234 "
         "--tokenizer-type NullTokenizer --vocab-size 1000 --mock-data --transformer-impl local "
         "--no-gradient-accumulation-fusion --no-persist-layer-norm --no-rope-fusion --log-interval 1 "
         "--eval-iters 0 --eval-interval 1000 --num-workers 0").split()
WARMUP = 3  # iterations left out: the first ones build Megatron's caches on both sides
MICROBATCHES = 8  # per iteration: FLAGS' global batch over its micro-batch
TOOK = re.compile(r"emulation took ([\d.]+)")


GC_EXTRA = 16  # iterations the second run of a --gc side adds


def run(kind: str, iters: int, work: Path, census: Path | None = None, probe: tuple[str, Path] | None = None
        ) -> dict[str, Any]:
    """One run; per measured iteration: Megatron's logged ms and, emulated, the emulation's own wall; and the run
    as a one_gpu_truth step (its start, its timestamped iterations) for ``step_threads``.
    ``census``: log every garbage collection of every process of the run there (gc_census); ``probe``: (mode,
    directory), probe each forward past the warm-up so, into there (forward_probe: calls or times)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    if census is not None:
        env.update(census_env("gc", census))
    if probe is not None:
        env.update(census_env(*probe, WARMUP * MICROBATCHES))
    flags = [*FLAGS, "--train-iters", str(iters)]
    spans = work / "plain.spans.json"
    if kind == "plain":
        env.update(_single(_port()), SPANS_OUT=str(spans))
        cmd = [sys.executable, str(REPO / "bench" / "gpu" / "spans_driver.py"), str(DRIVER_SCRIPT), *flags]
    else:
        cmd = [sys.executable, "-m", "prism_megatron", "run", "--prism-emulate", "--prism-world-size", "1",
               "--prism-devices", "cpu", "--prism-report", "off", "--prism-trace-dir", str(work / f"trace-{kind}"),
               str(DRIVER_SCRIPT), *flags]
    started = time.time()
    try:
        lines = parse_log(_run(cmd, work / f"{kind}.log", env, 600))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"{kind}: {e}") from None
    if not lines:
        raise SystemExit(f"{kind}: no iteration lines in {work / f'{kind}.log'}")
    kept = [lines[i] for i in sorted(lines) if i > WARMUP]
    walls = [TOOK.search(r["note"] or "") for r in kept]  # plain: Megatron's own figure is the wall
    return {"logged": [r["ms"] for r in kept],
            "wall": [float(w.group(1)) if w else r["ms"] for r, w in zip(kept, walls, strict=True)],
            "step": {"kind": kind, "started": started, "iterations": lines, "measured_from": WARMUP + 1},
            "split": real_spans({"iterations": lines, "measured_from": WARMUP + 1,
                                 "spans": json.loads(spans.read_text())}, MICROBATCHES) if kind == "plain"
            else trace_spans(work / f"trace-{kind}", WARMUP + 1)}


def collections(census: Path) -> dict[str, tuple[float, int]]:
    """Per process role of a run's census: (collector milliseconds, collections); ``coordinator`` is the process
    started as ``python -m -``, ``program`` every other (the plain process, or the launcher and the ranks it forked)."""
    out: dict[str, tuple[float, int]] = {}
    for f in sorted(census.glob("gc-*.txt")):
        command, events = read_census(f)
        role = "coordinator" if command.split()[:2] == ["-m", "-"] else "program"
        ms, n = out.get(role, (0.0, 0))
        out[role] = (ms + sum(e[1] for e in events) * 1e3, n + len(events))
    return out


def gc_per_iteration(iters: int, tmp: Path) -> None:
    """Print each side's collector time and collections per steady iteration (two runs per side, see --gc)."""
    for kind in ("plain", "emulated"):
        short, long = (collections(_census_run(kind, n, tmp)) for n in (iters, iters + GC_EXTRA))
        for role in sorted(long):
            ms = (long[role][0] - short.get(role, (0.0, 0))[0]) / GC_EXTRA
            n = (long[role][1] - short.get(role, (0.0, 0))[1]) / GC_EXTRA
            print(f"{kind:8s} {role:11s} {ms:6.2f} ms in {n:4.1f} collections per iteration", flush=True)


def _census_run(kind: str, iters: int, tmp: Path) -> Path:
    census = tmp / f"gc-{kind}-{iters}"
    run(kind, iters, tmp / f"{kind}-{iters}", census)
    return census


def _busiest(step: dict[str, Any], threads: Path, on_cpu: list[float]) -> str:
    """A run's busiest thread over its measured iterations, said; its CPU time per iteration added to ``on_cpu``."""
    busiest = step_threads(step, host_threads(threads), top=1)
    if not busiest:
        return ""
    t = busiest["threads"][0]
    on_cpu.append(t["on_cpu_ms"])
    return (f"; busiest thread {t['comm']}: on a CPU {t['on_cpu_ms']:.1f} ms of {busiest['wall_ms']:.1f} per "
            f"iteration, runnable {t['runqueue_ms']:.1f}, {t['voluntary']:.0f} blocked / {t['involuntary']:.0f} "
            "preempted")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="plain / emulated pairs, alternating (default 3)")
    p.add_argument("--iters", type=int, default=14, help=f"iterations a run ({WARMUP} of them warm-up)")
    p.add_argument("--gc", action="store_true", help="the collector per steady iteration on each side instead")
    p.add_argument("--calls", action="store_true", help="the calls of each forward on each side instead")
    p.add_argument("--times", action="store_true", help="each function's own time per forward on each side instead")
    p.add_argument("--threads", action="store_true",
                   help="also each run's busiest thread: time on a CPU per iteration against the wall")
    a = p.parse_args(argv)
    if a.pairs < 1 or a.iters <= WARMUP:
        p.error(f"--pairs {a.pairs} --iters {a.iters}: expected at least 1 pair and more than {WARMUP} iterations")
    if a.calls or a.times:
        mode = "calls" if a.calls else "times"
        with tempfile.TemporaryDirectory(prefix=f"rank-overhead-{mode}-") as tmp:
            counted = {}
            for kind in ("plain", "emulated"):
                run(kind, a.iters, Path(tmp) / kind, probe=(mode, Path(tmp) / f"{mode}-{kind}"))
                counted[kind] = read_probe(Path(tmp) / f"{mode}-{kind}", mode)
                if counted[kind] is None:
                    raise SystemExit(f"{kind}: no forward was probed (fewer than {a.iters - WARMUP} iterations ran?)")
            told = (calls_text if mode == "calls" else times_text)(counted["plain"], counted["emulated"], top=12)
            print(f"over {counted['emulated']['forwards']} and {counted['plain']['forwards']} forwards: {told}")
        return 0
    if a.gc:
        with tempfile.TemporaryDirectory(prefix="rank-overhead-gc-") as tmp:
            gc_per_iteration(a.iters, Path(tmp))
        return 0
    plain, wall, logged = [], [], []
    on_cpu: dict[str, list[float]] = {"plain": [], "emulated": []}
    split: dict[str, list[dict[str, float]]] = {"plain": [], "emulated": []}
    with tempfile.TemporaryDirectory(prefix="rank-overhead-") as tmp:
        sampler = subprocess.Popen([sys.executable, str(REPO / "bench" / "gpu" / "thread_sampler.py"),
                                    str(Path(tmp) / "threads.jsonl"), "--interval", "0.25"]) if a.threads else None
        try:
            for i in range(a.pairs):
                for kind in ("plain", "emulated"):
                    r = run(kind, a.iters, Path(tmp) / str(i))
                    med = statistics.median(r["wall"])
                    line = f"{kind:8s} run {i + 1}: median {med:7.1f} ms  ({' '.join(f'{x:.0f}' for x in r['wall'])})"
                    if r["split"]:
                        split[kind].append(r["split"])
                        line += f"; program = forward + backward + the rest: {split_text(r['split'])}"
                    if sampler is not None:
                        time.sleep(0.6)  # the sampler's next line holds the run's end
                        line += _busiest(r["step"], Path(tmp) / "threads.jsonl", on_cpu[kind])
                    print(line, flush=True)
                    if kind == "plain":
                        plain.append(med)
                    else:
                        wall.append(med)
                        logged.append(statistics.median(r["logged"]))
        finally:
            if sampler is not None:
                sampler.kill()
                sampler.wait()
    p_med, w_med, l_med = statistics.median(plain), statistics.median(wall), statistics.median(logged)
    print(f"plain {p_med:.1f} ms (runs {min(plain):.1f}-{max(plain):.1f}); emulated wall {w_med:.1f} ms "
          f"(runs {min(wall):.1f}-{max(wall):.1f}), ratio {w_med / p_med:.3f}; its prediction {l_med:.1f} ms, "
          f"ratio {l_med / p_med:.3f}")
    if split["plain"] and split["emulated"]:
        part = {k: {f: statistics.median(sp[f] for sp in v) for f in ("forward_ms", "backward_ms", "rest_ms")}
                for k, v in split.items()}
        print("emulated / plain, medians over the runs: " + ", ".join(
            f"{f[:-3]} {part['emulated'][f] / part['plain'][f]:.3f}" for f in ("forward_ms", "backward_ms", "rest_ms")))
    if on_cpu["plain"] and on_cpu["emulated"]:
        cp, ce = statistics.median(on_cpu["plain"]), statistics.median(on_cpu["emulated"])
        print(f"busiest thread on a CPU per iteration: plain {cp:.1f} ms, emulated {ce:.1f} ms, ratio {ce / cp:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
