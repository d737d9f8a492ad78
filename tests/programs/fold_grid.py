"""A job of TP2·DP·PP4 ranks (rank = tp + 2 * (dp + DP * pp), Megatron's tp-dp-pp order), no Megatron.

Every rank creates every TP, DP and PP group, then runs each op kind on them and on the world group.
Inputs depend only on the replica-invariant coordinates (tp, pp), so every data-parallel replica
computes the same: a full run and a run folded to replica 0 must give replica 0 the same results,
except the in-place all_gather, whose virtual chunks a fold *keeps* (the test checks both ways).
Results go to OUT_DIR/rank-R.pt.

Usage: fold_grid.py OUT_DIR
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from prism_megatron.trace import span

out_dir = Path(sys.argv[1])
dist.init_process_group("nccl")
r, w = dist.get_rank(), dist.get_world_size()
DP = w // 8
t, d, p = r % 2, (r // 2) % DP, r // (2 * DP)
rank = lambda t, d, p: t + 2 * (d + DP * p)  # noqa: E731

tp = dp = pp = None
for q in range(4):
    for dd in range(DP):
        g = dist.new_group([rank(0, dd, q), rank(1, dd, q)])
        tp = g if (dd, q) == (d, p) else tp
for q in range(4):
    for tt in range(2):
        g = dist.new_group([rank(tt, dd, q) for dd in range(DP)])
        dp = g if (tt, q) == (t, p) else dp
for dd in range(DP):
    for tt in range(2):
        g = dist.new_group([rank(tt, dd, q) for q in range(4)])
        pp = g if (tt, dd) == (t, d) else pp

base = float(1 + t + 10 * p)  # replica-invariant
res = {}
with span("iteration", iteration=0):
    x = torch.full((4,), base)
    dist.all_reduce(x, group=tp)
    res["tp_sum"] = x
    for op in ("sum", "avg", "max", "min", "product"):
        y = torch.full((3,), base if op != "product" else 1.0 + t)
        dist.all_reduce(y, op=getattr(dist.ReduceOp, op.upper()), group=dp)
        res[f"dp_{op}"] = y
    z = torch.tensor([int(base)], dtype=torch.int64)
    dist.all_reduce(z, group=None)
    res["world_sum_int"] = z
    flag = torch.tensor([1 if base > 30 else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    res["world_max_flag"] = flag
    gathered = torch.empty(DP * 2)
    dist.all_gather_into_tensor(gathered, torch.full((2,), base), group=dp)
    res["dp_all_gather"] = gathered
    parts = [torch.empty(2) for _ in range(DP)]
    dist.all_gather(parts, torch.full((2,), base + 0.5), group=dp)
    res["dp_all_gather_list"] = torch.cat(parts)
    # the distributed optimizer's parameter gather: my chunk of the buffer is my input
    buf = torch.arange(DP * 3, dtype=torch.float32) - 100.0
    mine = buf[d * 3:(d + 1) * 3]
    mine.fill_(base)
    dist.all_gather_into_tensor(buf, mine, group=dp)
    res["inplace_gather"] = buf
    rs_in = torch.cat([torch.full((2,), base + c) for c in range(DP)])
    rs_out = torch.empty(2)
    dist.reduce_scatter_tensor(rs_out, rs_in, group=dp)
    res["dp_reduce_scatter"] = rs_out
    splits_in = [j + 1 for j in range(DP)]
    a2a_in = torch.cat([torch.full((j + 1,), base + 100 * j) for j in range(DP)])
    a2a_out = torch.empty(DP * (d + 1))
    dist.all_to_all_single(a2a_out, a2a_in, [d + 1] * DP, splits_in, group=dp)
    res["dp_all_to_all"] = a2a_out
    for root in (0, DP - 1):
        b = torch.full((2,), base + root if d == root else -1.0)
        if d != root:
            b.fill_(base + root)  # a receiver holds what the root would: the virtual root's mirror sends it
        dist.broadcast(b, src=rank(t, root, p), group=dp)
        res[f"dp_broadcast_{root}"] = b
    red = torch.full((2,), base)
    dist.reduce(red, dst=rank(t, 0, p), group=dp)
    res["dp_reduce"] = red
    glist = [torch.empty(1) for _ in range(DP)] if d == 0 else None
    dist.gather(torch.full((1,), base), glist, dst=rank(t, 0, p), group=dp)
    if glist is not None:
        res["dp_gather"] = torch.cat(glist)
    sc = torch.empty(1)
    dist.scatter(sc, [torch.full((1,), base + j) for j in range(2)] if t == 0 else None, src=rank(0, d, p), group=tp)
    res["tp_scatter"] = sc
    objs = [None] * w
    dist.all_gather_object(objs, {"tp": t, "pp": p})
    res["world_objects"] = torch.tensor([o["tp"] * 10 + o["pp"] for o in objs])
    act = torch.full((3,), base)
    if p > 0:
        dist.recv(act, src=rank(t, d, p - 1), group=pp)
    if p < 3:
        dist.send(act * 2, dst=rank(t, d, p + 1), group=pp)
    res["pp_recv"] = act
    dist.barrier()
out_dir.mkdir(parents=True, exist_ok=True)
torch.save(res, out_dir / f"rank-{r}.pt")
dist.destroy_process_group()
