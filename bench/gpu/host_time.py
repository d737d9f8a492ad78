"""Host time per iteration of an emulated GPU rank under runtime variants (device `nvidia-h200-x2`).

The two-clock replay takes each segment's host time from the emulation; if emulating inflates it
(profiler, cold caches after every hand-over, idle cores clocking down), a host-bound job is
over-predicted. This runs the TP2 case of bench/accuracy under each variant and prints, per rank,
the median over iterations of the compute clock (one clock) and of the measured host time.

  python bench/gpu/host_time.py OUT_DIR [VARIANT...]   (wheels on PYTHONPATH, from the repo root;
  no VARIANT: all of them)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "accuracy"))
import run as acc  # noqa: E402 - bench/accuracy/run.py

VARIANTS = {
    "timing off": {"flags": ["--prism-gpu-timing", "off"], "env": {}},
    "timing on": {"flags": [], "env": {}},
    "timing on, pinned": {"flags": [], "env": {"PRISM_PIN_CORES": "1"}},
    "timing on, pinned, spin 2 ms": {"flags": [], "env": {"PRISM_PIN_CORES": "1", "PRISM_SPIN_GRANT_US": "2000"}},
    # a whole hand-over is ~10-20 ms of wall on this data plane: spin through all of it (the core never idles)
    "timing on, spin whole wait": {"flags": [], "env": {"PRISM_SPIN_GRANT_US": "10000000"}},
    "timing on, pinned, spin whole wait": {"flags": [], "env": {"PRISM_PIN_CORES": "1",
                                                                "PRISM_SPIN_GRANT_US": "10000000"}},
    # each rank alone on its own GPU (no other CUDA context on its device): is the inflation the GPU's sharing?
    "timing on, one GPU per rank": {"flags": ["--prism-devices", "0,1"], "env": {}},
}


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/host-time")
    out.mkdir(parents=True, exist_ok=True)
    case = next(c for c in acc.gpu_cases(4, "bf16") if c.name == "gpu-tp2")
    results = {}
    chosen = sys.argv[2:] or list(VARIANTS)
    for name in chosen:
        v = VARIANTS[name]
        work = Path("/tmp/host-time") / name.replace(" ", "_").replace(",", "")
        trace = acc._fresh(work / "trace")
        cmd = [acc.PY, "-m", "prism_megatron", "run", "--prism-emulate", "--prism-world-size", "2",
               "--prism-slots-per-device", "1", "--prism-threads-per-rank", "1",
               "--prism-report", "off", "--prism-log-ranks", "none", "--prism-trace-dir", str(trace),
               *(v["flags"] if "--prism-devices" in v["flags"] else ["--prism-devices", "0", *v["flags"]]),
               str(acc.CORE_DRIVER_SCRIPT), *case.flags]
        try:
            acc._run(cmd, work / "run.log", acc._env(**v["env"]), 300)
            results[name] = acc.host_device_per_iteration(trace, skip=1)
        except Exception as e:  # noqa: BLE001 - one failed variant must not hide the others
            results[name] = {"error": str(e)[-400:]}
        print(name, json.dumps(results[name]), flush=True)
    (out / "host_time.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
