"""Folded collectives timed in the program: all_reduce, reduce_scatter and all_gather over the world group
(every other rank virtual), each size and dtype, ``REPS`` timed ops after one warm-up; ms per op (issue to
result written) as the attributes of a ``timing`` span in the trace (the trace is what comes back from
the ranks). Sizes are the larger buffer's (all_gather: its output; reduce_scatter: its
input), as nccl-tests counts them.

Usage: fold_ops.py SIZE_MIB[,SIZE_MIB...] REPS [DEVICE]
"""
import sys
import time

import torch
import torch.distributed as dist

from prism_megatron.trace import span

sizes, reps = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2])
device = torch.device(sys.argv[3] if len(sys.argv) > 3 else "cpu")
dist.init_process_group("nccl")
n = dist.get_world_size()
res = {}


def run(kind: str, big: torch.Tensor, small: torch.Tensor) -> None:
    if kind == "all_reduce":
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
        for kind in ("all_reduce", "reduce_scatter", "all_gather"):
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
with span("timing", ms_per_op=res):
    pass
dist.destroy_process_group()
