"""4 ranks as 2 pipeline stages of TP pairs: (0,1) -> (2,3). Deterministic busy-loop compute.

Per iteration, stage 0 computes forward, all-reduces over its TP pair, sends to its stage-1 peer and
waits for the gradient; stage 1 receives, computes forward and backward, sends the gradient back;
both overlap an async TP all-reduce with a little compute and end with a 4-rank all-reduce. Busy
loops wait wall-clock time, so a rank's compute is the same however the ranks are multiplexed, and
with free communication an iteration takes at least 2 * (FORWARD + SKEW) + 2 * BACKWARD + OVERLAP.

Groups cover torch's two naming schemes: counter names (world, TP pairs, the 4-rank group, created by
every rank) and a hashed name (the pipeline pairs, use_local_synchronization=True, members only).
"""
import sys
import time

import torch
import torch.distributed as dist

from prism_megatron.trace import span

FORWARD, BACKWARD, OVERLAP, SKEW = 0.030, 0.045, 0.010, 0.004  # seconds; forward + SKEW on a pair's second rank


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


iters = int(sys.argv[1]) if len(sys.argv) > 1 else 3
dist.init_process_group("nccl")
r = dist.get_rank()
assert dist.get_world_size() == 4, "pairs_pipeline.py runs with 4 ranks"
stage, t = divmod(r, 2)
tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][stage]
pp = dist.new_group([t, t + 2], use_local_synchronization=True)
everyone = dist.new_group([0, 1, 2, 3])
act = torch.zeros(64, 64)
grad = torch.zeros(128, 256)  # 128 KiB: through shared memory, not inline
loss = torch.zeros(1)
for it in range(iters):
    with span("iteration", iteration=it):
        if stage == 1:
            dist.recv(act, src=r - 2, group=pp)
        busy(FORWARD + SKEW * t)
        dist.all_reduce(act, group=tp)
        if stage == 0:
            dist.send(act, dst=r + 2, group=pp)
            req = dist.irecv(grad, src=r + 2, group=pp)
            req.wait()
            busy(BACKWARD)
        else:
            busy(BACKWARD)
            dist.isend(grad, dst=r - 2, group=pp).wait()
        h = dist.all_reduce(grad, group=tp, async_op=True)
        busy(OVERLAP)
        h.wait()
        dist.all_reduce(loss, group=everyone)
