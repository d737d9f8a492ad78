"""Capture speed of the 1.08B accuracy jobs emulated on one GPU, with the data plane's staging memory
pageable (--prism-staging pageable) and page-locked (the default, auto, under --prism-swap none),
side by side; GPU timing on. Prints, per config and
mode, bench/gpu/capture_turns.py's line (capture wall vs physical limit, the slots' time split) and
the ranks' runtime work (staging, writing results, GPU timer); the predicted iteration times of both
traces must agree (staging is off the ranks' clocks).

  python3 bench/gpu/staging_bench.py OUT_DIR [gpu-tp2,gpu-dp2] [ITERS]     # device nvidia-h200, ~6 min

Needs megatron-core and the wheels of .whl on PYTHONPATH (see bench/gpu/accuracy.sh).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "accuracy"))
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
from capture_turns import analyse  # noqa: E402
from run import CORE_DRIVER_SCRIPT, GPU_CLUSTER, _env, driver_precision, gpu_cases, predict  # noqa: E402

from prism_megatron.calibration.costmodel import CollectiveCostModel  # noqa: E402
from prism_megatron.calibration.profiles import load_profile  # noqa: E402
from prism_megatron.trace import read_trace  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    only = (sys.argv[2] if len(sys.argv) > 2 else "gpu-tp2,gpu-dp2").split(",")
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    out.mkdir(parents=True, exist_ok=True)
    cases = [c for c in gpu_cases(iters, driver_precision()) if c.name in only]
    cost = CollectiveCostModel(load_profile(GPU_CLUSTER))
    for case in cases:
        predicted = {}
        for mode in ("pageable", "pinned"):
            trace = out / f"{case.name}-{mode}"
            cmd = [sys.executable, "-m", "prism_megatron", "run", "--prism-emulate", "--prism-world-size",
                   str(case.world), "--prism-devices", "0", "--prism-slots-per-device", "1", "--prism-swap", "none",
                   "--prism-staging", "pageable" if mode == "pageable" else "auto",
                   "--prism-report", "off", "--prism-log-ranks", "none", "--prism-trace-dir", str(trace),
                   str(CORE_DRIVER_SCRIPT), *case.flags]
            t0 = time.perf_counter()
            with open(out / f"{case.name}-{mode}.log", "w") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                    timeout=480).returncode
            if rc:
                print(f"{case.name} {mode}: exit {rc} after {time.perf_counter() - t0:.0f} s (see its log)", flush=True)
                continue
            times = predict(trace, cost)
            predicted[mode] = statistics.median(v for k, v in times.items() if k > 2)
            work = {e["rank"]: e.get("runtime_s") for e in read_trace(trace).manifest["ranks"]}
            print(f"{case.name} {mode} ({time.perf_counter() - t0:.0f} s): {analyse(trace)}", flush=True)
            print(f"  runtime work per rank: {work}; predicted median {predicted[mode] * 1e3:.1f} ms", flush=True)
        if len(predicted) == 2:
            print(f"{case.name}: predicted pinned / pageable {predicted['pinned'] / predicted['pageable']:.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
