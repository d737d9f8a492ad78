"""Rank 0 puts a file of its own into the trace directory while the job runs: the trace cannot replace it."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    Path(sys.argv[1]).mkdir(exist_ok=True)
    Path(sys.argv[1], "notes.txt").write_text("mine")
dist.all_reduce(torch.ones(4))
