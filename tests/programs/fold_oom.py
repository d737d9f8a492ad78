"""Two rank classes under a byte budget, on 4 ranks folded to ranks 0-1 (rep = r % 2), chosen by argv[1].

Set-up: rank 0 broadcasts the run's flags (int64, as Megatron's do_train flags) on the world group, and every
rank checks them. Then 2 iterations: an even rank keeps 8 MiB per iteration, an odd one 64 KiB; each
all-reduces a small tensor. Under a cap of a few MiB the even class runs out of memory in iteration 1, the
odd class fits.
oom: as above.
early: rank 0 allocates its first 8 MiB before the set-up broadcast (it runs out of memory before it).
crash: rank 0 raises in iteration 1 instead of allocating.
"""
import sys

import torch
import torch.distributed as dist

from prism_megatron.trace import span

MiB = 1 << 20
mode = sys.argv[1]
dist.init_process_group("gloo")
r = dist.get_rank()
kept = []
if mode == "early" and r % 2 == 0:
    kept.append(torch.ones(8 * MiB // 4))
flags = torch.tensor([7, 1], dtype=torch.int64) if r == 0 else torch.zeros(2, dtype=torch.int64)
dist.broadcast(flags, 0)
if flags.tolist() != [7, 1]:
    raise SystemExit(f"rank {r} got flags {flags.tolist()}, rank 0 sent [7, 1]")
for it in range(2):
    with span("iteration", iteration=it):
        if mode == "crash" and r == 0:
            raise RuntimeError("the program failed")
        kept.append(torch.ones((8 * MiB if r % 2 == 0 else 64 * 1024) // 4))
        x = torch.ones(16)
        dist.all_reduce(x)
dist.destroy_process_group()
