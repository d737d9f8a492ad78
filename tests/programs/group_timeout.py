"""The program's own process-group timeout: rank 1 comes late to an all_reduce; each waiting rank's wait
raises as gloo's does (prints the exception's type and message, exits 7)."""
import datetime
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[1])))
if dist.get_rank() == 1:
    time.sleep(float(sys.argv[2]))
try:
    dist.all_reduce(torch.ones(4))
except Exception as e:  # noqa: BLE001
    print(f"RAISED {type(e).__name__}: {e}", flush=True)
    sys.exit(7)
