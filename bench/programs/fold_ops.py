"""Folded collectives timed in the program: all_reduce, reduce_scatter, all_gather and all_to_all_single
(uneven splits, as a MoE token dispatch sends them) over the world group (every other rank virtual), each
size and dtype, ``REPS`` timed ops after one warm-up; ms per op (issue to result written) as the attributes
of a ``timing`` span in the trace (the trace is what comes back from the ranks). Sizes are the larger
buffer's (all_gather: its output; reduce_scatter: its input; all_to_all: each way), as nccl-tests counts
them.

Usage: fold_ops.py SIZE_MIB[,SIZE_MIB...] REPS [DEVICE] [KIND,KIND...]
"""
import sys
import time

import torch
import torch.distributed as dist

from prism_megatron.trace import span

sizes, reps = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2])
device = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu")
KINDS = sys.argv[4].split(",") if len(sys.argv) > 4 else ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"]
dist.init_process_group("nccl")
n = dist.get_world_size()
res = {}
a2a_out: dict = {}


def run(kind: str, big: torch.Tensor, small: torch.Tensor) -> None:
    if kind == "all_to_all":
        # rows of 1 KiB, uneven: a quarter to this rank, the rest to the others in parts n-1 : n-2 : ... : 1.
        # A virtual member mirrors this rank and, without coordinates, sends it its own piece for itself
        # (A2A_RULE): it receives n quarters, its input's size
        rows = big.numel() // (1024 // big.element_size())
        weights = range(n - 1, 0, -1)
        splits = [rows // n] + [(rows - rows // n) * k // sum(weights) for k in weights]
        splits[-1] += rows - sum(splits)
        out = a2a_out.setdefault(big.dtype, torch.empty_like(big))
        dist.all_to_all_single(out.view(rows, -1), big.view(rows, -1), output_split_sizes=[rows // n] * n,
                               input_split_sizes=splits)
    elif kind == "all_reduce":
        dist.all_reduce(big)
    elif kind == "reduce_scatter":
        dist.reduce_scatter_tensor(small, big)
    else:
        dist.all_gather_into_tensor(big, small)


for mib in sizes:
    for dtype in (torch.float32, torch.bfloat16):
        numel = (mib << 20) // dtype.itemsize
        big = torch.ones(numel, dtype=dtype, device=device)
        small = torch.ones(numel // n, dtype=dtype, device=device)
        for kind in KINDS:
            run(kind, big, small)  # warm-up: staging memory, page faults
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                run(kind, big, small)
            if device.type == "cuda":
                torch.cuda.synchronize()
            res[f"{kind} {mib} MiB {str(dtype).removeprefix('torch.')}"] = (time.perf_counter() - t0) / reps * 1e3
        del big, small
        a2a_out.clear()
with span("timing", ms_per_op=res):
    pass
dist.destroy_process_group()
