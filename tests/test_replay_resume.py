"""A replay that goes on where it stopped when its graph grows by whole iterations (the live prediction)."""

from __future__ import annotations

import random

import pytest

from prism_megatron.replay import Comm, DeadlockError, Graph, GraphBuilder, Mark, replay
from prism_megatron.replay.engine import ResumableReplay


def _pipeline_iteration(gb: GraphBuilder, n: int, rng: random.Random) -> None:
    """Iteration ``n`` of two pipeline stages (0 -> 1, then the gradient back) and a data-parallel all_reduce
    between ranks 0 and 2 (stage 0's replicas; rank 3 mirrors rank 1), two clocks, uneven times."""
    for r in range(4):
        gb.mark(r, "iteration", "B", iteration=n)
    for first, second in ((0, 1), (2, 3)):
        gb.compute(first, rng.uniform(0.1, 0.3), "forward", gpu=rng.uniform(0.1, 0.4))
        gb.send(first, second, 10 + first, 64, label="send_forward")
        gb.recv(second, first, 10 + first, 64, label="recv_forward")
        gb.compute(second, rng.uniform(0.1, 0.3), "forward-backward", gpu=rng.uniform(0.2, 0.6))
        gb.send(second, first, 10 + first, 64, label="send_backward")
        gb.recv(first, second, 10 + first, 64, label="recv_backward")
        gb.compute(first, rng.uniform(0.05, 0.2), "backward", gpu=rng.uniform(0.1, 0.3))
    for dp, members in ((20, (0, 2)), (21, (1, 3))):
        for r in members:
            handle = gb.collective(r, "all_reduce", dp, 1 << 20, async_op=True, label="grads")
            gb.compute(r, rng.uniform(0.01, 0.05), "other", gpu=0.01)
            gb.wait(r, handle)
    for r in range(4):
        gb.cpu_sync(r)
        gb.mark(r, "iteration", "E")


def _grown(iterations: int, seed: int = 0) -> list:
    """The graphs of the first 1, 2, ... ``iterations`` iterations of one job."""
    rng, gb = random.Random(seed), GraphBuilder()
    for pair in (0, 2):
        gb.group(10 + pair, [pair, pair + 1], f"pp{pair}")
    gb.group(20, [0, 2], "dp0")
    gb.group(21, [1, 3], "dp1")
    graphs = []
    for n in range(1, iterations + 1):
        _pipeline_iteration(gb, n, rng)
        graphs.append(gb.build())
    return graphs


def test_each_grown_graph_goes_on_from_the_last_and_gives_the_times_of_a_replay_from_the_start():
    resumable = ResumableReplay()
    for k, graph in enumerate(_grown(6), 1):
        got = resumable.iterations(graph)
        assert resumable.resumed == (k > 1)
        full = replay(graph).iterations()
        assert [(it.number, it.start, it.end, it.time) for it in got] == \
               [(it.number, it.start, it.end, it.time) for it in full]
    assert [it.number for it in got] == [1, 2, 3, 4, 5, 6] and all(it.time > 0 for it in got)


def test_a_graph_whose_earlier_events_changed_is_replayed_from_the_start():
    resumable = ResumableReplay()
    resumable.iterations(_grown(3, seed=1)[1])
    other = _grown(3, seed=2)[2]  # a third iteration, but the first two's times differ
    got = resumable.iterations(other)
    assert not resumable.resumed
    assert [it.time for it in got] == [it.time for it in replay(other).iterations()]


def test_a_grown_graph_that_deadlocks_raises_as_a_replay_from_the_start_does():
    graphs = _grown(2)
    resumable = ResumableReplay()
    resumable.iterations(graphs[0])
    stuck = Graph(graphs[1].groups, {r: list(evs) for r, evs in graphs[1].events.items()})
    stuck.events[0].append(Comm("recv", 10, 99, 1))  # no send ever matches it
    with pytest.raises(DeadlockError, match="rank 0 event"):
        resumable.iterations(stuck)
    assert resumable.iterations(graphs[0])[-1].time == replay(graphs[0]).iterations()[-1].time


def test_a_marker_whose_attributes_changed_is_a_change_though_markers_compare_equal_without_them():
    first, second = _grown(2, seed=3)
    resumable = ResumableReplay()
    resumable.iterations(first)
    renumbered = Graph(second.groups, {r: list(evs) for r, evs in second.events.items()})
    for evs in renumbered.events.values():
        evs[0] = Mark("iteration", "B", {"iteration": 7})
    got = resumable.iterations(renumbered)
    assert not resumable.resumed and [it.number for it in got] == [2, 7]
