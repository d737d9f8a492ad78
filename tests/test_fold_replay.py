"""Folded jobs: synthesis of every rank from the live ones, symmetric replay, reading job.fold."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from folding import fold_trace

from conftest import PROGRAMS, launch_source, prism
from prism_megatron.calibration.costmodel import CollectiveCostModel, link_for
from prism_megatron.calibration.profiles import load_profile
from prism_megatron.replay import Comm, GraphBuilder, GraphError, Group, graph_from_trace, replay
from prism_megatron.replay.graph import Graph, Mark, Wait
from prism_megatron.replay.synthesize import SynthesisError, fold_graph, synthesize
from prism_megatron.replay.synthetic import Shape, class_fold, megatron_1f1b, replica_fold
from prism_megatron.report import make_report, read_report, summary_text
from prism_megatron.report.wandb_log import report_summary
from prism_megatron.trace import TraceFormatError, read_trace
from prism_megatron.trace.fold import FoldClass, make_fold, parse_fold

PROFILE = load_profile("h100-nvlink-ib400")


def _canonical(graph, rank):
    """A rank's events with groups named by their ranks (synthesis gives shifted groups new ids)."""
    out = []
    for ev in graph.events[rank]:
        if isinstance(ev, Comm):
            out.append((ev.kind, graph.groups[ev.group].ranks, ev.seq, ev.peer, ev.root, ev.nbytes, ev.async_op,
                        ev.label))
        else:
            out.append(ev)
    return out


def _same_times(a, b, ranks):
    assert a.iteration_times() == b.iteration_times()
    for r in ranks:
        assert a.rank_end[r] == b.rank_end[r], r
        assert a.breakdown(r) == b.breakdown(r), r
        assert a.event_times[r] == b.event_times[r], r


@pytest.mark.parametrize("shape", [Shape(tp=2, pp=4, dp=8, microbatches=4, iterations=2, gpu_times=True),
                                   Shape(tp=1, pp=1, dp=8, microbatches=2, iterations=2)],
                         ids=["tp2-pp4-dp8", "dp8"])
def test_synthesis_and_symmetric_replay_equal_the_full_job(shape):
    full = megatron_1f1b(shape)
    folded = fold_graph(full, replica_fold(shape), gpus_per_node=4)
    live = sorted(folded.events)
    assert len(live) == shape.tp * shape.pp and all(set(g.ranks) for g in folded.groups.values())

    synth = synthesize(folded)
    assert sorted(synth.events) == list(range(shape.world_size))
    for r in range(shape.world_size):
        assert _canonical(synth, r) == _canonical(full, r), r

    cost = CollectiveCostModel(PROFILE, gpus_per_node=4)  # DP groups cross nodes, TP pairs do not
    ref = replay(full, cost)
    _same_times(replay(synth, cost), ref, range(shape.world_size))
    sym = replay(folded, cost)
    assert sorted(sym.graph.ranks) == live
    _same_times(sym, ref, live)
    # collectives over groups with virtual members are costed for the whole group
    dp_ops = [op for op in sym.ops.values() if op.label.startswith("dp.")]
    assert dp_ops and all(len(op.issue) < len(op.ranks) for op in dp_ops)
    rs = next(op for op in dp_ops if op.kind == "reduce_scatter")
    expected = cost.time("reduce_scatter", shape.grad_bytes // 2, rs.ranks)
    assert rs.end - rs.start == pytest.approx(expected, rel=1e-12)
    if shape.dp > 1:  # across nodes: slower than the same group size inside one node
        assert expected > cost.time("reduce_scatter", shape.grad_bytes // 2, range(shape.dp // 2))


def test_placement_changes_the_cost_of_groups_that_cross_nodes():
    shape = Shape(tp=2, pp=1, dp=4, microbatches=1, iterations=1)
    folded = fold_graph(megatron_1f1b(shape), replica_fold(shape), gpus_per_node=8)
    one_node = replay(folded, CollectiveCostModel(PROFILE, gpus_per_node=8)).makespan
    per_pair = replay(folded, CollectiveCostModel(PROFILE, gpus_per_node=2)).makespan
    assert per_pair > one_node  # DP groups {0,2,4,6} leave the node when a node holds one TP pair
    assert link_for(PROFILE, (0, 3), 4).name == "intra" and link_for(PROFILE, (0, 4), 4).name == "inter"
    assert link_for(PROFILE, (0, 4)).name == "intra"  # the profile's 8 GPUs per node
    with pytest.raises(ValueError, match="gpus_per_node 0"):
        CollectiveCostModel(PROFILE, gpus_per_node=0)


def _tiny(world=4):
    """TP pairs {0,1}, {2,3}; DP pairs {0,2}, {1,3}; one all-reduce on each."""
    b = GraphBuilder()
    tp = [b.group(0, [0, 1], "tp"), b.group(1, [2, 3], "tp")]
    dp = [b.group(2, [0, 2], "dp"), b.group(3, [1, 3], "dp")]
    for r in range(world):
        b.compute(r, 1.0)
        b.collective(r, "all_reduce", tp[r // 2], 8)
        b.collective(r, "all_reduce", dp[r % 2], 8)
    return b.build("tiny")


def test_inconsistent_folds_are_errors_naming_rank_and_group():
    b = GraphBuilder([Group(0, (0, 1)), Group(1, (2,))])
    for r in range(3):
        b.collective(r, "all_reduce", 0 if r < 2 else 1)
    with pytest.raises(SynthesisError, match=r"rank 2 \(mirroring rank 0, shift 2\).*group 0 .*rank 3 is outside"):
        synthesize(fold_graph(b.build(), [0, 1, 0], 8))
    with pytest.raises(SynthesisError, match=r"group 2 .*member 3 mirrors rank 0"):
        synthesize(fold_graph(_tiny(), [0, 0, 0, 0], 8))
    with pytest.raises(SynthesisError, match=r"group [13] .*virtual member 3 whose representative 0 is not in"):
        synthesize(fold_graph(_tiny(), [0, 1, 2, 0], 8))
    with pytest.raises(GraphError, match=r"group [13] .*virtual member 3 whose representative 0 is not in"):
        replay(fold_graph(_tiny(), [0, 1, 2, 0], 8))
    # a live rank whose pipeline partner is virtual cannot be replayed symmetrically; here (stage 1
    # "mirroring" stage 0) the synthesised job is no job either
    shape = Shape(tp=1, pp=2, dp=2, microbatches=1, iterations=1)
    bad = fold_graph(megatron_1f1b(shape), [0, 1, 0, 1], 8)
    with pytest.raises(GraphError, match=r"symmetric replay would not be exact: rank [01] event \d+ \(send\) has p2p "
                                         r"partner [23], which is not replayed"):
        replay(bad, fold_method="symmetric")
    with pytest.raises(SynthesisError, match=r"rank 2 event \d+ \(send with peer 2 of rank 0\) has translated peer 4, "
                                             r"outside \[0, 4\)"):
        replay(bad)  # auto: every rank, which cannot be synthesised


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """A real 8-rank TP2·PP2·DP2 trace and its fold to replica 0 (ranks 0, 1, 4, 5)."""
    root = tmp_path_factory.mktemp("fold")
    full = launch_source(root, (PROGRAMS / "tp_pp_dp.py").read_text(), world_size=8, slots_per_device=2)
    rep = [r - 2 * ((r // 2) % 2) for r in range(8)]  # DP index 1 -> 0
    classes = [FoldClass("stage 0 (first)", "embedding", 4, (0, 1)), FoldClass("stage 1 (last)", "loss", 4, (4, 5))]
    folded = read_trace(fold_trace(full.path, root / "folded", rep, gpus_per_node=4, classes=classes,
                                   class_of=[0, 0, 0, 0, 1, 1, 1, 1], contributions={"all_reduce": {"mirror": 12}}))
    return full, folded, rep


def test_folded_trace_synthesises_the_full_trace_graph(launched):
    full, folded, rep = launched
    assert folded.fold.live == (0, 1, 4, 5) and folded.fold.rep == tuple(rep)
    assert folded.fold.contribution_counts() == {"mirror": 12, "recorded": 0, "keep": 0, "passthrough": 0}
    g_full, g_fold = graph_from_trace(full), graph_from_trace(folded)
    assert sorted(g_fold.events) == [0, 1, 4, 5] and g_fold.fold == folded.fold
    synth = synthesize(g_fold)
    for r in range(8):  # the same program, op by op; only compute times differ (a virtual rank's are its rep's)
        assert [e for e in _canonical(synth, r) if isinstance(e, tuple)] == [
            e for e in _canonical(g_full, r) if isinstance(e, tuple)], r
    cost = CollectiveCostModel(PROFILE, gpus_per_node=4)
    _same_times(replay(g_fold, cost), replay(synth, cost), [0, 1, 4, 5])


def test_reader_rejects_bad_folds(launched, tmp_path):
    _, folded, rep = launched

    def with_fold(change):
        path = tmp_path / f"t{len(list(tmp_path.iterdir()))}"
        shutil.copytree(folded.path, path)
        manifest = json.loads((path / "manifest.json").read_text())
        change(manifest["job"]["fold"])
        (path / "manifest.json").write_text(json.dumps(manifest))
        return path

    cases = [
        (lambda f: f.update(rep=[1, *f["rep"][1:]]), r"job.fold.rep' maps live rank 0 to 1"),
        (lambda f: f.update(rep=f["rep"][:7]), r"job.fold.rep' has 7 entries, expected one per rank \(8\)"),
        (lambda f: f.update(world_size=16), r"job.fold.world_size' is 16, but the trace's world_size is 8"),
        (lambda f: f.update(version=9), r"job.fold.version' is 9"),
        (lambda f: f["classes"][0].update(count=5), r"job.fold.classes\[0\].count' is 5"),
    ]
    for change, message in cases:
        with pytest.raises(TraceFormatError, match=message):
            read_trace(with_fold(change))
    # rows of a rank the fold says is virtual
    path = with_fold(lambda f: f.update(live=[0, 1, 4], rep=[0, 1, 0, 1, 4, 4, 4, 4],
                                        classes=[], class_of=[]))
    with pytest.raises(TraceFormatError, match="column 'rank'.* contains 5, a virtual rank"):
        read_trace(path)


def test_report_of_a_folded_trace_shows_classes(launched, tmp_path):
    _, folded, _ = launched
    rep = read_report(make_report(folded.path, tmp_path, cluster="h100-nvlink-ib400")["report"])
    fold = rep["fold"]
    assert fold["world_size"] == 8 and fold["live"] == [0, 1, 4, 5] and fold["gpus_per_node"] == 4
    assert fold["contributions"] == {"mirror": 12, "recorded": 0, "keep": 0, "passthrough": 0}
    assert [(c["name"], c["count"], c["sandbox"]) for c in fold["classes"]] == [
        ("stage 0 (first)", 4, [0, 1]), ("stage 1 (last)", 4, [4, 5])]
    assert all(c["compute_s"] > 0 and c["bubble_s"] is not None for c in fold["classes"])
    assert [b["rank"] for b in rep["prediction"]["breakdown"]] == [0, 1, 4, 5]
    assert {b["class"] for b in rep["prediction"]["breakdown"]} == {"stage 0 (first)", "stage 1 (last)"}
    prov = rep["prediction"]["provenance"]
    assert "4 of 8 ranks ran for real (ranks 0-1,4-5), the other 4 are virtual" in prov
    assert "mirror 12, recorded 0, keep 0" in prov and "on 4 GPUs per node; symmetric replay" in prov
    text = summary_text(rep, width=200)
    assert "8 ranks (4 real, the others virtual)" in text and "rank classes: 4 of 8 ranks ran, 4 virtual" in text
    assert "median iteration per rank" not in text  # classes, not one row per rank
    logged = report_summary(rep)
    assert logged["prism/fold/live_ranks"] == 4 and logged["prism/classes/stage_0_first/ranks"] == 4
    assert logged["prism/classes/stage_1_last/compute_ms"] == fold["classes"][1]["compute_s"] * 1e3


def test_trace_show_and_chrome_of_a_folded_trace(launched, tmp_path):
    from prism_megatron.trace.chrome import to_chrome
    from prism_megatron.trace.summary import summarize

    _, folded, _ = launched
    text = summarize(folded.path)
    assert "folded: 4 of 8 ranks ran (ranks 0,1,4,5), 2 rank class(es), 4 GPUs per node; virtual contributions: " \
           "mirror 12, recorded 0, keep 0, passthrough 0" in text
    assert "compute time per rank" in text
    names = {e["args"]["name"] for e in to_chrome(folded)["traceEvents"] if e.get("name") == "process_name"}
    assert names == {"rank 0", "rank 1", "rank 4", "rank 5"}


def test_replay_cli_on_a_folded_trace(launched):
    _, folded, _ = launched
    root = folded.path.parent
    sym = prism("replay", str(folded.path), "--cluster", "h100-nvlink-ib400", cwd=root)
    full = prism("replay", str(folded.path), "--cluster", "h100-nvlink-ib400", "--full", cwd=root)
    assert sym.returncode == 0 and full.returncode == 0, sym.stderr + full.stderr
    assert "class (mean of its ranks)" in sym.stdout and "stage 1 (last)" in sym.stdout
    assert "symmetric replay of the live ranks" in sym.stdout
    assert "synthesised: 8 ranks" in full.stdout and "replay of the synthesised graph of every rank" in full.stdout
    its = lambda out: [line for line in out.splitlines() if line.strip().startswith("iteration ")]  # noqa: E731
    assert its(sym.stdout) and its(sym.stdout) == its(full.stdout)
    pairs = prism("replay", str(folded.path), "--cluster", "h100-nvlink-ib400", "--gpus-per-node", "2", cwd=root)
    assert pairs.returncode == 0 and "on 2 GPUs per node" in pairs.stdout, pairs.stderr
    makespan = lambda out: float(re.search(r"makespan ([0-9.]+) ms", out).group(1))  # noqa: E731
    assert makespan(pairs.stdout) > makespan(sym.stdout)  # data-parallel pairs now cross nodes


# --- version-2 folds (class depth): TP peers and middle pipeline stages folded too -------------------
# The plans below take their coordinates from replay.synthetic's rank order, tp fastest, then (cp = 1)
# dp, then pp: the mixed radix that Megatron's RankGenerator gives a dense layout in order tp-cp-dp-pp.


def test_v2_fold_translates_by_coordinates():
    shape = Shape(tp=2, pp=4, dp=3)
    fold = make_fold(**class_fold(shape), gpus_per_node=8)
    assert fold.version == 2 and fold.live == (0, 6, 18) and fold.depth == "class"
    doc = fold.to_json()
    assert doc["version"] == 2 and doc["sizes"] == [2, 1, 3, 4] and doc["coords"][7] == [1, 0, 0, 1]
    assert parse_fold(doc, 24, "m.json") == fold
    for r in range(24):
        for x in (0, 6, 18, 5, 23):
            c = [(a + b - d) % n for a, b, d, n in zip(fold.coords[x], fold.coords[r], fold.coords[fold.rep[r]],
                                                         fold.sizes, strict=True)]
            assert fold.coords[fold.translate(r, x)] == tuple(c)
    r = shape.rank(1, 2, 2)  # a TP peer of a middle stage mirrors stage 1's tp = dp = 0 rank
    assert fold.rep[r] == shape.rank(0, 0, 1)
    assert fold.translate(r, shape.rank(0, 0, 2)) == shape.rank(1, 2, 3)  # its downstream neighbour
    assert fold.translate(r, shape.rank(1, 1, 0)) == shape.rank(0, 0, 1)  # wraps around the torus
    assert fold.lockstep_steps() == (1, 1, 1, 4)  # tp, dp; not pp (stages 0 and 1 mirror different ranks)
    v1 = make_fold(replica_fold(shape), 8)
    assert v1.version == 1 and "coords" not in v1.to_json()
    assert v1.translate(shape.rank(1, 2, 3), shape.rank(0, 0, 2)) == shape.rank(0, 2, 2)  # x + r - rep[r]


def test_bad_v2_plans_are_refused_naming_the_field():
    good = make_fold(**class_fold(Shape(tp=2, pp=3, dp=2)), gpus_per_node=8).to_json()
    cases = [
        (dict(depth="deep"), r"'job.fold.depth' is 'deep', expected one of replica, class"),
        (dict(axes=["tp", "tp", "dp", "pp"]), r"'job.fold.axes' is \['tp', 'tp', 'dp', 'pp'\], expected a list of "
                                              "distinct axis names"),
        (dict(sizes=[2, 1, 2]), r"'job.fold.sizes' is \[2, 1, 2\], expected one size >= 1 per axis \(4 axes\)"),
        (dict(sizes=[2, 1, 3, 3]), r"'job.fold.sizes' is \[2, 1, 3, 3\], whose product 18 is not the world size 12"),
        (dict(coords=None), r"'job.fold.coords' is missing, expected one list of 4 coordinates per rank \(12\)"),
        (dict(coords=good["coords"][:5]), r"'job.fold.coords' has 5 entries"),
        (dict(coords=[*good["coords"][:3], [0, 0, 2, 0], *good["coords"][4:]]),
         r"'job.fold.coords\[3\]' is \[0, 0, 2, 0\], expected 4 integers within sizes \[2, 1, 2, 3\]"),
        (dict(coords=[*good["coords"][:3], good["coords"][0], *good["coords"][4:]]),
         r"'job.fold.coords\[3\]' is \[0, 0, 0, 0\], the same as rank 0's: coordinates must be distinct"),
    ]
    for change, message in cases:
        with pytest.raises(TraceFormatError, match=r"plan.json.*" + message):
            parse_fold({**good, **change}, 12, "plan.json")


def test_replica_fold_keeping_two_dp_indices_replays_symmetrically():
    """A version-2 replica fold that keeps k = 2 DP indices (as a MoE layout's expert groups may need):
    DP peers two apart are lockstep peers, so the live ranks replay symmetrically and exactly."""
    shape = Shape(tp=2, pp=2, dp=4, microbatches=2, iterations=1)
    kw = class_fold(shape)
    rep = [shape.rank(t, d % 2, p) for t, _, d, p in kw["coords"]]
    full = megatron_1f1b(shape)
    folded = fold_graph(full, rep, 4, depth="replica", axes=kw["axes"], sizes=kw["sizes"], coords=kw["coords"])
    assert folded.fold.lockstep_steps() == (2, 1, 2, 2) and len(folded.fold.live) == 8
    cost = CollectiveCostModel(PROFILE, gpus_per_node=4)
    sym = replay(folded, cost)
    assert sym.method.startswith("symmetric replay of the live ranks (8;")
    _same_times(sym, replay(full, cost), folded.fold.live)


@pytest.mark.parametrize("shape", [Shape(tp=2, pp=4, dp=3, microbatches=4, iterations=2, gpu_times=True),
                                   Shape(tp=2, pp=5, dp=2, microbatches=2, iterations=1)],
                         ids=["tp2-pp4-dp3", "tp2-pp5-dp2"])
def test_class_fold_synthesises_the_job_and_replays_one_pipeline_exactly(shape):
    full = megatron_1f1b(shape)  # every stage on its own 1F1B schedule; middle stages folded onto stage 1
    folded = fold_graph(full, gpus_per_node=4, **class_fold(shape))
    assert folded.fold.live == (0, shape.rank(0, 0, 1), shape.rank(0, 0, shape.pp - 1))
    synth = synthesize(folded)
    for r in range(shape.world_size):
        assert _canonical(synth, r) == _canonical(full, r), r
    cost = CollectiveCostModel(PROFILE, gpus_per_node=4)
    ref = replay(full, cost)
    _same_times(replay(synth, cost), ref, range(shape.world_size))
    fast = replay(folded, cost)  # one pipeline synthesised (its folded middle stages), symmetric over TP/DP peers
    pipeline = [shape.rank(0, 0, p) for p in range(shape.pp)]
    assert fast.graph.ranks == pipeline and "one pipeline" in fast.method
    _same_times(fast, ref, pipeline)
    everyone = replay(folded, cost, fold_method="full")
    assert sorted(everyone.graph.events) == list(range(shape.world_size)) and "every rank" in everyone.method
    _same_times(everyone, ref, range(shape.world_size))
    with pytest.raises(GraphError, match="the symmetric replay does not apply to this fold; replay of 4 synthesised"
                       if shape.pp == 4 else "the symmetric replay does not apply"):
        replay(folded, cost, fold_method="symmetric")


def test_asymmetric_placement_falls_back_to_every_rank():
    shape = Shape(tp=2, pp=4, dp=3, microbatches=2, iterations=1)
    full = megatron_1f1b(shape)
    folded = fold_graph(full, gpus_per_node=3, **class_fold(shape))
    cost = CollectiveCostModel(PROFILE, gpus_per_node=3)  # TP pair {0, 1} on one node, {2, 3} across two
    result = replay(folded, cost)
    assert "every rank (24)" in result.method
    assert any("the pipeline replay would not be exact (all_reduce of 16777216 B on ranks [0, 1] costs" in n and
               "on its translate [2, 3] (the placement on nodes is not symmetric" in n for n in result.graph.notes)
    _same_times(result, replay(full, cost), range(shape.world_size))
    with pytest.raises(GraphError, match="the pipeline replay would not be exact: all_reduce"):
        replay(folded, cost, fold_method="pipeline")


@pytest.mark.parametrize("pp", [4, 5, 6, 7, 8])
def test_folded_stages_run_their_own_1f1b_schedule(pp):
    """Stage p warms up min(pp - p - 1, M) forwards: each folded middle stage gets its own order of
    units from stage 1's, so the folded job is the full job, event for event and time for time."""
    cost = CollectiveCostModel(PROFILE, gpus_per_node=4)
    for m in range(1, 17):
        shape = Shape(tp=1, pp=pp, dp=2, microbatches=m, iterations=2, layers_per_stage=1, gpu_times=m % 2 == 0)
        full = megatron_1f1b(shape)
        folded = fold_graph(full, gpus_per_node=4, **class_fold(shape))
        synth = synthesize(folded)
        for r in range(shape.world_size):
            assert _canonical(synth, r) == _canonical(full, r), (m, r)
        fast = replay(folded, cost)
        assert "one pipeline" in fast.method
        _same_times(fast, replay(full, cost), fast.graph.ranks)


_VPP_CASES = [(pp, vpp, m, mode) for i, (pp, vpp, m) in enumerate(
    (pp, vpp, m) for pp in range(4, 9) for vpp in (2, 3, 4) for m in (pp, 2 * pp)) for mode in [i % 3]]


_MODES = ("batched", "overlap", "overlap-ws")


@pytest.mark.parametrize("pp,vpp,m,mode", _VPP_CASES,
                         ids=[f"pp{a}-vpp{b}-m{c}-{_MODES[d]}" for a, b, c, d in _VPP_CASES])
def test_folded_stages_run_their_own_interleaved_schedule(pp, vpp, m, mode):
    """Under Megatron's interleaved schedule each middle stage runs its own order of (microbatch, chunk)
    units and p2p calls (batched, or overlapped with waits deferred, the forward sends waited at once
    where the release does): every folded middle stage rebuilt from stage 1's is the full job's stage,
    event for event, and the folded replay is the full replay, time for time."""
    shape = Shape(tp=1, pp=pp, dp=2, microbatches=m, iterations=2, layers_per_stage=1, vpp=vpp,
                  overlap_p2p=mode > 0, wait_sends=mode == 2, gpu_times=m % 2 == 0)
    full = megatron_1f1b(shape)
    folded = fold_graph(full, gpus_per_node=4, **class_fold(shape))
    assert folded.fold.schedule == "interleaved" and folded.fold.chunks == vpp and len(folded.fold.live) == 3
    synth = synthesize(folded)
    for r in range(shape.world_size):
        assert _canonical(synth, r) == _canonical(full, r), r
    cost = CollectiveCostModel(PROFILE, gpus_per_node=4)
    fast = replay(folded, cost)
    assert "one pipeline" in fast.method
    _same_times(fast, replay(full, cost), fast.graph.ranks)


@pytest.mark.parametrize("pp,vpp,m,overlap", [(4, 1, 6, False), (6, 1, 8, False), (4, 2, 4, True), (6, 3, 12, False),
                                               (8, 4, 8, True), (5, 2, 10, True)])
def test_folded_stages_place_the_overlapped_dp_ops_as_their_own_stage_issues_them(pp, vpp, m, overlap):
    """With --overlap-grad-reduce --overlap-param-gather (and, interleaved, Megatron-LM's aligned grad sync and
    param gather: chunk c's grad sync after backward last(c) + stage, chunk c + 1's param gather before forward
    first(c) - stage) every folded middle stage rebuilt from stage 1's is the job built whole, event for event,
    and so is the replay."""
    shape = Shape(tp=1, pp=pp, dp=2, microbatches=m, iterations=2, layers_per_stage=1, vpp=vpp,
                  overlap_p2p=overlap, overlap_grad=True)
    full = megatron_1f1b(shape)
    folded = fold_graph(full, gpus_per_node=4, **class_fold(shape))
    synth = synthesize(folded)
    for r in range(shape.world_size):
        assert _canonical(synth, r) == _canonical(full, r), r
    cost = CollectiveCostModel(PROFILE, gpus_per_node=4)
    _same_times(replay(folded, cost, fold_method="full"), replay(full, cost), range(shape.world_size))


def test_a_dp_op_that_no_stage_rule_places_is_refused_naming_it():
    shape = Shape(tp=1, pp=4, dp=2, microbatches=4, iterations=1, layers_per_stage=1, vpp=2, overlap_grad=True)
    full = megatron_1f1b(shape)
    events = list(full.events[2])  # stage 1: its first grad sync, moved to after its first forward
    sync = next(i for i, e in enumerate(events) if isinstance(e, Comm) and e.kind == "reduce_scatter")
    op = events.pop(sync)
    f0 = next(i for i, e in enumerate(events) if isinstance(e, Mark) and e.name == "forward" and e.phase == "E")
    events.insert(f0 + 1, op)
    folded = fold_graph(Graph(full.groups, {**full.events, 2: events}), gpus_per_node=4, **class_fold(shape))
    with pytest.raises(SynthesisError, match=r"rank 2 \(pipeline stage 1\), iteration 0: event \d+ \(reduce_scatter "
                                             r"on group \d+\) lies directly after unit \('F', 0\), where Megatron's "
                                             r"interleaved schedule issues a param gather before a forward"):
        synthesize(folded)


def test_interleaved_fold_with_a_larger_microbatch_group_and_tp_dp_peers():
    shape = Shape(tp=2, pp=4, dp=2, microbatches=10, iterations=1, layers_per_stage=1, vpp=2, group=5,
                  overlap_p2p=True)
    full = megatron_1f1b(shape)
    folded = fold_graph(full, gpus_per_node=4, **class_fold(shape))
    synth = synthesize(folded)
    for r in range(shape.world_size):
        assert _canonical(synth, r) == _canonical(full, r), r
    cost = CollectiveCostModel(PROFILE, gpus_per_node=4)
    _same_times(replay(folded, cost, fold_method="full"), replay(full, cost), range(shape.world_size))


def test_interleaved_fold_errors_name_what_does_not_fit():
    shape = Shape(tp=1, pp=4, dp=1, microbatches=4, iterations=1, layers_per_stage=1, vpp=2)
    full = megatron_1f1b(shape)
    kw = class_fold(shape)
    wrong = fold_graph(full, gpus_per_node=8, **{**kw, "warmup": [9, 6, 2, 0]})  # stage 1 ran 2·2 + 2 = 6
    with pytest.raises(SynthesisError, match=r"rank 1 \(pipeline stage 1\), iteration 0: its units run in an order "
                                             r"that is not the plan's interleaved schedule for its stage "
                                             r"\(warm-up 6\)"):
        replay(wrong)
    as_1f1b = fold_graph(full, gpus_per_node=8, **{**kw, "schedule": "1f1b", "warmup": [3, 2, 1, 0]})
    with pytest.raises(SynthesisError, match=r"unit of microbatch 0, chunk 1, iteration 0: not a non-interleaved 1F1B "
                                             r"unit"):
        replay(as_1f1b)
    with pytest.raises(TraceFormatError, match=r"'job.fold.schedule.group' is 3, expected an integer >= 4"):
        fold_graph(full, gpus_per_node=8, **{**kw, "group": 3})  # below PP: Megatron refuses it


def test_folded_stages_need_the_schedule_and_unit_markers():
    shape = Shape(tp=1, pp=5, dp=1, microbatches=4, iterations=1)
    full = megatron_1f1b(shape)
    kw = class_fold(shape)
    no_schedule = fold_graph(full, gpus_per_node=8, **{**kw, "schedule": "", "warmup": ()})
    with pytest.raises(SynthesisError, match=r"rank 1's virtual pipeline stage 2 runs its own order of units, but "
                                             r"the fold plan names no pipeline schedule.*replica depth.*"
                                             r"\(needed for rank 2"):
        replay(no_schedule)
    markers = ("forward", "backward")
    bare = Graph(full.groups, {r: [Mark("step", e.phase) if isinstance(e, Mark) and e.name in markers else e
                                   for e in evs] for r, evs in full.events.items()})  # a program without units
    with pytest.raises(SynthesisError, match=r"rank 1 \(pipeline stage 1\): its trace has no scheduling units.*"
                                             r"cannot be folded"):
        replay(fold_graph(bare, gpus_per_node=8, **kw))
    wrong = fold_graph(full, gpus_per_node=8, **{**kw, "warmup": [4, 1, 2, 1, 0]})  # stage 1 ran 3 warm-ups
    with pytest.raises(SynthesisError, match=r"rank 1 \(pipeline stage 1\), iteration 0: its units run in an order "
                                             r"that is not the plan's 1F1B schedule for its stage \(warm-up 1\): "
                                             r"unit 2 is \('F', 2\), the schedule's \('B', 0\)"):
        replay(wrong)
    interleaved = fold_graph(full, gpus_per_node=8, **{**kw, "schedule": "interleaved", "warmup": ()})
    with pytest.raises(SynthesisError, match="names Megatron's interleaved schedule"):
        replay(interleaved)
    events = list(full.events[1])  # stage 1 (live) with a collective between two of its units
    at = next(i for i, e in enumerate(events) if isinstance(e, Mark) and e.name == "backward")
    mp = next(g.id for g in full.groups.values() if g.name == "mp")
    events = [Wait(tuple(x + (x >= at) for x in e.refs)) if isinstance(e, Wait) else e for e in events]
    events.insert(at, Comm("all_reduce", mp, 99, nbytes=4))
    odd = Graph(full.groups, {**full.events, 1: events})
    with pytest.raises(SynthesisError, match=rf"rank 1 \(pipeline stage 1\), iteration 0: event {at} \(all_reduce on "
                                             rf"group {mp}\) lies directly before unit \('B', 0\), where Megatron's "
                                             r"non-interleaved 1F1B schedule issues none between its units"):
        replay(fold_graph(odd, gpus_per_node=8, **kw))


def test_a_plan_with_a_bad_schedule_is_refused_naming_the_field():
    good = make_fold(**class_fold(Shape(tp=2, pp=3, dp=2)), gpus_per_node=8).to_json()
    assert good["schedule"] == {"name": "1f1b", "warmup": [2, 1, 0]}
    for change, message in [({"name": "zb"}, r"'job.fold.schedule.name' is 'zb'"),
                            ({"name": "1f1b", "warmup": [2, 1]}, r"'job.fold.schedule.warmup' has 2 entries"),
                            ({"name": "1f1b", "warmup": "2,1,0"}, r"'job.fold.schedule.warmup' is '2,1,0'")]:
        with pytest.raises(TraceFormatError, match=message):
            parse_fold({**good, "schedule": change}, 12, "plan.json")
    vpp = make_fold(**class_fold(Shape(tp=1, pp=4, dp=2, vpp=2, overlap_p2p=True)), gpus_per_node=8).to_json()
    assert vpp["schedule"] == {"name": "interleaved", "warmup": [10, 8, 6, 4], "chunks": 2, "group": 4,
                               "overlap_p2p": True, "wait_sends": False}
    assert parse_fold(vpp, 8, "plan.json").overlap_p2p
    for change, message in [({"chunks": 1}, r"'job.fold.schedule.chunks' is 1, expected an integer >= 2"),
                            ({"group": 2}, r"'job.fold.schedule.group' is 2, expected an integer >= 4"),
                            ({"overlap_p2p": "yes"}, r"'job.fold.schedule.overlap_p2p' is 'yes'"),
                            ({"warmup": [1, 2]}, r"'job.fold.schedule.warmup' has 2 entries; an interleaved")]:
        with pytest.raises(TraceFormatError, match=message):
            parse_fold({**vpp, "schedule": {**vpp["schedule"], **change}}, 8, "plan.json")
    legacy = parse_fold({**vpp, "schedule": {"name": "interleaved", "warmup": []}}, 8, "plan.json")
    assert legacy.schedule == "interleaved" and legacy.chunks == 0  # read; restage refuses it (re-plan)
    old = {k: v for k, v in good.items() if k != "schedule"}  # a version-2 plan from before: no schedule
    assert parse_fold(old, 12, "plan.json").schedule == ""


def test_inconsistent_v2_plans_are_errors_naming_rank_and_group():
    shape = Shape(tp=2, pp=3, dp=2, microbatches=1, iterations=1)
    kw = class_fold(shape)
    coords = list(kw["coords"])
    coords[2], coords[3] = coords[3], coords[2]  # ranks 2 and 3 (dp 1) swap their tp coordinates
    message = (r"rank 1 \(mirroring rank 0, offset tp\+1\) would join group \d+ \(dp, ranks \[0, 2\]\) translated to "
               r"ranks \[1, 3\], but member 3 mirrors rank 0 \(offset dp\+1\): the translated group does not exist")
    with pytest.raises(SynthesisError, match=message):
        synthesize(fold_graph(megatron_1f1b(shape), gpus_per_node=8, **{**kw, "coords": coords}))


def test_v2_folded_trace_reads_and_replays(launched, tmp_path):
    """The real TP2·PP2·DP2 trace folded to one rank per stage (TP peers and DP folded): rank r has
    coordinates tp = r % 2, dp = (r // 2) % 2, pp = r // 4 (the program's order, tp-cp-dp-pp)."""
    full, _, _ = launched
    coords = [(r % 2, 0, (r // 2) % 2, r // 4) for r in range(8)]
    path = fold_trace(full.path, tmp_path / "v2", [0, 0, 0, 0, 4, 4, 4, 4], gpus_per_node=4, depth="class",
                      axes=("tp", "cp", "dp", "pp"), sizes=(2, 1, 2, 2), coords=coords)
    trace = read_trace(path)
    assert trace.fold.version == 2 and trace.fold.live == (0, 4) and trace.fold.coords == tuple(coords)
    graph = graph_from_trace(trace)
    cost = CollectiveCostModel(PROFILE, gpus_per_node=4)
    sym = replay(graph, cost)
    assert sym.method.startswith("symmetric replay of the live ranks (2;") and sorted(sym.graph.events) == [0, 4]
    every = replay(synthesize(graph), cost)
    _same_times(sym, every, [0, 4])
    for r in range(8):  # rank 3 (tp 1, dp 1) does rank 0's ops on its own TP, DP and pipeline groups
        assert [e for e in _canonical(synthesize(graph), r) if isinstance(e, tuple)] == [
            e for e in _canonical(graph_from_trace(full), r) if isinstance(e, tuple)], r
