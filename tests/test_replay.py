"""Replay engine: exact hand-computed schedules, dependency invariants, 1F1B bubbles, traces, export."""

from __future__ import annotations

import json
import math

import pytest
from random_graphs import random_graph

from prism_megatron.replay import (
    Comm,
    Compute,
    DeadlockError,
    GraphBuilder,
    GraphError,
    Wait,
    graph_from_trace,
    replay,
    to_chrome,
    write_chrome,
)
from prism_megatron.trace import read_trace, write_trace

# ----------------------------------------------------------------------------- helpers


def one_f_one_b(pp: int, m: int, f: float, b: float, nbytes: int = 1024) -> GraphBuilder:
    """Megatron's non-interleaved 1F1B schedule (forward_backward_pipelining_without_interleaving).

    Warm-up: min(pp - s - 1, m) forwards (recv_forward, F, send_forward); then recv_forward and
    the steady state: F, send_forward_recv_backward (batched isend/irecv + wait), B,
    send_backward_recv_forward (send_backward on the last steady step); cool-down: the remaining
    backwards (recv_backward, B, send_backward).
    """
    gb = GraphBuilder()
    for s in range(pp - 1):
        gb.group(100 + s, [s, s + 1], f"pp{s}-{s + 1}")
    for s in range(pp):
        first, last = s == 0, s == pp - 1
        nxt, prv = 100 + s, 100 + s - 1

        def recv_forward(s=s, first=first, prv=prv):
            if not first:
                gb.recv(s, s - 1, prv, nbytes, label="recv_forward")

        def send_forward(s=s, last=last, nxt=nxt):
            if not last:
                gb.send(s, s + 1, nxt, nbytes, label="send_forward")

        def recv_backward(s=s, last=last, nxt=nxt):
            if not last:
                gb.recv(s, s + 1, nxt, nbytes, label="recv_backward")

        def send_backward(s=s, first=first, prv=prv):
            if not first:
                gb.send(s, s - 1, prv, nbytes, label="send_backward")

        def batched(s, peer, group):
            a = gb.send(s, peer, group, nbytes, async_op=True)
            c = gb.recv(s, peer, group, nbytes, async_op=True)
            gb.wait(s, a, c)

        gb.mark(s, "iteration", "B", iteration=1)
        warm = min(pp - s - 1, m)
        rem = m - warm
        for i in range(warm):
            recv_forward()
            gb.compute(s, f, f"F{i}")
            send_forward()
        if rem:
            recv_forward()
        for i in range(rem):
            gb.compute(s, f, f"F{warm + i}")
            if not last:
                batched(s, s + 1, nxt)  # send_forward_recv_backward
            gb.compute(s, b, f"B{i}")
            if i == rem - 1:
                send_backward()
            elif not first:
                batched(s, s - 1, prv)  # send_backward_recv_forward
        for i in range(rem, m):
            recv_backward()
            gb.compute(s, b, f"B{i}")
            send_backward()
        gb.mark(s, "iteration", "E", iteration=1)
    return gb


def reference_times(graph, cost, serialize=True):
    """Independent fixed-point solution of the replay equations (monotone relaxation)."""
    ev = graph.events
    ready = {r: [0.0] * len(e) for r, e in ev.items()}
    done = {r: [0.0] * len(e) for r, e in ev.items()}
    members: dict[tuple, dict[int, int]] = {}
    for r, e in ev.items():
        for i, x in enumerate(e):
            if isinstance(x, Comm):
                if x.is_p2p:
                    src, dst = (r, x.peer) if x.kind == "send" else (x.peer, r)
                    key = ("p", x.group, src, dst, x.seq)
                else:
                    key = ("c", x.group, x.seq)
                members.setdefault(key, {})[r] = i
    key_of = {(r, i): k for k, m in members.items() for r, i in m.items()}
    start = dict.fromkeys(members, 0.0)
    end = dict.fromkeys(members, 0.0)
    for _ in range(sum(len(e) for e in ev.values()) + len(members) + 2):
        changed = False
        for k, m in members.items():
            r0, i0 = next(iter(m.items()))
            x = ev[r0][i0]
            s = max(ready[r][i] for r, i in m.items())
            if serialize and k[0] == "c" and k[2] > 0:
                s = max(s, end[("c", k[1], k[2] - 1)])
            ranks = (k[2], k[3]) if k[0] == "p" else graph.groups[k[1]].ranks
            e_ = s + cost(x.kind, max(ev[r][i].nbytes for r, i in m.items()), ranks)
            if (s, e_) != (start[k], end[k]):
                start[k], end[k], changed = s, e_, True
        for r, e in ev.items():
            t = 0.0
            for i, x in enumerate(e):
                ready_ri = t
                if isinstance(x, Compute):
                    t = t + x.duration
                elif isinstance(x, Comm) and not x.async_op:
                    t = max(t, end[key_of[(r, i)]])
                elif isinstance(x, Wait):
                    t = max([t] + [end[key_of[(r, j)]] for j in x.refs])
                if (ready[r][i], done[r][i]) != (ready_ri, t):
                    ready[r][i], done[r][i], changed = ready_ri, t, True
        if not changed:
            break
    return ready, done, start, end


# ----------------------------------------------------------------------------- exact schedules


def test_known_schedule_reproduced_exactly():
    # rank 0: compute 2, send 100 B to 1, compute 1, all_reduce (0,1,2)
    # rank 1: compute 5, recv from 0, all_reduce
    # rank 2: compute 1, all_reduce
    gb = GraphBuilder()
    gb.group(0, [0, 1, 2], "world")
    gb.group(1, [0, 1], "pair")
    gb.compute(0, 2.0)
    gb.send(0, 1, 1, 100)
    gb.compute(0, 1.0)
    gb.collective(0, "all_reduce", 0, 8)
    gb.compute(1, 5.0)
    gb.recv(1, 0, 1, 100)
    gb.collective(1, "all_reduce", 0, 8)
    gb.compute(2, 1.0)
    gb.collective(2, "all_reduce", 0, 8)

    def cost(spec):
        return {"send": 0.5, "all_reduce": 0.25}[spec.kind]

    res = replay(gb.build(), cost)
    # send issued at 2, recv at 5 -> both complete at 5.5; rank 0 computes 5.5..6.5
    p2p = res.ops[("p2p", 1, 0, 1, 0)]
    assert (p2p.start, p2p.end) == (5.0, 5.5)
    ar = res.ops[("coll", 0, 0)]
    assert ar.issue == {0: 6.5, 1: 5.5, 2: 1.0}
    assert (ar.start, ar.end) == (6.5, 6.75)
    assert res.rank_end == {0: 6.75, 1: 6.75, 2: 6.75}
    assert res.makespan == 6.75
    b0, b1, b2 = (res.breakdown(r) for r in range(3))
    assert (b0.compute, b0.exposed_comm, b0.bubble) == (3.0, 0.75, 3.0)  # bubble: 2..5 waiting for rank 1's recv
    assert (b1.compute, b1.exposed_comm, b1.bubble) == (5.0, 0.75, 1.0)  # bubble: 5.5..6.5 waiting for rank 0
    assert (b2.compute, b2.exposed_comm, b2.bubble) == (1.0, 0.25, 5.5)
    assert res.iteration_times() == [6.75]
    # critical path: rank 1 compute 0..5, the send/recv 5..5.5, rank 0 compute 5.5..6.5, all_reduce 6.5..6.75
    path = [(s.kind, s.ranks, s.start, s.end) for s in res.critical_path]
    assert path == [("compute", (1,), 0.0, 5.0), ("send/recv", (0, 1), 5.0, 5.5),
                    ("compute", (0,), 5.5, 6.5), ("all_reduce", (0, 1, 2), 6.5, 6.75)]


def test_group_collectives_serialize_on_their_stream():
    gb = GraphBuilder()
    gb.group(0, [0, 1])
    for r in (0, 1):  # two async all-reduces issued back to back (as DDP's bucketed grad reduce)
        a = gb.collective(r, "all_reduce", 0, async_op=True)
        c = gb.collective(r, "all_reduce", 0, async_op=True)
        gb.wait(r, a, c)
    res = replay(gb.build(), lambda spec: 1.0)
    assert res.ops[("coll", 0, 1)].start == 1.0 and res.makespan == 2.0
    assert replay(gb.build(), lambda spec: 1.0, serialize_group_collectives=False).makespan == 1.0


@pytest.mark.parametrize("seed", range(25))
def test_dependency_order_never_violated_random_graphs(seed):
    graph = random_graph(seed).build()

    def cost_kind(kind, nbytes, ranks):
        return 0.125 * len(ranks) + nbytes / 64

    res = replay(graph, lambda spec: cost_kind(spec.kind, spec.nbytes, spec.ranks))
    for key, op in res.ops.items():
        assert op.start >= max(op.issue.values())
        assert op.end >= op.start
        for r in op.ranks:  # members proceed past a blocking op only once it completed for all together
            ev = graph.events[r][op.event[r]]
            if not ev.async_op:
                assert res.event_times[r][op.event[r]][1] == max(op.end, op.issue[r])
        if key[0] == "p2p":
            src = key[2]
            assert op.end >= op.issue[src]  # no recv ends before its send was issued
    for r in graph.ranks:
        assert res.breakdown(r).total == pytest.approx(res.makespan, abs=1e-9)
    steps = res.critical_path
    assert steps[0].start == 0.0 and steps[-1].end == pytest.approx(res.makespan)
    for a, b in zip(steps, steps[1:], strict=False):
        assert a.end == pytest.approx(b.start)
    # an independent fixed-point solution of the same equations agrees exactly
    ready, done, start, end = reference_times(graph, cost_kind)
    for r in graph.ranks:
        assert [t for _, t in res.event_times[r]] == done[r]
    for key, op in res.ops.items():
        ref = ("p",) + key[1:] if key[0] == "p2p" else ("c",) + key[1:]
        assert (op.start, op.end) == (start[ref], end[ref])


# ----------------------------------------------------------------------------- 1F1B


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 4), (3, 7), (8, 16)])
def test_1f1b_bubble_matches_closed_form(pp, m):
    f, b = 1.0, 2.0
    res = replay(one_f_one_b(pp, m, f, b).build())
    assert res.makespan == (m + pp - 1) * (f + b)
    assert res.iteration_times() == [(m + pp - 1) * (f + b)]
    for s in range(pp):
        bd = res.breakdown(s)
        assert bd.compute == m * (f + b)
        assert bd.exposed_comm == 0.0
        assert bd.bubble / res.makespan == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)
    assert sum(step.duration for step in res.critical_path) == pytest.approx(res.makespan)


def test_1f1b_with_p2p_cost_grows_by_the_pipeline_fill():
    pp, m, f, b, c = 4, 8, 1.0, 2.0, 0.125
    res = replay(one_f_one_b(pp, m, f, b).build(), lambda spec: c)
    free = (m + pp - 1) * (f + b)
    # every p2p hop on the fill and drain path adds c; steady-state exchanges also add to the path
    assert res.makespan > free + 2 * (pp - 1) * c - 1e-12
    assert any(res.breakdown(s).exposed_comm > 0 for s in range(pp))


# ----------------------------------------------------------------------------- errors


def test_deadlock_names_ranks_and_ops():
    gb = GraphBuilder()
    gb.group(0, [0, 1], "pp")
    gb.recv(0, 1, 0, 4, label="pp.recv_forward")
    gb.send(0, 1, 0, 4)
    gb.recv(1, 0, 0, 4, label="pp.recv_backward")
    gb.send(1, 0, 0, 4)
    with pytest.raises(DeadlockError) as e:
        replay(gb.build())
    msg = str(e.value)
    assert "rank 0 event 0: recv on group 0 (peer 1) [pp.recv_forward] waits for rank(s) [1]" in msg
    assert "rank 1 event 0: recv on group 0 (peer 0) [pp.recv_backward] waits for rank(s) [0]" in msg


def test_mismatched_collective_and_bad_graph_are_errors():
    gb = GraphBuilder()
    gb.group(0, [0, 1])
    gb.collective(0, "all_reduce", 0)
    gb.collective(1, "all_gather", 0)
    with pytest.raises(GraphError, match="different op"):
        replay(gb.build())
    gb = GraphBuilder()
    gb.group(0, [0, 1])
    gb.collective(2, "all_reduce", 0)
    with pytest.raises(GraphError, match="rank 2 event 0 .* do not include it"):
        gb.build()
    gb = GraphBuilder()
    gb.group(0, [0, 1])
    gb.collective(0, "all_reduce", 0, async_op=True)  # never awaited, rank 1 never joins
    with pytest.raises(GraphError, match="never matched"):
        replay(gb.build())


# ----------------------------------------------------------------------------- from a PrismTrace


def _row(rank, index, kind, group, seq, t_issue, t_complete, compute_before, peer=-1, async_op=False, label=""):
    return {"rank": rank, "index": index, "kind": kind, "group": group, "seq": seq, "peer": peer, "root": -1,
            "bytes": 4096, "dtype": "torch.float32", "shapes": [[1024]], "reduce_op": "sum" if peer < 0 else "",
            "async_op": async_op, "t_issue": t_issue, "t_complete": t_complete, "compute_before": compute_before,
            "label": label}


def test_graph_from_real_trace_replayed(tmp_path):
    manifest = {
        "world_size": 2,
        "groups": [{"id": 0, "name": "world", "ranks": [0, 1], "backend": "nccl"},
                   {"id": 1, "name": "pp", "ranks": [0, 1], "backend": "nccl"}],
        "ranks": [{"rank": 0, "exit_code": 0, "device": "cpu"}, {"rank": 1, "exit_code": 0, "device": "cpu"}],
    }
    # Bare-graph wall times are distorted (one slot): only compute_before and the order matter.
    ops = [
        _row(0, 0, "send", 1, 0, 1.0, 9.0, 1.0, peer=1, label="pp.send_forward"),
        _row(0, 1, "recv", 1, 0, 9.5, 20.0, 0.5, peer=1, async_op=True, label="pp.recv_backward"),
        _row(0, 2, "all_reduce", 0, 0, 21.0, 30.0, 0.25),
        _row(1, 0, "recv", 1, 0, 2.0, 9.0, 0.0, peer=0, label="pp.recv_forward"),
        _row(1, 1, "send", 1, 0, 19.0, 20.0, 3.0, peer=0, label="pp.send_backward"),
        _row(1, 2, "all_reduce", 0, 0, 29.0, 30.0, 0.125),
        _row(1, 3, "send", 1, 1, 30.5, 30.5, 0.0, peer=0, async_op=True),  # fire-and-forget at exit
    ]
    marks = [
        {"rank": r, "name": "iteration", "phase": ph, "t": t, "compute_clock": c, "attrs": {"iteration": 1}}
        for r, ph, t, c in [(0, "B", 0.0, 0.0), (0, "E", 31.0, 2.0), (1, "B", 0.5, 0.0), (1, "E", 31.0, 3.25)]
    ] + [{"rank": 1, "name": "forward", "phase": "B", "t": 10.0, "compute_clock": 1.0, "attrs": {"microbatch": 0}},
         {"rank": 1, "name": "forward", "phase": "E", "t": 18.0, "compute_clock": 3.0, "attrs": {}}]
    path = write_trace(tmp_path / "bare.prismtrace", manifest, ops, marks=marks)
    graph = graph_from_trace(read_trace(path))

    assert graph.notes == ["rank 1 op 3: send to/from rank 0 on group 1 has no matching recv; left out"]
    ev1 = graph.events[1]
    assert [type(e).__name__ for e in ev1] == ["Mark", "Comm", "Compute", "Mark", "Compute", "Mark",
                                               "Comm", "Compute", "Comm", "Compute", "Mark"]
    assert [e.duration for e in ev1 if isinstance(e, Compute)] == [1.0, 2.0, 0.125, 0.125]
    ev0 = graph.events[0]
    # the async irecv (event 4) is awaited together with the next blocking op, the all_reduce (event 6)
    assert [type(e).__name__ for e in ev0] == ["Mark", "Compute", "Comm", "Compute", "Comm", "Compute", "Comm",
                                               "Wait", "Compute", "Mark"]
    assert ev0[4].async_op and ev0[7].refs == (4,)

    res = replay(graph)
    # rank 0: compute 1 -> send (rendezvous with rank 1's recv at 1) -> compute .5 -> irecv at 1.5
    # rank 1: recv done at 1 -> compute 3 -> send at 4 -> completes with the irecv at 4
    # rank 0: compute .25 -> all_reduce issued 1.75, awaited with the irecv; rank 1: compute .125 -> 4.125
    # after it: rank 0 computes 2.0 - 1.75 until its iteration end, rank 1 3.25 - 3.125
    assert res.ops[("p2p", 1, 1, 0, 0)].end == 4.0
    assert res.ops[("coll", 0, 0)].start == 4.125
    assert res.rank_end == {0: 4.375, 1: 4.25}
    assert res.iteration_times() == [4.375]
    forward = [m for m in res.marks if m.name == "forward"]
    assert [(m.phase, m.t) for m in forward] == [("B", 2.0), ("E", 4.0)]


def test_waits_on_async_ops_placed_from_slot_releases(tmp_path):
    """batch_isend_irecv + wait(): the rank gave its slot back at the wait, so compute follows the wait."""
    manifest = {
        "world_size": 2,
        "groups": [{"id": 0, "name": "world", "ranks": [0, 1], "backend": "nccl"},
                   {"id": 1, "name": "pp", "ranks": [0, 1], "backend": "nccl"}],
        "ranks": [{"rank": 0, "exit_code": 0, "device": "cpu"}, {"rank": 1, "exit_code": 0, "device": "cpu"}],
    }
    ops = [
        _row(0, 0, "send", 1, 0, 0.5, 1.2, 0.5, peer=1, async_op=True),
        _row(0, 1, "recv", 1, 0, 0.5, 2.6, 0.0, peer=1, async_op=True),
        _row(0, 2, "all_reduce", 0, 0, 4.1, 5.0, 1.0),
        _row(1, 0, "recv", 1, 0, 0.6, 0.6, 0.0, peer=0),
        _row(1, 1, "send", 1, 0, 2.6, 2.6, 2.0, peer=0),
        _row(1, 2, "all_reduce", 0, 0, 3.1, 5.0, 0.5),
    ]
    slots = [{"rank": r, "device": "cpu", "slot": 0, "t_grant": g, "t_release": e, "compute_clock": c}
             for r, g, e, c in [(0, 0.0, 0.5, 0.5), (0, 3.1, 4.1, 1.5), (1, 0.5, 3.1, 2.5)]]
    path = write_trace(tmp_path / "bare.prismtrace", manifest, ops, slots=slots)
    graph = graph_from_trace(read_trace(path))
    assert [type(e).__name__ for e in graph.events[0]] == ["Compute", "Comm", "Comm", "Wait", "Compute", "Comm"]
    assert graph.events[0][3].refs == (1, 2)
    res = replay(graph)
    # rank 1 sends the gradient at 2.5; rank 0 waits for it before its 1.0 of compute
    assert res.ops[("coll", 0, 0)].start == 3.5 and res.makespan == 3.5
    # without the slot log the wait is deferred to the all_reduce and compute overlaps the recv
    bare = write_trace(tmp_path / "noslots.prismtrace", manifest, ops)
    assert replay(graph_from_trace(read_trace(bare))).makespan == 3.0


def test_recorded_waits_are_placed_where_the_program_waited_even_on_completed_ops(tmp_path):
    """Megatron's p2p call waits for its batch before returning. In this capture both ops had completed
    when rank 0 waited (no slot release), yet the wait stays where the program made it: in the replay
    rank 1 sends late and rank 0 waits for it before its compute, as the real program does."""
    manifest = {
        "world_size": 2,
        "groups": [{"id": 0, "name": "world", "ranks": [0, 1], "backend": "nccl"},
                   {"id": 1, "name": "pp", "ranks": [0, 1], "backend": "nccl"}],
        "ranks": [{"rank": 0, "exit_code": 0, "device": "cpu"}, {"rank": 1, "exit_code": 0, "device": "cpu"}],
    }
    waited = {"t_wait": 3.0, "wait_clock": 0.5}
    ops = [
        dict(_row(0, 0, "send", 1, 0, 0.5, 1.2, 0.5, peer=1, async_op=True), **waited),
        dict(_row(0, 1, "recv", 1, 0, 0.5, 2.6, 0.0, peer=1, async_op=True), **waited),
        dict(_row(0, 2, "all_reduce", 0, 0, 3.5, 4.0, 2.0, async_op=True), t_wait=4.5, wait_clock=3.25),
        _row(0, 3, "barrier", 0, 1, 4.2, 5.0, 0.5),
        _row(1, 0, "recv", 1, 0, 0.6, 0.6, 0.0, peer=0),
        _row(1, 1, "send", 1, 0, 2.6, 2.6, 2.0, peer=0),
        _row(1, 2, "all_reduce", 0, 0, 3.1, 4.0, 0.5),
        _row(1, 3, "barrier", 0, 1, 4.9, 5.0, 0.5),
    ]
    path = write_trace(tmp_path / "waited.prismtrace", manifest, ops)
    ev0 = graph_from_trace(read_trace(path)).events[0]
    # the all_reduce's wait was made after the barrier (the last-seen rule would have put it before)
    assert [type(e).__name__ for e in ev0] == ["Compute", "Comm", "Comm", "Wait", "Compute", "Comm", "Compute",
                                               "Comm", "Compute", "Wait"]
    assert ev0[3].refs == (1, 2) and ev0[9].refs == (5,)
    res = replay(graph_from_trace(read_trace(path)))
    # rank 1 sends at 2.5; rank 0 then computes 2.0 and issues the all_reduce at 4.5 (rank 1's at 3.0)
    assert res.ops[("coll", 0, 0)].start == 4.5
    assert [e.duration for e in ev0 if isinstance(e, Compute)] == [0.5, 2.0, 0.5, 0.25]
    # the same trace without the recorded waits (PrismTrace v4): the p2p wait moves past the barrier,
    # and rank 0's 2.0 of compute overlaps the recv that the program waited for
    old = write_trace(tmp_path / "v4.prismtrace", manifest,
                      [{k: v for k, v in op.items() if k not in waited} for op in ops])
    assert replay(graph_from_trace(read_trace(old))).ops[("coll", 0, 0)].start == 3.0


# ----------------------------------------------------------------------------- export


def test_chrome_export(tmp_path):
    res = replay(one_f_one_b(2, 3, 1.0, 2.0).build(), lambda spec: 0.25)
    doc = to_chrome(res, provenance={"cost": "constant 0.25 s"})
    json.dumps(doc)
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1, 2}  # two ranks + the critical path
    by_thread: dict[tuple, list] = {}
    for e in xs:
        by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
    for evs in by_thread.values():  # slices of one thread never overlap
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:], strict=False):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6
    total = sum(e["dur"] for e in xs if e["pid"] == 0 and e["tid"] == 0)
    assert total == pytest.approx(res.rank_end[0] * 1e6)
    assert doc["otherData"]["makespan_s"] == res.makespan
    out = write_chrome(res, tmp_path / "timeline.json")
    assert json.loads(out.read_text())["traceEvents"]
    assert not math.isnan(res.makespan)


def test_replay_does_not_import_runtime_or_megatron():
    import subprocess
    import sys

    code = ("import sys, prism_megatron.replay, prism_megatron.calibration; "
            "bad = [m for m in sys.modules if m.startswith(('prism_megatron.runtime', 'megatron', 'torch'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_iterations_time_is_the_loops_period_as_megatron_times_it():
    """Megatron's ``elapsed time per iteration`` runs from one log point to the next: what the loop does
    between two train steps (its logging) belongs to the iteration, an evaluation or a checkpoint save does
    not (Megatron stops the timer for them). The first iteration has no iteration before: begin to end."""
    gb = GraphBuilder()
    gb.group(0, [0, 1])
    for r in (0, 1):
        for n in (1, 2, 3):
            gb.mark(r, "iteration", "B", iteration=n)
            gb.compute(r, 1.0 + 0.5 * r)  # rank 1 ends each step last
            gb.collective(r, "all_reduce", 0, 1024)
            gb.mark(r, "iteration", "E", iteration=n)
            gb.compute(r, 0.1)  # the loop between steps: logging
            if n == 1:
                gb.mark(r, "checkpoint_save", "B", iteration=n)
                gb.compute(r, 2.0)
                gb.mark(r, "checkpoint_save", "E", iteration=n)
            if n == 2:
                gb.mark(r, "evaluate", "B", iteration=n)
                gb.compute(r, 3.0)
                gb.mark(r, "evaluate", "E", iteration=n)
    result = replay(gb.build())  # communication free
    its = {it.number: it for it in result.iterations()}
    assert its[1].time == pytest.approx(1.5)  # begin to the last rank's end
    assert its[2].time == pytest.approx(0.1 + 1.5)  # the logging after iteration 1, then the step; the save out
    assert its[3].time == pytest.approx(0.1 + 1.5)  # the 3 s of evaluation left out
    assert its[3].window == pytest.approx((its[2].end, its[3].end))
    assert result.iteration_times() == pytest.approx([1.5, 1.6, 1.6])


@pytest.mark.parametrize("seed", range(5))
def test_a_window_of_a_replays_segments_keeps_every_one_that_overlaps_it_in_order(seed):
    """``ReplayResult.within``: every segment overlapping the window, a long one begun well before it included, in
    the rank's order; a window's breakdown is the one over every segment; segments out of start order are all kept."""
    import random
    from dataclasses import astuple
    from types import SimpleNamespace

    from prism_megatron.replay.engine import ReplayResult, Segment

    rng = random.Random(seed)
    segs = []
    for _ in range(400):
        start = rng.uniform(0.0, 100.0)
        long = rng.random() < 0.02
        kind = rng.choice(["compute", "bubble", "exposed_comm", "comm"])
        segs.append(Segment(0, kind, start, start + rng.uniform(0.0, 30.0 if long else 0.5)))
    segs.sort(key=lambda s: (s.start, s.kind == "comm"))
    result = ReplayResult(SimpleNamespace(ranks=[0]), 130.0, {0: 130.0}, {0: segs}, {}, [], [])
    for _ in range(50):
        t0 = rng.uniform(0.0, 110.0)
        t1 = t0 + rng.uniform(0.0, 20.0)
        kept = result.within(0, t0, t1)
        overlapping = [s for s in segs if s.end > t0 and s.start < t1]
        assert [s for s in kept if s.end > t0 and s.start < t1] == overlapping
        assert len(kept) < len(segs) or t1 - t0 > 50
        full = ReplayResult(SimpleNamespace(ranks=[0]), 130.0, {0: 130.0}, {0: list(reversed(segs))}, {}, [], [])
        assert full.within(0, t0, t1) == list(reversed(segs))  # not in start order: every segment
        assert astuple(result.breakdown(0, t0, t1)) == pytest.approx(astuple(full.breakdown(0, t0, t1)))


def test_the_cyclic_collector_is_paused_while_a_graph_replays_and_back_after_it_even_when_it_fails():
    """A replay's millions of objects would make each full collection re-traverse them all
    (replay.collector): the collector is off while the graph replays, on again after, a failed replay included;
    a caller that had it off keeps it off."""
    import gc

    gb = GraphBuilder()
    gb.group(0, [0, 1], "pair")
    for r in (0, 1):
        gb.compute(r, 1.0)
        gb.collective(r, "all_reduce", 0, 8)
    seen = []

    def cost(spec):
        seen.append(gc.isenabled())
        return 0.5

    assert gc.isenabled()
    replay(gb.build(), cost)
    assert seen == [False] and gc.isenabled()

    def failing(spec):
        raise RuntimeError("cost")

    with pytest.raises(RuntimeError, match="cost"):
        replay(gb.build(), failing)
    assert gc.isenabled()
    gc.disable()
    try:
        replay(gb.build(), cost)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_comms_cheap_copy_is_dataclasses_replace_and_leaves_the_original_alone():
    from dataclasses import replace

    op = Comm("send", 3, 7, peer=5, nbytes=1024, dtype="bfloat16", async_op=True, label="fwd")
    moved = op.but(seq=9, group=4, peer=6)
    assert moved == replace(op, seq=9, group=4, peer=6) and hash(moved) == hash(replace(op, seq=9, group=4, peer=6))
    assert (op.seq, op.group, op.peer) == (7, 3, 5) and moved.is_p2p and moved.label == "fwd"
    with pytest.raises(AttributeError):  # still frozen
        moved.seq = 1
