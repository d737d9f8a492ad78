"""nccl_prune's executor over a real communicator (gloo, CPU): one spawn of five processes, each playing
one group position, runs many ops three ways and compares them at every live position:
the pruned op over a process group of the live members only (dist_executor), the host executor, and
the full op by gloo over all five members where virtual members hold their mirror's inputs."""

from __future__ import annotations

import datetime
import os
import random
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nccl_prune import PruneError, execute, plan_group
from nccl_prune.dist_executor import PrunedGroup
from tests.nccl_prune_cases import a2a_full_pieces, assert_reduced_close, ops_for, random_tensor

N = 5
# (group ranks in a world of 64, virtual rank -> its rep)
PLANS = [
    ([10, 20, 30, 40, 50], {10: 30, 20: 30, 40: 30, 50: 30}),  # one live member in the middle: A2A by shift
    ([0, 1, 2, 3, 4], {1: 0, 3: 2, 4: 0}),  # multiplicities 3 and 2
    ([7, 3, 5, 1, 9], {7: 9, 5: 3, 1: 9}),  # live positions 1 and 4, mirrors out of order
    ([0, 1, 2, 3, 4], {}),  # no virtual member
]
DTYPES = (torch.float32, torch.bfloat16, torch.int32, torch.uint8, torch.bool)
#: ops gloo runs over the full group with the same meaning (premul_sum: SUM of pre-multiplied inputs)
_GLOO = {"sum": "SUM", "min": "MIN", "max": "MAX", "product": "PRODUCT", "band": "BAND", "bor": "BOR",
         "bxor": "BXOR", "premul_sum": "SUM"}


def _plan(ranks, virt):
    rep = list(range(64))
    for r, m in virt.items():
        rep[r] = m
    return plan_group(ranks, rep)


class _Case:
    """One op's inputs for every live position, the same in every process (seeded)."""

    def __init__(self, plan, seed: int):
        self.plan = plan
        self.g = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)

    def per_live(self, make):
        return {p: make(self.g) for p in self.plan.live_positions}


def _full_reduce(x: torch.Tensor, op: str, factor):
    """The full op over the world by gloo (None where gloo has no op of the same meaning)."""
    if x.dtype == torch.bool or op not in _GLOO:  # bool: gloo's SUM/PRODUCT are not the runtime's OR/AND
        return None
    y = x * factor if op == "premul_sum" else x.clone()
    dist.all_reduce(y, op=getattr(dist.ReduceOp, _GLOO[op]))
    return y


def _reductions(plan, pg, me, seed):
    n = plan.size
    live = plan.live_positions
    for dtype in DTYPES:
        for op in ops_for(dtype):
            seed += 1
            c = _Case(plan, seed)
            factor = 0.75 if op == "premul_sum" else None
            ins = c.per_live(lambda g, op=op, dtype=dtype: [random_tensor(g, (2, 3), dtype, op),
                                                           random_tensor(g, (n * 2,), dtype, op)])
            mine = [t.clone() for t in ins[plan.mirror[me]]]
            full = [_full_reduce(t, op, factor) for t in mine]
            host = execute("all_reduce", plan, ins, op=op, factor=factor)
            rs_host = execute("reduce_scatter", plan, {p: [v[1]] for p, v in ins.items()}, op=op, factor=factor)
            what = f"plan {plan.ranks} {op} {dtype}"
            if me in live:
                pruned = [t.clone() for t in ins[me]]
                PrunedGroup(plan, pg, me).all_reduce(pruned, op, factor)
                for j in range(2):
                    terms = [ins[plan.mirror[q]][j] for q in range(n)]
                    assert_reduced_close(pruned[j].reshape(-1), host[me][j].reshape(-1), terms, op, factor, what)
                    if full[j] is not None:
                        assert_reduced_close(full[j].reshape(-1), host[me][j].reshape(-1), terms, op, factor,
                                             what + " full")
                out = torch.empty(2, dtype=dtype)
                PrunedGroup(plan, pg, me).reduce_scatter_tensor(out, ins[me][1], op, factor)
                terms = [ins[plan.mirror[q]][1][2 * me:2 * me + 2] for q in range(n)]
                assert_reduced_close(out, rs_host[me][0], terms, op, factor, what + " reduce_scatter")
                for root in (0, 1):
                    t = ins[me][0].clone()
                    PrunedGroup(plan, pg, me).reduce(t, root, op, factor)
                    want = host[me][0].reshape(2, 3) if me == root else ins[me][0]
                    terms = [ins[plan.mirror[q]][0] for q in range(n)]
                    assert_reduced_close(t, want, terms, op, factor, what + f" reduce to {root}")
    return seed


def _data_movement(plan, pg, me, seed):
    n = plan.size
    live = plan.live_positions
    is_live = me in live
    pg_me = PrunedGroup(plan, pg, me) if is_live else None
    for dtype in (torch.bfloat16, torch.int64, torch.bool):
        seed += 1
        c = _Case(plan, seed)
        ins = c.per_live(lambda g, dtype=dtype: [random_tensor(g, (3,), dtype)])
        host = execute("all_gather", plan, ins)
        full = [torch.empty(3, dtype=dtype) for _ in range(n)]
        dist.all_gather(full, ins[plan.mirror[me]][0])
        if is_live:
            out = torch.empty(3 * n, dtype=dtype)
            pg_me.all_gather_into_tensor(out, ins[me][0])
            assert torch.equal(out, host[me][0]) and torch.equal(torch.cat(full), out)
            lst = [torch.empty(3, dtype=dtype) for _ in range(n)]
            pg_me.all_gather(lst, ins[me][0])
            assert torch.equal(torch.cat(lst), out)
            # in place: the input is this member's chunk of a buffer of stale values; virtual chunks keep them
            stale = {p: random_tensor(c.g, (3 * n,), dtype) for p in live}
            buf = stale[me].clone()
            buf[3 * me:3 * me + 3] = ins[me][0]
            pg_me.all_gather_into_tensor(buf, buf[3 * me:3 * me + 3])
            cur = {p: [stale[p].clone()] for p in live}
            for p in live:
                cur[p][0][3 * p:3 * p + 3] = ins[p][0]
            kept = execute("all_gather", plan, {p: [cur[p][0][3 * p:3 * p + 3]] for p in live}, in_place=True,
                           current=cur)
            assert torch.equal(buf, kept[me][0])
            for q in plan.virtual_positions:
                assert torch.equal(buf[3 * q:3 * q + 3], stale[me][3 * q:3 * q + 3])
        # gather to a live and (where there is one) a virtual root
        for root in (live[0], 0):
            gl = [torch.empty(3, dtype=dtype) for _ in range(n)] if me == root else None
            dist.gather(ins[plan.mirror[me]][0].clone(), gl, dst=root)
            if is_live:
                mine = [torch.zeros(3, dtype=dtype) for _ in range(n)] if me == root else None
                pg_me.gather(ins[me][0], mine, root)
                if me == root and plan.is_live(root):
                    hg = execute("gather", plan, ins, root=root)[me]
                    assert all(torch.equal(a, b) and torch.equal(a, f) for a, b, f in zip(mine, hg, gl, strict=True))
        # broadcast from every position: a virtual root sends its mirror's buffer
        for root in range(n):
            t = ins[plan.mirror[me]][0].clone()
            dist.broadcast(t, src=root)
            if is_live:
                b = ins[me][0].clone()
                pg_me.broadcast(b, root)
                hb = execute("broadcast", plan, {p: ins[p] for p in live}, root=root)[me]
                assert torch.equal(b, t) and (me == root or torch.equal(b, hb[0]))
        # scatter from a live root
        root = live[-1]
        pieces = [random_tensor(_Case(plan, seed + 1000).g, (2,), dtype) for _ in range(n)]
        t = torch.empty(2, dtype=dtype)
        dist.scatter(t, pieces if me == root else None, src=root)
        if is_live:
            s = torch.empty(2, dtype=dtype)
            pg_me.scatter(s, pieces if me == root else None, root)
            assert torch.equal(s, t) and torch.equal(s, pieces[me])
    return seed


def _exchanges(plan, pg, me, seed):
    n = plan.size
    live = plan.live_positions
    for trial in range(4):
        seed += 1
        c = _Case(plan, seed)
        splits = {p: [c.rng.randint(0, 3) for _ in range(n)] for p in live}
        pieces = {p: [torch.randint(0, 1 << 20, (s, 2), generator=c.g) for s in splits[p]] for p in live}
        full = a2a_full_pieces(plan, pieces)  # every member's pieces, rows of 2
        sizes_in = [t.shape[0] for t in full[me]]
        sizes_out = [full[q][me].shape[0] for q in range(n)]
        out_full = torch.empty(sum(sizes_out), 2, dtype=torch.int64)
        dist.all_to_all_single(out_full, torch.cat(full[me]), sizes_out, sizes_in)
        if me in live:
            flat = {p: [torch.cat(pieces[p]).reshape(-1)] for p in live}
            host = execute("all_to_all", plan, flat, in_splits={p: [2 * s for s in splits[p]] for p in live})[me]
            out = torch.empty_like(out_full)
            PrunedGroup(plan, pg, me).all_to_all_single(out, torch.cat(pieces[me]), sizes_out, splits[me])
            assert torch.equal(out, out_full) and torch.equal(out.reshape(-1), host[0]), (plan.ranks, trial)
            outs = [torch.empty(s, 2, dtype=torch.int64) for s in sizes_out]
            PrunedGroup(plan, pg, me).all_to_all(outs, pieces[me])
            assert torch.equal(torch.cat(outs), out_full)
    if len(live) == 1:  # a member that expects other sizes than it is sent: an error, no one left waiting
        wrong = torch.empty(n + 1, 2, dtype=torch.int64)
        if me in live:
            with pytest.raises(PruneError, match="expects 32 bytes from rank"):
                PrunedGroup(plan, pg, me).all_to_all_single(wrong, torch.zeros(n, 2, dtype=torch.int64),
                                                            [2] + [1] * (n - 1), [1] * n)
    return seed


def _misc(plan, pg, me):
    live = plan.live_positions
    objs = [None] * plan.size
    dist.all_gather_object(objs, {"pos": plan.mirror[me], "x": [plan.mirror[me]] * 3})
    if me not in live:
        return
    p = PrunedGroup(plan, pg, me)
    assert p.all_gather_object({"pos": me, "x": [me] * 3}) == objs
    lst = [{"from": me}]
    p.broadcast_object_list(lst, plan.size - 1)
    assert lst == [{"from": plan.mirror[plan.size - 1]}]
    p.barrier()
    if len(live) >= 2:
        a, b = live[0], live[1]
        t = torch.arange(4.0) if me == a else torch.zeros(4)
        if me == a:
            p.send(t, b)
        elif me == b:
            p.recv(t, a)
            assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    if plan.virtual_positions:
        with pytest.raises(PruneError, match="is virtual"):
            p.send(torch.zeros(1), plan.virtual_positions[0])


def _worker(me: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=me, world_size=N,
                            timeout=datetime.timedelta(seconds=60))
    plans = [_plan(r, v) for r, v in PLANS]
    groups = [dist.new_group(list(plan.live_positions)) for plan in plans]  # every process, same order
    seed = 0
    for plan, pg in zip(plans, groups, strict=True):
        seed = _reductions(plan, pg, me, seed)
        seed = _data_movement(plan, pg, me, seed)
        seed = _exchanges(plan, pg, me, seed)
        _misc(plan, pg, me)
    dist.barrier()
    dist.destroy_process_group()


def test_pruned_ops_over_gloo_equal_host_executor_and_full_op():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.start_processes(_worker, args=(port,), nprocs=N, start_method="fork")
