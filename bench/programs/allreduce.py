"""Times `iters` all-reduces of `mib` MiB (or `nbytes` bytes) on every rank; rank 0 writes JSON."""
import json
import sys
import time

import torch
import torch.distributed as dist

out, nbytes, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
t = torch.ones(max(1, nbytes // 4))
dist.all_reduce(t)  # warm-up
dist.barrier()
t0 = time.perf_counter()
for _ in range(iters):
    dist.all_reduce(t)
dist.barrier()
dt = time.perf_counter() - t0
if dist.get_rank() == 0:
    json.dump({"seconds": dt, "iters": iters, "bytes": t.numel() * 4, "world": dist.get_world_size()},
              open(out, "w"))
dist.destroy_process_group()
