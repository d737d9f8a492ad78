"""Tensors handed to collectives die with their last reference, as with NCCL: no Work/Future cycle
may keep them until the cyclic GC runs (which is off here). Writes OUT/rank-R.txt."""

import gc
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

gc.disable()
dist.init_process_group("gloo")
rank = dist.get_rank()
lines = []

t = torch.ones(1 << 16)
ref = weakref.ref(t)
work = dist.all_reduce(t, async_op=True)
work.wait()
del work, t
lines.append(f"async_work_freed={ref() is None}")

t = torch.ones(1 << 16)
ref = weakref.ref(t)
fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0].sum().item())
value = fut.wait()
del fut, t
lines.append(f"future_then_freed={ref() is None} value={value}")

ts = [torch.ones(1 << 14) for _ in range(3)]
refs = [weakref.ref(x) for x in ts]
with dist._coalescing_manager(async_ops=True) as cm:
    for x in ts:
        dist.all_reduce(x)
cm.wait()
del cm, ts, x
lines.append(f"coalesced_freed={all(r() is None for r in refs)}")

dist.destroy_process_group()
Path(sys.argv[1], f"rank-{rank}.txt").write_text("\n".join(lines) + "\n")
