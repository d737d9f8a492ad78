"""Rank classes, the replica-depth sandbox and ``prism-megatron plan`` (CPU, fast).

Every layout is checked against Megatron's own group construction (``RankGenerator``): each
data-parallel group holds exactly the sandbox's DP indices as live members, every virtual member's
representative sits in its group, and classes follow the pipeline stages Megatron builds.
"""

from __future__ import annotations

import json

import pytest

from prism_megatron.megatron.fold import (
    FoldError,
    FoldPlan,
    FoldPlanFormatError,
    TargetLayout,
    build_fold_plan,
    check_class_members,
    import_megatron,
)

pytestmark = pytest.mark.megatron  # runs megatron-core: CI also runs it on the second stack (.ci/run)

try:
    import_megatron()  # megatron-core 0.19 without triton: imported as the fold imports it
except ImportError:
    pytest.skip("megatron-core is not importable", allow_module_level=True)

from click.testing import CliRunner  # noqa: E402
from megatron.core.parallel_state import RankGenerator  # noqa: E402

from prism_megatron.cli import main  # noqa: E402
from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT  # noqa: E402
from prism_megatron.megatron.plan import (  # noqa: E402
    PLAN_JSON_VERSION,
    REPORT_TIME_MODEL,
    SERIAL_GPU_TIME_MODEL,
    GiB,
    _memory,
)


def test_the_fold_imports_megatron_without_its_notes_on_the_terminal():
    """The run's and the plan's own import of Megatron's modules (no Transformer Engine, no apex: the report
    names each substitution) prints none of its import-time warnings, as the ranks' preload does not."""
    import subprocess
    import sys

    code = "from prism_megatron.megatron.fold import import_megatron; import_megatron(); print('imported')"
    out = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr[-2000:]
    assert "Warning" not in out.stderr, out.stderr[-2000:]


def _dense(layout: TargetLayout) -> RankGenerator:
    return RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order=layout.order)


def _expert(layout: TargetLayout) -> RankGenerator:
    return RankGenerator(tp=layout.etp, ep=layout.ep, dp=layout.edp, pp=layout.pp, cp=1, order=layout.order)


def _check_against_megatron(plan: FoldPlan, layout: TargetLayout) -> None:
    """rep/live/class_of as Megatron's groups say they must be."""
    live = set(plan.live)
    assert all(plan.rep[r] == r for r in plan.live)
    for g in _dense(layout).get_ranks("dp"):
        assert [r for r in g if r in live] == g[:plan.k]  # the sandbox is DP indices 0..k-1
        assert all(plan.rep[r] == g[i % plan.k] for i, r in enumerate(g))
    for stage_groups in _dense(layout).get_ranks("pp"):
        for p, r in enumerate(stage_groups):
            assert p in plan.classes[plan.class_of[r]].coords["pp"]
    for token in ("tp", "cp", "tp-pp"):
        for g in _dense(layout).get_ranks(token):
            if any(r in live for r in g):
                assert all(r in live for r in g)  # TP/CP/model groups are never split by the sandbox
            else:
                s = plan.shift(g[0])
                assert all(plan.shift(r) == s for r in g)
    for g in _expert(layout).get_ranks("tp-ep"):
        assert len({r in live for r in g}) == 1  # expert groups are whole inside or outside the sandbox
    assert sum(c.count for c in plan.classes) == layout.world_size
    for ci, c in enumerate(plan.classes):
        assert c.sandbox == [r for r in plan.live if plan.class_of[r] == ci]
        assert c.count == sum(1 for x in plan.class_of if x == ci)


def test_dense_tp2_pp4_dp1024():
    layout = TargetLayout(world_size=8192, tp=2, pp=4, num_layers=8)
    plan = build_fold_plan(layout, "replica")
    assert plan.k == 1 and plan.live == [0, 1, 2048, 2049, 4096, 4097, 6144, 6145]
    assert [(c.name, c.count, c.sandbox) for c in plan.classes] == [
        ("first", 2048, [0, 1]), ("middle", 4096, [2048, 2049, 4096, 4097]), ("last", 2048, [6144, 6145])]
    assert plan.classes[0].role == "stage 0 (first: embedding; 2 layers)"
    assert plan.classes[1].role == "stages 1-2 (middle; 2 layers)"
    assert plan.classes[2].role == "stage 3 (last: loss; 2 layers)"
    assert plan.rep[8191] == 6145 and plan.shift(8191) == 8191 - 6145
    _check_against_megatron(plan, layout)
    again = FoldPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan


def test_pp_with_vpp_chunks():
    layout = TargetLayout(world_size=32, tp=2, pp=4, vpp=2, num_layers=16)
    plan = build_fold_plan(layout, "replica")
    assert [c.name for c in plan.classes] == ["first", "middle", "last"]
    assert "2+2 layers in 2 chunks" in plan.classes[1].role
    first = plan.classes[0].coords["chunks"]
    assert first[0][0] == "embedding" and "embedding" not in first[1]
    assert plan.classes[2].coords["chunks"][-1][-1] == "loss"
    _check_against_megatron(plan, layout)


def test_uneven_first_and_last_stage():
    layout = TargetLayout(world_size=64, tp=2, pp=4, num_layers=10, first_stage_layers=1, last_stage_layers=3)
    plan = build_fold_plan(layout, "replica")
    roles = [c.role for c in plan.classes]
    assert roles == ["stage 0 (first: embedding; 1 layer)", "stages 1-2 (middle; 3 layers)",
                     "stage 3 (last: loss; 3 layers)"]
    _check_against_megatron(plan, layout)


def test_custom_pipeline_layout_splits_middle_stages():
    layout = TargetLayout(world_size=16, pp=4, num_layers=5, pipeline_layout="Et|tt|t|tL")
    plan = build_fold_plan(layout, "replica")
    assert [(c.name, c.coords["pp"]) for c in plan.classes] == [
        ("first", [0]), ("middle-1", [1]), ("middle-2", [2]), ("last", [3])]
    _check_against_megatron(plan, layout)


@pytest.mark.parametrize("layout", [
    TargetLayout(world_size=64, tp=2, cp=2, pp=2, num_layers=4),
    TargetLayout(world_size=64, tp=2, pp=4, num_layers=8, order="tp-cp-ep-pp-dp"),  # --use-tp-pp-dp-mapping
], ids=["cp2", "tp-pp-dp-order"])
def test_cp_and_tp_pp_dp_order(layout):
    plan = build_fold_plan(layout, "replica")
    assert len(plan.live) == layout.tp * layout.cp * layout.pp
    _check_against_megatron(plan, layout)


@pytest.mark.parametrize("tp,etp,want_k", [(1, 1, 4), (2, 1, 2)])
def test_moe_ep4_dp_spanning_expert_groups(tp, etp, want_k):
    layout = TargetLayout(world_size=64, tp=tp, etp=etp, pp=2, ep=4, num_experts=8, num_layers=4)
    plan = build_fold_plan(layout, "replica")
    assert plan.k == want_k
    assert len(plan.live) == tp * 2 * want_k
    assert [c.name for c in plan.classes] == [f"{s}/ep{e}" for s in ("first", "last") for e in range(4)]
    assert plan.classes[1].role == "stage 0 (first: embedding; 2 layers, 2 MoE), expert rank 1 of 4"
    for g in _expert(layout).get_ranks("ep"):  # expert peers: one class each, the rank's position in the group
        assert [plan.classes[plan.class_of[r]].coords["ep_rank"] for r in g] == [0, 1, 2, 3]
    assert all(len(c.sandbox) == tp * want_k // 4 for c in plan.classes)
    _check_against_megatron(plan, layout)


@pytest.mark.parametrize("layout,words", [
    (TargetLayout(world_size=10, tp=2, pp=4, num_layers=8), ["10", "TP·PP·CP", "8"]),
    (TargetLayout(world_size=32, pp=2, ep=4, num_experts=6, num_layers=4), ["--num-experts 6", "4"]),
    (TargetLayout(world_size=24, tp=1, pp=2, ep=16, num_experts=16, num_layers=4), ["24", "ETP·EP·PP", "32"]),
    (TargetLayout(world_size=8, pp=1, vpp=2, num_layers=4), ["virtual pipeline size 2", "1"]),
    (TargetLayout(world_size=8, pp=4, num_layers=10), ["10 layers", "PP4"]),
    (TargetLayout(world_size=8, pp=4, num_layers=10, first_stage_layers=1, last_stage_layers=2), ["10 layers"]),
])
def test_bad_layout_refused_naming_values(layout, words):
    with pytest.raises(FoldError) as e:
        build_fold_plan(layout)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_class_members_that_differ_are_refused():
    plan = build_fold_plan(TargetLayout(world_size=64, tp=2, pp=4, num_layers=8), "replica")
    same = [("all_reduce", (4, 8)), ("send", (2, 8))]
    check_class_members(plan, {16: same, 17: same, 32: same})
    with pytest.raises(FoldError, match=r"class 'middle' \(stages 1-2.*ranks 16 and 32.*entry 1"):
        check_class_members(plan, {16: same, 32: [same[0], ("send", (2, 16))]}, "ops (kind, shape)")


def _trace_of(graph, plan: FoldPlan, path):
    """A folded trace of the live ranks of ``plan`` written from a synthetic graph (one tick per event)."""
    from prism_megatron.replay.graph import Comm, Mark
    from prism_megatron.trace import write_trace

    ops, marks = [], []
    for r in plan.live:
        for t, e in enumerate(graph.events[r]):
            if type(e) is Comm:
                ops.append(dict(rank=r, index=len(ops), kind=e.kind, group=e.group, seq=e.seq, peer=e.peer,
                                root=e.root, bytes=e.nbytes, dtype=e.dtype, shapes=[[e.nbytes]], reduce_op="",
                                async_op=e.async_op, t_issue=float(t), t_complete=float(t), compute_before=0.0,
                                label=e.label, splits="", t_wait=float("nan"), wait_clock=float("nan"), payload=""))
            elif type(e) is Mark:
                marks.append(dict(rank=r, name=e.name, phase=e.phase, t=float(t), compute_clock=0.0, attrs=e.attrs))
    manifest = {"world_size": plan.world_size, "job": {"fold": plan.to_json()},
                "groups": [{"id": g.id, "name": g.name, "ranks": list(g.ranks), "backend": "gloo"}
                           for g in graph.groups.values()],
                "ranks": [{"rank": r, "exit_code": 0, "device": "cpu"} for r in plan.live]}
    return write_trace(path, manifest, ops, marks)


@pytest.mark.parametrize("overlap", [True, False])
def test_a_replica_fold_of_an_interleaved_pipeline_accepts_its_middle_stages_own_orders(tmp_path, overlap):
    """PP4·VPP2·TP2·DP2 at replica depth: the class 'middle' holds live ranks on stages 1 and 2, which run
    their units and p2p calls in their own stage's order (warm-up counts; with overlapped p2p, Megatron's
    unbatched _p2p_ops posts a call's send first on even stages and its receive first on odd ones). The
    same work: accepted. A member that differs in a unit's ops or in a p2p stream's sizes: refused, naming
    the class, the part of the program and the difference."""
    from prism_megatron.megatron.fold_mode import FoldModeError, check_trace_classes
    from prism_megatron.replay.graph import Comm, Graph, Mark
    from prism_megatron.replay.synthetic import Shape, megatron_1f1b

    shape = Shape(tp=2, pp=4, dp=2, vpp=2, microbatches=8, layers_per_stage=1, iterations=2,
                  overlap_p2p=overlap, overlap_grad=True)
    plan = build_fold_plan(TargetLayout(world_size=16, tp=2, pp=4, vpp=2, overlap_p2p=overlap, num_layers=8),
                           "replica")
    middle = next(c for c in plan.classes if c.name == "middle")
    assert middle.sandbox == [4, 5, 8, 9] and middle.coords["pp"] == [1, 2]
    graph = megatron_1f1b(shape)
    sizes = {g.id: len(g.ranks) for g in graph.groups.values()}

    def flat(r):
        return [(e.kind, e.nbytes, e.dtype, sizes[e.group]) for e in graph.events[r] if type(e) is Comm]

    assert flat(4) != flat(8)  # stage 1 and stage 2 issue their ops in different orders: the refusal this fixes
    check_trace_classes(_trace_of(graph, plan, tmp_path / "same"))

    def changed(r, pick, nbytes):  # rank r's graph with the first op that ``pick`` selects resized
        events = list(graph.events[r])
        i = next(i for i, e in enumerate(events) if type(e) is Comm and pick(i, e))
        e = events[i]
        events[i] = Comm(e.kind, e.group, e.seq, e.peer, e.root, nbytes, e.dtype, e.async_op, e.label)
        return Graph(graph.groups, {**graph.events, r: events}, graph.source)

    inside, open_units = set(), 0  # indices of rank 8's ops within a backward unit
    for i, e in enumerate(graph.events[8]):
        if type(e) is Mark and e.name == "backward":
            open_units += 1 if e.phase == "B" else -1
        elif type(e) is Comm and open_units:
            inside.add(i)
    assert inside

    with pytest.raises(FoldModeError, match=r"class 'middle' \(stages 1-2.*ranks 4 and 8 differ in their ops .* in "
                                            r"backward unit \(iteration 0, microbatch \d+, chunk \d\).* at entry 0"):
        check_trace_classes(_trace_of(changed(8, lambda i, e: i in inside, 12345), plan, tmp_path / "unit"))
    with pytest.raises(FoldModeError, match=r"ranks 4 and 8 differ .* in p2p sends with the next stage outside "
                                            r"scheduling units at entry 0: \('send', 16777216.* vs \('send', 8,"):
        check_trace_classes(_trace_of(changed(8, lambda i, e: e.kind == "send" and e.peer == 12, 8), plan,
                                      tmp_path / "p2p"))


def test_plan_json_rejects_what_it_cannot_read():
    data = build_fold_plan(TargetLayout(world_size=16, tp=2, pp=2, num_layers=4), "replica").to_json()
    with pytest.raises(FoldPlanFormatError, match="field version 9"):
        FoldPlan.from_json({**data, "version": 9})
    with pytest.raises(FoldPlanFormatError, match="field rep is missing"):
        FoldPlan.from_json({k: v for k, v in data.items() if k != "rep"})
    with pytest.raises(FoldPlanFormatError, match="rep names a rank that is not live"):
        FoldPlan.from_json({**data, "rep": [3 if r == 5 else x for r, x in enumerate(data["rep"])]})
    with pytest.raises(FoldPlanFormatError, match="rep\\[l\\] == l"):
        FoldPlan.from_json({**data, "rep": [1] * 16})


def test_memory_refusal_says_what_would_fit():
    """The sandbox's need is the sum of its live ranks' class estimates (prism's, per class); Megatron's
    formula, given beside, is shown and not used."""
    plan = build_fold_plan(TargetLayout(world_size=8192, tp=2, pp=4, num_layers=8), "replica")

    def per_class(first: float, middle: float, last: float) -> dict:
        return {"source": "prism", "classes": {"first": {"total": int(first * GiB)},
                                               "middle": {"total": int(middle * GiB)},
                                               "last": {"total": int(last * GiB)}}}

    estimate = per_class(12, 9, 10)  # live: 2 x first, 4 x middle, 2 x last = 80 GiB
    formula = {"total": 1 * GiB, "source": "formula"}
    cpu = _memory(plan, estimate, ["cpu"], None, 40.0, "auto", formula)
    assert cpu["fits"] is False and "88.0 GiB of host RAM" in cpu["why"] and cpu["megatron"]["total"] == GiB
    assert cpu["per_rank"] == 12 * GiB and cpu["per_rank_class"] == "first"
    gpu = _memory(plan, estimate, ["0"], 40.0, 30.0, "none")
    assert gpu["fits"] is False and "at least 2 device(s) of 40 GiB" in gpu["why"]
    assert _memory(plan, estimate, ["0", "1"], 40.0, 30.0, "none")["fits"] is True
    big = _memory(plan, per_class(9, 50, 9), ["0", "1"], 40.0, 300.0, "auto")
    assert big["fits"] is False and "a sandbox rank of class middle needs 50.0 GiB" in big["why"]
    none = _memory(plan, {"error": "no vocabulary"}, ["0"], 40.0, 30.0, "auto", formula)
    assert none["fits"] is None and "no vocabulary" in none["why"]


def test_a_plan_for_gpus_this_machine_lacks_says_how_to_plan_for_them(monkeypatch):
    from prism_megatron.launcher import config
    from prism_megatron.launcher.config import LaunchError

    plan = build_fold_plan(TargetLayout(world_size=16, tp=2, pp=4, num_layers=8), "replica")
    estimate = {"source": "prism", "classes": {c: {"total": 5 * GiB} for c in ("first", "middle", "last")}}
    monkeypatch.setattr(config, "_gpus_seen", lambda visible: ())  # a machine without CUDA devices
    with pytest.raises(LaunchError, match=r"no device 0; to plan for a machine that has them, give its device memory "
                       r"\(--prism-device-memory GiB"):
        _memory(plan, estimate, ["0"], None, 30.0, "none")
    assert _memory(plan, estimate, ["0"], 80.0, 30.0, "none")["fits"] is True  # its memory given: planned


def test_the_plan_says_what_a_swap_switch_holds_in_host_memory():
    """4 live ranks of 60 GiB on one 140 GiB device: 100 GiB spill, which 146 GiB of host memory hold. But under the
    checkpoint API a rank coming in is still out while two whole ranks leave for it: 180 GiB at once, so the plan
    says it does not fit; in-process swaps copy only the blocks in use, so there it is judged swap by swap."""
    plan = build_fold_plan(TargetLayout(world_size=16, tp=2, pp=2, num_layers=4), "replica")
    estimate = {"source": "prism", "classes": {"first": {"total": 60 * GiB}, "last": {"total": 60 * GiB}}}
    ck = _memory(plan, estimate, ["0"], 140.0, 150.0, "checkpoint")
    assert ck["fits"] is False
    assert "needs 180.0 GiB to 240.0 GiB of host memory (from prism's memory estimates)" in ck["why"]
    assert "less than the least a switch holds" in ck["swap_host"]
    inproc = _memory(plan, estimate, ["0"], 140.0, 150.0, "inprocess")
    assert inproc["fits"] is True and "judged swap by swap" in inproc["swap_host"]
    assert _memory(plan, estimate, ["0"], 140.0, 300.0, "checkpoint")["fits"] is True
    assert "swap_host" not in _memory(plan, estimate, ["0", "1"], 140.0, 150.0, "checkpoint")  # no spill, no swaps
    # on two 100 GiB devices, as the launcher places them (contiguous blocks): the first stage's ranks 0, 1 (80 GiB
    # each) on one, never together, a switch holding both; the last stage's 8, 9 (40 each) fit the other
    uneven = {"source": "prism", "classes": {"first": {"total": 80 * GiB}, "last": {"total": 40 * GiB}}}
    two = _memory(plan, uneven, ["0", "1"], 100.0, 300.0, "checkpoint")
    assert "needs 160.0 GiB to 160.0 GiB" in two["swap_host"]  # placed 0, 8 | 1, 9 it would be 120 on each


def test_a_rank_over_the_target_cap_runs_to_its_oom_verdict_where_the_cap_is_below_the_device():
    """A class whose estimate exceeds the emulating device but also the target's cap is stopped at the cap by the
    allocator (memory.probe): it holds at most the cap here, so the plan runs it to a predicted OOM instead of
    refusing it; with the cap above the device the rank could exhaust the device first, and the plan refuses it."""
    from prism_megatron.megatron.plan import Plan, _serial, plan_fits, plan_verdict, predicted_ooms

    layout = TargetLayout(world_size=64, pp=4, num_layers=8)
    fold = build_fold_plan(layout, "class")  # live: first, middle, last
    estimate = {"source": "prism", "classes": {"first": {"total": 30 * GiB}, "middle": {"total": 50 * GiB},
                                               "last": {"total": 20 * GiB}}}

    def plan_with(cap_gib: float | None, capture: str) -> Plan:
        target = None if cap_gib is None else {"name": f"{cap_gib:g} GiB", "usable": int(cap_gib * GiB)}
        plan = Plan(layout=layout, fold=fold, iterations=1, devices=["0"],
                    memory=_memory(fold, estimate, ["0"], 40.0, 100.0, "none", None, target))
        if capture == "serial":
            plan.capture = _serial(plan)
        return plan

    without = plan_with(None, "serial")  # no target: the middle rank's 50 GiB cannot be held by a 40 GiB device
    assert plan_fits(without) is False and plan_verdict(without) == "does not fit"
    assert "one live rank needs 50.0 GiB against 40.0 GiB" in without.capture["why"]

    capped = plan_with(25.0, "serial")  # cap 25 < device 40: first and middle stop at 25 GiB
    m = capped.memory
    assert m["per_rank"] == 50 * GiB and m["per_rank_held"] == 25 * GiB
    assert m["target"]["oom"] == {"first": 30 * GiB, "middle": 50 * GiB}
    assert plan_fits(capped) is True and plan_verdict(capped) == "runs (to an OOM verdict)"
    assert capped.capture["why"].startswith("one live rank needs 25.0 GiB (class middle: estimate 50.0 GiB, stopped "
                                            "at the target's cap) against 40.0 GiB of one device")
    assert "stops_at" not in capped.capture  # a serial run captures every class past a predicted OOM
    lines = predicted_ooms(capped)
    assert lines[1] == ("rank class middle: predicted OOM on 25 GiB (estimate 50.0 GiB > cap 25.0 GiB); the run "
                        "stops it at the cap and reports the failing allocation")
    assert lines[-1] == ("serial: every class is captured; a capture that reaches its OOM (first, middle) ends "
                         "there and the later captures still run, so the report gives each class its verdict (fits, "
                         "or the failing allocation) and no time prediction")
    from rich.console import Console

    from prism_megatron.megatron.plan import render_plan

    console = Console(width=300, record=True)
    render_plan(Plan(**{**vars(capped), "time": {"seconds": 60.0, "iterations": 1, "model": "rough"}}), console)
    text = console.export_text()
    assert lines[1] in text and "verdict: runs (to an OOM verdict)" in text, text
    # together: 25 + 25 + 20 GiB held on one 40 GiB device, swap off: does not fit, and no OOM is promised
    together = plan_with(25.0, "together")
    assert together.memory["gpu_needed"] == 70 * GiB and plan_verdict(together) == "does not fit"
    assert predicted_ooms(together) == []

    over = plan_with(45.0, "serial")  # cap 45 > device 40: the 50 GiB rank could exhaust the device before its cap
    assert plan_fits(over) is False and plan_verdict(over) == "does not fit" and predicted_ooms(over) == []
    assert over.memory["why"] == ("a sandbox rank of class middle needs 50.0 GiB (prism's estimate), more than the "
                                  "target 45 GiB's cap of 45.0 GiB per rank, but that cap is above the 40.0 GiB a "
                                  "device holds here: the rank could exhaust the device before its cap stops it, so "
                                  "its OOM would be the emulation's, not the target's: use GPUs with more than "
                                  "45.0 GiB")
    under = plan_with(60.0, "serial")  # cap above every estimate: no OOM predicted, the old refusal stands
    assert under.memory["target"]["oom"] == {} and plan_verdict(under) == "does not fit"
    assert "a sandbox rank of class middle needs 50.0 GiB (prism's estimate) but a device holds 40.0 GiB" \
        in under.memory["why"]


TINY_GPT = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
            "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "1024", "--train-iters", "2",
            "--lr", "1e-4", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
            "--transformer-impl", "local"]


@pytest.mark.heavy
def test_plan_cli_8192_rank_command_json():
    result = CliRunner().invoke(main, ["plan", "--json", "--prism-world-size", "8192", "--devices", "cpu",
                                       "--prism-fold-depth", "replica", "--", str(CORE_DRIVER_SCRIPT), *TINY_GPT])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)  # stdout only: warnings go to stderr
    assert out["version"] == PLAN_JSON_VERSION and out["layout"] == "TP2·PP4·DP1024 = 8192 ranks"
    assert out["capture"] == {"mode": "together"} and out["fits"] is out["memory"]["fits"]
    assert out["microbatches"] is None  # every micro-batch runs unless --prism-fold-microbatches says otherwise
    assert out["fold_depth"] == "replica (asked)"
    fold = FoldPlan.from_json(out["fold"])
    assert fold.world_size == 8192 and len(fold.live) == 8 and fold.depth == "replica"
    assert [c.count for c in fold.classes] == [2048, 4096, 2048]
    memory = out["memory"]  # prism's estimate per class on CPU (the device asked), the live ranks' sum judged
    assert memory["classes"]["first"]["total"] > memory["classes"]["middle"]["total"] > 0
    assert memory["per_rank"] == max(c["total"] for c in memory["classes"].values())
    assert memory["classes"]["middle"]["in_flight"] == [1]  # GBS 1024 over DP1024: one micro-batch in flight
    assert memory["fits"] is True and set(memory["megatron"]) >= {"total", "error"}
    assert out["time"]["iterations"] == 2 and "rough" in out["time"]["model"]


@pytest.mark.heavy
def test_plan_of_a_serial_capture_judges_one_live_rank_at_a_time():
    """8 live ranks whose sum does not fit the host RAM given, one of which does: refused together, planned
    serially (8 captures), and a host too small for even one rank is refused naming the serial need."""
    base = ["plan", "--json", "--prism-world-size", "8192", "--devices", "cpu", "--prism-fold-depth", "replica"]
    args = ["--", str(CORE_DRIVER_SCRIPT), *TINY_GPT]
    together = CliRunner().invoke(main, [*base, "--prism-host-memory", "6", *args])
    assert together.exit_code != 0 and "the sandbox does not fit here" in together.output
    serial = CliRunner().invoke(main, [*base, "--prism-host-memory", "6", "--prism-fold-capture", "serial", *args])
    assert serial.exit_code == 0, serial.output
    out = json.loads(serial.stdout)
    capture = out["capture"]
    assert capture["mode"] == "serial" and capture["captures"] == 8 and out["fits"] is True
    assert out["memory"]["fits"] is False  # together: still said
    assert capture["why"].startswith("one live rank needs 1.0 GiB against 6.0 GiB of host RAM"), capture
    tiny = CliRunner().invoke(main, [*base, "--prism-host-memory", "0.5", "--prism-fold-capture", "serial", *args])
    assert tiny.exit_code != 0 and "one live rank needs 1.0 GiB against 0.5 GiB of host RAM" in tiny.output


@pytest.mark.heavy
def test_plan_cli_takes_the_target_gpu_and_runs_a_rank_over_its_cap_to_the_oom_verdict():
    """``plan --prism-target-gpu``: a device smaller than the heaviest rank's estimate but larger than the target's
    cap plans a run to the OOM verdict (exit 0, ``verdict``, ``predicted_oom``); a cap above the device refuses."""
    base = ["plan", "--json", "--prism-world-size", "8192", "--devices", "0", "--prism-host-memory", "8",
            "--prism-fold-depth", "replica", "--prism-fold-capture", "serial"]
    args = ["--", str(CORE_DRIVER_SCRIPT), *TINY_GPT]
    first = CliRunner().invoke(main, [*base, "--prism-device-memory", "1000", *args])
    assert first.exit_code == 0, first.output
    need = json.loads(first.stdout)["memory"]["per_rank"] / GiB  # the heaviest class's estimate
    device = f"{need * 0.8:.4f}"
    runs = CliRunner().invoke(main, [*base, "--prism-device-memory", device, "--prism-target-gpu", f"{need * 0.5:.4f}",
                                     "--prism-target-context", "0", *args])
    assert runs.exit_code == 0, runs.output
    out = json.loads(runs.stdout)
    assert out["version"] == PLAN_JSON_VERSION and out["fits"] is True and out["verdict"] == "runs (to an OOM verdict)"
    assert out["memory"]["per_rank_held"] == out["memory"]["target"]["cap"] < out["memory"]["per_rank"]
    assert out["predicted_oom"] and out["predicted_oom"][0].startswith("rank class first: predicted OOM on ")
    # a class that runs out of memory ends its capture in its first iterations, and the report replays nothing
    t, g = out["time"], SERIAL_GPU_TIME_MODEL
    over = set(out["memory"]["target"]["oom"])
    names = [out["fold"]["classes"][out["fold"]["class_of"][r]]["name"] for r in out["fold"]["live"]]
    per_iteration = t["sandbox_flops_per_iteration"] / len(names) / g["dense_flops"]
    assert t["captures_s"] == [pytest.approx(g["capture_s"] + (g["oom_iterations"] if name in over else 3)
                                             * per_iteration, abs=0.1) for name in names]
    assert t["report_s"] == 0 and t["seconds"] == pytest.approx(g["run_s"] + sum(t["captures_s"]), abs=0.5)
    over = CliRunner().invoke(main, [*base, "--prism-device-memory", device, "--prism-target-gpu", f"{need * 0.9:.4f}",
                                     "--prism-target-context", "0", *args])
    assert over.exit_code != 0 and "that cap is above the" in over.output


#: a MoE job shaped like the targets for the core driver: TP1·PP2·EP8 on 64 ranks (expert DP4), 64 experts top-8
MOE_TARGET = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
              "--max-position-embeddings", "1024", "--vocab-size", "32000", "--micro-batch-size", "1",
              "--global-batch-size", "256", "--train-iters", "3", "--lr", "1e-4", "--bf16",
              "--no-masked-softmax-fusion",
              "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "8", "--num-experts", "64",
              "--moe-router-topk", "8", "--moe-ffn-hidden-size", "512", "--moe-token-dispatcher-type", "alltoall",
              "--use-distributed-optimizer", "--disable-bias-linear", "--mock-data", "--tokenizer-type",
              "NullTokenizer"]


@pytest.mark.heavy
def test_plan_of_a_moe_target_captured_serially_folds_expert_peers_at_class_depth(parse_each_command_once):
    """Serial capture of a MoE job: auto depth keeps the replica (16 live expert ranks) where it fits here together,
    and refuses to capture it serially, naming class depth; where it does not fit, auto takes class depth (2 live
    ranks, expert peers by the translated mirror) and one live rank at a time fits."""
    base = ["plan", "--json", "--prism-world-size", "64", "--devices", "0", "--prism-host-memory", "1",
            "--prism-fold-capture", "serial"]
    args = ["--", str(CORE_DRIVER_SCRIPT), *MOE_TARGET]
    roomy = CliRunner().invoke(main, [*base, "--prism-device-memory", "100", *args])
    assert roomy.exit_code != 0 and "serial capture refused: a MoE layout (EP8) at replica depth" in roomy.output
    out = json.loads(roomy.stdout)
    assert out["fold_depth"].startswith("auto: replica for a MoE layout (one model replica fits here together")
    assert len(out["fold"]["live"]) == 16 and out["capture"]["refused"] is True and out["fits"] is False
    # the report step: 3 iterations x 8 micro-batches (GBS 256 over DP32) x 8 MoE layers at TP1, on each replayed
    # rank: the replica's 16 live ranks (8 per stage of 2) here, one pipeline of 2 at class depth below
    per_layer = REPORT_TIME_MODEL["attention_ops"][("mha", False)] + REPORT_TIME_MODEL["mlp_ops"][("moe", False)]
    assert out["time"]["report_ops"] == round(3 * 8 * 8 * per_layer * 16 / 2), out["time"]
    small = CliRunner().invoke(main, [*base, "--prism-device-memory", "4", *args])
    assert small.exit_code == 0, small.output
    out = json.loads(small.stdout)
    assert out["fold_depth"].startswith("auto: class for a MoE layout captured serially (one model replica does not "
                                        "fit here: the sandbox's 16 ranks need")
    assert out["fold"]["live"] == [0, 32] and out["fold"]["expert_tokens"] == "translated mirror"
    assert out["time"]["report_ops"] == round(3 * 8 * 8 * per_layer), out["time"]
    capture = out["capture"]
    assert capture["captures"] == 2 and capture["fits"] is True and "refused" not in capture, capture
    # the time on a GPU: the run's own cost, then each capture's and its live rank's 3 iterations at the MoE rate;
    # auto's second pass may take the first capture again (at most 2(k-1) = 2), its stop expects one take
    t, g = out["time"], SERIAL_GPU_TIME_MODEL
    assert capture["second_pass"]["at_most"] == 2 and capture["second_pass"]["counted"] == 1 and t["captures"] == 3
    each = g["capture_s"] + 3 * t["sandbox_flops_per_iteration"] / 2 / g["moe_flops"]
    assert t["captures_s"] == [pytest.approx(each, abs=0.1)] * 3 and t["run_s"] == g["run_s"]
    assert t["seconds"] == pytest.approx(g["run_s"] + 3 * each + t["report_s"], abs=0.2)
    assert "1 more expected for the second pass (for a fold with MoE layers; at most 2)" in t["model"]
    need = out["memory"]["classes"]["first"]["total"] / 2**30  # prism's estimate of the largest class
    assert 1.5 < need < 4.0 and out["memory"]["per_rank_class"] == "first"
    assert capture["why"].startswith(f"one live rank needs {need:.1f} GiB against 4.0 GiB of one device")
    tiny = CliRunner().invoke(main, [*base, "--prism-device-memory", "1.5", *args])  # not even one rank
    assert tiny.exit_code != 0 and f"one live rank needs {need:.1f} GiB against 1.5 GiB" in tiny.output


def test_serial_capture_refuses_what_no_rule_answers_by_name():
    from types import SimpleNamespace

    from prism_megatron.megatron.plan import serial_refusal

    moe = TargetLayout(world_size=16, pp=2, ep=4, num_experts=8, num_layers=4)
    ok = SimpleNamespace(moe_token_dispatcher_type="alltoall", calculate_per_token_loss=False)
    assert serial_refusal(moe, "class", ok) is None
    assert serial_refusal(moe, "class", SimpleNamespace(**{**vars(ok), "moe_token_dispatcher_type": "allgather"})) \
        is None
    flex = serial_refusal(moe, "class", SimpleNamespace(**{**vars(ok), "moe_token_dispatcher_type": "flex"}))
    assert flex.startswith("--moe-token-dispatcher-type flex: a serial capture answers the alltoall and allgather")
    assert "at replica depth" in serial_refusal(moe, "replica", ok)
    dense = TargetLayout(world_size=8, pp=2, num_layers=4)
    assert serial_refusal(dense, "replica", ok) is None  # EP1: nothing crosses captures but the dense ops
    per_token = SimpleNamespace(**{**vars(ok), "calculate_per_token_loss": True})
    assert serial_refusal(dense, "class", per_token).startswith("--calculate-per-token-loss: every stage divides")
    assert serial_refusal(TargetLayout(world_size=8, num_layers=4), "class", per_token) is None  # PP1: one stage


@pytest.mark.heavy
def test_plan_cli_mini_recipe_table(parse_each_command_once):
    result = CliRunner().invoke(main, ["plan", "--recipe", "mini-dense-tp2pp2dp4"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "rank classes" in text and "TP2·PP2·DP4 = 16 ranks" in text
    assert "stage 0 (first: embedding; 2 layers)" in text and "stage 1 (last: loss; 2 layers)" in text
    assert "fold depth: replica (auto: replica" in text  # auto folds no deeper than needed
    assert "sandbox: 4 live rank(s)" in text and "one model replica" in text and "virtual: 12 rank(s)" in text
    result = CliRunner().invoke(main, ["plan", "--recipe", "mini-dense-tp2pp2dp4", "--prism-fold-depth", "class"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "fold depth: class (class (asked))" in text
    assert "sandbox: 2 live rank(s)" in text and "one per class" in text and "virtual: 14 rank(s)" in text
    assert "expected emulation time" in text


@pytest.mark.heavy
def test_plan_is_of_the_options_a_recipe_chose_and_says_them(tmp_path, parse_each_command_once):
    import yaml

    from prism_megatron.recipe import find_recipe

    data = yaml.safe_load(find_recipe("mini-dense-tp2pp2dp4").read_text())
    data.update(version=3, name="mini-chooses", emulation={"fold_depth": "class", "fold_capture": "serial"})
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(main, ["plan", "--json", "--recipe", str(tmp_path / "r.yaml"), "--prism-fold-capture",
                                       "together"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["said"] == ["prism: --prism-fold-depth class (recipe mini-chooses's emulation.fold_depth)"]
    assert out["fold"]["depth"] == "class" and out["capture"]["mode"] == "together"  # the flag over the recipe


@pytest.mark.heavy
def test_plan_cli_refuses_bad_layout():
    result = CliRunner().invoke(main, ["plan", "--prism-world-size", "12", "--", str(CORE_DRIVER_SCRIPT), *TINY_GPT])
    assert result.exit_code != 0
    assert "world size 12 is not divisible by TP·PP·CP = 2·4·1 = 8" in result.output


def test_plan_cli_uneven_layout_through_megatron_lm_parser(monkeypatch):
    """Megatron-LM's own parser and validate_args: its uneven-stage and layout flags reach the classes."""
    from prism_megatron.megatron.driver import DRIVER_SCRIPT
    from prism_megatron.megatron.megatron_lm import training_available

    if not training_available():
        pytest.skip("megatron.training is not importable (set MEGATRON_LM_PATH to a Megatron-LM checkout)")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # validate_args asks for it with TP > 1
    base = TINY_GPT[:1] + ["5"] + TINY_GPT[2:] + ["--no-gradient-accumulation-fusion"]
    result = CliRunner().invoke(main, ["plan", "--json", "--prism-world-size", "64", "--", str(DRIVER_SCRIPT), *base,
                                       "--pipeline-model-parallel-layout", "Et|tt|t|tL"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)  # stdout only: warnings go to stderr
    assert [(c["name"], c["count"]) for c in out["fold"]["classes"]] == [
        ("first", 16), ("middle-1", 16), ("middle-2", 16), ("last", 16)]
    assert out["memory"]["per_rank"] > 0 and out["memory"]["fits"] is True


def test_plan_cli_core_driver_gets_megatron_formula():
    """The core driver's parser leaves what Megatron-LM's validate_args fills in (world size, expert TP size)
    unset; Megatron's formula reads them (0.19), so the plan must give them or show no memory at all."""
    from prism_megatron.megatron.megatron_lm import training_available

    if not training_available():
        pytest.skip("megatron.training is not importable (set MEGATRON_LM_PATH to a Megatron-LM checkout)")
    result = CliRunner().invoke(main, ["plan", "--json", "--prism-world-size", "16", "--devices", "cpu", "--",
                                       str(CORE_DRIVER_SCRIPT), *TINY_GPT])
    assert result.exit_code == 0, result.output
    memory = json.loads(result.output)["memory"]
    assert memory["per_rank"] > 0 and memory["fits"] is True, memory


def test_plan_table_merges_expert_classes_beyond_the_row_limit():
    from prism_megatron.megatron.plan import _class_rows

    plan = build_fold_plan(TargetLayout(world_size=4096, pp=4, ep=16, num_experts=64, num_layers=8))
    assert len(plan.classes) == 48
    rows = _class_rows(plan)
    assert [(name, count, len(sandbox)) for name, _, count, sandbox in rows] == [
        ("first/ep*", 1024, 16), ("middle/ep*", 2048, 32), ("last/ep*", 1024, 16)]
    assert rows[0][1] == "stage 0 (first: embedding; 2 layers, 2 MoE); 16 expert ranks, one class each"


def test_args_with_an_axis_the_fold_does_not_know_are_refused():
    import argparse

    from prism_megatron.megatron.fold import layout_from_args

    args = argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, num_layers=4,
                              gtp_weight_remat_size=2)
    with pytest.raises(FoldError, match="--gtp-weight-remat-size 2"):
        layout_from_args(args, 16)
    args.gtp_weight_remat_size = 1
    layout = layout_from_args(args, 16, gpus_per_node=4)
    assert (layout.tp, layout.pp, layout.dp, layout.etp, layout.gpus_per_node) == (2, 2, 4, 2, 4)


@pytest.mark.heavy
def test_plan_says_what_micro_batch_folding_will_run_and_plans_that_command(parse_each_command_once):
    """GBS 1024 over DP1024 is one micro-batch per pipeline: nothing to fold; GBS 16,384 is 16, of which
    the minimum (the largest 1F1B warm-up, 3 at PP4, + 2) runs and the plan is of that command. Megatron
    parses two commands: the target's (read again by the unfolded plan and the refused count) and the
    folded one the plan is of."""
    base = ["plan", "--json", "--prism-world-size", "8192", "--devices", "cpu", "--prism-fold-depth", "replica"]
    big = [*TINY_GPT[:TINY_GPT.index("--global-batch-size") + 1], "16384",
           *TINY_GPT[TINY_GPT.index("--global-batch-size") + 2:]]
    result = CliRunner().invoke(main, [*base, "--prism-fold-microbatches", "auto", "--", str(CORE_DRIVER_SCRIPT),
                                       *big])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["microbatches"]["target"] == 16 and out["microbatches"]["captured"] == 5
    folded_flops = out["time"]["sandbox_flops_per_iteration"]
    result = CliRunner().invoke(main, [*base, "--", str(CORE_DRIVER_SCRIPT), *big])
    unfolded = json.loads(result.stdout)["time"]
    assert unfolded["sandbox_flops_per_iteration"] == pytest.approx(folded_flops * 16 / 5)
    # the report step replays the target's 16 micro-batches either way: 2 iterations x 16 x 8 dense TP2 layers on
    # each of the replica's 8 live ranks (2 per stage of 4)
    per_layer = REPORT_TIME_MODEL["attention_ops"][("mha", True)] + REPORT_TIME_MODEL["mlp_ops"][("dense", True)]
    for t in (out["time"], unfolded):
        assert t["report_ops"] == round(2 * 16 * 8 * per_layer * 8 / 4), t
        assert t["report_s"] == pytest.approx(t["report_ops"] * REPORT_TIME_MODEL["s_per_op"], rel=1e-3)
        assert "then the report: " in t["model"] and "(16 micro-batches)" in t["model"]
    assert out["time"]["seconds"] > out["time"]["report_s"] > 0
    result = CliRunner().invoke(main, [*base, "--prism-fold-microbatches", "4", "--", str(CORE_DRIVER_SCRIPT), *big])
    assert result.exit_code != 0 and "below the minimum 5" in result.output


def test_plan_counts_the_second_pass_in_the_serial_captures_and_the_time():
    base = ["plan", "--json", "--prism-world-size", "8", "--devices", "cpu", "--prism-fold-depth", "class",
            "--prism-fold-capture", "serial"]
    args = ["--", str(CORE_DRIVER_SCRIPT), *TINY_GPT]  # TP2·PP4 on 8 ranks: first, middle, last live
    out = {}
    for mode in ("off", "on"):
        r = CliRunner().invoke(main, [*base, "--prism-fold-second-pass", mode, *args])
        assert r.exit_code == 0, r.output
        out[mode] = json.loads(r.stdout)
    off, on = out["off"], out["on"]
    # 3 live ranks (first, middle, last): the second pass may add 2 x 2 captures, counted only where taken
    assert off["capture"]["second_pass"]["at_most"] == on["capture"]["second_pass"]["at_most"] == 4
    assert (off["capture"]["second_pass"]["counted"], on["capture"]["second_pass"]["counted"]) == (0, 4)
    assert (off["time"]["captures"], on["time"]["captures"]) == (3, 7)
    assert on["time"]["seconds"] > off["time"]["seconds"]
    assert "4 more expected for the second pass (by --prism-fold-second-pass on; at most 4)" in on["time"]["model"]
    assert len(on["time"]["captures_s"]) == 7 and on["time"]["run_s"] == 0  # CPU: the rough model, no run cost


def test_the_gpu_list_started_with_the_planning_is_the_one_the_plan_reads(monkeypatch):
    """The run command starts the child that lists the GPUs (it imports torch and starts CUDA: seconds on a GPU
    host) beside its parsing child; the plan's device-memory question then reads that child's answer instead of
    starting another, and every later question reads the same answer."""
    import os

    from prism_megatron.launcher import config

    monkeypatch.setattr(config, "_gpu_answers", {})
    monkeypatch.setattr(config, "_gpu_queries", {})
    started = []
    real = config._query_child
    monkeypatch.setattr(config, "_query_child", lambda: started.append(1) or real())
    config.start_gpu_query()
    config.start_gpu_query()  # one child per CUDA_VISIBLE_DEVICES
    assert len(started) == 1
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    assert config._gpus_seen(visible) == ()  # this CPU machine has no CUDA device
    assert len(started) == 1 and config._gpu_queries == {}
    with pytest.raises(config.LaunchError, match="this machine has 0 CUDA device"):
        config._check_gpus(["0"])
    config.start_gpu_query()  # answered: nothing more to start
    assert len(started) == 1
