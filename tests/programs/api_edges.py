"""Explicit-store rendezvous, get_backend, markers, an unsupported op's and a refused call's errors,
Work/future semantics."""
import os
import sys

import torch
import torch.distributed as dist

from prism_megatron.trace import mark, span

out = sys.argv[1]
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
dist.init_process_group("nccl", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
r = dist.get_rank()
lines = [f"backend={dist.get_backend()}"]
g = dist.new_group(backend="gloo")
lines.append(f"group_backend={dist.get_backend(g)}")
with span("unit", microbatch=r):
    t = torch.ones(3)
    w = dist.all_reduce(t, async_op=True)
    lines.append(f"future_then={w.get_future().then(lambda f: f.value()[0].sum().item()).wait()}")
    lines.append(f"completed={w.is_completed()} success={w.is_success()}")
mark("after", value=1)
pg = dist.group.WORLD
# an op prism lacks, and one it refuses for bad input (one output list for a group of four), before anything is sent
for name, call in [("allgather_coalesced", lambda: pg.allgather_coalesced([[torch.empty(1)]], [torch.ones(1)])),
                   ("future_op", lambda: pg.future_op(torch.ones(1)))]:
    try:
        call()
        lines.append(f"unsupported {name}=no error")
    except Exception as e:  # noqa: BLE001
        lines.append(f"unsupported {name}={type(e).__name__}: {e}")
dist.barrier()
with open(os.path.join(out, f"rank-{r}.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
