"""Rank 3 all-reduces a tensor of a different shape: the bug that hangs NCCL jobs at scale."""
import torch
import torch.distributed as dist

dist.init_process_group("nccl")
r = dist.get_rank()
dist.all_reduce(torch.ones(4))
dist.all_reduce(torch.ones(5 if r == 3 else 4))
