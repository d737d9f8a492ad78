"""Times `iters` all-reduces of `nbytes` bytes on every rank; rank 0 writes JSON.

A 4th argument `solo` all-reduces over a group of one per rank (Megatron's data-parallel group at DP 1)."""
import json
import sys
import time

import torch
import torch.distributed as dist

out, nbytes, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
solo = len(sys.argv) > 4 and sys.argv[4] == "solo"
group = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()] if solo else None
t = torch.ones(max(1, nbytes // 4))
dist.all_reduce(t, group=group)  # warm-up
dist.barrier()
t0 = time.perf_counter()
for _ in range(iters):
    dist.all_reduce(t, group=group)
dist.barrier()
dt = time.perf_counter() - t0
if dist.get_rank() == 0:
    json.dump({"seconds": dt, "iters": iters, "bytes": t.numel() * 4, "world": dist.get_world_size()},
              open(out, "w"))
dist.destroy_process_group()
