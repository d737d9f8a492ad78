"""Random execution graphs for the replay's invariant tests (one clock, or two with GPU times)."""

from __future__ import annotations

import random

from prism_megatron.replay import GraphBuilder


def random_graph(seed: int, *, two_clock: bool = False) -> GraphBuilder:
    """2-5 ranks, a WORLD group and three random subgroups, 5-25 random steps: computes, collectives,
    sends/recvs (sync or async), waits; with ``two_clock`` computes get GPU times and CpuSyncs occur."""
    rng = random.Random(seed)
    n = rng.randint(2, 5)
    gb = GraphBuilder()
    groups = [gb.group(0, list(range(n)))]
    for gid in range(1, 4):
        groups.append(gb.group(gid, sorted(rng.sample(range(n), rng.randint(2, n)))))
    outstanding: dict[int, list[int]] = {r: [] for r in range(n)}
    times = [0.0, 0.25, 0.5, 1.0, 1.5, 3.0]
    for _ in range(rng.randint(5, 25)):
        roll = rng.random()
        if roll < 0.4:
            gpu = rng.choice([*times, None]) if two_clock else None
            gb.compute(rng.randrange(n), rng.choice(times), gpu=gpu)
        elif roll < 0.45 and two_clock:
            gb.cpu_sync(rng.randrange(n))
        elif roll < 0.7:
            g = gb.groups[rng.choice(groups)]
            asy = rng.random() < 0.3
            kind = rng.choice(["all_reduce", "all_gather"])
            for r in g.ranks:
                i = gb.collective(r, kind, g.id, rng.randint(1, 64), async_op=asy)
                if asy:
                    outstanding[r].append(i)
        elif roll < 0.9:
            src, dst = rng.sample(range(n), 2)
            asy = rng.random() < 0.5
            i = gb.send(src, dst, 0, rng.randint(1, 64), async_op=asy)
            j = gb.recv(dst, src, 0, rng.randint(1, 64), async_op=asy)
            if asy:
                outstanding[src].append(i)
                outstanding[dst].append(j)
        else:
            r = rng.randrange(n)
            if outstanding[r]:
                gb.wait(r, *outstanding[r])
                outstanding[r] = []
    for r in range(n):
        gb.compute(r, 0.25, gpu=0.5 if two_clock else None)
        if outstanding[r]:
            gb.wait(r, *outstanding[r])
    return gb
