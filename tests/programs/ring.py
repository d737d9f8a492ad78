"""A small training-like loop: compute, all-reduce, p2p ring, markers. Used by several tests and benches."""
import os
import sys
import time

import torch
import torch.distributed as dist

from prism_megatron.trace import span

iters = int(sys.argv[1]) if len(sys.argv) > 1 else 3
setup_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0  # a slow set-up before the first iteration
dist.init_process_group("nccl")
r, w = dist.get_rank(), dist.get_world_size()
dev = "cuda" if torch.cuda.is_available() else "cpu"
ballast_gib = float(os.environ.get("RING_BALLAST_GIB", "0"))  # GPU memory each rank holds (swap tests)
ballast = torch.ones(int(ballast_gib * 2**30), dtype=torch.uint8, device=dev) if ballast_gib else None
x = torch.randn(64, 64, generator=torch.Generator().manual_seed(r)).to(dev)
time.sleep(setup_s)
for it in range(iters):
    with span("iteration", iteration=it):
        for _ in range(5):
            x = torch.tanh(x @ x) / 8
        dist.all_reduce(x)
        nxt, prv = (r + 1) % w, (r - 1) % w
        y = torch.empty_like(x)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)])
        for q in reqs:
            q.wait()
        x = (x + y) / 2
if ballast is not None:
    # survived every swap intact (checked in chunks: a whole-tensor reduction would need 8x its size)
    assert all(bool((c == 1).all()) for c in ballast.split(1 << 28)), "ballast corrupted"
out = os.environ.get("RING_OUT")
if out:
    torch.save(x.cpu(), os.path.join(out, f"rank-{r}.pt"))
