"""Rank 2 raises after the first collective; the others go on to wait for it."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
r = dist.get_rank()
dist.all_reduce(torch.ones(3))
if r == 2:
    raise ValueError("boom on rank two")
dist.all_reduce(torch.ones(3))
