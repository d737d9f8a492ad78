"""Time gloo collectives and point-to-point between 2 real processes on this host (loopback).

What the CPU ground truth pays for communication, measured the way nccl-tests measures a link:
per op kind and message size, the median time of one op (each rep starts after a barrier, so
every member is ready, as the replay assumes at an op's start), the slowest member's. ``run.py``
fits latency and bandwidth to these points. Sizes follow the trace's convention: the tensor for
all_reduce and broadcast, the gathered output for all_gather, one rank's send buffer for
all_to_all, the message for send/recv.

  OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 bench/accuracy/gloo_probe.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

SIZES = [4, 4096, 65536, 524288, 2 << 20, 8 << 20, 32 << 20]  # bytes
REPS = 11


def _ops(nbytes: int, rank: int) -> dict:
    n = max(nbytes // 4, 1)
    x = torch.ones(n)
    out = torch.empty(n)
    half = torch.ones(max(n // 2, 1))
    gathered = torch.empty(2 * half.numel())
    peer = 1 - rank

    def p2p() -> None:  # one message, rank 0 -> rank 1, as Megatron's send_forward/recv_forward
        op = dist.P2POp(dist.isend, x, peer) if rank == 0 else dist.P2POp(dist.irecv, out, peer)
        for work in dist.batch_isend_irecv([op]):
            work.wait()

    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, half),
        "broadcast": lambda: dist.broadcast(x, 0),
        "all_to_all": lambda: dist.all_to_all_single(out[: 2 * half.numel()], x[: 2 * half.numel()]),
        "p2p": p2p,
    }


def main(path: str) -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor: what Megatron calls
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results: dict[str, list[tuple[int, float]]] = {}
    for nbytes in SIZES:
        for family, op in _ops(nbytes, rank).items():
            times = []
            for rep in range(REPS + 1):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                if rep:  # the first one warms buffers and connections
                    times.append(time.perf_counter() - t0)
            # an op ends for the job when its slowest member is done
            t = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results.setdefault(family, []).append((nbytes, float(t)))
    if rank == 0:
        with open(path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
