"""Programs a fold cannot answer for, chosen by argv[1], on 4 ranks folded to ranks 0-1 (rep = r % 2).

p2p: rank 0 sends to rank 2, which is virtual (its representative is rank 0 itself) and not its
neighbour on the world group.
ring: rank 1 sends to its virtual neighbour 2 (a live rank downstream, 0, would receive it, so it is
kept), and rank 0 receives from its virtual neighbour 2 on the group [0, 2], where the only live rank
upstream is rank 0 itself.
uneven: ranks 0 and 1 (one class in the test's fold) issue different ops: rank 1 reduces once more
on the group [1, 3] (complete with its live member alone).
hang: rank 0 all-reduces once more on the world group, which rank 1 never joins.
"""
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
r = dist.get_rank()
evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
x = torch.ones(4)
dist.all_reduce(x)
if sys.argv[1] == "p2p":
    if r == 0:
        dist.send(x, dst=2)
    elif r == 2:
        dist.recv(x, src=0)
elif sys.argv[1] == "ring":
    if r == 1:
        dist.send(x, dst=2)
    dist.barrier()
    if r == 0:
        dist.recv(x, src=2, group=evens)
elif sys.argv[1] == "uneven" and r % 2 == 1:
    dist.all_reduce(x[:2], group=odds)
elif sys.argv[1] == "hang" and r == 0:
    dist.all_reduce(x)
dist.destroy_process_group()
