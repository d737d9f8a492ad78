"""Rank 0's shared-memory segments are unlinked by something outside the job (a cleanup of /dev/shm)
while the job runs. ``after``: once the coordinator holds rank 0's all_reduce, which waits for rank 1:
the job must still compute the sum. ``before``: before rank 0's first op names them: a clear error."""
import os
import sys

import torch
import torch.distributed as dist


def own_segments() -> list[str]:
    """The shared-memory files this process maps (its staging segments), as an outside cleanup finds them."""
    with open("/proc/self/maps") as maps:
        return sorted({line.split()[-1] for line in maps if "/dev/shm/prism-" in line})


when = sys.argv[1]
dist.init_process_group("gloo")
r = dist.get_rank()
pair = dist.new_group([0, 1])  # same members, another group: orders the two ranks around the cleanup
big = torch.full((1 << 16,), float(r + 1))  # 256 KiB: staged through shared memory, not inlined
if r == 0:
    if when == "before":
        for path in own_segments():
            os.unlink(path)
    work = dist.all_reduce(big, async_op=True)
    dist.barrier(group=pair)  # rank 1 is past it once the coordinator took the all_reduce (one connection, in order)
    if when == "after":
        paths = own_segments()
        assert paths, "no staging segment mapped"
        for path in paths:
            os.unlink(path)
    dist.barrier(group=pair)
    work.wait()
else:
    dist.barrier(group=pair)
    dist.barrier(group=pair)
    dist.all_reduce(big)
assert torch.equal(big, torch.full_like(big, 3.0)), big[:4]
dist.destroy_process_group()
