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
from prism_megatron.replay.synthesize import SynthesisError, fold_graph, synthesize
from prism_megatron.replay.synthetic import Shape, megatron_1f1b, replica_fold
from prism_megatron.report import make_report, read_report, summary_text
from prism_megatron.report.wandb_log import report_summary
from prism_megatron.trace import TraceFormatError, read_trace
from prism_megatron.trace.fold import FoldClass

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
    # a live rank whose pipeline partner is virtual cannot be replayed symmetrically
    shape = Shape(tp=1, pp=2, dp=2, microbatches=1, iterations=1)
    with pytest.raises(GraphError, match=r"rank [01] event \d+: send on group \d+ \(peer [23]\).*peer is a virtual"):
        replay(fold_graph(megatron_1f1b(shape), [0, 1, 0, 1], 8))


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
