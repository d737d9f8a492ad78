"""Rank 1 keeps the others waiting: STALL=compute holds its slot in a long loop, STALL=stop stops itself
(SIGSTOP), STALL=outside sleeps in its own code before its first collective."""
import os
import signal
import sys
import time

how = os.environ["STALL"]
if how == "outside" and os.environ["RANK"] == "1":  # a wait outside the runtime (I/O, a lock)
    time.sleep(600)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    if how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        t = time.time()
        while time.time() - t < 600:
            pass
dist.all_reduce(torch.ones(4))
sys.exit(0)
