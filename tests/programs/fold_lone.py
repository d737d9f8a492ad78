"""Every collective a rank answers itself on a folded group whose only live member it is
(runtime.local_fold), and the same on a group with two live members (the coordinator's), on seeded
inputs of several dtypes and sizes (inline and shared-memory staged). Run with 8 ranks folded to
ranks 0 and 4 (rep[r] = r - r % 4). Results go to OUT_DIR/rank-R.pt.

Usage: fold_lone.py OUT_DIR
"""
import gc
import sys
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from prism_megatron.trace import span

out_dir = Path(sys.argv[1])
dist.init_process_group("nccl")
r, w = dist.get_rank(), dist.get_world_size()
quads = [dist.new_group(list(range(q, q + 4))) for q in range(0, w, 4)]
lone = quads[r // 4]  # this rank is its only live member
gen = torch.Generator().manual_seed(1000 + r)
SIZES = (5, 40_000)  # inline, and staged through shared memory on the coordinator's path


def inp(n: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(n, generator=gen) * 3).to(dtype)
    return torch.randint(-50, 50, (n,), generator=gen).to(dtype)


res = {}
with span("iteration", iteration=0):
    for gname, g in (("lone", lone), ("world", None)):
        n = dist.get_world_size(g)
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for size in SIZES:
                key = f"{gname}/{dtype}/{size}"
                ops = ["sum", "avg", "min", "max", "product", "premul_sum"] if dtype.is_floating_point \
                    else ["sum", "min", "max", "band", "bor", "bxor"]
                for op in ops:
                    x = inp(size, dtype)
                    rop = dist._make_nccl_premul_sum(0.25) if op == "premul_sum" else getattr(dist.ReduceOp, op.upper())
                    dist.all_reduce(x, op=rop, group=g)
                    res[f"{key}/all_reduce/{op}"] = x
                a, b = inp(size, dtype), inp(3, dtype)
                with dist._coalescing_manager(group=g, async_ops=True) as cm:
                    dist.all_reduce(a, group=g)
                    dist.all_reduce(b, group=g)
                cm.wait()
                res[f"{key}/all_reduce/coalesced"] = torch.cat([a, b])
                rs_out = torch.empty(size, dtype=dtype)
                dist.reduce_scatter_tensor(rs_out, inp(size * n, dtype), group=g)
                res[f"{key}/reduce_scatter"] = rs_out
                buf = inp(size * n, dtype)  # in place: this member's chunk of the output is its input
                me = dist.get_rank(g)
                dist.reduce_scatter_tensor(buf[me * size:(me + 1) * size], buf, group=g)
                res[f"{key}/reduce_scatter/in_place"] = buf
                rl_out = torch.empty(size, dtype=dtype)
                dist.reduce_scatter(rl_out, [inp(size, dtype) for _ in range(n)], group=g)
                res[f"{key}/reduce_scatter/list"] = rl_out
                ag = torch.empty(size * n, dtype=dtype)
                dist.all_gather_into_tensor(ag, inp(size, dtype), group=g)
                res[f"{key}/all_gather"] = ag
                parts = [torch.empty(size, dtype=dtype) for _ in range(n)]
                dist.all_gather(parts, inp(size, dtype), group=g)
                res[f"{key}/all_gather/list"] = torch.cat(parts)
                gouts = [torch.empty(size * n, dtype=dtype), torch.empty(3 * n, dtype=dtype)]
                with dist._coalescing_manager(group=g, async_ops=True) as cm:
                    dist.all_gather_into_tensor(gouts[0], inp(size, dtype), group=g)
                    dist.all_gather_into_tensor(gouts[1], inp(3, dtype), group=g)
                cm.wait()
                res[f"{key}/all_gather/coalesced"] = torch.cat(gouts)
                obuf = inp(size * n, dtype)  # the distributed optimizer's parameter gather
                dist.all_gather_into_tensor(obuf, obuf[me * size:(me + 1) * size], group=g)
                res[f"{key}/all_gather/in_place"] = obuf
                rows = [(i * 3 + r + 1) % 5 for i in range(n)]  # uneven; what it receives: a count exchange first
                got_rows = torch.empty(n, dtype=torch.int64)
                dist.all_to_all_single(got_rows, torch.tensor(rows), group=g)
                x = inp(sum(rows) * size, dtype).view(sum(rows), size)
                a2a = torch.full((int(got_rows.sum()), size), 7, dtype=dtype)
                dist.all_to_all_single(a2a, x, output_split_sizes=got_rows.tolist(), input_split_sizes=rows, group=g)
                res[f"{key}/all_to_all_single/uneven"] = a2a
                a2a = torch.empty(n * size, dtype=dtype)
                dist.all_to_all_single(a2a, inp(n * size, dtype), group=g)
                res[f"{key}/all_to_all_single"] = a2a
                parts = [torch.empty(size, dtype=dtype) for _ in range(n)]
                dist.all_to_all(parts, [inp(size, dtype) for _ in range(n)], group=g)
                res[f"{key}/all_to_all/list"] = torch.cat(parts)
                bc = inp(size, dtype)
                dist.broadcast(bc, src=dist.get_global_rank(g, 0) if g is not None else 0, group=g)
                res[f"{key}/broadcast"] = bc
                dist.barrier(group=g)
# an op's tensors die with the program's last reference (no cycle keeps them for the cyclic GC: the rank's
# memory would exceed the target's)
gc.disable()
x = torch.ones(40_000)
ref = weakref.ref(x)
dist.all_reduce(x, group=lone)
del x
res["freed"] = torch.tensor([ref() is None])
gc.enable()
out_dir.mkdir(parents=True, exist_ok=True)
torch.save(res, out_dir / f"rank-{r}.pt")
dist.destroy_process_group()
