"""8 ranks as TP2·PP2·DP2 in Megatron's rank order (rank = tp + 2 * (dp + 2 * pp)): a symmetric job.

Every rank creates every group (as Megatron's initialize_model_parallel does). Per iteration, stage
0 computes, all-reduces over its TP pair and sends to stage 1, which receives, computes and sends a
gradient back; both end with a data-parallel all-reduce (across replicas) and a model-parallel one
(inside the replica). Data-parallel replicas do the same work: the job folds to replica 0.
"""
import sys

import torch
import torch.distributed as dist

from prism_megatron.trace import span

iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2
dist.init_process_group("nccl")
r = dist.get_rank()
assert dist.get_world_size() == 8, "tp_pp_dp.py runs with 8 ranks"
t, d, p = r % 2, (r // 2) % 2, r // 4
rank = lambda t, d, p: t + 2 * (d + 2 * p)  # noqa: E731
tp = {(dd, pp): dist.new_group([rank(0, dd, pp), rank(1, dd, pp)]) for pp in range(2) for dd in range(2)}[(d, p)]
dp = {(tt, pp): dist.new_group([rank(tt, 0, pp), rank(tt, 1, pp)]) for pp in range(2) for tt in range(2)}[(t, p)]
pp = {(tt, dd): dist.new_group([rank(tt, dd, 0), rank(tt, dd, 1)]) for dd in range(2) for tt in range(2)}[(t, d)]
mp = {dd: dist.new_group([rank(tt, dd, q) for q in range(2) for tt in range(2)]) for dd in range(2)}[d]
act = torch.ones(256, 256)
grad = torch.ones(1024)
for it in range(iters):
    with span("iteration", iteration=it):
        if p == 1:
            dist.recv(act, src=rank(t, d, 0), group=pp)
        x = act @ act
        dist.all_reduce(x, group=tp)
        if p == 0:
            dist.send(x, dst=rank(t, d, 1), group=pp)
            dist.recv(act, src=rank(t, d, 1), group=pp)
        else:
            y = x @ x
            dist.send(y, dst=rank(t, d, 0), group=pp)
        dist.all_reduce(grad, group=dp)
        dist.all_reduce(grad[:1], group=mp)
dist.destroy_process_group()
