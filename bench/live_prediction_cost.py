"""What the coordinator's live prediction costs at iteration k of a capture (this CPU; issue 21's run 41 saw the
coordinator spend 84-103 ms of CPU per iteration of a W = 1 job).

At each logged iteration the coordinator writes every record so far (``runtime.trace_export``), reads the snapshot
back and replays it from the first iteration (``report.live.predict_iteration``) while the logging rank waits, so
the cost grows with the iterations run. This captures the tiny host-bound job of ``bench/rank_overhead_cpu.py`` (W =
1, CPU) once, then for several k times, side by side: the replay of iterations 1..k as the live prediction makes it,
and the snapshot's conversion of the ops recorded by then, field by field (as ``write_bare_trace`` now does) against
``dataclasses.asdict`` (as it did).

    python bench/live_prediction_cost.py [--iters 24] [--at 3,6,12,24]

Needs megatron-core and Megatron-LM (MEGATRON_LM_PATH) as the driver does.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from rank_overhead_cpu import FLAGS  # noqa: E402 - the same tiny job

from prism_megatron.megatron.driver import DRIVER_SCRIPT  # noqa: E402
from prism_megatron.report.live import predict_iteration, until_iteration  # noqa: E402
from prism_megatron.runtime.recorder import OpRecord  # noqa: E402
from prism_megatron.runtime.trace_export import _OP_COLUMNS  # noqa: E402
from prism_megatron.trace import read_trace  # noqa: E402


def capture(iters: int, trace: Path) -> None:
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=24, help="iterations captured (24)")
    p.add_argument("--at", default="3,6,12,24", help="the iterations k to time the prediction at (3,6,12,24)")
    a = p.parse_args(argv)
    at = [int(x) for x in a.at.split(",") if x]
    if not at or min(at) < 1 or max(at) > a.iters:
        p.error(f"--at {a.at}: expected iterations between 1 and --iters {a.iters}")
    with tempfile.TemporaryDirectory(prefix="live-prediction-") as tmp:
        trace = Path(tmp) / "trace"
        t0 = time.perf_counter()
        capture(a.iters, trace)
        print(f"captured {a.iters} iterations in {time.perf_counter() - t0:.0f} s", flush=True)
        tr = read_trace(trace)
        names = {f.name for f in fields(OpRecord)}
        for k in at:
            so_far = [OpRecord(**{n: v for n, v in o.items() if n in names and n not in ("splits", "payload")})
                      for o in until_iteration(tr, k).ops.to_pylist()]
            copied = _ms(lambda recs=so_far: [{c: v for c, v in asdict(r).items() if c in _OP_COLUMNS} for r in recs])
            direct = _ms(lambda recs=so_far: [{c: getattr(r, c) for c in _OP_COLUMNS} for r in recs])
            predicted = _ms(lambda k=k: predict_iteration(trace, k))
            print(f"iteration {k:3d}: {len(so_far):6d} ops so far; replay to it {predicted:7.1f} ms; snapshot rows "
                  f"{direct:6.1f} ms field by field, {copied:6.1f} ms by asdict", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
