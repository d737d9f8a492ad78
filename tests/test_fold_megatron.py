"""Megatron jobs folded by ``run --prism-fold``: the mini recipes folded vs fully captured (per-class
peak memory, losses), tiny GPTs at 1,024 and 8,192 target ranks end to end (plan, capture, replay,
report), and the run mode's refusals. The core driver (megatron.core only) runs them on CPU.

Losses: a folded run computes one replica; its data-parallel reductions mirror that replica, so its
loss is replica 0's loss where the full run averages replicas that read different samples. They agree
within the spread of per-sample losses of a freshly initialised model (log(vocab) ~ 6.9): 2% here.
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from prism_megatron.megatron import cpu_mode

pytestmark = pytest.mark.skipif(cpu_mode._gpu_present(), reason="CPU runs of Megatron need CPU mode")
# runs megatron-core: CI also runs it on the second stack (.ci/run), but for the long checks of prism's own
# machinery (``heavy``: pytest.ini), which run on the first stack only: there the second runs one fold against
# its full capture, TP2·PP2·DP2's (whose full capture test_megatron_emulation's numerics make there too), and a
# serial capture of a middle stage under Megatron-LM's trainer. Unmarked, on the first stack only as before: the
# 8,192-rank fold (the 1,024-rank fold's Megatron code and 8 live ranks, at prism's scale), the MoE class fold by
# translated mirror, and batched p2p under VPP, whose p2p calls are the same in both releases' interleaved
# schedule. Overlapped p2p under VPP is where the releases differ (0.19 waits each steady forward's send at once:
# the fold's wait_sends); against real Megatron it runs on the first stack (0.16); on the second, the plan's record
# of the installed release's order (test_fold_class_depth) and 0.19's order in the synthetic schedule tests
# (test_fold_replay, test_microbatch_fold).
MEGATRON = pytest.mark.megatron
HEAVY = (MEGATRON, pytest.mark.heavy)

RECIPES = Path(__file__).parent / "recipes"
LOSS_RTOL = 0.02
# Runs: ``megatron_runs.run`` (conftest), each distinct command once per session. Folds are at replica depth
# unless a test asks for class depth: the sandbox the comparisons were made for (class depth folds middle
# pipeline stages, whose p2p with a live neighbour is another rule's).


def _class_peaks(trace_dir: Path, fold) -> dict[str, int]:
    """Per class of ``fold``: the largest max-allocated of the trace's ranks in it."""
    from prism_megatron.report.build import build_report

    out: dict[str, int] = {}
    for entry in build_report(trace_dir)["memory"]["ranks"]:
        name = fold.class_name(entry["rank"])
        out[name] = max(out.get(name, 0), entry["max_allocated"])
    return out


def _losses(metrics: dict) -> dict[int, float]:
    return {it: loss["lm loss"] for (_, it), (loss, _) in metrics.items() if loss.get("lm loss") is not None}


CASES = {
    "tp2pp2dp2": "mini-dense-tp2pp2dp2",
    "tp2pp2dp4": "mini-dense-tp2pp2dp4",
    "pp2vpp2": "mini-dense-pp2vpp2",
    "tp2dp2-distopt": "mini-dense-tp2dp2-distopt",
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=MEGATRON if c == "tp2pp2dp2" else HEAVY) for c in CASES])
def test_a_folded_mini_recipe_matches_its_full_capture(case, megatron_runs):
    from prism_megatron.trace import read_trace

    folded = megatron_runs.run(CASES[case], "on")
    full = megatron_runs.run(CASES[case], "off")  # also test_megatron_emulation's capture of the case
    fold = read_trace(folded["trace"]).fold
    assert fold is not None and len(fold.live) < fold.world_size, folded["output"][-2000:]
    assert "prism: fold: " in folded["output"] and "classes:" in folded["output"]
    assert read_trace(full["trace"]).fold is None
    got, want = _class_peaks(folded["trace"], fold), _class_peaks(full["trace"], fold)
    assert set(want) == {c.name for c in fold.classes} and all(want.values()), want
    if case == "tp2dp2-distopt":
        # the distributed optimizer's DP ranks are not identical to the byte (DP rank 1 peaked 452 B above
        # DP rank 0, whose figure the fold reports): within 1 KiB, the fold never above the full run
        assert got.keys() == want.keys() and all(0 <= want[k] - got[k] <= 1024 for k in want), (got, want)
    else:
        assert got == want, f"per-class max allocated differs (dense: 0 B expected): fold {got}, full {want}"
    a, b = _losses(folded["metrics"]), _losses(full["metrics"])
    assert a.keys() == b.keys() and a
    for it in b:
        assert math.isfinite(a[it]) and math.isclose(a[it], b[it], rel_tol=LOSS_RTOL), (case, it, a[it], b[it])
    if case == "tp2dp2-distopt":  # the parameter all-gather is in place: its virtual chunks are kept
        assert fold.contributions.get("all_gather", {}).get("keep", 0) > 0, fold.contributions


@pytest.mark.heavy
@MEGATRON
def test_moe_ep4_pp2_folds_to_the_whole_job(tmp_path):
    """EP4 spans all four DP indices, so the v1 sandbox (whole expert groups) is the whole job: the
    run says so and captures every rank."""
    from prism_megatron.launcher.config import LaunchConfig
    from prism_megatron.megatron.fold_mode import choose_fold
    from prism_megatron.megatron.run import launch_config, parse_run_args

    request = parse_run_args(["--recipe", "mini-moe-ep4-tp1pp2", "--prism-driver", "core"])
    said: list[str] = []
    cfg = launch_config(request)
    assert isinstance(cfg, LaunchConfig)
    assert choose_fold("on", cfg, request.env, say=said.append) is None
    assert any("the sandbox is the whole job (8 ranks)" in s for s in said), said


def _op_sequence(trace, rank: int) -> list[tuple]:
    sizes = {g["id"]: len(g["ranks"]) for g in trace.manifest["groups"]}
    cols = trace.ops.select(["rank", "kind", "bytes", "dtype", "group"]).to_pydict()
    return [(k, b, d, sizes.get(g)) for r, k, b, d, g in zip(cols["rank"], cols["kind"], cols["bytes"], cols["dtype"],
                                                              cols["group"], strict=True) if r == rank]


def test_moe_class_depth_folds_expert_peers_by_translated_mirror(megatron_runs):
    """MoE EP4·PP2 at class depth (2 live ranks: each stage's ep 0) against its replica-depth capture (here
    the whole job). The live expert rank issues the full capture's ep-0 op sequence: same kinds, dtypes,
    group sizes, and bytes for every op but the token all-to-alls, whose sizes routing decides; under the
    translated mirror each of those moves exactly the tokens the live rank's router sends out (micro-batch
    2 x seq 64 x top-2 = 256 rows: 256 x 64 fp32 hidden values, 256 probabilities), where the full run's
    ranks receive more or fewer. Per-class max allocated: the fold's within the full run's range over the
    class's ranks (their routing differs, so their expert activations do: about 8 % apart on this model)."""
    from prism_megatron.report.build import build_report
    from prism_megatron.trace import read_trace

    folded = megatron_runs.run("mini-moe-ep4-tp1pp2", "on", depth="class")
    full = megatron_runs.run("mini-moe-ep4-tp1pp2")  # also test_megatron_emulation's smoke capture
    fold, whole = read_trace(folded["trace"]), read_trace(full["trace"])
    assert fold.fold.live == (0, 4) and fold.fold.expert_tokens == "translated mirror", folded["output"][-2000:]
    assert fold.fold.contributions["all_to_all"]["mirror"] > 0
    for rank in fold.fold.live:
        got, want = _op_sequence(fold, rank), _op_sequence(whole, rank)
        assert [(k, d, n) for k, _, d, n in got] == [(k, d, n) for k, _, d, n in want], rank
        assert [x for x in got if x[0] != "all_to_all"] == [x for x in want if x[0] != "all_to_all"], rank
        assert {b for k, b, _, _ in got if k == "all_to_all"} == {256 * 64 * 4, 256 * 4}, rank
        assert len({b for k, b, _, _ in want if k == "all_to_all"}) > 2, rank  # routing-sized in the full run
    got, want = _class_peaks(folded["trace"], fold.fold), _class_peaks(full["trace"], fold.fold)
    low: dict[str, int] = {}
    for entry in build_report(full["trace"])["memory"]["ranks"]:
        name = fold.fold.class_name(entry["rank"])
        low[name] = min(low.get(name, entry["max_allocated"]), entry["max_allocated"])
    assert got.keys() == want.keys() == {"first", "last"}
    assert all(low[c] <= got[c] <= want[c] for c in got), (low, got, want)
    losses = _losses(folded["metrics"])
    assert set(losses) == {1, 2, 3} and all(math.isfinite(x) for x in losses.values())
    ref = _losses(full["metrics"])
    assert all(math.isclose(losses[it], ref[it], rel_tol=LOSS_RTOL) for it in ref), (losses, ref)
    # TP2 with expert TP1 and expert DP2 (16 ranks): the plan's axes split TP and DP into EP's digits; the
    # same rule (2 live ranks), 128 rows per all-to-all (sequence parallel halves the tokens)
    wide = megatron_runs.run(str(RECIPES / "fold-class-moe-tp2etp1ep4pp2.yaml"), "on", depth="class", memory=False)
    trace = read_trace(wide["trace"])
    assert trace.fold.live == (0, 8) and trace.fold.axes == ("tp", "cp", "ep", "edp", "pp"), wide["output"][-2000:]
    assert trace.fold.sizes == (2, 1, 2, 2, 2)
    for rank in trace.fold.live:
        assert {b for k, b, _, _ in _op_sequence(trace, rank) if k == "all_to_all"} == {128 * 64 * 4, 128 * 4}
    losses = _losses(wide["metrics"])
    assert set(losses) == {1, 2, 3} and all(math.isfinite(x) for x in losses.values())


def _expert_bias_update(counts: list[float], bias: list[float], rate: float):
    """Megatron's get_updated_expert_bias on already reduced counts (float32, as its buffers)."""
    import torch

    t, b = torch.tensor(counts, dtype=torch.float32), torch.tensor(bias, dtype=torch.float32)
    return b + torch.sign(t.sum() / t.numel() - t) * rate


@pytest.mark.heavy
@MEGATRON
@pytest.mark.parametrize("capture", ["together", "serial"])
def test_a_moe_class_folds_router_counts_are_its_peers_translated_counts(megatron_runs, monkeypatch, tmp_path,
                                                                          capture):
    """DeepSeek-V3's balancing (sigmoid router, expert bias, sequence aux loss) on TP2·ETP1·EP4·PP2·DP4 (16 ranks)
    at class depth: 2 live ranks (each stage's first), every other member of their reduce groups virtual. The
    expert-bias update's token counts (an all-reduce over the stage's 8 tensor-data-and-context ranks) must be
    the sum of the members' *translated* counts: each of EP4's offsets twice, so per local expert twice the live
    rank's counts summed over its 4 blocks, the same in every block - not the plain mirror's 8 x its own counts.
    Each live router's expert bias after iterations 1 and 2 (``PRISM_ROUTER_STATE``: its counts before the
    reduction, its bias after) is Megatron's update from the translated counts, to the bit; the mirror's
    differs. The sequence aux loss's reduction over the tensor-and-context group (TP2: EP digits inside TP)
    runs through the same seam (a group it could not translate stops the run). Captured serially (one live rank
    at a time) the same: those groups' members are of the live rank's own class, answered by the mirror."""
    import torch

    from prism_megatron.trace import read_trace

    states = tmp_path / "router.jsonl"
    monkeypatch.setenv("PRISM_ROUTER_STATE", str(states))
    extra = ("--prism-fold-capture", "serial") if capture == "serial" else ()
    run = megatron_runs.run(str(RECIPES / "fold-class-moe-expert-bias.yaml"), "on", *extra, depth="class",
                            memory=False)
    fold = read_trace(run["trace"]).fold
    assert fold.capture_mode == capture
    assert fold.live == (0, 8) and fold.expert_tokens == "translated mirror", run["output"][-2000:]
    rows = {(r["rank"], r["iteration"]): r for r in map(json.loads, states.read_text().splitlines())}
    assert set(rows) == {(r, it) for r in fold.live for it in (1, 2)}, sorted(rows)
    members, ep, rate = 8, 4, 1e-3
    mirror_differs = False
    for rank in fold.live:
        bias = [[0.0] * 8, [0.0] * 8]  # two MoE layers per stage, Megatron's zero initial bias
        for it in (1, 2):
            row = rows[(rank, it)]
            assert len(row["tokens_per_expert"]) == len(row["expert_bias"]) == 2
            for layer, counts in enumerate(row["tokens_per_expert"]):
                assert sum(counts) == 2 * 2 * 32 * 2  # micro-batches x mbs x seq / TP x top-2 (sequence parallel)
                blocks = torch.tensor(counts).view(ep, -1).sum(0)  # per local expert, over the 4 EP blocks
                translated = (members // ep * blocks).repeat(ep).tolist()
                want = _expert_bias_update(translated, bias[layer], rate)
                got = torch.tensor(row["expert_bias"][layer], dtype=torch.float32)
                assert torch.equal(got, want), (rank, it, layer, counts, row["expert_bias"][layer])
                mirror = _expert_bias_update([members * c for c in counts], bias[layer], rate)
                mirror_differs |= not torch.equal(mirror, want)
                bias[layer] = got.tolist()
    assert mirror_differs  # the plain mirror would have updated the bias from the live rank's own imbalance
    losses = _losses(run["metrics"])
    assert set(losses) == {1, 2} and all(math.isfinite(x) for x in losses.values())


@pytest.mark.parametrize("recipe, world, live", [
    pytest.param("fold-scale-tp2pp4dp128", 1024, 8, marks=HEAVY),
    pytest.param("fold-scale-tp2pp4dp1024", 8192, 8),  # Megatron as at 1,024: prism's scale, on one stack
])
def test_a_tiny_gpt_at_scale_runs_folded_end_to_end(recipe, world, live, megatron_runs):
    """Plan, capture, replay and report of a job of ``world`` ranks with ``live`` processes (the
    synthesised full graph replayed at 1,024; at 8,192 that replay is bench/fold_scale.py's)."""
    from prism_megatron.report.build import build_report
    from prism_megatron.trace import read_trace

    run = megatron_runs.run(str(RECIPES / f"{recipe}.yaml"), "auto", memory=False, timeout=600)
    assert "the full job does not fit here" in run["output"] and f"{world - live:,} virtual" in run["output"]
    trace = read_trace(run["trace"])
    assert trace.world_size == world and len(trace.fold.live) == live
    assert len(trace.manifest["ranks"]) == live
    assert trace.fold.contribution_counts()["mirror"] > 0
    losses = _losses(run["metrics"])
    assert set(losses) == {1, 2} and all(math.isfinite(x) for x in losses.values())
    # rank world-1 is virtual: the live rank that mirrors it prints Megatron's iteration line, predicted
    assert re.search(r"iteration +2/ +2 \|.*elapsed time per iteration \(ms\): [0-9.]+ \(predicted", run["output"])
    report = build_report(run["trace"], cluster="h100-nvlink-ib400")
    t = report["prediction"]["iteration_time_s"]
    assert t is not None and t > 0
    assert "virtual" in report["prediction"]["provenance"]
    if world > 1024:
        return
    full = subprocess.run([sys.executable, "-m", "prism_megatron", "replay", "--full", str(run["trace"])],
                          capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "synthesised graph of every rank" in full.stdout + full.stderr


@MEGATRON
@pytest.mark.heavy
def test_a_sandbox_that_cannot_fit_is_refused_saying_what_would(tmp_path, monkeypatch, capsys):
    """``run`` (in this process: its plan reads the session's parse of the command, conftest) refuses before
    any rank starts: exit 2, naming what would fit, no trace."""
    from prism_megatron.megatron.run import parse_run_args, run

    request = parse_run_args(["--recipe", "mini-dense-tp2pp2dp2", "--prism-driver", "core", "--prism-fold", "on",
                              "--prism-fold-depth", "replica", "--prism-report", "off", "--prism-host-memory", "2",
                              "--prism-trace-dir", str(tmp_path / "trace")])
    for key, value in request.env.items():  # run sets the recipe's environment: this test's only
        monkeypatch.setenv(key, value)
    assert run(request) == 2
    err = capsys.readouterr().err
    assert "the sandbox does not fit here" in err and "4 ranks" in err, err[-3000:]
    assert not (tmp_path / "trace" / "manifest.json").exists()


@pytest.mark.heavy
@MEGATRON
def test_fold_auto_captures_fully_what_fits(tmp_path):
    from prism_megatron.launcher.config import LaunchConfig
    from prism_megatron.megatron.fold_mode import choose_fold
    from prism_megatron.megatron.run import launch_config, parse_run_args

    request = parse_run_args(["--recipe", "mini-dense-tp2pp2", "--prism-driver", "core",
                              "--prism-host-memory", "64"])
    said: list[str] = []
    cfg = launch_config(request)
    assert isinstance(cfg, LaunchConfig)
    assert choose_fold("auto", cfg, request.env, say=said.append) is None
    assert any("fold auto: full capture" in s for s in said), said


@MEGATRON
def test_a_recipes_substitutions_go_into_the_trace_job(tmp_path):
    import dataclasses

    from prism_megatron.launcher.launch import _Job
    from prism_megatron.megatron.run import launch_config, parse_run_args
    from prism_megatron.recipe import load_recipe

    script = tmp_path / "pretrain_gpt.py"  # a target recipe runs Megatron-LM's script, not the core driver
    script.write_text("")
    request = parse_run_args(["--recipe", "targets-llama3-8b-h100x8", str(script)])
    want = [dataclasses.asdict(x) for x in load_recipe("targets-llama3-8b-h100x8").substitutions]
    got = _Job(launch_config(request)).job_meta()["substitutions"]
    assert want and got[:len(want)] == want  # then the attention the recipe's emulation renders, and the optimizer
    # step Megatron falls back to here, without Transformer Engine or apex
    assert [s["setting"] for s in got[len(want):]] == ["core attention (--prism-attention sdpa)",
                                                       "optimizer step (Megatron's fallback without Transformer "
                                                       "Engine or apex)"]


@pytest.mark.heavy
@MEGATRON
def test_fold_auto_runs_a_program_the_plan_cannot_read_in_full_and_on_refuses_it(tmp_path, parse_each_command_once):
    from prism_megatron.launcher.config import LaunchConfig
    from prism_megatron.megatron.fold_mode import FoldModeError, choose_fold

    cfg = LaunchConfig(script=Path(__file__).parent / "programs" / "fold_bad.py", script_args=["none"],
                       world_size=4, trace_dir=tmp_path / "t")
    said: list[str] = []
    assert choose_fold("auto", cfg, say=said.append) is None
    assert any("fold auto: full capture" in s and "no fold plan" in s for s in said), said
    with pytest.raises(FoldModeError, match="--prism-fold on"):
        choose_fold("on", cfg, say=said.append)


def _skeleton(graph, rank: int, collectives: bool = False) -> list[tuple]:
    """A rank's units and pipeline p2p ops (and collectives) in order: what its schedule decides, not
    its timing; a group by its ranks (a synthesised graph numbers groups its own way)."""
    from prism_megatron.replay.graph import Comm, Mark

    out = []
    for ev in graph.events[rank]:
        if isinstance(ev, Mark) and ev.phase == "B" and ev.name in ("forward", "backward"):
            out.append((ev.name, ev.attrs.get("iteration"), ev.attrs.get("microbatch"), ev.attrs.get("chunk") or 0))
        elif isinstance(ev, Comm) and (ev.is_p2p or collectives):
            out.append((ev.kind, ev.peer, ev.seq, ev.nbytes, graph.groups[ev.group].ranks))
    return out


def _live_and_report_ms(run: dict, cluster: str) -> tuple[list[float], list[float]]:
    """Megatron's iteration lines' predicted times (ms, as printed) and the report's, rounded alike."""
    from prism_megatron.report.build import build_report

    live = [float(x) for x in re.findall(r"iteration +\d+/ +\d+ \|.*?elapsed time per iteration \(ms\): "
                                         r"([0-9.]+) \(predicted", run["output"])]
    report = build_report(run["trace"], cluster=cluster)["prediction"]["iteration_times_s"]
    return live, [round(t * 1e3, 1) for t in report]


@MEGATRON
@pytest.mark.heavy
def test_class_depth_gives_a_folded_middle_stage_its_own_1f1b_schedule(megatron_runs):
    """TP1·PP4, 4 microbatches: stage 2 (1 warm-up forward) is folded onto stage 1 (2 warm-ups). The
    synthesised stage 2 runs stage 1's units in stage 2's own order, with the p2p ops Megatron's
    schedule posts there: the same units and p2p ops, in the same order, as stage 2 of the full capture.
    (How close the predicted iteration times are: bench/fold_class_schedule.py; CPU timing is too noisy
    for a test.)"""
    from prism_megatron.calibration.costmodel import CollectiveCostModel
    from prism_megatron.calibration.profiles import load_profile
    from prism_megatron.replay import graph_from_trace, replay
    from prism_megatron.replay.synthesize import synthesize
    from prism_megatron.trace import read_trace

    recipe = str(RECIPES / "fold-class-tp1pp4.yaml")
    folded = megatron_runs.run(recipe, "on", depth="class", memory=False)
    full = megatron_runs.run(recipe, "off", memory=False)
    trace = read_trace(folded["trace"])
    assert trace.fold.live == (0, 1, 3) and trace.fold.rep[2] == 1
    assert trace.fold.schedule == "1f1b" and trace.fold.warmup == (3, 2, 1, 0)
    graph = graph_from_trace(trace)
    cost = CollectiveCostModel(load_profile("h100-nvlink-ib400"), gpus_per_node=8)
    result = replay(graph, cost)  # no deadlock
    assert "one pipeline" in result.method and len(result.iteration_times()) == 2
    assert all(t > 0 for t in result.iteration_times())
    real = graph_from_trace(read_trace(full["trace"]))
    synth = synthesize(graph)
    want = _skeleton(real, 2)
    assert [x[0] for x in want[:8]] == ["recv", "forward", "send", "recv", "forward", "send", "recv", "backward"]
    assert _skeleton(synth, 2) == want
    for r in range(4):  # the live stages ran their own schedules; every op of the job is the full run's
        assert _skeleton(synth, r, collectives=True) == _skeleton(real, r, collectives=True), r
    # the prediction in Megatron's log line is the report's (the same folded replay of the same graph)
    for run in (folded, full):
        live, report = _live_and_report_ms(run, "h100-nvlink-ib400")
        assert len(live) == 2 and live == pytest.approx(report, abs=0.051), run["trace"]


@MEGATRON
def test_a_folded_training_loop_logs_the_prediction_where_its_virtual_last_rank_would(megatron_runs):
    """Megatron-LM's training loop (--prism-driver training) folded at replica depth, TP2·PP2·DP2: the job's
    last rank (7) is virtual and live rank 5 prints Megatron's iteration lines for it. Each line carries the
    predicted time, the report's, not the emulation's wall time."""
    from prism_megatron.megatron.megatron_lm import training_available
    from prism_megatron.trace import read_trace

    if not training_available():
        pytest.skip("the training driver is Megatron-LM's trainer's (megatron.training not found)")
    run = megatron_runs.run("mini-dense-tp2pp2dp2", "on", driver="training", memory=False)
    assert read_trace(run["trace"]).fold.live == (0, 1, 4, 5)
    live, report = _live_and_report_ms(run, "h100-nvlink-ib400")
    assert len(live) == 3 and live == pytest.approx(report, abs=0.051), run["output"][-3000:]


@pytest.mark.parametrize("overlap", [pytest.param(True, id="overlap-p2p", marks=HEAVY),
                                     pytest.param(False, id="batched-p2p")])
def test_class_depth_gives_a_folded_middle_stage_its_own_interleaved_schedule(megatron_runs, overlap):
    """TP1·PP4·VPP2, 8 microbatches (16 virtual ones), p2p overlapped with compute (Megatron-LM's
    default under VPP) or batched: stage 2 (6 warm-up forwards) is folded onto stage 1 (8). The
    synthesised stage 2 runs stage 1's (microbatch, chunk) units in stage 2's own order, with the p2p
    ops and waits Megatron's interleaved schedule posts there: the same units and p2p ops, in the same
    order, as stage 2 of the full capture."""
    from prism_megatron.calibration.costmodel import CollectiveCostModel
    from prism_megatron.calibration.profiles import load_profile
    from prism_megatron.replay import graph_from_trace, replay
    from prism_megatron.replay.synthesize import synthesize
    from prism_megatron.trace import read_trace

    recipe = str(RECIPES / "fold-class-tp1pp4vpp2.yaml")
    extra = () if overlap else ("--no-overlap-p2p-communication",)
    folded = megatron_runs.run(recipe, "on", *extra, depth="class", memory=False)
    full = megatron_runs.run(recipe, "off", *extra, memory=False)
    trace = read_trace(folded["trace"])
    assert trace.fold.live == (0, 1, 3) and trace.fold.rep[2] == 1
    assert trace.fold.schedule == "interleaved" and trace.fold.warmup == (10, 8, 6, 4)
    assert (trace.fold.chunks, trace.fold.group, trace.fold.overlap_p2p) == (2, 4, overlap)
    graph = graph_from_trace(trace)
    cost = CollectiveCostModel(load_profile("h100-nvlink-ib400"), gpus_per_node=8)
    result = replay(graph, cost)  # no deadlock
    assert "one pipeline" in result.method and len(result.iteration_times()) == 2
    real = graph_from_trace(read_trace(full["trace"]))
    synth = synthesize(graph)
    want = _skeleton(real, 2)
    units = [x[2:] for x in want if x[0] in ("forward", "backward")]  # (microbatch, chunk)
    assert units[:9] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1),  # 6 warm-ups in Megatron's table order,
                         (2, 1), (0, 1), (3, 1)]  # then pairs: forward, backward (chunks reversed)
    assert _skeleton(synth, 2) == want
    for r in range(4):  # the live stages ran their own schedules; every op of the job is the full run's
        assert _skeleton(synth, r, collectives=True) == _skeleton(real, r, collectives=True), r
    for r in range(4):  # replay's model of the schedule (also the synthetic jobs') is what Megatron ran, every stage
        for it in (1, 2):
            assert _interleaved_skeleton(real, r, it) == _modelled(trace.fold, r, 8, another=it == 1), (r, it)


@MEGATRON
def test_the_installed_release_says_when_its_interleaved_schedule_waits_its_sends():
    """The fold's wait_sends is read from the installed megatron-core's interleaved schedule: 0.16 waits a steady
    forward's send when the next one is posted, 0.19 at once. (The overlapped-p2p class fold above checks the
    modelled order against a real capture; this is its seam, cheap enough for both stacks.)"""
    import importlib.metadata

    from megatron.core.pipeline_parallel import schedules

    from prism_megatron.megatron.fold import _waits_forward_sends

    release = tuple(int(x) for x in importlib.metadata.version("megatron-core").split(".")[:2])
    assert _waits_forward_sends(schedules) == (release >= (0, 19)), release


def _interleaved_skeleton(graph, rank: int, iteration: int) -> list:
    """A rank's units ((F | B, microbatch, chunk)) and pipeline p2p streams in one iteration, from the
    first unit on (the iteration's first input receive precedes its markers)."""
    from prism_megatron.replay.graph import Comm, Mark
    from prism_megatron.replay.stage_schedule import RECV_NEXT, RECV_PREV, SEND_NEXT, SEND_PREV

    out, at, pp = [], None, len(graph.events)
    for ev in graph.events[rank]:
        if isinstance(ev, Mark) and ev.phase == "B" and ev.name in ("forward", "backward"):
            at = ev.attrs.get("iteration")
            if at == iteration:
                out.append((ev.name[0].upper(), ev.attrs["microbatch"], ev.attrs.get("chunk") or 0))
        elif at == iteration and isinstance(ev, Comm) and ev.is_p2p:
            nxt = ev.peer == (rank + 1) % pp
            out.append({("send", True): SEND_NEXT, ("send", False): SEND_PREV, ("recv", True): RECV_NEXT,
                        ("recv", False): RECV_PREV}[(ev.kind, nxt)])
    return out


def _modelled(fold, stage: int, microbatches: int, another: bool) -> list:
    """The same for pipeline stage ``stage`` as replay.stage_schedule.interleaved_steps models it: its
    first input receive belongs to the iteration before (``another``: one follows this one)."""
    from prism_megatron.replay.stage_schedule import interleaved_steps, schedule_table

    table = schedule_table(microbatches, fold.chunks, fold.group)
    out = []
    for step in interleaved_steps(len(fold.warmup), stage, fold.chunks, fold.group, microbatches, fold.warmup[stage],
                                  fold.overlap_p2p, fold.wait_sends):
        if step[0] == "call":
            out += [stream for stream, _ in step[1]]
        elif step[0] in ("F", "B"):
            mb, chunk = table[step[1]]
            out.append((step[0], mb, chunk if step[0] == "F" else fold.chunks - 1 - chunk))
    if out[0] != "recv_prev":  # the first stage receives no input
        return out
    return out[1:] + (["recv_prev"] if another else [])


def test_a_class_fold_captured_serially_reads_like_one_captured_together(megatron_runs):
    """TP2·PP2·DP2 at class depth (live ranks 0 and 4): captured together and one live rank at a time
    (--prism-fold-capture serial). Same live ranks and plan, per-class max allocated equal to the byte, the
    same ops per live rank (kind, bytes, group, per-group sequence number, peer), losses finite. Replay: the
    merged graph is the together graph but for its measured compute, so with the together capture's compute
    durations it predicts the same iteration times (1e-9); with its own (CPU timing: noisy), times > 0
    (bench/fold_serial.py prints both side by side)."""
    together = megatron_runs.run("mini-dense-tp2pp2dp2", "on", depth="class")
    serial = megatron_runs.run("mini-dense-tp2pp2dp2", "on", "--prism-fold-capture", "serial", depth="class")
    assert "serial capture 2/2: rank 4 (class last)" in serial["output"]
    # --prism-fold-second-pass auto on a dense fold: capture 1's backward stand-ins stay unrecorded, said
    assert "serial capture: capture(s) 1 not captured again: second pass off for a dense fold" in serial["output"]
    assert "serial capture 1/2 again" not in serial["output"]
    _, merged = _serial_reads_like_together(together, serial)
    assert merged.fold.unrecorded_standins().startswith("capture 1 kept stand-ins without a recorded norm (second "
                                                         "pass off for a dense fold: ")


@MEGATRON
@pytest.mark.heavy
def test_a_serial_captures_grad_norm_sums_every_stage_as_together(megatron_runs):
    """TP2·PP2·DP2 at class depth captured serially with the second pass on: Megatron's grad norm (squared norms
    summed over the model-parallel group, TP x PP members) in each capture's final take sums both stages' shares,
    the other stage's as its own capture recorded it (nccl_prune.RECORDED_REDUCTION_RULE): exactly, from the
    recordings in the captures' traces, so the two captures log the same grad norm. Self mirror counted each
    capture's own stage four times (first 2.48, last 1.25 against 1.71 together in iteration 1). What is left
    against the capture together is the stand-ins' (seeded directions, not the neighbour's): 15-23 % above it on
    megatron-core 0.16.1 and 0.19.2 alike (bench/grad_norm_fold.py prints the figures), bounded here by a third."""
    import struct

    from prism_megatron.launcher.serial import captures_dir, take_dir
    from prism_megatron.runtime.folding import _read_reductions
    from prism_megatron.trace import read_trace

    together = megatron_runs.run("mini-dense-tp2pp2dp2", "on", depth="class")
    serial = megatron_runs.run("mini-dense-tp2pp2dp2", "on", "--prism-fold-capture", "serial",
                               "--prism-fold-second-pass", "on", depth="class")
    # capture 1 again (its stand-ins and reductions lacked recordings), then capture 2 again: its first take had
    # only capture 1's derived recording (made after a stand-in without a norm)
    assert "serial capture 1/2 again" in serial["output"] and "serial capture 2/2 again" in serial["output"]
    want = {it: n for (r, it), (_, n) in together["metrics"].items() if r == 0}
    got = {(r, it): n for (r, it), (_, n) in serial["metrics"].items()}  # a rank's last take's
    assert len(want) == 3 and {r for r, _ in got} == {0, 4}

    def shares(index: int, rank: int, take: int) -> list[float]:
        """The squared-norm share a take's live rank put into each iteration's grad-norm reduction over the
        model-parallel group (0, 1, 4, 5), as its trace recorded it for later captures."""
        manifest = json.loads((take_dir(captures_dir(serial["trace"]), index, rank, take) / "manifest.json")
                              .read_text())
        recorded = _read_reductions(manifest["job"]["fold"]["capture"]["part"]["reductions"], "reductions")
        out = [struct.unpack("<f", tensors[0][1])[0] for (group, _, r), (_, tensors, _) in
               sorted(recorded.items(), key=lambda kv: kv[0][1])
               if group[1] == (0, 1, 4, 5) and r == rank and [dt for dt, _ in tensors] == ["float32"]]
        assert len(out) == 3, (index, take, out)
        return out

    # the takes ran 1, 2, 1 again (given 2's recording), 2 again (given 1 again's): each final take's squares are
    # its own stage's twice (its TP pair) and the other stage's twice, as the other capture recorded them
    first, last_before, last = shares(0, 0, 2), shares(1, 4, 1), shares(1, 4, 2)
    for it in (1, 2, 3):
        i = it - 1
        assert got[(0, it)] ** 2 == pytest.approx(2 * first[i] + 2 * last_before[i], rel=1e-5)
        assert got[(4, it)] ** 2 == pytest.approx(2 * first[i] + 2 * last[i], rel=1e-5)
        assert got[(0, it)] == pytest.approx(got[(4, it)], rel=1e-2)
        assert got[(0, it)] == pytest.approx(want[it], rel=1 / 3)
    merged = read_trace(serial["trace"])
    assert [c["reductions_unrecorded"] for c in merged.fold.capture["captures"]] == [0, 0]
    assert merged.fold.contributions["all_reduce"]["recorded"] > 0
    # the plan's bound on what the second pass adds holds: 2 takes again for 2 live ranks
    from prism_megatron.megatron.fold import FoldPlan
    from prism_megatron.megatron.plan import second_pass_bound

    plan = {k: v for k, v in merged.manifest["job"]["fold"].items() if k not in ("contributions", "capture")}
    taken = sum(serial["output"].count(f"serial capture {i}/2 again") for i in (1, 2))
    assert taken == second_pass_bound(FoldPlan.from_json(plan)) == 2


def _serial_reads_like_together(together: dict, serial: dict) -> tuple:
    """The checks a class fold captured serially passes against the same fold captured together (both runs of
    ``megatron_runs``): same live ranks and plan, per-class max allocated equal to the byte, the same ops per live
    rank (kind, bytes, group, per-group sequence number, peer), losses finite, and the same predicted iteration
    times from the same compute. Returns the two traces."""
    from prism_megatron.calibration.costmodel import CollectiveCostModel
    from prism_megatron.calibration.profiles import load_profile
    from prism_megatron.replay import graph_from_trace, replay
    from prism_megatron.replay.graph import Comm, Compute
    from prism_megatron.trace import read_trace

    a, b = read_trace(together["trace"]), read_trace(serial["trace"])
    assert a.fold.live == b.fold.live == (0, 4) and a.fold.rep == b.fold.rep and a.fold.depth == "class"
    assert (a.fold.capture_mode, b.fold.capture_mode) == ("together", "serial") and b.incomplete is None
    ways = b.fold.contribution_counts()
    assert ways["self_mirror"] > 0 and ways["standin"] > 0 and "standin" not in a.fold.contribution_counts()
    peaks = _class_peaks(serial["trace"], b.fold)
    assert peaks == _class_peaks(together["trace"], a.fold) and set(peaks) == {"first", "last"}, peaks

    def ops(t) -> dict[int, list[tuple]]:
        groups = {g["id"]: (g["name"], tuple(g["ranks"])) for g in t.manifest["groups"]}
        return {r: [(o["kind"], o["bytes"], groups[o["group"]], o["seq"], o["peer"]) for o in t.ops_for_rank(r)]
                for r in t.fold.live}

    assert ops(a) == ops(b) and all(len(v) > 50 for v in ops(a).values())
    losses = _losses(serial["metrics"])
    assert losses and all(math.isfinite(x) for x in losses.values()), losses
    # the last stage's tied output layer starts from a seeded draw, not the zeros self mirror would leave
    # (patches.serial_embedding): gradients reach every layer of its stage from the first iteration on
    norms = {it: n for (r, it), (_, n) in serial["metrics"].items() if r == 4}
    assert len(norms) == 3 and all(n > 0 and math.isfinite(n) for n in norms.values()), norms

    cost = CollectiveCostModel(load_profile("h100-nvlink-ib400"), gpus_per_node=8)
    ga, gb = graph_from_trace(a), graph_from_trace(b)
    assert ga.ranks == gb.ranks
    for r in ga.ranks:
        assert [type(e) for e in ga.events[r]] == [type(e) for e in gb.events[r]], r
        comms = [[(e.kind, e.seq, e.peer, e.nbytes, g.groups[e.group].ranks) for e in g.events[r]
                  if isinstance(e, Comm)] for g in (ga, gb)]
        assert comms[0] == comms[1], r
        gb.events[r] = [x if isinstance(x, Compute) else y for x, y in zip(ga.events[r], gb.events[r], strict=True)]
    want, got = replay(ga, cost).iteration_times(), replay(gb, cost).iteration_times()
    assert len(want) == 3 and got == pytest.approx(want, rel=1e-9)
    own = replay(graph_from_trace(b), cost).iteration_times()
    assert len(own) == 3 and all(t > 0 and math.isfinite(t) for t in own), own
    return a, b


@MEGATRON
@pytest.mark.heavy
def test_a_moe_class_fold_captured_serially_answers_expert_peers_as_together(megatron_runs):
    """MoE EP4·PP2 at class depth (live ranks 0 and 4: each stage's ep 0) captured together (the translated-mirror
    test's run) and serially. In each capture the live rank's expert peers are of its own class, so its count
    gathers and token all-to-alls are answered by the translated mirror as together: the same all-to-all
    contributions (mirror, none by self mirror), each capture's plan recording the rule (expert_tokens); what
    crosses captures (pipeline p2p, the embedding and model-parallel reductions) is answered as for a dense fold.
    Everything _serial_reads_like_together checks holds: peaks to the byte, the same ops (the all-to-alls' routing
    sized bytes included), the same prediction from the same compute (bench/fold_serial.py --recipe
    mini-moe-ep4-tp1pp2 prints the figures)."""
    from prism_megatron.trace import read_trace

    together = megatron_runs.run("mini-moe-ep4-tp1pp2", "on", depth="class")
    serial = megatron_runs.run("mini-moe-ep4-tp1pp2", "on", "--prism-fold-capture", "serial", depth="class")
    assert "serial capture 2/2: rank 4 (class last)" in serial["output"], serial["output"][-2000:]
    a, b = _serial_reads_like_together(together, serial)
    assert a.fold.expert_tokens == b.fold.expert_tokens == "translated mirror"
    assert b.fold.contributions["all_to_all"] == a.fold.contributions["all_to_all"]
    assert a.fold.contributions["all_to_all"]["mirror"] > 0
    for c in b.fold.capture["captures"]:
        part = read_trace(serial["trace"].parent / c["trace"])
        assert part.fold.live == (c["rank"],) and part.fold.expert_tokens == "translated mirror"
        row = part.fold.contributions["all_to_all"]
        assert row["mirror"] > 0 and row.get("self_mirror", 0) == 0, (c["rank"], row)


@MEGATRON
@pytest.mark.heavy
def test_a_moe_serial_capture_answers_its_token_all_to_alls_in_the_rank_as_the_coordinator(megatron_runs):
    """MoE EP4·PP2 at class depth captured serially: each capture's live rank is the only live member of its
    expert-parallel group, so its count and token all-to-alls are answered in the rank (runtime.local_fold,
    A2A_RULE's pieces by the fold's coordinates). Against the same run with every op through the coordinator
    (PRISM_FOLD_LOCAL=0): the merged traces agree in everything but times (ops, their routing-sized bytes,
    marks with the memory figures, groups), the contributions are the same, and so are the losses and grad
    norms, bit for bit (bench/fold_local.py megatron --recipe mini-moe-ep4-tp1pp2 prints the walls)."""
    from prism_megatron.trace import read_trace
    from prism_megatron.trace.untimed import untimed_differences

    args = ("mini-moe-ep4-tp1pp2", "on", "--prism-fold-capture", "serial")
    local = megatron_runs.run(*args, depth="class")
    staged = megatron_runs.run(*args, depth="class", env={"PRISM_FOLD_LOCAL": "0"})
    a, b = read_trace(local["trace"]), read_trace(staged["trace"])
    assert a.fold.coords and a.ops.column("kind").to_pylist().count("all_to_all") > 50
    assert untimed_differences(a, b) == []
    assert a.fold.contributions == b.fold.contributions and a.fold.contributions["all_to_all"]["mirror"] > 0
    assert local["metrics"] and local["metrics"] == staged["metrics"]


@MEGATRON
def test_a_serial_capture_of_a_middle_stage_trains_on_the_first_stages_flags(megatron_runs):
    """TP1·PP4 at class depth captured serially: stage 1 (middle) builds no data loader, so Megatron's trainer
    learns do_train/do_valid/do_test from rank 0's world broadcast. In the middle stage's capture rank 0 is
    virtual: self mirror would send the middle stage's own zeros and end its program before training. The
    broadcast is answered from what rank 0's capture recorded; every capture trains its iteration."""
    from prism_megatron.megatron.megatron_lm import training_available
    from prism_megatron.trace import read_trace

    if not training_available():
        pytest.skip("the do_train broadcast is Megatron-LM's trainer's (megatron.training not found)")
    run = megatron_runs.run(str(RECIPES / "fold-class-tp1pp4.yaml"), "on", "--prism-fold-capture", "serial",
                            "--train-iters", "1", depth="class", driver="training", memory=False)
    merged = read_trace(run["trace"])
    assert merged.incomplete is None and merged.fold.live == (0, 1, 3)
    captures = [read_trace(run["trace"].parent / c["trace"]) for c in merged.fold.capture["captures"]]
    for t in captures:
        marks = [(m["name"], m["phase"]) for m in t.marks.to_pylist()]
        assert marks.count(("iteration", "E")) == 1, (t.fold.live, marks)
    first, middle, last = (t.manifest["job"]["fold"]["capture"]["part"] for t in captures)
    assert any(b["group"][1] == [0, 1, 2, 3] and b["dtype"] == "int64" for b in first["broadcasts"]), first
    for t, part in ((captures[1], middle), (captures[2], last)):
        assert len(part["answers"]) == len(first["broadcasts"])
        assert t.fold.contributions["broadcast"]["recorded"] >= 1
