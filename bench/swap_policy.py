"""Swaps per iteration of an 8-rank job that only fits with swapping, FIFO slots vs resident-first.

Uses the budget stand-in swapper (no GPU): each rank reports 60 GiB, the device holds 141 GiB, so
at most 2 ranks are resident — as 8 ranks of 60 GiB on one H200 would be. Prints swaps per
iteration for each slot policy, side by side in one run.

  python bench/swap_policy.py [iterations]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(policy: str, iters: int, tmp: Path) -> tuple[int, float]:
    env = dict(os.environ, PRISM_SWAP_POLICY=policy, PRISM_FOOTPRINT_BYTES=str(60 * 2**30))
    trace = tmp / f"trace-{policy}"
    p = subprocess.run([sys.executable, "-m", "prism_megatron", "launch", "-w", "8", "--slots-per-device", "2",
                        "--swap", "budget", "--device-memory", "141", "--log-ranks", "none", "--trace-dir", str(trace),
                        str(ROOT / "tests" / "programs" / "ring.py"), str(iters)], capture_output=True, text=True,
                       env=env)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    from prism_megatron.trace import read_trace

    swap = read_trace(trace).manifest["job"]["swap"]
    return sum(s["swaps_out"] for s in swap.values()), sum(s["bytes_out"] for s in swap.values()) / 2**30


def main() -> None:
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    with tempfile.TemporaryDirectory() as d:
        rows = {pol: run(pol, iters, Path(d)) for pol in ("fifo", "resident-first")}
    print(f"8 ranks x 60 GiB (stand-in) on a 141 GiB device, 2 slots, {iters} iterations of tests/programs/ring.py")
    for pol, (n, gib) in rows.items():
        print(f"  {pol:<15} {n:4d} swaps out ({n / iters:.1f} per iteration), {gib:,.0f} GiB moved out")
    f, r = rows["fifo"][0], rows["resident-first"][0]
    print(f"  resident-first / fifo swaps: {r / f:.2f}" if f else "  fifo made no swaps")


if __name__ == "__main__":
    main()
