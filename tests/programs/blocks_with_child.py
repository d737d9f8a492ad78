"""Each rank starts a child process (its pid in $OUT/child-RANK) and some shared memory traffic, then
waits in a barrier that rank 0 never joins: the job runs until someone ends it."""
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
Path(os.environ["OUT"], f"child-{rank}").write_text(str(child.pid))
dist.all_reduce(torch.ones(1 << 18))  # 1 MiB: through the shared-memory segments
if rank == 0:
    time.sleep(600)
dist.barrier()
