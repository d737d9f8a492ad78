"""Members that disagree about a group: rank 1 makes '1' of [1, 2] while rank 0 made it of [0, 1]."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
g = dist.new_group({0: [0, 1], 1: [1, 2], 2: [1, 2], 3: [3]}[rank])
dist.all_reduce(torch.ones(1), group=g)
dist.destroy_process_group()
