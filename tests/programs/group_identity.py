"""Every way torch makes process groups, with one all_reduce on each, on 4 ranks; writes OUT/rank-R.txt.

torch names groups by a counter (or a hash of the ranks), so different groups may share a name on
different ranks; the same lines must come out under prism as under torchrun with gloo.
With ``--beyond-gloo``, also patterns gloo itself cannot run twice in one job, because its
rendezvous keys are the group's name (the test checks their sums): disjoint groups that only
their members make under one counter name, and a hashed name made again after a destroy.
"""

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(sys.argv[1])
beyond_gloo = "--beyond-gloo" in sys.argv
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 4, world
lines = []


def total(group, value=None) -> int:
    """Sum of (global rank + 1) over the group's members, computed by the group."""
    t = torch.tensor([rank + 1 if value is None else value], dtype=torch.int64)
    dist.all_reduce(t, group=group)
    return int(t.item())


def note(what: str, group) -> None:
    lines.append(f"{what}: ranks={dist.get_process_group_ranks(group)} sum={total(group)}")


# every rank makes a group of itself alone (Megatron's FSDP adapter): one name, four groups
note("self", dist.new_group(ranks=[rank]))

# every rank makes every group (the documented way), then uses its own
pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
note("pairs", pairs[rank // 2])

# members only, torch's hashed names (use_local_synchronization)
mine = [0, 1] if rank < 2 else [2, 3]
note("local_sync", dist.new_group(mine, use_local_synchronization=True))
if rank in (0, 3):  # a group that only its two members create
    note("local_sync_some", dist.new_group([0, 3], use_local_synchronization=True))


sub, _ = dist.new_subgroups(group_size=2)
note("new_subgroups", sub)
sub, _ = dist.new_subgroups_by_enumeration([[0, 3], [1, 2]])
note("new_subgroups_by_enumeration", sub)

mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
note("mesh_dp", mesh.get_group("dp"))
note("mesh_tp", mesh.get_group("tp"))

try:  # torch splits only on an accelerator, from a default group bound to a device
    dist.split_group(split_ranks=[[0, 1], [2, 3]])
    lines.append("split_group: made")
except RuntimeError as e:
    lines.append(f"split_group: RuntimeError {'accelerator' if 'device' in str(e) else str(e)}")

# test after test in one process (Megatron's unit tests): groups made, used, destroyed, made again
for size in (2, 4, 1, 2):
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, world, size)]
    note(f"round{size}", groups[rank // size])
    for g in groups:
        if rank in dist.get_process_group_ranks(g):
            dist.destroy_process_group(g)

if beyond_gloo:
    # ranks 0 and 2 make [0, 2], 1 and 3 make [1, 3]: one counter name, two groups
    note("members_only", dist.new_group([0, 2] if rank % 2 == 0 else [1, 3]))
    # a hashed name comes back once its group is destroyed: the same name, a new incarnation
    # (torch hashes the ranks with the number of groups the rank holds: 0 and 3 hold as many, so do 1 and 2)
    names = []
    for i in range(2):
        g = dist.new_group([0, 3] if rank in (0, 3) else [1, 2], use_local_synchronization=True)
        names.append(g.group_name)
        lines.append(f"remade{i}: sum={total(g, 10 * i + rank)}")
        dist.destroy_process_group(g)
    lines.append(f"remade_same_name: {names[0] == names[1]}")

# the whole world destroyed and made again: torch's counter restarts, names repeat with other members
# (a fresh store prefix: gloo's rendezvous keys are the names, which now repeat)
dist.destroy_process_group()
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
dist.init_process_group("gloo", store=dist.PrefixStore("epoch2", store), rank=rank, world_size=world)
note("epoch2_world", dist.group.WORLD)
note("epoch2_self", dist.new_group(ranks=[rank]))
note("epoch2_pairs", [dist.new_group([0, 3]), dist.new_group([1, 2])][0 if rank in (0, 3) else 1])
dist.destroy_process_group()
(out / f"rank-{rank}.txt").write_text("\n".join(lines) + "\n")
