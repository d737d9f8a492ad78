"""What the coordinator's live prediction costs at iteration k of a capture (this CPU; issue 21's run 41 saw the
coordinator spend 84-103 ms of CPU per iteration of a W = 1 job, and run 46 the logging rank wait 226-434 ms).

At each logged iteration the coordinator writes every record so far (``runtime.trace_export``), reads the snapshot
back, builds its graph and replays it (``report.live.predict_iteration``) while the logging rank waits. The replay
goes on from where the last prediction's stopped (``replay.ResumableReplay``); the graph is still built from the
whole snapshot. This writes the snapshots a run's coordinator would after each iteration, then times, side by side
at several k, the prediction as a run makes it (after the predictions of 1..k-1: resumed), the same from the start
(a replay of every iteration so far), and the graph build both include, and checks that the two predictions are
equal; and the coordinator's write of the snapshot, as it writes it (atomic, not flushed) and flushed to the disk.
The trace is the tiny host-bound job of ``bench/rank_overhead_cpu.py`` (W = 1, CPU) captured here, or ``--trace
DIR``, any PrismTrace (a GPU-timed one carries a row per segment).

    python bench/live_prediction_cost.py [--iters 24] [--at 3,6,12,24] [--trace DIR]

Without ``--trace`` it needs megatron-core and Megatron-LM (MEGATRON_LM_PATH) as the driver does.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from prism_megatron.replay import graph_from_trace  # noqa: E402
from prism_megatron.report import live  # noqa: E402
from prism_megatron.trace import PrismTrace, read_trace, write_trace  # noqa: E402


def capture(iters: int, trace: Path) -> None:
    from rank_overhead_cpu import FLAGS  # the same tiny job

    from prism_megatron.megatron.driver import DRIVER_SCRIPT

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--prism-emulate", "--prism-world-size", "1",
           "--prism-devices", "cpu", "--prism-report", "off", "--prism-trace-dir", str(trace), str(DRIVER_SCRIPT),
           *FLAGS, "--train-iters", str(iters)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        raise SystemExit(f"capture failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def _ms(f, repeats: int = 3) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        runs.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(runs)


def snapshot(trace: PrismTrace, k: int, dest: Path) -> Path:
    """``trace`` as the coordinator's snapshot after iteration ``k`` holds it: each rank's records up to its
    k-th iteration end (its GPU rows by its compute clock there)."""
    part = live.until_iteration(trace, k)
    ends: dict[int, list[float]] = {}
    for m in part.marks.to_pylist():
        if m["name"] == "iteration" and m["phase"] == "E":
            ends.setdefault(m["rank"], []).append(m["compute_clock"])
    gpu = [row for row in trace.gpu.to_pylist() if row["clock_end"] <= max(ends.get(row["rank"], [0.0])) + 1e-9]
    if dest.exists():
        shutil.rmtree(dest)
    return write_trace(dest, part.manifest, part.ops, marks=part.marks, slots=part.slots, gpu=gpu,
                       incomplete="live snapshot of a running job")


def _predict(snapshots: list[Path], live_dir: Path, k: int) -> tuple[float | None, float]:
    """(prediction, ms) of iteration ``k`` from the live directory holding snapshot k (copied there first)."""
    if live_dir.exists():
        shutil.rmtree(live_dir)
    shutil.copytree(snapshots[k - 1], live_dir)
    t0 = time.perf_counter()
    seconds = live.predict_iteration(live_dir, k)[0]
    return seconds, (time.perf_counter() - t0) * 1e3


def _write(manifest: dict, rows: list[list[dict]], dest: Path, durable: bool) -> None:
    """A snapshot written as the coordinator writes it: from its records as rows (ops, marks, slots, gpu)."""
    ops, marks, slots, gpu = rows
    write_trace(dest, manifest, ops, marks=marks, slots=slots, gpu=gpu, incomplete="live snapshot of a running job",
                durable=durable)


def measure(trace_dir: Path, at: list[int], work: Path) -> None:
    trace = read_trace(trace_dir)
    whole = live.whole_iterations(trace)
    if max(at) > whole:
        raise SystemExit(f"--at {max(at)}: {trace_dir} holds {whole} whole iterations")
    snapshots = [snapshot(trace, k, work / f"snapshot-{k}") for k in range(1, max(at) + 1)]
    live_dir = work / "live"
    for k in at:
        part = read_trace(snapshots[k - 1])
        built = _ms(lambda part=part: graph_from_trace(part))
        rows = [t.to_pylist() for t in (part.ops, part.marks, part.slots, part.gpu)]
        written = {durable: _ms(lambda durable=durable, part=part, rows=rows: _write(
            part.manifest, rows, work / "written", durable)) for durable in (True, False)}
        start, resumed = [], []
        for _ in range(3):
            live._REPLAYS.clear()  # nothing to go on from
            expected, ms = _predict(snapshots, live_dir, k)
            start.append(ms)
            live._REPLAYS.clear()  # a run's own sequence: iterations 1..k-1, then k timed
            for j in range(1, k):
                _predict(snapshots, live_dir, j)
            got, ms = _predict(snapshots, live_dir, k)
            resumed.append(ms)
            went_on = next(iter(live._REPLAYS.values())).resumed
        same = "equal" if got == expected else f"NOT EQUAL ({got} against {expected})"
        print(f"iteration {k:3d}: {part.ops.num_rows:6d} ops, {part.gpu.num_rows:6d} GPU rows so far; prediction "
              f"{statistics.median(resumed):7.1f} ms {'resumed' if went_on else 'NOT RESUMED'}, "
              f"{statistics.median(start):7.1f} ms from the start; graph build (in both) {built:7.1f} ms; "
              f"predictions {same}; the coordinator's snapshot {written[False]:6.1f} ms as written now (atomic), "
              f"{written[True]:6.1f} ms flushed to the disk", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=24, help="iterations captured (24)")
    p.add_argument("--at", default="3,6,12,24", help="the iterations k to time the prediction at (3,6,12,24)")
    p.add_argument("--trace", type=Path, help="time this PrismTrace instead of capturing one")
    a = p.parse_args(argv)
    at = [int(x) for x in a.at.split(",") if x]
    if not at or min(at) < 1 or (a.trace is None and max(at) > a.iters):
        p.error(f"--at {a.at}: expected iterations between 1 and --iters {a.iters}")
    with tempfile.TemporaryDirectory(prefix="live-prediction-") as tmp:
        trace = a.trace
        if trace is None:
            trace = Path(tmp) / "trace"
            t0 = time.perf_counter()
            capture(a.iters, trace)
            print(f"captured {a.iters} iterations in {time.perf_counter() - t0:.0f} s", flush=True)
        measure(trace, at, Path(tmp))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
