"""What a process pays when some thread of it holds a dynamo frame callback (issue 21's host-bound hunt).

While any thread has a dynamo callback set (``torch._C._dynamo.eval_frame.set_eval_frame`` to a callable or to
``False``, run-only), torch installs its frame evaluator for the whole interpreter: every Python frame of every
thread passes through dynamo's shim, and Python's specialised calls give way to the generic path. The emulated
rank's slow frames on the GPU (docs/measurements.md, run 43) sit around compiled calls, so this measures, in fresh
processes interleaved, an empty Python call, a call into a ``torch.compile``-d function and Megatron's per-call
``torch.nn.Softmax`` construction and use, with no other thread (``plain``), with a thread blocked in a socket read
as the rank's receiver is (``receiver``), and with a thread that holds a run-only callback while it waits
(``callback-thread``), and inside a prism rank (``rank``: the same child as the one logical rank of
``prism-megatron launch --world-size 1 --devices cpu``, its process group initialised and an all-reduce between
repeats, as the rank's runtime is called between forwards). Minimum over repeats per process (this machine is
shared), the median over rounds.

Usage: python bench/dynamo_shim_cost.py [--rounds 3] [--device cuda]   (on CPU Inductor builds a C++ kernel: needs a
compiler; with ``--device cuda`` a Triton one on GPU 0, and the rank is launched there: ``--devices 0``)
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from interleaved import interleave, ratios

VARIANTS = ("plain", "receiver", "callback-thread", "rank")


def in_rank(rounds_file: str, device: str) -> dict[str, float]:
    """The ``rank`` variant: this script's ``rank-inner`` child as a prism rank; its figures come back in a file
    (a rank's output goes through the launcher)."""
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "figures.json")
        devices = "0" if device == "cuda" else "cpu"
        launch = [sys.executable, "-m", "prism_megatron", "launch", "--world-size", "1", "--devices", devices,
                  "--trace-dir", os.path.join(tmp, "trace")]
        script = [rounds_file, "--child", "rank-inner", "--figures", out, "--device", device]
        run = subprocess.run([*launch, "--", *script], capture_output=True, text=True, check=False)
        if run.returncode != 0 or not os.path.exists(out):
            raise SystemExit(f"the rank variant failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
        with open(out) as f:
            return json.load(f)


def child(variant: str, device: str) -> dict[str, float]:
    import socket
    import threading

    import torch

    torch.set_num_threads(1)

    @torch.compile
    def fused(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(x + b)

    def frame() -> None:
        return None

    x, b = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    for _ in range(20):
        fused(x, b)
    if variant == "receiver":
        here, there = socket.socketpair()
        threading.Thread(target=lambda: here.recv(1), daemon=True).start()
    elif variant == "callback-thread":
        from torch._C._dynamo.eval_frame import set_eval_frame

        held = threading.Event()
        done = threading.Event()

        def hold() -> None:
            set_eval_frame(False)
            held.set()
            done.wait()

        threading.Thread(target=hold, daemon=True).start()
        held.wait()
    between = None
    if variant == "rank-inner":
        import torch.distributed as dist

        dist.init_process_group()
        one = torch.ones(4, device=device)

        def between() -> None:
            dist.all_reduce(one)

    def per_call(fn, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6

    out: dict[str, list[float]] = {"frame_us": [], "compiled_us": [], "softmax_module_us": []}
    for _ in range(7):
        if between is not None:
            between()
        out["frame_us"].append(per_call(frame, 20000))
        out["compiled_us"].append(per_call(lambda: fused(x, b), 2000))
        out["softmax_module_us"].append(per_call(lambda: torch.nn.Softmax(dim=-1)(x), 2000))
    return {k: min(v) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds over the variants, interleaved (default 3)")
    p.add_argument("--child", choices=(*VARIANTS, "rank-inner"), help=argparse.SUPPRESS)
    p.add_argument("--figures", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the tensors live (cuda: GPU 0, and the rank variant launched on it; default cpu)")
    a = p.parse_args(argv)
    if a.child == "rank":
        print(json.dumps(in_rank(__file__, a.device)))
    elif a.child == "rank-inner":
        figures = child(a.child, a.device)
        with open(a.figures, "w") as f:
            json.dump(figures, f)
    elif a.child:
        print(json.dumps(child(a.child, a.device)))
    if a.child:
        return 0
    print(ratios(interleave(__file__, VARIANTS, a.rounds, ["--device", a.device])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
