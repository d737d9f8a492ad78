"""Every op the prism backend supports, on deterministic inputs; saves each rank's results.

Run under real gloo (torchrun, W processes) and under prism; the tests compare the files.
Ops gloo lacks (AVG, PREMUL_SUM) store an exact reference computed here instead, under gloo only.
Usage: op_matrix.py OUT_DIR [cuda]; OP_MATRIX_EVEN_ONLY=1 leaves out the uneven all_to_all_single (its split
sizes are not in a PrismTrace, so calibration's virtual ranks cannot replay it: tests/test_slice_run.py).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

out_dir = sys.argv[1]
device = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cpu")
dist.init_process_group("gloo")
R, W = dist.get_rank(), dist.get_world_size()
prism = os.environ.get("PRISM_EMULATED") == "1"
res: dict[str, torch.Tensor] = {}


def inp(n=6, dtype=torch.float32, rank=None, salt=0):
    r = R if rank is None else rank
    base = torch.arange(n, dtype=torch.float64) * 0.37 + r * 1.3 + salt + 1
    return base.to(dtype).to(device)


def save(key, t):
    res[key] = t.detach().cpu().clone()


for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
    for op in ("SUM", "MIN", "MAX", "PRODUCT"):
        if dtype == torch.bfloat16 and op == "PRODUCT":
            continue
        t = inp(5, dtype)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        save(f"all_reduce/{op}/{dtype}", t)
# AVG and PREMUL_SUM: NCCL-only ops; under gloo store the exact reference
t = inp(5)
if prism:
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
else:
    t = sum(inp(5, rank=r) for r in range(W)) / W
save("all_reduce/AVG", t)
t = inp(5)
if prism:
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.25))
else:
    t = sum(inp(5, rank=r) * 0.25 for r in range(W))
save("all_reduce/PREMUL_SUM", t)

# big (shared-memory path) and async
big = inp(300_000)
work = dist.all_reduce(big, async_op=True)
work.wait()
save("all_reduce/big_async", big)
fut_t = inp(7)
fut = dist.all_reduce(fut_t, async_op=True).get_future()
fut.wait()
save("all_reduce/future", fut.value()[0])

# coalesced forms (what Megatron's DDP and distributed optimizer use)
a, b = inp(4), inp(300, salt=1)
with dist._coalescing_manager(async_ops=True) as cm:
    dist.all_reduce(a)
    dist.all_reduce(b)
cm.wait()
save("coalesced/all_reduce/a", a)
save("coalesced/all_reduce/b", b)
outs = [torch.empty(W * 3, device=device), torch.empty(W * 50_000, device=device)]
with dist._coalescing_manager(async_ops=True) as cm:
    dist.all_gather_into_tensor(outs[0], inp(3))
    dist.all_gather_into_tensor(outs[1], inp(50_000, salt=2))
cm.wait()
save("coalesced/all_gather/0", outs[0])
save("coalesced/all_gather/1", outs[1])
rs_outs = [torch.empty(2, device=device), torch.empty(5000, device=device)]
with dist._coalescing_manager(async_ops=True) as cm:
    dist.reduce_scatter_tensor(rs_outs[0], inp(2 * W))
    dist.reduce_scatter_tensor(rs_outs[1], inp(5000 * W, salt=3))
cm.wait()
save("coalesced/reduce_scatter/0", rs_outs[0])
save("coalesced/reduce_scatter/1", rs_outs[1])

# gathers and scatters
lst = [torch.empty(4, device=device) for _ in range(W)]
dist.all_gather(lst, inp(4))
save("all_gather/list", torch.stack(lst))
flat = torch.empty(W * 4, device=device)
dist.all_gather_into_tensor(flat, inp(4))
save("all_gather/into_tensor", flat)
o = torch.empty(3, device=device)
dist.reduce_scatter_tensor(o, inp(3 * W))
save("reduce_scatter/tensor", o)
o = torch.empty(3, device=device)
dist.reduce_scatter(o, [inp(3, salt=j) for j in range(W)])
save("reduce_scatter/list", o)
t = inp(6) if R == 3 % W else torch.zeros(6, device=device)
dist.broadcast(t, src=3 % W)
save("broadcast", t)
t = inp(6)
dist.reduce(t, dst=2 % W)
if R == 2 % W:
    save("reduce", t)
g = [torch.empty(6, device=device) for _ in range(W)] if R == 1 % W else None
dist.gather(inp(6), g, dst=1 % W)
if R == 1 % W:
    save("gather", torch.stack(g))
o = torch.empty(6, device=device)
dist.scatter(o, [inp(6, salt=j) for j in range(W)] if R == 5 % W else None, src=5 % W)
save("scatter", o)

# all-to-all, even and uneven
outs = [torch.empty(3, device=device) for _ in range(W)]
try:
    dist.all_to_all(outs, [inp(3, salt=j) for j in range(W)])
except RuntimeError as e:  # gloo of torch < 2.13 lacks the list form: store the exact reference
    if prism or "does not support" not in str(e):
        raise
    outs = [inp(3, rank=j, salt=R) for j in range(W)]
save("all_to_all/list", torch.stack(outs))
o = torch.empty(2 * W, device=device)
dist.all_to_all_single(o, inp(2 * W))
save("all_to_all_single/even", o)
if os.environ.get("OP_MATRIX_EVEN_ONLY") != "1":
    in_splits = [(R + j) % 3 + 1 for j in range(W)]  # rank R sends (R+j)%3+1 rows to j
    out_splits = [(j + R) % 3 + 1 for j in range(W)]  # and receives (j+R)%3+1 rows from j
    x = inp(sum(in_splits) * 4).reshape(-1, 4)
    o = torch.empty(sum(out_splits), 4, device=device)
    dist.all_to_all_single(o, x, out_splits, in_splits)
    save("all_to_all_single/uneven", o)
    x = inp(sum(in_splits) * 4096).reshape(-1, 4096)  # big: shared memory
    o = torch.empty(sum(out_splits), 4096, device=device)
    dist.all_to_all_single(o, x, out_splits, in_splits)
    save("all_to_all_single/uneven_big", o)

# point to point
nxt, prv = (R + 1) % W, (R - 1) % W
recv_t = torch.empty(5, device=device)
if R % 2 == 0:
    dist.send(inp(5), nxt)
    dist.recv(recv_t, prv)
else:
    dist.recv(recv_t, prv)
    dist.send(inp(5), nxt)
save("p2p/sync_ring", recv_t)
r1 = torch.empty(70_000, device=device)
reqs = [dist.isend(inp(70_000), nxt), dist.irecv(r1, prv)]
for q in reqs:
    q.wait()
save("p2p/async_ring_big", r1)
fwd, bwd = torch.empty(4, device=device), torch.empty(4, device=device)
ops = [dist.P2POp(dist.isend, inp(4, salt=1), nxt), dist.P2POp(dist.irecv, fwd, prv),
       dist.P2POp(dist.isend, inp(4, salt=2), prv), dist.P2POp(dist.irecv, bwd, nxt)]
for q in dist.batch_isend_irecv(ops):
    q.wait()
save("p2p/batch_fwd", fwd)
save("p2p/batch_bwd", bwd)
if R == 0:
    got = []
    for _ in range(W - 1):
        t = torch.empty(3, device=device)
        src = dist.recv(t)
        got.append((src, t))
    got.sort(key=lambda x: x[0])
    save("p2p/any_source", torch.stack([t for _, t in got]))
    save("p2p/any_source_srcs", torch.tensor([s for s, _ in got]))
else:
    dist.send(inp(3), 0)

# subgroups
evens, odds = dist.new_group(list(range(0, W, 2))), dist.new_group(list(range(1, W, 2)))
mine = evens if R % 2 == 0 else odds
t = inp(4)
dist.all_reduce(t, group=mine)
save("group/parity_sum", t)
gl = dist.new_group(list(range(W)), backend="gloo")
t = inp(4)
dist.all_reduce(t, group=gl, op=dist.ReduceOp.MAX)
save("group/gloo_max", t)
pair = [R - R % 2, R - R % 2 + 1]
pg = dist.new_group(pair, use_local_synchronization=True)
t = inp(3)
dist.all_reduce(t, group=pg)
save("group/local_sync_pair", t)
t = torch.empty(3, device=device)
dist.broadcast(t if R % 2 else inp(3), src=pair[0], group=pg)
save("group/pair_broadcast", t if R % 2 else inp(3))

# groups of one (Megatron's data-parallel group when DP = 1): under prism the rank computes the result
# itself, nothing staged; under gloo, the same ops on one process
solo = [dist.new_group([r]) for r in range(W)][R]
for op in ("SUM", "MAX"):
    t = inp(5, salt=9)
    dist.all_reduce(t, group=solo, op=getattr(dist.ReduceOp, op))
    save(f"solo/all_reduce/{op}", t)
t = inp(5)
if prism:
    dist.all_reduce(t, group=solo, op=dist._make_nccl_premul_sum(0.25))
    u = inp(5, dtype=torch.int64)
    dist.all_reduce(u, group=solo, op=dist.ReduceOp.AVG)
else:
    t, u = t * 0.25, inp(5, dtype=torch.int64)
save("solo/all_reduce/PREMUL_SUM", t)
save("solo/all_reduce/AVG_int", u)
big = inp(300_000, salt=1)
dist.all_reduce(big, group=solo, async_op=True).wait()
save("solo/all_reduce/big_async", big)
flat = torch.empty(4, device=device)
dist.all_gather_into_tensor(flat, inp(4, salt=2), group=solo)
save("solo/all_gather/into_tensor", flat)
lst = [torch.empty(4, device=device)]
dist.all_gather(lst, inp(4, salt=3), group=solo)
save("solo/all_gather/list", lst[0])
o = torch.empty(3, device=device)
dist.reduce_scatter_tensor(o, inp(3, salt=4), group=solo)
save("solo/reduce_scatter/tensor", o)
t = inp(6, salt=5)
dist.broadcast(t, src=R, group=solo)
save("solo/broadcast", t)
t = inp(6, salt=6)
dist.reduce(t, dst=R, group=solo)
save("solo/reduce", t)
g = [torch.empty(6, device=device)]
dist.gather(inp(6, salt=7), g, dst=R, group=solo)
save("solo/gather", g[0])
o = torch.empty(6, device=device)
dist.scatter(o, [inp(6, salt=8)], src=R, group=solo)
save("solo/scatter", o)
o = torch.empty(2, device=device, dtype=torch.bfloat16)
dist.all_to_all_single(o, inp(2, dtype=torch.bfloat16, salt=9), group=solo)
save("solo/all_to_all_single", o)
dist.barrier(group=solo)

# functional collectives
t = funcol.all_reduce(inp(4), "sum", dist.group.WORLD)
save("funcol/all_reduce", funcol.wait_tensor(t) if hasattr(funcol, "wait_tensor") else t)
t = funcol.all_gather_tensor(inp(2), 0, dist.group.WORLD)
save("funcol/all_gather", t.wait() if hasattr(t, "wait") else t)

dist.barrier()
os.makedirs(out_dir, exist_ok=True)
torch.save(res, os.path.join(out_dir, f"rank-{R}.pt"))
dist.barrier()
dist.destroy_process_group()
