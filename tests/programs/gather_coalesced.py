"""dist.all_gather_coalesced (deprecated by torch, still accepted on gloo) in every form gloo accepts:
synchronous and async, mixed shapes, empty tensors, complex, a subgroup, a group of one, and a call
gloo refuses. Saves each rank's results; run under real gloo (torchrun) and under prism, compared.
Usage: gather_coalesced.py OUT_DIR (3 ranks)."""

import os
import sys

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
dist.init_process_group("gloo")
R, W = dist.get_rank(), dist.get_world_size()
assert W == 3, "run with 3 ranks"
res: dict[str, torch.Tensor] = {}


def inp(shape, rank, salt=0, dtype=torch.float32):
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float64) * 0.5 + rank * 10 + salt).to(dtype).reshape(shape)


def gather(key, shapes, ranks, group=None, async_op=False, dtype=torch.float32):
    me = ranks.index(R)
    ins = [inp(s, R, j, dtype) for j, s in enumerate(shapes)]
    outs = [[torch.full(s, -1, dtype=dtype) for s in shapes] for _ in ranks]
    got = dist.all_gather_coalesced(outs, ins, group=group, async_op=async_op)
    if async_op:
        got.wait()
    for r, lst in enumerate(outs):
        for j, t in enumerate(lst):
            res[f"{key}/{r}/{j}"] = t.clone()
    res[f"{key}/input"] = torch.cat([x.reshape(-1) for x in ins]).clone()  # inputs are left as they were
    assert me >= 0


everyone = list(range(W))
gather("mixed", [[1], [2, 2], [3, 3, 3]], everyone)
gather("async_empty", [[2, 2], [0], [3], [0]], everyone, async_op=True)
gather("big_int", [[100_000], [7]], everyone, dtype=torch.int64)
pair = dist.new_group([0, 2])
if R in (0, 2):
    gather("pair_complex", [[2], [3, 1]], [0, 2], group=pair, dtype=torch.complex64)
alone = dist.new_group([1])
if R == 1:
    gather("alone", [[4], [2, 3]], [1], group=alone)
try:  # two output lists for a group of three: gloo refuses it, so must prism
    dist.all_gather_coalesced([[torch.zeros(2)] for _ in range(2)], [torch.zeros(2)])
    res["refused"] = torch.tensor(0)
except (RuntimeError, ValueError):
    res["refused"] = torch.tensor(1)
dist.barrier()
os.makedirs(out_dir, exist_ok=True)
torch.save(res, os.path.join(out_dir, f"rank-{R}.pt"))
dist.destroy_process_group()
