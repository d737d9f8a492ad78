"""Calibration: the slice planner, inter-slice alignment and the calibrated graph file.

Slice runs are simulated with the replay engine: the slice's ranks get the true compute and
in-slice communication costs, every other rank is "replayed" with distorted durations (as virtual
ranks replay the bare graph), and each slice's clock gets its own offset. Alignment must then
recover the true timeline. Durations are multiples of 1/64 s so that every sum is exact in
binary floating point and results can be compared with ==.
"""

from __future__ import annotations

import json
import os
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prism_megatron.calibration import (
    AlignError,
    CalibratedFormatError,
    SliceError,
    SliceRun,
    align_slices,
    group_traffic,
    plan_slices,
    read_calibrated,
    slice_run_from_trace,
    spans_nodes,
    write_calibrated,
)
from prism_megatron.calibration.calibrated import op_key
from prism_megatron.replay import Comm, Compute, Graph, GraphBuilder, Mark, replay
from prism_megatron.trace import read_trace, write_trace

MiB = 2**20


def true_cost(spec) -> float:
    """The "real" network: exact in binary floating point for the sizes used here."""
    return 1 / 64 + spec.nbytes / (64 * MiB) * len(spec.ranks) / 2


def model(tp: int, dp: int, pp: int, m: int, seed: int = 0, dyadic: bool = True) -> Graph:
    """A Megatron-like job (rank = t + tp*(d + dp*p)): per microbatch a TP all-reduce in forward and
    backward, sync p2p between stages (GPipe order), then an async DP all-reduce awaited after the
    optimizer step (two buckets, serialized on the DP group's stream). TP carries the most collective bytes per rank."""
    rng = random.Random(seed)
    dur = (lambda: rng.randint(1, 32) / 64) if dyadic else (lambda: rng.uniform(0.01, 0.5))
    gb = GraphBuilder()
    rank = lambda t, d, p: t + tp * (d + dp * p)  # noqa: E731
    for p in range(pp):
        for d in range(dp):
            gb.group(len(gb.groups), [rank(t, d, p) for t in range(tp)], f"tp{p}.{d}")
    for p in range(pp):
        for t in range(tp):
            gb.group(len(gb.groups), [rank(t, d, p) for d in range(dp)], f"dp{p}.{t}")
    pp_group = {}
    for d in range(dp):
        for t in range(tp):
            g = gb.group(len(gb.groups), [rank(t, d, p) for p in range(pp)], f"pp{d}.{t}")
            pp_group.update({rank(t, d, p): g for p in range(pp)})
    tp_of = {r: g.id for g in gb.groups.values() if g.name.startswith("tp") for r in g.ranks}
    dp_of = {r: g.id for g in gb.groups.values() if g.name.startswith("dp") for r in g.ranks}
    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                r, g = rank(t, d, p), pp_group[rank(t, d, p)]
                gb.mark(r, "iteration", "B", iteration=1)
                for mb in range(m):
                    if p > 0:
                        gb.recv(r, r - tp * dp, g, 4 * MiB, label="recv_forward")
                    gb.compute(r, dur(), f"F{mb}")
                    gb.collective(r, "all_reduce", tp_of[r], 16 * MiB)
                    if p < pp - 1:
                        gb.send(r, r + tp * dp, g, 4 * MiB, label="send_forward")
                for mb in range(m):
                    if p < pp - 1:
                        gb.recv(r, r + tp * dp, g, 4 * MiB, label="recv_backward")
                    gb.compute(r, 2 * dur(), f"B{mb}")
                    gb.collective(r, "all_reduce", tp_of[r], 16 * MiB)
                    if p > 0:
                        gb.send(r, r - tp * dp, g, 4 * MiB, label="send_backward")
                # two gradient buckets back to back: the second waits for the first on the group's stream
                a = gb.collective(r, "all_reduce", dp_of[r], 8 * MiB, async_op=True, label="grads0")
                b = gb.collective(r, "reduce_scatter", dp_of[r], 8 * MiB, async_op=True, label="grads1")
                gb.compute(r, dur() / 4, "optimizer")
                gb.wait(r, a, b)
                gb.mark(r, "iteration", "E", iteration=1)
    return gb.build("model")


def measure(graph: Graph, slices: list[tuple[int, ...]], offsets: list[float] | None = None) -> list[SliceRun]:
    """Simulate one run per slice: its ranks real, the others replayed with distorted timings."""
    runs = []
    for k, members in enumerate(slices):
        inside = set(members)
        events = {r: evs if r in inside else [Compute(e.duration * (3 + r % 2)) if isinstance(e, Compute) else e
                                             for e in evs]
                  for r, evs in graph.events.items()}
        cost = lambda spec, inside=inside: true_cost(spec) if set(spec.ranks) <= inside else 3 * true_cost(spec) + 1 / 8  # noqa: E731
        res = replay(Graph(graph.groups, events, f"slice {k}"), cost)
        off = offsets[k] if offsets else 1000.0 * (k + 1) + k / 4
        op_times = {r: [(res.ops[op_key(r, e)].issue[r] + off, res.ops[op_key(r, e)].end + off)
                        for e in graph.events[r] if isinstance(e, Comm)] for r in members}
        runs.append(SliceRun(k, dict(graph.groups), {r: graph.events[r] for r in members}, op_times,
                             device="sim:0", source=f"slice{k}.prismtrace"))
    return runs


def timeline(res):
    return (res.makespan, {k: (op.start, op.end) for k, op in res.ops.items()}, res.event_times)


# ----------------------------------------------------------------------------- slice planner


def test_planner_keeps_tp_groups_whole_and_stages_together():
    graph = model(tp=2, dp=2, pp=2, m=3)
    traffic = group_traffic(graph)
    assert [t.name[:2] for t in traffic[:4]] == ["tp"] * 4  # heaviest per rank: the TP groups
    plan = plan_slices(graph, devices=2, ranks_per_device=2)
    assert [s.ranks for s in plan] == [(0, 1, 2, 3), (4, 5, 6, 7)]  # one pipeline stage per slice
    assert plan == plan_slices(graph, devices=2, ranks_per_device=2)  # deterministic
    tp_groups = [g for g in graph.groups.values() if g.name.startswith("tp")]
    for capacity in (2, 3, 4, 6, 8):
        plan = plan_slices(graph, capacity)
        assert sorted(r for s in plan for r in s.ranks) == list(range(8))  # every rank exactly once
        assert all(len(s.ranks) <= capacity for s in plan)
        for g in tp_groups:
            assert sum(set(g.ranks) <= set(s.ranks) for s in plan) == 1, (capacity, g, plan)
            assert any(g.id in s.groups for s in plan)
        assert len(plan) == -(-8 // (capacity - capacity % 2))


def test_planner_follows_traffic_not_rank_order():
    gb = GraphBuilder()
    heavy = [gb.group(0, [0, 2], "tp-a"), gb.group(1, [1, 3], "tp-b")]
    light = [gb.group(2, [0, 1]), gb.group(3, [2, 3])]
    for g in heavy:
        for r in gb.groups[g].ranks:
            gb.collective(r, "all_gather", g, 64 * MiB)
    for g in light:
        for r in gb.groups[g].ranks:
            gb.collective(r, "all_reduce", g, MiB)
    plan = plan_slices(gb.build(), devices=2)
    assert [(s.ranks, s.groups) for s in plan] == [((0, 2), (0,)), ((1, 3), (1,))]
    # at a lower bar the light groups couple too, and the union of all of them no longer fits
    with pytest.raises(SliceError, match="together they span 4 ranks"):
        plan_slices(gb.build(), devices=2, couple=0.01)
    assert len(plan_slices(gb.build(), devices=4, couple=0.01)) == 1


def test_planner_couples_by_bytes_per_rank():
    # one microbatch: DP (2 buckets x 8 MiB) carries half the TP bytes per rank (2 x 16 MiB) -> coupled at 0.5
    graph = model(tp=2, dp=2, pp=2, m=1)
    with pytest.raises(SliceError, match="together they span 4 ranks") as e:
        plan_slices(graph, devices=2)
    assert "group 4 'dp0.0' (2 ranks, 16 MiB" in str(e.value) and "'couple'" in str(e.value)
    assert [s.ranks for s in plan_slices(graph, devices=2, couple=0.6)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [s.ranks for s in plan_slices(graph, devices=4)] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_planner_error_names_group_and_sizes():
    graph = model(tp=4, dp=1, pp=2, m=1)
    with pytest.raises(SliceError) as e:
        plan_slices(graph, devices=1, ranks_per_device=2)
    msg = str(e.value)
    assert "group 0 'tp0.0' (4 ranks" in msg and "at most 2 ranks" in msg and "1 device(s) x 2 rank(s)" in msg


def test_planner_explicit_groups_overlap_and_packing():
    gb = GraphBuilder()
    gb.group(0, [0, 1], "a")
    gb.group(1, [1, 2], "b")
    gb.group(2, [3, 4], "c")
    for r in range(6):
        gb.compute(r, 1.0)
    graph = gb.build()
    with pytest.raises(SliceError) as e:  # a and b overlap: 3 ranks must share a slice
        plan_slices(graph, devices=2, couple=[0, 1])
    assert "group 0 'a'" in str(e.value) and "group 1 'b'" in str(e.value)
    assert [s.ranks for s in plan_slices(graph, devices=3, couple=[0, 1, 2])] == [(0, 1, 2), (3, 4, 5)]
    # units {0,1} {2} {3,4} {5} in capacity 3: next-fit takes 3 slices, first-fit 2 -> first-fit wins
    plan = plan_slices(graph, devices=3, couple=[0, 2])
    assert [s.ranks for s in plan] == [(0, 1, 2), (3, 4, 5)]
    plan = plan_slices(graph, devices=3, couple=[0])
    assert [s.ranks for s in plan] == [(0, 1, 2), (3, 4, 5)]
    gb2 = GraphBuilder()
    gb2.group(0, [0, 1, 2])
    gb2.group(1, [3, 4])
    for r in range(6):
        gb2.compute(r, 1.0)
    # units {0,1,2} {3,4} {5} in capacity 4: both fits take 2 slices -> keep the contiguous next-fit
    assert [s.ranks for s in plan_slices(gb2.build(), devices=4, couple=[0, 1])] == [(0, 1, 2), (3, 4, 5)]
    with pytest.raises(ValueError, match="unknown group"):
        plan_slices(graph, devices=3, couple=[9])
    with pytest.raises(ValueError):
        plan_slices(graph, devices=0)


# ----------------------------------------------------------------------------- alignment


def test_hand_computed_schedule_from_two_slices():
    # TP pairs {0,1} (group 0) and {2,3} (group 1), pipeline 0->2 (group 2) and 1->3 (group 3).
    # Truth: rank 0 computes 1, rank 1 computes 2; TP all-reduce 0.25 -> ends 2.25; sends 0.125 -> 2.375;
    # rank 2 computes 1 (-> 3.375), rank 3 0.5 (-> 2.875); TP all-reduce 0.5 from 3.375 to 3.875.
    gb = GraphBuilder()
    for g, ranks in enumerate([(0, 1), (2, 3), (0, 2), (1, 3)]):
        gb.group(g, ranks)
    for r, c in [(0, 1.0), (1, 2.0)]:
        gb.compute(r, c)
        gb.collective(r, "all_reduce", 0, MiB)
        gb.send(r, r + 2, 2 + r, MiB)
    for r, c in [(2, 1.0), (3, 0.5)]:
        gb.recv(r, r - 2, r, MiB)
        gb.compute(r, c)
        gb.collective(r, "all_reduce", 1, MiB)
    g = gb.build()
    # slice A ran 0,1 at t=100 (the replayed receivers were slow); slice B ran 2,3 at t=5000
    a = SliceRun(0, g.groups, {0: g.events[0], 1: g.events[1]},
                 {0: [(101.0, 102.25), (102.25, 107.0)], 1: [(102.0, 102.25), (102.25, 109.0)]})
    b = SliceRun(1, g.groups, {2: g.events[2], 3: g.events[3]},
                 {2: [(5000.0, 5009.0), (5010.0, 5010.5)], 3: [(5000.0, 5009.0), (5009.5, 5010.5)]})
    asked = []
    cal = align_slices([a, b], lambda spec: asked.append(spec.kind) or 0.125)
    assert asked == ["send", "send"]  # only the cross-slice sends go to the model
    assert {k: (c.duration, c.source, c.slice) for k, c in cal.costs.items()} == {
        ("coll", 0, 0): (0.25, "measured", 0), ("coll", 1, 0): (0.5, "measured", 1),
        ("p2p", 2, 0, 2, 0): (0.125, "model", -1), ("p2p", 3, 1, 3, 0): (0.125, "model", -1)}
    res = cal.replay()
    assert res.makespan == 3.875
    assert (res.ops[("coll", 0, 0)].start, res.ops[("coll", 0, 0)].end) == (2.0, 2.25)
    assert res.ops[("p2p", 2, 0, 2, 0)].end == res.ops[("p2p", 3, 1, 3, 0)].end == 2.375
    assert (res.ops[("coll", 1, 0)].start, res.ops[("coll", 1, 0)].end) == (3.375, 3.875)
    with pytest.raises(AlignError, match=r"measured in no single slice \(its members ran in slices \[0, 1\]\)"):
        align_slices([a, b])


@pytest.mark.parametrize("tp,dp,pp,m,devices", [(2, 2, 2, 3, 4), (2, 1, 4, 4, 2), (4, 2, 2, 2, 4), (1, 2, 3, 2, 2)])
def test_known_schedule_recovered_exactly(tp, dp, pp, m, devices):
    graph = model(tp, dp, pp, m, seed=tp * 100 + pp)
    plan = plan_slices(graph, devices)
    assert len(plan) > 1
    cal = align_slices(measure(graph, [s.ranks for s in plan]), true_cost)
    assert timeline(cal.replay()) == timeline(replay(graph, true_cost))
    # compute durations are the slices' own; ops inside one slice were measured, not modelled
    for r in graph.ranks:
        assert [e.duration for e in cal.graph.events[r] if isinstance(e, Compute)] == \
               [e.duration for e in graph.events[r] if isinstance(e, Compute)]
    slice_of = {r: s.index for s in plan for r in s.ranks}
    for key, c in cal.costs.items():
        ranks = key[2:4] if key[0] == "p2p" else graph.groups[key[1]].ranks
        assert c.source == ("measured" if len({slice_of[r] for r in ranks}) == 1 else "model"), key
    assert sum(c.source == "measured" for c in cal.costs.values()) > 0


def test_measured_costs_win_over_the_model_except_where_forced():
    graph = model(2, 2, 2, 2, seed=3)
    runs = measure(graph, [s.ranks for s in plan_slices(graph, 4)])
    wrong = lambda spec: 7.0  # noqa: E731
    cal = align_slices(runs, wrong)
    measured = {k: c for k, c in cal.costs.items() if c.source == "measured"}
    assert measured and all(c.duration == true_cost_of(graph, k) for k, c in measured.items())
    assert all(c.duration == 7.0 for c in cal.costs.values() if c.source == "model")
    # every group spans two 2-GPU "nodes" once forced: nothing measured is used
    forced = align_slices(runs, true_cost, use_model=lambda spec: True)
    assert {c.source for c in forced.costs.values()} == {"model"}
    assert timeline(forced.replay()) == timeline(replay(graph, true_cost))
    part = align_slices(runs, wrong, use_model=spans_nodes(2))
    assert {k for k, c in part.costs.items() if c.source == "measured"} < set(measured)
    with pytest.raises(AlignError, match="use_model"):
        align_slices(runs, use_model=lambda spec: True)


def true_cost_of(graph, key):
    ranks = key[2:4] if key[0] == "p2p" else graph.groups[key[1]].ranks
    ev = next(e for r in ranks for e in graph.events[r] if isinstance(e, Comm) and op_key(r, e) == key)
    return true_cost(type("S", (), {"nbytes": ev.nbytes, "ranks": ranks})())


def test_clock_offsets_between_slices_are_removed():
    graph = model(2, 2, 2, 3, seed=7)
    slices = [s.ranks for s in plan_slices(graph, 4)]
    base = align_slices(measure(graph, slices, [0.0, 0.0]), true_cost)
    shifted = align_slices(measure(graph, slices, [0.0, 1000.0]), true_cost)
    skewed = align_slices(measure(graph, slices, [-3.5, 1e6 + 0.25]), true_cost)
    for other in (shifted, skewed):
        assert other.costs == base.costs
        assert other.graph.events == base.graph.events
        assert timeline(other.replay()) == timeline(base.replay())


@pytest.mark.parametrize("seed", range(6))
def test_dependency_order_never_violated(seed):
    rng = random.Random(seed)
    tp, dp, pp = rng.choice([(2, 2, 2), (2, 1, 4), (1, 2, 3), (4, 1, 2)])
    graph = model(tp, dp, pp, rng.randint(2, 4), seed=seed, dyadic=False)
    plan = plan_slices(graph, rng.choice([d for d in (2, 4) if d >= tp]))
    runs = measure(graph, [s.ranks for s in plan], [rng.uniform(-1e4, 1e4) for _ in plan])
    res = align_slices(runs, true_cost).replay()
    truth = replay(graph, true_cost)
    assert res.makespan == pytest.approx(truth.makespan, rel=1e-9)
    for key, op in res.ops.items():
        assert op.end >= op.start >= max(op.issue.values())
        assert op.end - op.start == pytest.approx(true_cost_of(graph, key), rel=1e-6, abs=1e-9)
        for r, i in op.event.items():
            ev = graph.events[r][i]
            if key[0] == "p2p":
                # a recv cannot end before its send was issued (nor a send before its recv was posted)
                assert op.end >= op.issue[key[2]] and op.end >= op.issue[key[3]]
                if not ev.async_op:
                    assert res.event_times[r][i][1] == op.end >= op.issue[key[2]]
            elif not ev.async_op:
                assert res.event_times[r][i][1] == op.end  # one completion for every member


# ----------------------------------------------------------------------------- from slice traces


def _row(rank, index, kind, group, seq, t_issue, t_complete, compute_before, peer=-1):
    return {"rank": rank, "index": index, "kind": kind, "group": group, "seq": seq, "peer": peer, "root": -1,
            "bytes": MiB, "dtype": "torch.float32", "shapes": [[MiB // 4]], "reduce_op": "sum" if peer < 0 else "",
            "async_op": False, "t_issue": t_issue, "t_complete": t_complete, "compute_before": compute_before,
            "label": ""}


def test_slice_runs_from_prismtraces(tmp_path):
    manifest = {
        "world_size": 2,
        "groups": [{"id": 0, "name": "world", "ranks": [0, 1], "backend": "nccl"},
                   {"id": 1, "name": "pp", "ranks": [0, 1], "backend": "nccl"}],
        "ranks": [{"rank": 0, "exit_code": 0, "device": "cuda:0"}, {"rank": 1, "exit_code": 0, "device": "cuda:1"}],
    }
    # slice 0 ran rank 0 for real (rank 1 replayed), slice 1 rank 1; coordinator clocks differ
    a = write_trace(tmp_path / "s0", manifest, [
        _row(0, 0, "send", 1, 0, 51.0, 58.0, 1.0, peer=1),
        _row(0, 1, "send", 1, 1, 58.0, 58.0, 0.25, peer=1),  # never received: left out of the graph
        _row(0, 2, "all_reduce", 0, 0, 58.25, 70.0, 0.25),
        _row(1, 0, "recv", 1, 0, 57.0, 58.0, 7.0, peer=0),
        _row(1, 1, "all_reduce", 0, 0, 69.0, 70.0, 11.0),
    ])
    b = write_trace(tmp_path / "s1", manifest, [
        _row(0, 0, "send", 1, 0, 9.0, 9.5, 9.0, peer=1),
        _row(0, 1, "all_reduce", 0, 0, 15.0, 15.5, 5.5),
        _row(1, 0, "recv", 1, 0, 2.0, 9.5, 2.0, peer=0),
        _row(1, 1, "all_reduce", 0, 0, 9.625, 15.5, 0.125),
    ])
    runs = [slice_run_from_trace(read_trace(a), [0], 0), slice_run_from_trace(read_trace(b), [1], 1)]
    assert runs[0].op_times == {0: [(51.0, 58.0), (58.25, 70.0)]}
    assert runs[0].device == "cuda:0" and runs[0].source.endswith("s0") and runs[0].notes
    assert runs[1].op_times == {1: [(2.0, 9.5), (9.625, 15.5)]}
    cal = align_slices(runs, lambda spec: 0.25 if spec.kind == "send" else 0.5, trace="bare.prismtrace")
    res = cal.replay()
    # rank 0: 1.0 compute, send (recv posted at 2.0) 2.0-2.25, compute .25+.25, all_reduce issued 2.75;
    # rank 1: 2.0 compute, recv, 0.125 compute -> 2.375; all_reduce 2.75-3.25
    assert res.ops[("p2p", 1, 0, 1, 0)].end == 2.25
    assert (res.ops[("coll", 0, 0)].start, res.makespan) == (2.75, 3.25)
    assert [s.device for s in cal.slices] == ["cuda:0", "cuda:1"]


# ----------------------------------------------------------------------------- the calibrated file


def _calibrated():
    graph = model(2, 1, 2, 2, seed=11)
    runs = measure(graph, [s.ranks for s in plan_slices(graph, 2)])
    return align_slices(runs, true_cost, trace="job.prismtrace", cost_name="true network")


def test_calibrated_file_round_trip(tmp_path):
    cal = _calibrated()
    path = write_calibrated(tmp_path / "cal", cal)
    back = read_calibrated(path)
    assert back.graph.events == cal.graph.events and back.graph.groups == cal.graph.groups
    marks = [(e.name, e.attrs) for evs in back.graph.events.values() for e in evs if isinstance(e, Mark)]
    assert marks and all(a == {"iteration": 1} for _, a in marks)
    assert back.costs == cal.costs and back.slices == cal.slices
    assert (back.trace, back.cost, back.serialize_group_collectives) == ("job.prismtrace", "true network", True)
    assert back.graph.notes == cal.graph.notes
    assert timeline(back.replay()) == timeline(cal.replay())
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"], manifest["world_size"]) == ("prismcalibrated", 2, 4)
    assert manifest["slices"][0] == {"index": 0, "ranks": [0, 1], "device": "sim:0", "source": "slice0.prismtrace"}
    write_calibrated(path, cal)  # replacing an existing one is fine, and leaves no temp dirs
    assert sorted(os.listdir(tmp_path)) == ["cal"]
    (tmp_path / "other").mkdir()
    with pytest.raises(FileExistsError):
        write_calibrated(tmp_path / "other", cal)


def _edit_manifest(path, edit):
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("edit,field,problem", [
    (lambda m: m.update(format="prismtrace"), "manifest field 'format'", "expected 'prismcalibrated'"),
    (lambda m: m.update(version=3), "manifest field 'version'", "supports version(s) 1, 2"),
    (lambda m: m.pop("slices"), "manifest field 'slices'", "is missing"),
    (lambda m: m.update(world_size="4"), "manifest field 'world_size'", "is string, expected integer"),
    (lambda m: m.update(serialize_group_collectives=1), "manifest field 'serialize_group_collectives'",
     "expected boolean"),
    (lambda m: m["groups"][0].update(ranks=[0, "1"]), "manifest field 'groups[0].ranks'", "list of ranks"),
    (lambda m: m["slices"][1].pop("device"), "manifest field 'slices[1].device'", "is missing"),
    (lambda m: m.update(complete=False), "manifest field 'complete'", "not finished"),
])
def test_reader_rejects_bad_manifest_naming_file_and_field(tmp_path, edit, field, problem):
    path = write_calibrated(tmp_path / "cal", _calibrated())
    _edit_manifest(path, edit)
    with pytest.raises(CalibratedFormatError) as e:
        read_calibrated(path)
    assert str(path / "manifest.json") in str(e.value) and field in str(e.value) and problem in str(e.value)
    assert e.value.field == field


def _edit_events(path, edit):
    file = path / "events.parquet"
    pq.write_table(edit(pq.read_table(file)), file)


def _set(table, name, fn):
    values = table.column(name).to_pylist()
    return table.set_column(table.schema.get_field_index(name), name,
                            pa.array(fn(values, table.column("type").to_pylist()), table.schema.field(name).type))


@pytest.mark.parametrize("edit,field,problem", [
    (lambda t: t.drop_columns(["duration"]), "column 'duration'", "is missing"),
    (lambda t: t.set_column(t.schema.get_field_index("seq"), "seq", t.column("seq").cast(pa.int32())),
     "column 'seq'", "has type int32, expected int64"),
    (lambda t: _set(t, "cost_source", lambda v, ty: [x == "comm" and "guess" or s for s, x in zip(v, ty, strict=True)]),
     "column 'cost_source'", "is 'guess'"),
    (lambda t: _set(t, "type", lambda v, ty: ["sleep" if x == "compute" else x for x in v]),
     "column 'type'", "is 'sleep'"),
    (lambda t: _set(t, "duration", lambda v, ty: [d + (i == ty.index("comm")) for i, d in enumerate(v)]),
     "column 'duration'", "differs between its members"),
    (lambda t: _set(t, "index", lambda v, ty: [i + (i > 2) for i in v]), "column 'index'", "jumps to 4"),
    (lambda t: _set(t, "refs", lambda v, ty: ["[99]" if x == "wait" else s for s, x in zip(v, ty, strict=True)]),
     "events", "waits on event 99"),
])
def test_reader_rejects_bad_events_naming_file_and_field(tmp_path, edit, field, problem):
    path = write_calibrated(tmp_path / "cal", _calibrated())
    _edit_events(path, edit)
    with pytest.raises(CalibratedFormatError) as e:
        read_calibrated(path)
    assert str(path / "events.parquet") in str(e.value) and field in str(e.value) and problem in str(e.value)


def test_reader_rejects_what_is_not_a_calibrated_graph(tmp_path):
    with pytest.raises(CalibratedFormatError, match="manifest is missing"):
        read_calibrated(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(CalibratedFormatError, match=r"manifest.json: manifest is not JSON"):
        read_calibrated(tmp_path)


def test_align_rejects_inconsistent_slices():
    graph = model(2, 1, 2, 1)
    runs = measure(graph, [(0, 1), (2, 3)])
    with pytest.raises(AlignError, match="rank 1 is in slice 0 and in slice 1"):
        align_slices([runs[0], SliceRun(1, graph.groups, {**runs[1].events, 1: graph.events[1]},
                                        {**runs[1].op_times, 1: runs[0].op_times[1]})], true_cost)
    with pytest.raises(AlignError, match="repeat"):
        align_slices([runs[0], SliceRun(0, graph.groups, runs[1].events, runs[1].op_times)], true_cost)
    with pytest.raises(AlignError, match=r"rank\(s\) \[2, 3\] belong to process groups but were measured in no"):
        align_slices(runs[:1], true_cost)
    runs[1].op_times[3] = runs[1].op_times[3][:-1]
    with pytest.raises(AlignError, match="rank 3 has 6 op"):
        align_slices(runs, true_cost)
    runs[1].op_times[3] = [(1.0, 0.5)] * 6
    with pytest.raises(AlignError, match="completion >= issue"):
        align_slices(runs, true_cost)


def test_calibrated_graph_keeps_two_clocks_and_reads_version_1(tmp_path):
    """Slices measured on GPUs give compute with device times and host waits; the file keeps them (v2),
    and a v1 file (no gpu column) still reads, on one clock."""
    from prism_megatron.replay import CpuSync, Wait

    cal = _calibrated()
    rank0 = cal.graph.events[0]
    i = next(k for k, e in enumerate(rank0) if isinstance(e, Compute))
    rank0[i] = Compute(rank0[i].duration, rank0[i].label, rank0[i].duration * 3)
    rank0.insert(i + 1, CpuSync())
    for k, e in enumerate(rank0):  # waits name ops by position: shift those after the insert
        if isinstance(e, Wait):
            rank0[k] = Wait(tuple(r + 1 if r > i else r for r in e.refs))
    path = write_calibrated(tmp_path / "cal", cal)
    back = read_calibrated(path)
    assert back.graph.events == cal.graph.events
    assert timeline(back.replay()) == timeline(cal.replay())
    assert back.replay().makespan > _calibrated().replay().makespan  # the device time and the wait count
    one = write_calibrated(tmp_path / "one", _calibrated())
    table = pq.read_table(one / "events.parquet").drop_columns(["gpu"])
    pq.write_table(table, one / "events.parquet")
    _edit_manifest(one, lambda m: m.update(version=1))
    assert read_calibrated(one).graph.events == _calibrated().graph.events
