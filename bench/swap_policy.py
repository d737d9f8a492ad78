"""Swaps per iteration of an 8-rank job that only fits with swapping, FIFO slots vs resident-first.

Uses the budget stand-in swapper (no GPU): each rank reports 60 GiB, the device holds 141 GiB, so
at most 2 ranks are resident — as 8 ranks of 60 GiB on one H200 would be. Prints swaps per
iteration for each slot policy, side by side in one run.

  python bench/swap_policy.py [iterations]
  python bench/swap_policy.py megatron       # a Megatron GPT, DP8 (CPU), 8 x 4 GiB on 20 GiB

The Megatron job (the driver of `prism-megatron run`, tiny GPT on CPU) runs for 2 and for 4 training
iterations per policy: the difference over 2 is the swaps of a steady iteration, apart from start-up.
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


GPT = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
       "--tokenizer-type NullTokenizer --vocab-size 1024 --mock-data --micro-batch-size 2 --global-batch-size 16 "
       "--lr 0.0001 --seed 1234 --transformer-impl local --no-gradient-accumulation-fusion --log-interval 1 "
       "--eval-iters 0 --eval-interval 1000").split()


def megatron_child(policy: str, iters: int, trace: str) -> int:
    """One emulated Megatron run with the stand-in swapper (what `prism-megatron run` does, swap budget)."""
    os.environ.update(PRISM_SWAP_POLICY=policy, PRISM_FOOTPRINT_BYTES=str(4 * 2**30))
    from prism_megatron.launcher.launch import launch
    from prism_megatron.megatron.run import launch_config, parse_run_args, select_driver

    script = select_driver("auto")[1]
    request = parse_run_args(["--prism-emulate", "--prism-world-size", "8", "--prism-devices", "cpu",
                              "--prism-slots-per-device", "2", "--prism-log-ranks", "none", "--prism-trace-dir", trace,
                              str(script), *GPT, "--train-iters", str(iters)])
    cfg = launch_config(request)
    cfg.swap, cfg.device_memory_gib = "budget", 20.0
    return launch(cfg.validate())


def megatron(tmp: Path) -> None:
    from prism_megatron.trace import read_trace

    print("Megatron GPT DP8 on CPU, stand-in footprints 8 x 4 GiB on a 20 GiB device, 2 slots")
    per_iter = {}
    for policy in ("fifo", "resident-first"):
        counts = {}
        for iters in (2, 4):
            trace = tmp / f"meg-{policy}-{iters}"
            p = subprocess.run([sys.executable, __file__, "megatron-child", policy, str(iters), str(trace)],
                               capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(p.stderr[-3000:])
            swap = read_trace(trace).manifest["job"].get("swap", {})
            counts[iters] = sum(s["swaps_out"] for s in swap.values())
        per_iter[policy] = (counts[4] - counts[2]) / 2
        print(f"  {policy:<15} swaps out: {counts[2]} in 2 iterations, {counts[4]} in 4: "
              f"{per_iter[policy]:.1f} per steady iteration")
    if per_iter["fifo"]:
        print(f"  resident-first / fifo swaps per iteration: {per_iter['resident-first'] / per_iter['fifo']:.2f}")


def main() -> None:
    if sys.argv[1:2] == ["megatron-child"]:
        raise SystemExit(megatron_child(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
    if sys.argv[1:2] == ["megatron"]:
        with tempfile.TemporaryDirectory() as d:
            megatron(Path(d))
        return
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
