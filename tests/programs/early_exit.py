"""Rank 1 exits cleanly before the last collective the others wait in."""
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(3))
if dist.get_rank() == 1:
    sys.exit(0)
dist.all_reduce(torch.ones(3))
