"""Class depth (one live rank per rank class), the plan's coordinates and version-2 JSON (CPU, fast).

Every plan is checked against Megatron's own group construction (``RankGenerator`` and its default
embedding groups), with a translation written here from the plan's coords: a group with live members
holds each member's representative, and for every rank r (sampled on the largest layouts) the group
of ``rep[r]`` translated by ``coords[r] - coords[rep[r]]`` is r's group of the same kind.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from prism_megatron.megatron.fold import (
    FoldDepthError,
    FoldError,
    FoldPlan,
    FoldPlanFormatError,
    TargetLayout,
    build_fold_plan,
    import_megatron,
)

pytestmark = pytest.mark.megatron  # runs megatron-core: CI also runs it on the second stack (.ci/run)

try:
    import_megatron()
except ImportError:
    pytest.skip("megatron-core is not importable", allow_module_level=True)

from megatron.core.parallel_state import RankGenerator, default_embedding_ranks  # noqa: E402

DENSE_TOKENS = ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp", "tp-dp-cp")
EXPERT_TOKENS = ("tp", "ep", "tp-ep", "tp-ep-pp", "dp")


def _kinds(t: TargetLayout) -> dict[str, list[list[int]]]:
    dense = RankGenerator(tp=t.tp, ep=1, dp=t.dp, pp=t.pp, cp=t.cp, order=t.order)
    expert = RankGenerator(tp=t.etp, ep=t.ep, dp=t.edp, pp=t.pp, cp=1, order=t.order)
    out = {f"dense {k}": dense.get_ranks(k) for k in DENSE_TOKENS}
    out |= {f"expert {k}": expert.get_ranks(k) for k in EXPERT_TOKENS}
    out["embedding"] = [default_embedding_ranks(g) for g in dense.get_ranks("pp")]
    return out


def _translate(plan: FoldPlan, index: dict[tuple, int], r: int, x: int) -> int:
    """The rank that is, for r, what x is for rep[r] (the contract's torus translation)."""
    c, cr, cq = plan.coords[x], plan.coords[r], plan.coords[plan.rep[r]]
    return index[tuple((a + b - q) % n for a, b, q, n in zip(c, cr, cq, plan.sizes, strict=True))]


def _check_against_megatron(plan: FoldPlan, t: TargetLayout, sample: int | None = None) -> None:
    world = t.world_size
    kinds = _kinds(t)
    # coords: each rank's position in Megatron's group of each axis
    expert = plan.axes == ("tp", "cp", "ep", "edp", "pp")  # MoE at class depth with expert DP > 1
    inner = t.tp // t.etp if expert else 1  # dense-TP positions inside one EP position
    for a, axis in enumerate(plan.axes):
        kind = {"ep": "expert ep", "edp": "expert dp"}.get(axis, f"dense {axis}")
        for g in kinds[kind]:
            assert [plan.coords[r][a] for r in g] == [i // inner if axis == "ep" else i for i in range(len(g))]
    assert plan.sizes == ([t.tp, t.cp, t.ep // inner, t.edp, t.pp] if expert else [t.tp, t.cp, t.dp, t.pp])
    index = {tuple(c): r for r, c in enumerate(plan.coords)}
    assert len(index) == world
    live = set(plan.live)
    ranks = list(range(world))
    if sample is not None and world > sample:
        ranks = sorted(set(random.Random(world).sample(ranks, sample)) | live | {world - 1})
    for name, groups in kinds.items():
        of = {r: i for i, g in enumerate(groups) for r in g}
        for g in groups:
            if any(r in live for r in g):  # mirrored in place: each member's rep is a member
                assert all(plan.rep[r] in g for r in g), (name, g)
        for r in ranks:
            if r not in of:
                continue
            assert plan.rep[r] in of, (name, r)
            moved = {_translate(plan, index, r, x) for x in groups[of[plan.rep[r]]]}
            assert moved == set(groups[of[r]]), (name, r, plan.rep[r])


def _stage_of(plan: FoldPlan, r: int) -> int:
    return plan.coords[r][3]


LAYOUTS = {
    "tp1-pp1-dp8": TargetLayout(world_size=8, num_layers=2),
    "tp2-pp1-dp4": TargetLayout(world_size=8, tp=2, num_layers=2),
    "tp4-pp2-dp2": TargetLayout(world_size=16, tp=4, pp=2, num_layers=4),
    "tp1-pp3-dp2": TargetLayout(world_size=6, pp=3, num_layers=6),
    "tp2-pp4-8b": TargetLayout(world_size=8, tp=2, pp=4, num_layers=32, hidden_size=4096, num_attention_heads=32),
    "tp2-pp5-dp2": TargetLayout(world_size=20, tp=2, pp=5, num_layers=10),
    "tp1-pp8-dp2": TargetLayout(world_size=16, pp=8, num_layers=16),
    "tp2-pp2-vpp2": TargetLayout(world_size=16, tp=2, pp=2, vpp=2, num_layers=8),
    "tp2-cp2-pp2": TargetLayout(world_size=32, tp=2, cp=2, pp=2, num_layers=4),
    "tp2-cp2-pp4-dp2": TargetLayout(world_size=32, tp=2, cp=2, pp=4, num_layers=8),
    "uneven-first1-last3": TargetLayout(world_size=64, tp=2, pp=4, num_layers=10, first_stage_layers=1,
                                        last_stage_layers=3),
    "uneven-pp8": TargetLayout(world_size=64, tp=4, pp=8, num_layers=22, first_stage_layers=2, last_stage_layers=2),
    "account-embedding-loss": TargetLayout(world_size=16, pp=4, num_layers=14, account_for_embedding=True,
                                           account_for_loss=True),
    "tp-pp-dp-order": TargetLayout(world_size=64, tp=2, pp=4, num_layers=8, order="tp-cp-ep-pp-dp"),
    "custom-layout": TargetLayout(world_size=16, pp=4, num_layers=5, pipeline_layout="Et|tt|t|tL"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_class_depth_keeps_one_live_rank_per_class(name):
    t = LAYOUTS[name]
    plan = build_fold_plan(t)  # auto: class depth for a dense layout
    assert plan.depth == "class" and plan.version == 2
    assert len(plan.live) == len(plan.classes)
    for ci, c in enumerate(plan.classes):
        (r,) = c.sandbox
        assert plan.class_of[r] == ci
        assert plan.coords[r][:3] == [0, 0, 0] and _stage_of(plan, r) == c.coords["pp"][0]  # lowest stage
        assert c.count == plan.class_of.count(ci)
    for r in range(t.world_size):  # rep: tp = cp = 0, DP index 0, the live stage of r's class
        q = plan.rep[r]
        assert plan.class_of[q] == plan.class_of[r] and plan.coords[q][:3] == [0, 0, 0]
    first, last = plan.classes[plan.class_of[0]], plan.classes[plan.class_of[t.world_size - 1]]
    assert first.coords["pp"] == [0] and last.coords["pp"] == [t.pp - 1]  # first and last stay live
    _check_against_megatron(plan, t)
    assert FoldPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_the_issues_8b_layout_folds_to_first_middle_last():
    plan = build_fold_plan(LAYOUTS["tp2-pp4-8b"])
    assert [(c.name, c.count, c.sandbox) for c in plan.classes] == [
        ("first", 2, [0]), ("middle", 4, [2]), ("last", 2, [6])]
    assert plan.rep == [0, 0, 2, 2, 2, 2, 6, 6]


def test_uneven_and_custom_layouts_split_their_classes():
    uneven = build_fold_plan(LAYOUTS["uneven-pp8"])
    assert [(c.name, c.coords["pp"]) for c in uneven.classes] == [("first", [0]), ("middle", [1, 2, 3, 4, 5, 6]),
                                                                  ("last", [7])]
    custom = build_fold_plan(LAYOUTS["custom-layout"])
    assert [(c.name, c.sandbox) for c in custom.classes] == [("first", [0]), ("middle-1", [4]), ("middle-2", [8]),
                                                             ("last", [12])]  # DP4: stages 4 ranks apart


@pytest.mark.parametrize("t", [
    TargetLayout(world_size=8192, tp=2, pp=4, num_layers=8),
    TargetLayout(world_size=8192, tp=4, pp=8, num_layers=32),
    TargetLayout(world_size=1024, num_layers=2),
], ids=["tp2-pp4-dp1024", "tp4-pp8-dp256", "pp1-dp1024"])
@pytest.mark.heavy
def test_class_depth_at_scale(t):
    plan = build_fold_plan(t)
    assert len(plan.live) == len(plan.classes) == (1 if t.pp == 1 else 3)
    assert sum(c.count for c in plan.classes) == t.world_size
    _check_against_megatron(plan, t, sample=300)


def test_class_depth_for_moe_folds_expert_peers_onto_ep0_and_auto_keeps_a_replica():
    # EP4 = DP4: each stage's expert peers fold onto its ep = 0 rank (translated mirror of its routing)
    t = TargetLayout(world_size=8, tp=1, pp=2, ep=4, num_experts=8, num_layers=4)
    plan = build_fold_plan(t, "class")
    assert plan.depth == "class" and plan.live == [0, 4] and plan.expert_tokens == "translated mirror"
    assert [(c.name, c.count, c.sandbox) for c in plan.classes] == [("first", 4, [0]), ("last", 4, [4])]
    _check_against_megatron(plan, t)
    doc = json.loads(json.dumps(plan.to_json()))
    assert doc["expert_tokens"] == "translated mirror" and FoldPlan.from_json(doc) == plan
    with pytest.raises(FoldPlanFormatError, match="field expert_tokens is 'zeros'"):
        FoldPlan.from_json({**doc, "expert_tokens": "zeros"})
    assert build_fold_plan(t).depth == "replica"  # auto: expert ranks stay live unless class is asked for
    # an expert axis that is not made of TP's digits above ETP and DP's: refused, naming the sizes or group
    with pytest.raises(FoldDepthError, match=r"\(TP1·PP2·EP4·ETP2·DP8 = 16 ranks\): its expert-parallel axis is not "
                                             r"made of .*ETP must divide TP.*replica"):
        build_fold_plan(TargetLayout(world_size=16, tp=1, etp=2, pp=2, ep=4, num_experts=8, num_layers=4), "class")
    with pytest.raises(FoldDepthError, match=r"expert tp group \[0, 1\] moved by tp\+1 is not one group"):
        build_fold_plan(TargetLayout(world_size=64, tp=4, etp=2, pp=2, ep=4, num_experts=8, num_layers=4), "class")
    # expert DP > 1 or ETP1 under TP2: the plan's axes split TP and DP into EP's digits (tp, ep) and expert DP
    t = TargetLayout(world_size=64, tp=2, etp=1, pp=2, ep=4, num_experts=8, num_layers=4)
    for m in (TargetLayout(world_size=16, tp=1, pp=1, ep=8, num_experts=8, num_layers=4),
              TargetLayout(world_size=64, tp=2, pp=2, ep=4, num_experts=8, num_layers=4), t,
              TargetLayout(world_size=1024, tp=2, etp=1, pp=8, ep=64, num_experts=256, num_layers=16),
              TargetLayout(world_size=256, tp=1, pp=8, ep=8, num_experts=128, num_layers=16)):
        plan = build_fold_plan(m, "class")
        assert plan.axes == ("tp", "cp", "ep", "edp", "pp") and plan.expert_tokens == "translated mirror"
        assert len(plan.live) == len(plan.classes) == min(m.pp, 3), (m, plan.live)
        _check_against_megatron(plan, m, sample=200)
        assert FoldPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    plan = build_fold_plan(t)
    assert plan.depth == "replica" and plan.k == 2 and len(plan.live) == 8
    _check_against_megatron(plan, t)
    with pytest.raises(FoldError, match="fold depth 'deep' is not one of auto, replica, class"):
        build_fold_plan(t, "deep")


def _p2p(pp: int, p: int, vpp: int | None = None) -> object:
    """What Megatron's get_pp_rank_microbatches reads of a P2P communicator: pipeline rank p of pp
    (and the virtual stages)."""
    group = type("Group", (), {"size": lambda self: pp, "rank": lambda self: p})()
    return type("P2P", (), {"virtual_pipeline_model_parallel_size": vpp, "pp_group": group})()


def test_the_plan_records_megatrons_warmup_per_stage():
    """Under 1F1B pipeline rank p runs min(pp - p - 1, M) warm-up forwards (Megatron's
    get_pp_rank_microbatches, asked here through the plan): replay gives each folded stage its own."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    plan = build_fold_plan(TargetLayout(world_size=16, pp=8, num_layers=8))
    assert plan.schedule == {"name": "1f1b", "warmup": [7, 6, 5, 4, 3, 2, 1, 0]}
    assert plan.to_json()["schedule"] == plan.schedule

    for p in range(8):  # with M = 3 microbatches Megatron caps the warm-up at 3
        warmup = get_pp_rank_microbatches(3, 1, None, p2p_communicator=_p2p(8, p))[2]
        assert warmup == min(plan.schedule["warmup"][p], 3)
    assert build_fold_plan(TargetLayout(world_size=4, num_layers=2)).schedule["name"] == "no_pipelining"
    assert build_fold_plan(TargetLayout(world_size=16, tp=2, pp=2, vpp=2, num_layers=8)).depth == "class"


@pytest.mark.parametrize("pp,vpp,group", [(4, 2, None), (6, 3, None), (8, 4, 10)])
def test_the_plan_records_the_interleaved_schedule_and_folds_its_middle_stages(pp, vpp, group):
    """Under VPP the plan records Megatron's warm-up per pipeline rank (get_pp_rank_microbatches, with
    chunks and microbatch group), and replay's schedule table is Megatron's get_schedule_table."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches, get_schedule_table

    from prism_megatron.replay.stage_schedule import interleaved_steps, schedule_table

    t = TargetLayout(world_size=2 * pp, pp=pp, vpp=vpp, vp_group=group, num_layers=pp * vpp, overlap_p2p=True)
    plan = build_fold_plan(t)
    n = group or pp
    assert plan.depth == "class" and len(plan.live) == 3  # first, one middle stage for all, last
    assert plan.schedule == {"name": "interleaved", "warmup": [2 * (pp - p - 1) + (vpp - 1) * n for p in range(pp)],
                             "chunks": vpp, "group": n, "overlap_p2p": True, "wait_sends": plan.schedule["wait_sends"]}

    for m in (n, 2 * n, 3 * n + pp):
        assert schedule_table(m, vpp, n) == get_schedule_table(m, vpp, n)
        for p in range(pp):
            _total, _all, w, _rest = get_pp_rank_microbatches(m, vpp, n, p2p_communicator=_p2p(pp, p, vpp))
            assert w == min(plan.schedule["warmup"][p], m * vpp)
            units = [x for x in interleaved_steps(pp, p, vpp, n, m, plan.schedule["warmup"][p]) if x[0] in "FB"]
            assert [x[1] for x in units if x[0] == "F"] == list(range(m * vpp))  # forwards in table order
            assert units[:w] == [("F", k) for k in range(w)]  # warm-up, then 1F1B pairs, or the cool-down
            assert units[w:w + 2] == ([("F", w), ("B", 0)] if w < m * vpp else [("B", 0), ("B", 1)])
    assert FoldPlan.from_json(plan.to_json()).schedule == plan.schedule
    with pytest.raises(FoldError, match="microbatch group per virtual stage 2 is below PP4"):
        build_fold_plan(TargetLayout(world_size=8, pp=4, vpp=2, vp_group=2, num_layers=8))


def test_replica_depth_of_a_dense_layout_is_the_v1_sandbox():
    t = TargetLayout(world_size=64, tp=2, pp=4, num_layers=8)
    plan = build_fold_plan(t, "replica")
    assert plan.depth == "replica" and len(plan.live) == 8
    assert all(plan.rep[r] == r - plan.coords[r][2] * 2 for r in range(64))  # rank = tp + 2 * dp + 16 * pp
    _check_against_megatron(plan, t)


def test_a_rep_that_does_not_translate_is_refused_naming_the_group():
    from prism_megatron.megatron.fold import _check_fold, _Generators, _Grid, _group_kinds

    t = TargetLayout(world_size=16, tp=2, pp=4, num_layers=8)
    plan = build_fold_plan(t)
    gens = _Generators(t)
    grid, kinds = _Grid(gens, t), _group_kinds(gens, t)
    import numpy as np

    rep = np.array(plan.rep)
    _check_fold(kinds, grid, rep)  # the plan's own rep folds
    bad = rep.copy()
    peer = plan.coords.index([1, 0, 0, 3])  # the last stage's TP peer mirrors the first stage's rank
    bad[peer] = 0
    with pytest.raises(FoldError, match=rf"dense tp group \[{peer - 1}, {peer}\] has live members but rank {peer}'s "
                                        "representative 0 is outside it"):
        _check_fold(kinds, grid, bad)
    # expert TP groups of two DP indices (ETP2 over TP1): rank 3 doing rank 0's work translated by dp+3
    # would see {3, 4} as its expert TP group, but Megatron's is {2, 3}
    with pytest.raises(FoldError, match=r"expert tp group \[0, 1\] moved by dp\+1 is not one group of that kind"):
        build_fold_plan(TargetLayout(world_size=16, etp=2, num_layers=2))


def test_plan_json_versions_1_and_2():
    plan = build_fold_plan(TargetLayout(world_size=16, tp=2, pp=4, num_layers=8))
    data = plan.to_json()
    assert data["version"] == 2 and data["depth"] == "class" and data["axes"] == ["tp", "cp", "dp", "pp"]
    assert data["sizes"] == [2, 1, 2, 4] and len(data["coords"]) == 16
    v1 = build_fold_plan(TargetLayout(world_size=16, tp=2, pp=4, num_layers=8), "replica").to_json()
    v1 = {k: v for k, v in v1.items() if k not in ("depth", "axes", "sizes", "coords", "schedule")} | {"version": 1}
    old = FoldPlan.from_json(v1)
    assert old.version == 1 and old.depth == "replica" and old.coords == [] and old.to_json() == v1
    for broken, field in [({**data, "coords": data["coords"][:-1]}, "coords has 15 entries"),
                          ({**data, "coords": [[0, 0, 0, 0]] * 16}, r"coords\[1\] is \[0, 0, 0, 0\], the position"),
                          ({**data, "coords": [[0, 0, 0, 9]] + data["coords"][1:]}, r"coords\[0\] is \[0, 0, 0, 9\]"),
                          ({**data, "depth": "deep"}, "field depth 'deep'"),
                          ({**data, "axes": ["pp", "dp", "cp", "tp"]}, "field axes"),
                          ({**data, "sizes": [2, 1, 2, 2]}, "field sizes"),
                          ({k: v for k, v in data.items() if k != "coords"}, "field coords is missing"),
                          ({**data, "version": 3}, "field version 3 is not supported"),
                          ({**data, "schedule": {"name": "gpipe", "warmup": []}}, "field schedule.name is 'gpipe'"),
                          ({**data, "schedule": {"name": "1f1b", "warmup": [3, 2]}},
                           r"field schedule.warmup has 2 entries; a 1f1b schedule needs one per pipeline rank \(4\)"),
                          ({**data, "schedule": {"name": "1f1b", "warmup": [3, 2, -1, 0]}},
                           "field schedule.warmup is")]:
        with pytest.raises(FoldPlanFormatError, match=field):
            FoldPlan.from_json(broken)


def test_the_trace_reader_accepts_a_version_2_plan():
    from prism_megatron.trace.fold import read_fold

    plan = build_fold_plan(TargetLayout(world_size=16, tp=2, pp=4, num_layers=8))
    manifest = {"world_size": 16, "job": {"fold": {**plan.to_json(), "contributions": {}}}}
    fold = read_fold(manifest)
    assert fold.live == (0, 4, 12) and fold.rep == tuple(plan.rep)
    assert fold.schedule == "1f1b" and fold.warmup == (3, 2, 1, 0)


def test_the_plan_and_the_trace_reader_name_the_same_schedules():
    from prism_megatron.megatron.fold import SCHEDULES
    from prism_megatron.trace.fold import SCHEDULES as READ

    assert SCHEDULES == READ


@pytest.mark.heavy
def test_plan_cli_shows_three_live_ranks_for_an_8b_shaped_tp2_pp4_job():
    from click.testing import CliRunner

    from prism_megatron.cli import main
    from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT

    llama = ["--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads",
             "32", "--group-query-attention", "--num-query-groups", "8", "--seq-length", "4096",
             "--max-position-embeddings", "4096", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128255",
             "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "32", "--train-iters", "3", "--lr",
             "1e-4", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
             "--transformer-impl", "local"]
    # host memory declared large: the plan checks the sandbox's state (prism's estimate, ~173 GiB with the
    # unfused attention) against it and would refuse on a small machine
    result = CliRunner().invoke(main, ["plan", "--prism-world-size", "8", "--devices", "cpu", "--prism-host-memory",
                                       "4096", "--prism-fold-depth", "class", "--", str(CORE_DRIVER_SCRIPT), *llama])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "TP2·PP4·DP1 = 8 ranks" in text and "fold depth: class (class (asked))" in text
    assert "sandbox: 3 live rank(s) run the real program: 0,2,6" in text and "virtual: 5 rank(s)" in text
    for row in ("stage 0 (first: embedding; 8 layers)", "stages 1-2 (middle; 8 layers)",
                "stage 3 (last: loss; 8 layers)"):
        assert row in text
    # prism's estimate of stage 0 (unfused attention: s x s probabilities of 4 micro-batches x 8 layers) is at
    # least what that stage held on an H200 when it ran out of memory (72,145,931,264 B = 67.2 GiB allocated,
    # bench/gpu/results/2026-12-01-fold-class-h200.txt); Megatron's formula gave far less
    first = re.search(r"│ first .*?│ *([\d.]+) GiB │", text)
    assert first and float(first.group(1)) >= 67.2, text


@pytest.mark.heavy
def test_run_passes_the_depth_to_the_fold_and_folds_moe_expert_peers_at_class_depth(parse_each_command_once):
    from prism_megatron.megatron.fold_mode import choose_fold
    from prism_megatron.megatron.run import launch_config, parse_run_args

    request = parse_run_args(["--recipe", "mini-dense-tp2pp2dp4", "--prism-driver", "core",
                              "--prism-fold-depth", "class"])
    said: list[str] = []
    fold = choose_fold("on", launch_config(request), request.env, say=said.append,
                       depth=request.run_options().fold_depth)
    assert fold["depth"] == "class" and fold["live"] == [0, 8] and fold["version"] == 2
    assert any("2 live rank(s), 14 virtual" in s and "depth class (class (asked))" in s for s in said), said
    # auto folds no deeper than needed: this replica fits (or cannot be costed), so replica depth
    request = parse_run_args(["--recipe", "mini-dense-tp2pp2dp4", "--prism-driver", "core"])
    said = []
    cfg = launch_config(request)
    fold = choose_fold("on", cfg, request.env, say=said.append, depth=request.run_options().fold_depth)
    assert fold["depth"] == "replica" and fold["live"] == [0, 1, 8, 9], fold["live"]
    # the live ranks are admitted by prism's estimate of their class until they are measured
    assert sorted(cfg.memory_estimates) == [0, 1, 8, 9] and min(cfg.memory_estimates.values()) > 0
    assert any("depth replica (auto: replica" in s for s in said), said
    request = parse_run_args(["--recipe", "mini-moe-ep4-tp1pp2", "--prism-driver", "core",
                              "--prism-fold-depth", "class"])
    assert request.run_options().fold_depth == "class"
    said = []
    fold = choose_fold("on", launch_config(request), request.env, say=said.append, depth="class")
    assert fold["live"] == [0, 4] and fold["expert_tokens"] == "translated mirror", fold["live"]
    assert any("translated mirror of ep 0's routing" in s for s in said), said


def test_admission_estimates_give_each_running_rank_its_classs_estimate():
    from prism_megatron.megatron.fold_mode import admission_estimates
    from prism_megatron.megatron.plan import GiB, Plan, _memory

    t = TargetLayout(world_size=16, tp=2, pp=4, num_layers=8)
    estimate = {"source": "prism", "classes": {"first": {"total": 12 * GiB}, "middle": {"total": 10 * GiB},
                                               "last": {"total": 8 * GiB}}}
    fold = build_fold_plan(t, "replica")
    plan = Plan(layout=t, fold=fold, iterations=1, devices=["cpu"], depth_note="replica (asked)",
                memory=_memory(fold, estimate, ["cpu"], None, 1000.0, "auto", {"total": GiB}),
                time={"seconds": 1.0, "iterations": 1, "model": "rough"})
    every = admission_estimates(plan, range(16))
    assert every[0] == every[1] == 12 * GiB and every[14] == every[15] == 8 * GiB  # stage 0 first, 3 last
    assert set(every.values()) == {12 * GiB, 10 * GiB, 8 * GiB} and len(every) == 16
    assert sorted(admission_estimates(plan, fold.live)) == sorted(fold.live)
    plan.memory["classes"] = None  # no estimate: the governor falls back to the device
    assert admission_estimates(plan, fold.live) == {}


def test_plan_table_gives_each_class_its_live_memory_by_prisms_estimate():
    from rich.console import Console

    from prism_megatron.megatron.plan import GiB, Plan, _memory, render_plan

    t = TargetLayout(world_size=8192, tp=2, pp=4, num_layers=8)
    estimate = {"source": "prism", "classes": {"first": {"total": 12 * GiB}, "middle": {"total": 10 * GiB},
                                               "last": {"total": 8 * GiB}}}
    formula = {"total": 3 * GiB}
    for depth, live_memory in (("class", ["12.0 GiB", "10.0 GiB", "8.0 GiB"]),
                               ("replica", ["24.0 GiB", "40.0 GiB", "16.0 GiB"])):
        fold = build_fold_plan(t, depth)
        plan = Plan(layout=t, fold=fold, iterations=1, devices=["cpu"], depth_note=f"{depth} (asked)",
                    memory=_memory(fold, estimate, ["cpu"], None, 1000.0, "auto", formula),
                    time={"seconds": 60.0, "iterations": 1, "model": "rough"})
        console = Console(width=200, record=True)
        render_plan(plan, console)
        text = console.export_text()
        rows = [line for line in text.splitlines() if line.startswith("│ ") and "stage" in line]
        assert [row.split("│")[-2].strip() for row in rows] == live_memory, text
        assert all(row.split("│")[-3].strip() == "3.0 GiB" for row in rows), text  # Megatron's, beside
        host = next(line for line in text.splitlines() if "host RAM" in line)
        state = sum(float(x.split()[0]) for x in live_memory)
        assert host.split("│")[2].strip() == f"{state + len(fold.live):.1f} GiB"  # + 1 GiB of process per live rank


@pytest.mark.heavy
def test_a_serial_capture_needs_one_live_rank_to_fit_and_a_folded_run(parse_each_command_once, capsys):
    from prism_megatron.launcher.exit_codes import BAD_INPUT
    from prism_megatron.megatron.fold_mode import FoldModeError, choose_fold
    from prism_megatron.megatron.run import launch_config, parse_run_args, run

    request = parse_run_args(["--recipe", "mini-dense-tp2pp2dp2", "--prism-driver", "core", "--prism-fold-depth",
                              "replica", "--prism-host-memory", "2", "--prism-fold-capture", "serial"])
    assert request.run_options().fold_capture == "serial"
    cfg = launch_config(request)
    with pytest.raises(FoldModeError, match="the sandbox does not fit here.*a serial capture"):
        choose_fold("on", cfg, request.env, say=lambda m: None, depth="replica")  # 4 live ranks together
    said: list[str] = []
    fold = choose_fold("on", cfg, request.env, say=said.append, depth="replica", capture="serial")
    assert fold["live"] == [0, 1, 4, 5] and any("fold capture serial: 4 capture(s), one live rank each" in s
                                                 for s in said), said
    # MoE: at replica depth (auto keeps it where the replica fits together) each expert rank is live in its own
    # capture: refused by name; at class depth expert peers are the live rank's own class (translated mirror)
    moe = parse_run_args(["--recipe", "mini-moe-ep4-tp1pp2", "--prism-driver", "core"])
    with pytest.raises(FoldModeError, match=r"--prism-fold-capture serial: .*EP4\) at replica depth: .*"
                                            r"--prism-fold-depth class.*fits here together"):
        choose_fold("on", launch_config(moe), moe.env, say=said.append, capture="serial")
    said.clear()
    deep = choose_fold("on", launch_config(moe), moe.env, say=said.append, depth="class", capture="serial")
    assert deep["live"] == [0, 4] and deep["expert_tokens"] == "translated mirror"
    assert any("fold capture serial: 2 capture(s), one live rank each" in s and "translated mirror" in s
               for s in said), said
    off = parse_run_args(["--recipe", "mini-dense-tp2pp2dp2", "--prism-driver", "core", "--prism-fold", "off",
                          "--prism-fold-capture", "serial"])
    assert run(off) == BAD_INPUT
    assert "--prism-fold-capture serial captures a folded run one live rank at a time; --prism-fold off" in \
        capsys.readouterr().err
