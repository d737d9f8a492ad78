"""``--prism-fold-microbatches`` on a real Megatron job (the core driver on CPU), and its refusals.

A TP1·PP2 tiny GPT with M = 8 micro-batches per iteration, captured at its minimum m_c = 3 (warm-up 1
+ 2) and in full: the replayed graph has M forward and M backward units per stage, the report says
what was folded and counts the target's tokens, and the per-rank peak memory is the full run's. The
first stage's is equal to the byte. The last stage keeps each micro-batch's reduced loss (Megatron's
``forward_data_store``) until the end of the iteration, a few bytes per micro-batch (16 B here): the
fold's last stage is lower by those of the M - m_c micro-batches that did not run, and by nothing else.
The same holds for a TP1·PP2·VPP2 job (Megatron's interleaved schedule) at M = 10 captured at 6, whose
expanded graph has the full capture's units and p2p ops in the same order on every rank.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from prism_megatron.megatron import cpu_mode

pytestmark = pytest.mark.skipif(cpu_mode._gpu_present(), reason="CPU runs of Megatron need CPU mode")
# runs megatron-core: CI also runs these on the second stack (.ci/run), but for five tests that run on the first
# stack only, each prism's own code over what the marked tests already run on both stacks: the refused count
# (choose_microbatches on Megatron's parse of the command; the same refusal through `plan` runs on both in
# test_fold_plan), the class fold of a micro-batch-folded capture (the micro-batch fold and the class fold's 1F1B
# schedule each run on both here and in test_fold_megatron; their combination is the synthesis's), the
# interleaved capture (whose schedule's p2p calls the class-fold tests in test_fold_megatron check on both stacks),
# its variant with overlapped DP ops (whose placement the synthetic tests of test_microbatch_fold check) and the
# interleaved plan (whose record choose_microbatches' test checks on both)
MEGATRON = pytest.mark.megatron

RECIPE = str(Path(__file__).parent / "recipes" / "fold-microbatches-pp2.yaml")
#: bytes of one micro-batch's reduced loss that the last stage holds to the end of the iteration
LOSS_STORE_BYTES = 16
# Runs: ``megatron_runs.run`` (conftest), each distinct command once per session.


@MEGATRON
@pytest.mark.heavy  # the second stack leaves it to the first (pytest.ini); there it plans this fold (test_fold_plan)
def test_a_folded_capture_replays_the_targets_microbatches_with_its_memory(megatron_runs):
    from prism_megatron.replay import graph_from_trace
    from prism_megatron.replay.graph import Mark
    from prism_megatron.report.build import build_report
    from prism_megatron.trace import read_trace

    folded = megatron_runs.run(RECIPE, "off", "--prism-fold-microbatches", "auto")
    assert "prism: micro-batches: 3 of 8 run per iteration" in folded["output"]
    full = megatron_runs.run(RECIPE, "off", "--prism-fold-microbatches", "off")
    trace = read_trace(folded["trace"])
    mb = trace.microbatches
    assert (mb.target, mb.captured, mb.schedule, mb.warmup) == (8, 3, "1f1b", (1, 0))
    assert read_trace(full["trace"]).microbatches is None
    captured = trace.marks.to_pylist()
    assert sum(1 for m in captured if m["name"] == "forward" and m["phase"] == "B" and m["rank"] == 0) == 3 * 2
    graph = graph_from_trace(trace)
    for r, events in graph.events.items():
        for kind in ("forward", "backward"):
            units = [(e.attrs["iteration"], e.attrs["microbatch"]) for e in events
                     if isinstance(e, Mark) and e.name == kind and e.phase == "B"]
            assert units == [(it, i) for it in (1, 2) for i in range(8)], (r, kind, units)

    cluster = "h100-nvlink-ib400"
    fold_report = build_report(folded["trace"], cluster)
    full_report = build_report(full["trace"], cluster)
    pred = fold_report["prediction"]
    assert ("micro-batches: 3 of 8 run per iteration; 5 replayed as copies of micro-batch 1's forward/backward"
            in pred["provenance"])
    target_tokens = 8 * 1 * 32  # M x micro batch x sequence: the target's global batch, not the captured 3
    assert pred["tokens_per_s"] * pred["iteration_time_s"] == pytest.approx(target_tokens)
    full_pred = full_report["prediction"]
    assert full_pred["tokens_per_s"] * full_pred["iteration_time_s"] == pytest.approx(target_tokens)
    assert pred["tflops_per_gpu"] / pred["tokens_per_s"] == pytest.approx(
        full_pred["tflops_per_gpu"] / full_pred["tokens_per_s"])

    got = {e["rank"]: e["max_allocated"] for e in fold_report["memory"]["ranks"]}
    want = {e["rank"]: e["max_allocated"] for e in full_report["memory"]["ranks"]}
    assert got[0] == want[0], (got, want)  # first stage: to the byte
    assert 0 <= want[1] - got[1] <= (mb.target - mb.captured) * LOSS_STORE_BYTES, (got, want)


def test_a_count_below_the_minimum_is_refused_naming_it(megatron_runs):
    run = megatron_runs.run(RECIPE, "off", "--prism-fold-microbatches", "2", check=False)
    assert run["code"] != 0
    assert ("--prism-fold-microbatches 2: 2 micro-batches per iteration is below the minimum 3 (largest warm-up 1 "
            "+ 2, at least 3)") in run["output"]
    assert not (run["trace"] / "manifest.json").exists()


def _args(**kw) -> argparse.Namespace:
    base = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=4, num_layers=4, hidden_size=32,
                num_attention_heads=2, micro_batch_size=2, global_batch_size=64, train_iters=2, eval_iters=0,
                eval_interval=1000, rampup_batch_size=None, train_samples=None)
    return argparse.Namespace(**{**base, **kw})


@MEGATRON
def test_choose_microbatches_rewrites_the_global_batch_once_and_refuses_what_it_cannot_fold():
    from prism_megatron.megatron.microbatch_mode import MicrobatchModeError, choose_microbatches

    said: list[str] = []

    def choose(value: str, **kw):
        return choose_microbatches(value, Path("pretrain_gpt.py"), ["--x"], 8, args=_args(**kw), say=said.append)

    argv, record = choose("auto")  # PP4 x DP2, micro batch 2: M = 64 / 4 = 16; warm-up 3 -> m_c = 5
    assert argv == ["--x", "--global-batch-size", str(5 * 2 * 2)]
    assert (record["target"], record["captured"], record["warmup"]) == (16, 5, [3, 2, 1, 0])
    argv, record = choose("7")
    assert argv[-1] == str(7 * 2 * 2) and record["captured"] == 7
    assert choose("off") == (["--x"], None)
    assert choose("auto", global_batch_size=20) == (["--x"], None)  # M = 5: nothing beyond the minimum
    assert "all 5 run per iteration" in said[-1]
    vpp = dict(virtual_pipeline_model_parallel_size=2, num_layers=8)  # interleaved: groups of PP4, 3 of them
    argv, record = choose("auto", **vpp)
    assert argv == ["--x", "--global-batch-size", str(12 * 2 * 2)]
    assert (record["schedule"], record["captured"], record["warmup"], record["chunks"], record["group"]) == (
        "interleaved", 12, [10, 8, 6, 4], 2, 4)
    assert "12 of 16 run per iteration (interleaved, 2 chunks, groups of 4)" in said[-1]
    assert choose("auto", global_batch_size=96, **vpp)[1]["captured"] == 12  # M = 24
    assert choose("auto", global_batch_size=48, **vpp) == (["--x"], None)  # M = 12: nothing beyond the minimum
    for value, kw, match in [
        ("4", {}, r"--prism-fold-microbatches 4: 4 micro-batches per iteration is below the minimum 5"),
        ("17", {}, r"17 micro-batches per iteration is more than the target's 16"),
        ("auto", {"rampup_batch_size": [8, 8, 100]}, r"--rampup-batch-size 8 8 100: the micro-batch count changes"),
        ("8", {"virtual_pipeline_model_parallel_size": 2, "num_layers": 8},
         r"--prism-fold-microbatches 8: 8 micro-batches per iteration is below the minimum 12 \(the first group, a "
         r"steady group and the last group, over warm-ups up to 10 of 2 chunks\)"),
        ("14", {"virtual_pipeline_model_parallel_size": 2, "num_layers": 8, "global_batch_size": 96},
         r"14 micro-batches per iteration is not the target's 24 less a multiple of the micro-batch group 4 \(whole "
         r"groups are replayed\): give 12 or 16"),
        ("auto", {"virtual_pipeline_model_parallel_size": 2, "num_layers": 8, "global_batch_size": 40},
         r"10 micro-batches per iteration .* with micro-batch groups of 4: Megatron's interleaved schedule needs a "
         r"group <= M and a remainder of M by it of 0 or >= PP4"),
        ("auto", {"train_samples": 640}, r"--train-samples 640: the iteration count follows from the global batch"),
        ("auto", {"eval_iters": 2, "eval_interval": 1}, r"--eval-iters 2 with --eval-interval 1"),
        ("many", {}, r"--prism-fold-microbatches 'many': expected auto, off or a number"),
    ]:
        with pytest.raises(MicrobatchModeError, match=match):
            choose(value, **kw)


def test_a_class_fold_of_a_microbatch_folded_capture_gives_the_folded_stage_the_targets_microbatches(megatron_runs):
    """TP1·PP4 at M = 16 captured with m_c = 5 and its middle stage 2 folded onto stage 1: the synthesised
    stage 2 runs 16 forward and 16 backward units per iteration in its own 1F1B order (warm-up 1)."""
    from prism_megatron.replay import replay
    from prism_megatron.replay.graph import Mark, graph_from_trace
    from prism_megatron.replay.stage_schedule import one_f_one_b
    from prism_megatron.replay.synthesize import synthesize
    from prism_megatron.trace import read_trace

    recipe = str(Path(__file__).parent / "recipes" / "fold-class-tp1pp4.yaml")
    run = megatron_runs.run(recipe, "on", "--prism-fold-microbatches", "auto", "--global-batch-size", "16",
                            depth="class", memory=False)
    trace = read_trace(run["trace"])
    assert trace.fold.live == (0, 1, 3) and (trace.microbatches.target, trace.microbatches.captured) == (16, 5)
    graph = graph_from_trace(trace)
    synth = synthesize(graph)
    for r, warmup in ((1, 2), (2, 1), (3, 0)):
        order = [("F" if e.name == "forward" else "B", e.attrs["microbatch"]) for e in synth.events[r]
                 if isinstance(e, Mark) and e.name in ("forward", "backward") and e.phase == "B"
                 and e.attrs["iteration"] == 2]
        assert order == one_f_one_b(warmup, 16), r
    result = replay(graph)
    assert "one pipeline" in result.method and len(result.iteration_times()) == 2


#: labels of the data-parallel grad and param collectives (patches.ddp)
DP_LABELS = ("grad-reduce-scatter", "grad-all-reduce", "param-all-gather")


def _skeleton(graph, rank: int, dp: bool = False) -> list:
    """A rank's units (name, iteration, micro-batch, chunk) and pipeline p2p ops (kind, peer, group's ranks);
    with ``dp`` its data-parallel grad/param collectives (kind, group's ranks, label, unit begun or ended)."""
    from prism_megatron.replay.graph import Comm, Mark

    out = []
    for e in graph.events[rank]:
        if isinstance(e, Mark) and e.phase == "B" and e.name in ("forward", "backward"):
            out.append((e.name, e.attrs["iteration"], e.attrs["microbatch"], e.attrs.get("chunk")))
        elif isinstance(e, Mark) and e.phase == "E" and e.name in ("forward", "backward") and dp:
            out.append((e.name, "end"))
        elif isinstance(e, Comm) and e.is_p2p:
            out.append((e.kind, e.peer, graph.groups[e.group].ranks))
        elif isinstance(e, Comm) and dp and e.label in DP_LABELS:
            out.append((e.kind, graph.groups[e.group].ranks, e.label))
    return out


def test_an_interleaved_capture_expands_to_the_full_captures_units_with_its_memory(megatron_runs):
    """TP1·PP2·VPP2 (Megatron's interleaved schedule, overlapped p2p, groups of 2) at M = 10, captured at
    m_c = 6 (3 groups) and in full: the expanded graph's units and p2p ops, in order on every rank, are the
    full capture's; the first stage's peak is the full run's to the byte, the last stage's lower by the reduced
    losses of the 4 micro-batches not run."""
    from prism_megatron.replay import graph_from_trace
    from prism_megatron.report.build import build_report
    from prism_megatron.trace import read_trace

    recipe = str(Path(__file__).parent / "recipes" / "fold-microbatches-pp2vpp2.yaml")
    folded = megatron_runs.run(recipe, "off", "--prism-fold-microbatches", "auto")
    assert "prism: micro-batches: 6 of 10 run per iteration (interleaved, 2 chunks, groups of 2)" in folded["output"]
    full_run = megatron_runs.run(recipe, "off", "--prism-fold-microbatches", "off")
    trace = read_trace(folded["trace"])
    mb = trace.microbatches
    assert (mb.target, mb.captured, mb.schedule, mb.warmup, mb.chunks, mb.group) == (10, 6, "interleaved", (4, 2), 2, 2)
    expanded, full = graph_from_trace(trace), graph_from_trace(read_trace(full_run["trace"]))
    for r in (0, 1):
        want = _skeleton(full, r)
        assert sum(1 for x in want if x[0] == "forward") == 2 * 10 * 2  # iterations x M x chunks
        assert _skeleton(expanded, r) == want, r

    cluster = "h100-nvlink-ib400"
    fold_report, full_report = build_report(folded["trace"], cluster), build_report(full_run["trace"], cluster)
    assert mb.describe() in fold_report["prediction"]["provenance"]
    pred = fold_report["prediction"]
    assert pred["tokens_per_s"] * pred["iteration_time_s"] == pytest.approx(10 * 1 * 32)
    got = {e["rank"]: e["max_allocated"] for e in fold_report["memory"]["ranks"]}
    want = {e["rank"]: e["max_allocated"] for e in full_report["memory"]["ranks"]}
    assert got[0] == want[0], (got, want)
    assert 0 <= want[1] - got[1] <= (mb.target - mb.captured) * LOSS_STORE_BYTES, (got, want)


def test_an_interleaved_capture_with_overlapped_dp_ops_expands_to_the_full_captures_units_and_dp_ops(megatron_runs):
    """TP1·PP2·VPP2·DP2 with the distributed optimizer and overlapped grad reduce-scatter / param all-gather at
    M = 8, captured at m_c = 6 and in full: every rank's units, p2p ops and data-parallel collectives (those
    issued inside each chunk's first forward, right after the backward that readies a chunk's grads, and after
    the schedule) are the full capture's, in order; no copied unit carries one."""
    from prism_megatron.replay import graph_from_trace
    from prism_megatron.trace import read_trace

    recipe = str(Path(__file__).parent / "recipes" / "fold-microbatches-pp2vpp2dp2-overlap.yaml")
    folded = megatron_runs.run(recipe, "off", "--prism-fold-microbatches", "auto", memory=False)
    assert "prism: micro-batches: 6 of 8 run per iteration (interleaved" in folded["output"]
    full_run = megatron_runs.run(recipe, "off", "--prism-fold-microbatches", "off", memory=False)
    expanded = graph_from_trace(read_trace(folded["trace"]))
    full = graph_from_trace(read_trace(full_run["trace"]))
    for r in range(4):
        want = _skeleton(full, r, dp=True)
        assert sum(1 for x in want if x[0] == "forward" and len(x) == 4) == 2 * 8 * 2  # iterations x M x chunks
        assert {x[2] for x in want if len(x) == 3 and x[2] in DP_LABELS} == {"grad-reduce-scatter",
                                                                           "param-all-gather"}
        assert _skeleton(expanded, r, dp=True) == want, r
    seq = _skeleton(full, 2, dp=True)  # stage 1 starts a chunk's grad sync between two units of the schedule
    assert any(x[-1] == "grad-reduce-scatter" and seq[i - 1] == ("backward", "end") and seq[i + 1][0] == "recv"
               for i, x in enumerate(seq[:-1]))


def test_plan_says_what_an_interleaved_micro_batch_fold_will_run():
    """PP2·VPP2 at M = 32: the plan's --json has the fold's record (the plan prints its sentence, as for 1F1B;
    the refusals are choose_microbatches', above)."""
    import json

    from click.testing import CliRunner

    from prism_megatron.cli import main

    recipe = str(Path(__file__).parent / "recipes" / "fold-microbatches-pp2vpp2.yaml")
    base = ["plan", "--recipe", recipe, "--prism-driver", "core", "--global-batch-size", "32"]
    result = CliRunner().invoke(main, [*base, "--json", "--prism-fold-microbatches", "auto"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout)["microbatches"]
    assert (record["version"], record["schedule"], record["target"], record["captured"], record["rule"]) == (
        2, "interleaved", 32, 6, "steady-group-copy")
