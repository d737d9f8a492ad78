"""Replay with two clocks per rank (host + device stream): hand-computed schedules and invariants."""

from __future__ import annotations

import pytest
from random_graphs import random_graph

from prism_megatron.replay import GraphBuilder, replay


def const(c: float):
    return lambda spec: c


def activity(res, rank):
    """(kind, label, start, end) of the rank's device timeline, without the comm-in-flight segments."""
    return [(s.kind, s.label, s.start, s.end) for s in res.segments[rank] if s.kind != "comm"]


def path(res):
    return [(s.kind, s.ranks, s.start, s.end) for s in res.critical_path]


def approx_rows(rows):
    return [(*row[:-2], pytest.approx(row[-2]), pytest.approx(row[-1])) for row in rows]


# ----------------------------------------------------------------------------- one clock is unchanged


def two_rank_all_reduce(gpu: bool) -> GraphBuilder:
    """Rank 0 computes 1, rank 1 computes 2, all_reduce, both compute 0.5; iteration markers around."""
    gb = GraphBuilder()
    gb.group(0, [0, 1])
    for r, c in ((0, 1.0), (1, 2.0)):
        gb.mark(r, "iteration", "B", iteration=1)
        gb.compute(r, c, "F", gpu=c if gpu else None)
        gb.collective(r, "all_reduce", 0, 8)
        gb.compute(r, 0.5, "B", gpu=0.5 if gpu else None)
        gb.mark(r, "iteration", "E", iteration=1)
    return gb


def test_without_gpu_times_one_clock_is_unchanged():
    res = replay(two_rank_all_reduce(gpu=False).build(), const(0.25))
    # all_reduce issued at 1 and 2, runs 2..2.25; both ranks then compute 2.25..2.75 and wait for it
    assert res.ops[("coll", 0, 0)].issue == {0: 1.0, 1: 2.0}
    assert res.makespan == 2.75 and res.rank_end == {0: 2.75, 1: 2.75}
    assert res.iteration_times() == [2.75]
    assert activity(res, 0) == [("compute", "F", 0.0, 1.0), ("bubble", "waiting for the op to start", 1.0, 2.0),
                                ("exposed_comm", "", 2.0, 2.25), ("compute", "B", 2.25, 2.75)]
    assert activity(res, 1) == [("compute", "F", 0.0, 2.0), ("exposed_comm", "", 2.0, 2.25),
                                ("compute", "B", 2.25, 2.75)]
    # the host waited for the all_reduce: the blocking op's times and the end marker are at 2.25 / 2.75
    assert res.event_times[0] == [(0.0, 0.0), (0.0, 1.0), (1.0, 2.25), (2.25, 2.75), (2.75, 2.75)]
    assert path(res) == [("compute", (1,), 0.0, 2.0), ("all_reduce", (0, 1), 2.0, 2.25),
                         ("compute", (0,), 2.25, 2.75)]


def test_same_graph_with_gpu_times_lets_the_host_run_ahead():
    res = replay(two_rank_all_reduce(gpu=True).build(), const(0.25))
    # the device does exactly what the one clock did ...
    assert res.makespan == 2.75 and res.rank_end == {0: 2.75, 1: 2.75}
    assert activity(res, 0) == [("compute", "F", 0.0, 1.0), ("bubble", "waiting for the op to start", 1.0, 2.0),
                                ("exposed_comm", "", 2.0, 2.25), ("compute", "B", 2.25, 2.75)]
    # ... but the host does not wait for the all_reduce: its end markers are at 1.5 and 2.5
    marks = sorted((m.rank, m.phase, m.t) for m in res.marks)
    assert marks == [(0, "B", 0.0), (0, "E", 1.5), (1, "B", 0.0), (1, "E", 2.5)]
    assert res.iteration_times() == [2.5]


# ----------------------------------------------------------------------------- host- and device-bound


def three_steps(c: float, g: float) -> GraphBuilder:
    """Both ranks: compute, all_reduce, compute, all_reduce, compute (synchronous all_reduces)."""
    gb = GraphBuilder()
    gb.group(0, [0, 1])
    for r in (0, 1):
        for k in range(3):
            gb.compute(r, c, f"C{k}", gpu=g)
            if k < 2:
                gb.collective(r, "all_reduce", 0, 8)
    return gb


def test_host_bound_rank_hides_communication():
    res = replay(three_steps(c=1.0, g=0.2).build(), const(0.1))
    # C0: device 0..0.2, ends when the host has issued it at 1.0; all_reduce 1.0..1.1 on the stream
    # C1: device from 1.1 busy until 1.3, host done at 2.0; all_reduce 2.0..2.1; C2: 2.1..2.3, host 3.0
    ar0, ar1 = res.ops[("coll", 0, 0)], res.ops[("coll", 0, 1)]
    assert (ar0.start, ar0.end) == (1.0, pytest.approx(1.1))
    assert (ar1.start, ar1.end) == (2.0, pytest.approx(2.1))
    assert res.makespan == 3.0  # 3 x host time: both all_reduces hidden (one clock: 3.2)
    assert replay(three_steps(c=1.0, g=None).build(), const(0.1)).makespan == pytest.approx(3.2)
    # the stream waits for each all_reduce, but the device would have waited for the host instead: the
    # waits are the host's ("host"), so the breakdown's exposed communication agrees with the path's
    assert activity(res, 0) == approx_rows([
        ("compute", "C0", 0.0, 0.2), ("compute", "host", 0.2, 1.0), ("compute", "host", 1.0, 1.1),
        ("compute", "C1", 1.1, 1.3), ("compute", "host", 1.3, 2.0), ("compute", "host", 2.0, 2.1),
        ("compute", "C2", 2.1, 2.3), ("compute", "host", 2.3, 3.0)])
    b = res.breakdown(0)
    assert (b.compute, b.exposed_comm, b.bubble) == (pytest.approx(3.0), 0.0, 0.0)
    assert b.comm == pytest.approx(0.2)  # still in flight for 0.2 s, overlapped with the host's issuing
    # the host is what is critical: three host segments back to back
    assert path(res) == [("compute", (0,), 0.0, 1.0), ("compute", (0,), 1.0, 2.0), ("compute", (0,), 2.0, 3.0)]


def test_comm_partly_hidden_behind_the_host_is_exposed_by_what_free_comm_would_save():
    """A 1 s all_reduce on the stream after 0.5 s of device work; the host issues the next segment until
    1.1 and then waits for the device (CpuSync) until 1.6: with free communication it would have waited
    until 1.1 only, so 0.5 s of the op is exposed and the rest was the host's."""
    def graph() -> GraphBuilder:
        gb = GraphBuilder()
        gb.group(0, [0, 1])
        for r in (0, 1):
            gb.compute(r, 0.1, "C0", gpu=0.5)
            gb.collective(r, "all_reduce", 0, 8)
            gb.compute(r, 1.0, "C1", gpu=0.1)
            gb.cpu_sync(r)
        return gb

    res, free = replay(graph().build(), const(1.0)), replay(graph().build(), const(0.0))
    assert (res.makespan, free.makespan) == (pytest.approx(1.6), pytest.approx(1.1))
    assert activity(res, 0) == approx_rows([
        ("compute", "C0", 0.0, 0.5), ("compute", "host", 0.5, 1.0), ("exposed_comm", "", 1.0, 1.5),
        ("compute", "C1", 1.5, 1.6)])
    b = res.breakdown(0)
    assert (b.compute, b.exposed_comm, b.comm) == (pytest.approx(1.1), pytest.approx(0.5), pytest.approx(1.0))
    assert b.exposed_comm == pytest.approx(res.makespan - free.makespan)
    assert path(res) == approx_rows([("compute", (0,), 0.0, 0.5), ("all_reduce", (0, 1), 0.5, 1.5),
                                     ("compute", (0,), 1.5, 1.6)])


def test_device_bound_rank_sums_gpu_and_comm():
    res = replay(three_steps(c=0.1, g=1.0).build(), const(0.1))
    # device: C0 0..1, all_reduce 1..1.1, C1 1.1..2.1, all_reduce 2.1..2.2, C2 2.2..3.2; host ends at 0.3
    assert res.makespan == pytest.approx(3.2) and res.rank_end[0] == res.makespan
    assert res.ops[("coll", 0, 1)].issue == {0: pytest.approx(2.1), 1: pytest.approx(2.1)}
    assert res.event_times[0][4] == (pytest.approx(0.2), pytest.approx(0.3))  # C2 on the host
    b = res.breakdown(1)
    assert (b.compute, b.exposed_comm, b.bubble) == (pytest.approx(3.0), pytest.approx(0.2), 0.0)
    assert path(res) == approx_rows([("compute", (0,), 0.0, 1.0), ("all_reduce", (0, 1), 1.0, 1.1),
                                     ("compute", (0,), 1.1, 2.1), ("all_reduce", (0, 1), 2.1, 2.2),
                                     ("compute", (0,), 2.2, 3.2)])


# ----------------------------------------------------------------------------- CpuSync


def test_cpu_sync_makes_the_host_wait_for_the_device():
    gb = GraphBuilder()
    gb.mark(0, "iteration", "B")
    gb.compute(0, 0.1, "F", gpu=1.0)
    gb.cpu_sync(0)
    gb.mark(0, "iteration", "E")
    res = replay(gb.build())
    assert [m.t for m in res.marks] == [0.0, 1.0]  # not 0.1
    assert res.event_times[0][2] == (0.1, 1.0)
    assert res.iteration_times() == [1.0] and res.makespan == 1.0

    no_sync = GraphBuilder()
    no_sync.compute(0, 0.1, "F", gpu=1.0)
    no_sync.mark(0, "iteration", "E")
    res = replay(no_sync.build())
    assert [m.t for m in res.marks] == [0.1] and res.makespan == 1.0  # the exit still waits for the device


def test_cpu_sync_then_host_bound_compute_critical_path():
    gb = GraphBuilder()
    gb.compute(0, 0.1, "F", gpu=1.0)
    gb.cpu_sync(0)
    gb.compute(0, 1.0, "opt", gpu=0.1)
    res = replay(gb.build())
    # host waits until 1.0, issues "opt" until 2.0; the device runs it 1.0..1.1 then waits for the host
    assert res.makespan == 2.0
    assert activity(res, 0) == approx_rows([("compute", "F", 0.0, 1.0), ("compute", "opt", 1.0, 1.1),
                                            ("compute", "host", 1.1, 2.0)])
    assert path(res) == [("compute", (0,), 0.0, 1.0), ("compute", (0,), 1.0, 2.0)]


# ----------------------------------------------------------------------------- async ops, p2p


def test_async_all_reduce_overlaps_device_compute():
    gb = GraphBuilder()
    gb.group(0, [0, 1])
    for r in (0, 1):
        gb.compute(r, 0.1, "F", gpu=1.0)
        a = gb.collective(r, "all_reduce", 0, 8, async_op=True)
        gb.compute(r, 0.1, "B", gpu=1.0)
        gb.wait(r, a)
        gb.compute(r, 0.1, "opt", gpu=0.5)
    res = replay(gb.build(), const(1.5))
    # issued on the stream at 1.0 (not at the host's 0.1), runs 1.0..2.5 while B runs 1.0..2.0;
    # the wait holds the stream 2.0..2.5, then opt 2.5..3.0
    ar = res.ops[("coll", 0, 0)]
    assert ar.issue == {0: 1.0, 1: 1.0} and (ar.start, ar.end) == (1.0, 2.5)
    assert res.event_times[0][1] == (1.0, 1.0) and res.event_times[0][3] == (2.0, 2.5)
    assert res.makespan == 3.0
    assert activity(res, 0) == [("compute", "F", 0.0, 1.0), ("compute", "B", 1.0, 2.0),
                                ("exposed_comm", "", 2.0, 2.5), ("compute", "opt", 2.5, 3.0)]
    b = res.breakdown(0)
    assert (b.compute, b.exposed_comm, b.bubble, b.comm) == (2.5, 0.5, 0.0, 1.5)
    assert path(res) == [("compute", (0,), 0.0, 1.0), ("all_reduce", (0, 1), 1.0, 2.5),
                         ("compute", (0,), 2.5, 3.0)]


def test_pipeline_p2p_two_clocks():
    gb = GraphBuilder()
    gb.group(1, [0, 1], "pp")
    for r in (0, 1):
        gb.mark(r, "iteration", "B", iteration=1)
    gb.compute(0, 0.25, "F0", gpu=1.0)
    gb.send(0, 1, 1, 64)
    gb.compute(0, 2.5, "F1", gpu=1.0)  # slow host
    gb.send(0, 1, 1, 64)
    gb.recv(1, 0, 1, 64)
    gb.compute(1, 0.25, "G0", gpu=2.0)
    gb.recv(1, 0, 1, 64)
    gb.compute(1, 0.25, "G1", gpu=2.0)
    for r in (0, 1):
        gb.cpu_sync(r)
        gb.mark(r, "iteration", "E", iteration=1)
    res = replay(gb.build(), const(0.5))
    # send 0: rank 0's stream at 1.0, rank 1's recv at 0 -> 1.0..1.5
    # rank 0: F1 on the device 1.5..2.5, host issues until 0.25 + 2.5 = 2.75 -> send 1 issued at 2.75
    # rank 1: G0 1.5..3.5 -> recv 1 issued at 3.5 -> 3.5..4.0; G1 4.0..6.0
    first, second = res.ops[("p2p", 1, 0, 1, 0)], res.ops[("p2p", 1, 0, 1, 1)]
    assert first.issue == {0: 1.0, 1: 0.0} and (first.start, first.end) == (1.0, 1.5)
    assert second.issue == {0: 2.75, 1: 3.5} and (second.start, second.end) == (3.5, 4.0)
    assert activity(res, 0) == [
        ("compute", "F0", 0.0, 1.0), ("compute", "host", 1.0, 1.5), ("compute", "F1", 1.5, 2.5),
        ("compute", "host", 2.5, 2.75), ("bubble", "waiting for the op to start", 2.75, 3.5),
        ("exposed_comm", "", 3.5, 4.0), ("bubble", "idle", 4.0, 6.0)]
    assert activity(res, 1) == [
        ("bubble", "waiting for the op to start", 0.0, 1.0), ("exposed_comm", "", 1.0, 1.5),
        ("compute", "G0", 1.5, 3.5), ("exposed_comm", "", 3.5, 4.0), ("compute", "G1", 4.0, 6.0)]
    assert sorted((m.rank, m.phase, m.t) for m in res.marks if m.phase == "E") == [(0, "E", 4.0), (1, "E", 6.0)]
    assert res.rank_end == {0: 4.0, 1: 6.0} and res.iteration_times() == [6.0]
    b0, b1 = res.breakdown(0), res.breakdown(1)
    # rank 0's first send is hidden behind its slow host (F1 is issued until 2.75 either way)
    assert (b0.compute, b0.exposed_comm, b0.bubble) == (2.75, 0.5, 2.75)
    assert (b1.compute, b1.exposed_comm, b1.bubble) == (4.0, 1.0, 1.0)
    assert path(res) == [("compute", (0,), 0.0, 1.0), ("send/recv", (0, 1), 1.0, 1.5),
                         ("compute", (1,), 1.5, 3.5), ("send/recv", (0, 1), 3.5, 4.0),
                         ("compute", (1,), 4.0, 6.0)]


# ----------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("seed", range(25))
def test_breakdown_and_path_invariants_random_two_clock_graphs(seed):
    gb = random_graph(seed, two_clock=True)
    n = len(gb.events)
    res = replay(gb.build(), lambda spec: 0.125 * len(spec.ranks))
    for r in range(n):
        b = res.breakdown(r)
        assert b.total == pytest.approx(res.makespan, abs=1e-9)
        acts = [s for s in res.segments[r] if s.kind != "comm"]  # the device timeline tiles [0, makespan]
        assert acts[0].start == 0.0 and acts[-1].end == pytest.approx(res.makespan)
        for a, c in zip(acts, acts[1:], strict=False):
            assert a.end == pytest.approx(c.start)
    for op in res.ops.values():
        assert op.start >= max(op.issue.values()) and op.end >= op.start
    steps = res.critical_path
    assert steps[0].start == 0.0 and steps[-1].end == pytest.approx(res.makespan)
    for a, c in zip(steps, steps[1:], strict=False):
        assert a.end == pytest.approx(c.start)
