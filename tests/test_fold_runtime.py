"""A folded launch of a generic torch.distributed program (no Megatron): only live ranks run, the
coordinator answers for the virtual ones (nccl_prune), and the results equal a full run's where every
data-parallel replica computes the same; the trace records the fold; what a fold cannot answer is a
clear error."""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from prism_megatron.launcher.exit_codes import BAD_INPUT
from prism_megatron.launcher.launch import LaunchConfig, launch
from prism_megatron.trace import read_trace
from prism_megatron.trace.fold import make_fold, read_fold
from prism_megatron.trace.untimed import untimed_differences

PROGRAMS = Path(__file__).parent / "programs"
W, DP = 64, 8


def _grid_rep() -> list[int]:
    """rank = tp + 2 * (dp + DP * pp): every rank mirrors the rank of DP index 0 with its tp and pp."""
    return [(r % 2) + 2 * DP * (r // (2 * DP)) for r in range(W)]


def _run(tmp_path: Path, name: str, script: str, args: list[str], world: int, fold: dict | None) -> int:
    cfg = LaunchConfig(script=PROGRAMS / script, script_args=args, world_size=world, trace_dir=tmp_path / name,
                       hang_timeout=60, fold=fold)
    return launch(cfg)


def test_a_folded_run_gives_the_live_ranks_the_full_runs_results(tmp_path):
    rep = _grid_rep()
    live = sorted(set(rep))
    assert len(live) == 8
    fold = make_fold(rep, 8).to_json()
    assert _run(tmp_path, "fold", "fold_grid.py", [str(tmp_path / "fold-res")], W, fold) == 0
    assert _run(tmp_path, "full", "fold_grid.py", [str(tmp_path / "full-res")], W, None) == 0
    assert sorted(p.name for p in (tmp_path / "fold-res").iterdir()) == sorted(f"rank-{r}.pt" for r in live)
    for r in live:
        got = torch.load(tmp_path / "fold-res" / f"rank-{r}.pt")
        want = torch.load(tmp_path / "full-res" / f"rank-{r}.pt")
        assert got.keys() == want.keys()
        for key in want:
            if key == "inplace_gather":
                continue
            assert torch.equal(got[key], want[key]), (r, key, got[key], want[key])
        # in place: the full run gathers every replica's chunk; a fold keeps what the virtual chunks held
        chunk = want["inplace_gather"][:3]
        assert torch.equal(want["inplace_gather"], chunk.repeat(DP))
        initial = torch.arange(DP * 3, dtype=torch.float32) - 100.0
        assert torch.equal(got["inplace_gather"][:3], chunk)
        assert torch.equal(got["inplace_gather"][3:], initial[3:])
    assert want["world_sum_int"].item() == DP * sum(1 + r % 2 + 10 * (r // (2 * DP)) for r in live)

    trace = read_trace(tmp_path / "fold")
    f = read_fold(trace.manifest, tmp_path / "fold")
    assert f.live == tuple(live) and f.rep == tuple(rep)
    assert sorted(set(trace.ops.column("rank").to_pylist())) == live
    assert [e["rank"] for e in trace.manifest["ranks"]] == live
    groups = {tuple(g["ranks"]) for g in trace.manifest["groups"]}
    assert tuple(range(W)) in groups  # the world group keeps its full rank list
    assert tuple(2 * d for d in range(DP)) in groups  # a data-parallel group with 7 virtual members
    c = f.contributions
    # one op per DP group of 8 (7 virtual members each), 8 live ranks in 8 DP groups
    assert c["all_gather"] == {"mirror": 8 * 7, "recorded": 0, "keep": 8 * 7, "passthrough": 0}
    assert c["all_to_all"]["mirror"] == 8 * 7 and c["reduce_scatter"]["mirror"] == 8 * 7
    assert c["barrier"] == {"mirror": 0, "recorded": 0, "keep": 0, "passthrough": 0}
    assert "send" not in c  # p2p between live ranks only


def test_a_p2p_with_a_virtual_peer_that_is_no_neighbour_is_refused_naming_both_ranks(tmp_path):
    fold = make_fold([0, 1, 0, 1], 8).to_json()
    assert _run(tmp_path, "p2p", "fold_bad.py", ["p2p"], 4, fold) == BAD_INPUT
    report = (tmp_path / "p2p.logs" / "fold-report.txt").read_text()
    assert "rank 0 sends to virtual rank 2 on group [0, 1, 2, 3], which is not its neighbour" in report, report


def _received(res: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(res / f"rank-{rank}.pt")


def test_virtual_pipeline_stages_pass_messages_through(tmp_path):
    """4 stages in 1F1B with batched p2p, stage 2 folded onto stage 1: stage 3 receives what stage 1
    sent forward, stage 1 what stage 3 sent backward (fold_pipeline.py's arithmetic), in order."""
    M = 4
    fold = make_fold([0, 1, 1, 3], 8).to_json()
    assert _run(tmp_path, "pipe", "fold_pipeline.py", [str(tmp_path / "res"), str(M)], 4, fold) == 0
    res = tmp_path / "res"
    assert sorted(p.name for p in res.iterdir()) == ["rank-0.pt", "rank-1.pt", "rank-3.pt"]
    x0 = torch.stack([(torch.arange(128 * 160, dtype=torch.float32) % 7).reshape(128, 160) + 100.0 * mb
                      for mb in range(M)])
    stage1, stage3, stage0 = _received(res, 1), _received(res, 3), _received(res, 0)
    assert torch.equal(stage1["fwd"], x0 + 1000)  # live to live
    assert torch.equal(stage3["fwd"], x0 + 1000 + 2000)  # stage 1's sends, stage 2's layers as the identity
    assert torch.equal(stage1["bwd"], (x0 + 3000) * 2 + 40000)  # stage 3's gradients, passed through stage 2
    assert torch.equal(stage0["bwd"], stage1["bwd"] + 20000)
    f = read_fold(read_trace(tmp_path / "pipe").manifest, tmp_path / "pipe")
    assert f.contributions == {"recv": {"mirror": 0, "recorded": 0, "keep": 0, "passthrough": 2 * M}}
    log = (tmp_path / "pipe.logs" / "coordinator.log").read_text()
    assert "pass-through" not in log, log  # every kept message was received (freed)


def test_a_pass_through_of_another_shape_is_refused_naming_ranks_and_shapes(tmp_path):
    fold = make_fold([0, 1, 1, 3], 8).to_json()
    assert _run(tmp_path, "bad", "fold_pipeline.py", [str(tmp_path / "res"), "2", "mismatch"], 4, fold) == BAD_INPUT
    report = (tmp_path / "bad.logs" / "fold-report.txt").read_text()
    assert "rank 3 receives float32[160, 128] from virtual rank 2 (forward, receive #0)" in report, report
    assert "rank 1 sent to virtual rank 2: float32[128, 160]" in report and "pass messages through" in report


def test_one_live_rank_on_a_ring_is_refused_and_unreceived_messages_are_said(tmp_path):
    fold = make_fold([0, 1, 0, 1], 8).to_json()
    assert _run(tmp_path, "ring", "fold_bad.py", ["ring"], 4, fold) == BAD_INPUT
    report = (tmp_path / "ring.logs" / "fold-report.txt").read_text()
    assert "rank 0 receives from virtual rank 2 on group [0, 2]" in report and "its own later send" in report, report
    log = (tmp_path / "ring.logs" / "coordinator.log").read_text()
    assert "1 message(s) rank 1 sent to virtual rank 2 on group" in log and "never received" in log, log


def test_a_hang_in_a_folded_group_names_the_missing_live_rank(tmp_path):
    from prism_megatron.launcher.exit_codes import HANG

    fold = make_fold([0, 1, 0, 1], 8).to_json()
    cfg = LaunchConfig(script=PROGRAMS / "fold_bad.py", script_args=["hang"], world_size=4,
                       trace_dir=tmp_path / "hang", hang_timeout=2, fold=fold)
    assert launch(cfg) == HANG
    report = (tmp_path / "hang.logs" / "hang-report.txt").read_text()
    assert "collective #1 on group" in report and "arrived 0; missing 1 (exited: 1)" in report, report


def test_members_of_one_class_that_issue_different_ops_are_refused(tmp_path):
    from prism_megatron.megatron.fold_mode import FoldModeError, check_trace_classes

    fold = make_fold([0, 1, 0, 1], 8).to_json()
    fold["classes"] = [{"name": "stage", "role": "every rank", "count": 4, "sandbox": [0, 1], "coords": {}}]
    fold["class_of"] = [0, 0, 0, 0]
    assert _run(tmp_path, "uneven", "fold_bad.py", ["uneven"], 4, fold) == 0
    with pytest.raises(FoldModeError, match=r"class 'stage'.*ranks 0 and 1 differ.*entry 1"):
        check_trace_classes(tmp_path / "uneven")
    assert _run(tmp_path, "even", "fold_bad.py", ["none"], 4, fold) == 0
    check_trace_classes(tmp_path / "even")  # the same ops: accepted


def test_a_fold_that_does_not_fit_the_launch_is_a_launch_error(tmp_path):
    from prism_megatron.launcher.config import LaunchError

    fold = make_fold([0, 1, 0, 1], 8).to_json()
    cfg = LaunchConfig(script=PROGRAMS / "fold_bad.py", script_args=["none"], world_size=8,
                       trace_dir=tmp_path / "t", fold=fold)
    with pytest.raises(LaunchError, match="world_size"):
        cfg.validate()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_a_folded_collective_answered_in_its_one_live_rank_matches_the_coordinators_and_the_trace(
        tmp_path, monkeypatch):
    """fold_lone.py on 8 ranks folded to 0 and 4: each is the only live member of its group of 4, and one
    of two on the world group. With the answer in the rank (runtime.local_fold) and without it, every
    result is bitwise the same and the traces agree in everything but times."""
    fold = make_fold([r - r % 4 for r in range(8)], 8).to_json()
    assert _run(tmp_path, "local", "fold_lone.py", [str(tmp_path / "local-res")], 8, fold) == 0
    monkeypatch.setenv("PRISM_FOLD_LOCAL", "0")
    assert _run(tmp_path, "staged", "fold_lone.py", [str(tmp_path / "staged-res")], 8, fold) == 0
    for r in (0, 4):
        got, want = _received(tmp_path / "local-res", r), _received(tmp_path / "staged-res", r)
        assert got.keys() == want.keys() and len(got) == 2 * 3 * 2 * 18 + 1
        assert got["freed"].item()  # nothing of the answer kept the op's tensors alive
        assert [k for k in want if not torch.equal(_bits(got[k]), _bits(want[k]))] == []
    a, b = read_trace(tmp_path / "local"), read_trace(tmp_path / "staged")
    assert a.ops.num_rows > 0 and untimed_differences(a, b) == []
    fa, fb = read_fold(a.manifest, tmp_path / "local"), read_fold(b.manifest, tmp_path / "staged")
    assert fa.contributions == fb.contributions and fa.contributions["all_reduce"]["mirror"] > 0


def test_which_collectives_a_rank_answers_alone(monkeypatch):
    from prism_megatron.runtime import local_fold

    rep = [r - r % 4 for r in range(8)]
    plan = local_fold.lone_plan([0, 1, 2, 3], rep, 0)
    assert plan is not None and plan.live_positions == (0,) and plan.multiplicity[0] == 4
    assert local_fold.lone_plan(list(range(8)), rep, 0) is None  # two live members: the coordinator's
    assert local_fold.lone_plan([0, 4], [0, 1, 2, 3, 4], 0) is None  # no virtual member
    assert local_fold.lone_plan([1, 2], [0, 0, 0], 0) is None  # not foldable: the coordinator says why
    x, big = torch.ones(8), torch.ones(1 << 15)
    assert local_fold.answerable(plan, "all_reduce", [x], [x], {"redop": "sum"})
    assert local_fold.answerable(plan, "reduce_scatter", [x], [torch.empty(2)], {})
    assert not local_fold.answerable(plan, "reduce_scatter", [x], [torch.empty(3)], {})  # the coordinator says
    assert not local_fold.answerable(plan, "all_gather", [x], [torch.empty(32, dtype=torch.int32)], {})
    mixed = [x, torch.ones(4, dtype=torch.bfloat16)]  # a coalesced all_reduce of two dtypes: each its own
    assert local_fold.answerable(plan, "all_reduce", mixed, mixed, {"redop": "avg"})
    assert not local_fold.answerable(plan, "all_reduce", [x[::2]], [x[::2]], {})  # not contiguous
    assert not local_fold.answerable(plan, "all_to_all", [x], [x], {})  # no splits: not as the backend passes it
    assert local_fold.answerable(plan, "all_to_all", [x], [x], {"in_splits": [8] * 4})
    assert not local_fold.answerable(plan, "all_to_all", [x], [torch.empty(4)], {"in_splits": [8] * 4})
    assert local_fold.answerable(plan, "all_to_all_list", [x] * 4, [torch.empty(8, dtype=torch.int32)] * 4, {})
    assert not local_fold.answerable(plan, "all_to_all_list", [x] * 4, [torch.empty(4)] * 4, {})
    assert not local_fold.answerable(plan, "reduce", [x], [x], {"root": 0})
    assert local_fold.answerable(plan, "broadcast", [big], [], {"root": 0})
    assert not local_fold.answerable(plan, "broadcast", [x], [], {"root": 0})  # a serial capture may record it
    assert not local_fold.answerable(plan, "broadcast", [], [big], {"root": 1})  # a virtual root
    monkeypatch.setenv(local_fold.ENV, "0")  # off: every op through the coordinator
    assert local_fold.lone_plan([0, 1, 2, 3], rep, 0) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_a_rank_answers_every_kind_it_takes_bitwise_as_the_coordinator(dtype):
    """local_fold.answer on the rank's tensors against the coordinator's path (OpKind.run on staged
    copies, its output view for an in-place all_reduce, results copied back as bytes)."""
    from prism_megatron.ops import OPS, CollectiveCall
    from prism_megatron.runtime import local_fold
    from prism_megatron.runtime.staging import typed

    plan = local_fold.lone_plan([0, 1, 2, 3], [0, 0, 0, 0], 0)
    g = torch.Generator().manual_seed(3)

    def inp(k):
        return ((torch.randn(k, generator=g) * 3).to(dtype) if dtype.is_floating_point
                else torch.randint(-9, 9, (k,), generator=g))

    def coordinator(kind, ins, outs, redop=None, factor=None, in_place=False, current=None):
        staged = [t.clone().reshape(-1) for t in ins]
        view = (lambda i, j, like: staged[j]) if kind == "all_reduce" else None
        cur = [[t.clone().reshape(-1) for t in current]] if current else None
        call = CollectiveCall(ins=[staged], redop=redop, factor=factor, out_view=view, fold=plan,
                              in_place=in_place, current=cur)
        res = OPS[kind].run(call)[0]
        for o, r in zip(outs, res, strict=True):
            o.copy_(typed(r.reshape(-1).view(torch.uint8), o))

    ops = ["sum", "avg", "min", "max", "product", "premul_sum"] if dtype.is_floating_point else \
        ["sum", "avg", "min", "max", "band", "bor", "bxor"]
    cases = []
    for op in ops:
        factor = 0.25 if op == "premul_sum" else None
        cases.append(("all_reduce", [inp(7), inp(5)], None, {"redop": op, "factor": factor}))
        cases.append(("reduce_scatter", [inp(8)], [2], {"redop": op, "factor": factor}))
        cases.append(("reduce_scatter_list", [inp(3) for _ in range(4)], [3], {"redop": op, "factor": factor}))
    cases += [("all_gather", [inp(3), inp(2)], [12, 8], {}), ("all_gather_list", [inp(3)], [3] * 4, {})]
    for kind, ins, out_sizes, attrs in cases:
        mine = [t.clone() for t in ins]
        outs = mine if out_sizes is None else [torch.full((k,), 7, dtype=ins[0].dtype) for k in out_sizes]
        theirs_in = [t.clone() for t in ins]
        theirs = theirs_in if out_sizes is None else [o.clone() for o in outs]
        assert local_fold.answerable(plan, kind, mine, outs, attrs)
        local_fold.answer(plan, kind, mine, outs, redop=attrs.get("redop"), factor=attrs.get("factor"))
        coordinator(kind, theirs_in, theirs, attrs.get("redop"), attrs.get("factor"))
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, theirs, strict=True)), (kind, attrs)
    mine = [inp(7), torch.randn(5, generator=g).to(torch.float64)]  # a coalesced all_reduce of two dtypes
    theirs = [t.clone() for t in mine]
    local_fold.answer(plan, "all_reduce", mine, mine, redop="avg")
    coordinator("all_reduce", theirs, theirs, "avg")
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(mine, theirs, strict=True))
    buf = inp(12)  # in place: the chunks of virtual members kept, this member's own in place
    theirs = buf.clone()
    local_fold.answer(plan, "all_gather", [buf[:3]], [buf], in_place=True, current=[buf])
    coordinator("all_gather", [theirs[:3]], [theirs], in_place=True, current=[theirs])
    assert torch.equal(_bits(buf), _bits(theirs))


def _grid(sizes: tuple[int, ...]) -> list[list[int]]:
    """Every rank's coordinates, the first axis fastest (rank = a0 + s0 * (a1 + s1 * ...))."""
    import itertools

    return [list(reversed(c)) for c in itertools.product(*(range(n) for n in reversed(sizes)))]


#: (name, the fold plan's JSON as coordinator and rank read it, the group, its live member's position): a pure
#: data-parallel mirror (no coordinates: pieces by shift); an expert-parallel group folded onto ep 0 by
#: coordinates (ep x pp, every rank's rep 0 as in a serial capture of rank 0); a group spanning two replicas
#: (ep x dp, ep 0 and 1 of each: some counterparts lie outside the group, A2A_RULE's "l itself"); the world
#: of tp x ep translated along both axes onto rank 5, listed out of rank order
A2A_PLANS = [
    ("dp-mirror", {"rep": [0] * 4, "live": [0]}, [0, 1, 2, 3], 0),
    ("ep-translated", {"rep": [0] * 8, "live": [0], "sizes": [4, 2], "coords": _grid((4, 2))}, [0, 1, 2, 3], 0),
    ("ep-spans-replicas", {"rep": [0] * 8, "live": [0], "sizes": [4, 2], "coords": _grid((4, 2))},
     [0, 1, 4, 5], 0),
    ("tp-ep-world", {"rep": [5] * 8, "live": [5], "sizes": [2, 4], "coords": _grid((2, 4))},
     [1, 3, 5, 7, 0, 2, 4, 6], 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("case", A2A_PLANS, ids=[c[0] for c in A2A_PLANS])
def test_a_rank_answers_an_all_to_all_alone_bitwise_as_the_coordinator(case, dtype):
    """all_to_all_single (even and uneven splits, rows of several elements, in place) and all_to_all (lists)
    answered in the rank (local_fold, its plan built from the fold's JSON as a rank builds it) against the
    coordinator's path (runtime.folding's fold of the group, OpKind.run on staged copies, results copied
    back as bytes): the same bytes, and the op counted alike."""
    from prism_megatron.ops import OPS, CollectiveCall
    from prism_megatron.runtime import local_fold
    from prism_megatron.runtime.backend import _split_bytes
    from prism_megatron.runtime.folding import Folding, untranslation
    from prism_megatron.runtime.groups import Group
    from prism_megatron.runtime.staging import typed

    _, fold, ranks, me = case
    n = len(ranks)
    mine = local_fold.lone_plan(ranks, fold["rep"], me, untranslation(fold))
    folding = Folding(fold)
    g = Group(0, "ep", ranks, "nccl")
    assert folding.fold_group(g) is None and mine is not None and mine == g.fold
    assert [mine.counterpart(me, q) for q in range(n)] == [g.fold.counterpart(me, q) for q in range(n)]
    gen = torch.Generator().manual_seed(11)

    def inp(*shape):
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        if dtype.is_floating_point:
            return (torch.randn(*shape, generator=gen) * 3).to(dtype)
        return torch.randint(-1 << 40, 1 << 40, shape, generator=gen)

    def coordinator(kind, ins, outs, in_splits):
        call = CollectiveCall(ins=[[t.clone().reshape(-1) for t in ins]], fold=g.fold,
                              in_splits=None if in_splits is None else [in_splits])
        folding.count(g, kind, None, False)
        for o, r in zip(outs, OPS[kind].run(call)[0], strict=True):
            o.copy_(typed(r.reshape(-1).view(torch.uint8), o))

    def received(rows):  # the rows of each piece the live member receives (A2A_RULE), in member order
        return [rows[mine.counterpart(me, q)] for q in range(n)]

    cases = []
    for rows, width in (([2] * n, 1), ([3, 0, 5, 1, 2, 0, 4, 1][:n], 3), ([0] * n, 2)):
        x = inp(sum(rows), width)
        out = torch.full((sum(received(rows)), width), 1, dtype=dtype)
        cases.append(("all_to_all", [x], [out], rows))
    x = inp(4 * n)  # in place: the output is the input
    cases.append(("all_to_all", [x], [x], [4] * n))
    lists = [inp(k) for k in [1, 4, 0, 2, 7, 3, 2, 5][:n]]
    cases.append(("all_to_all_list", lists, [torch.empty(t.numel(), dtype=dtype) for t in received(lists)], None))
    for kind, ins, outs, rows in cases:
        splits = None if rows is None else _split_bytes(ins[0], rows, n, "input")
        theirs_in, theirs = [t.clone() for t in ins], [o.clone() for o in outs]
        if outs[0] is ins[0]:
            theirs = theirs_in
        assert local_fold.answerable(mine, kind, ins, outs, {"in_splits": splits})
        local_fold.answer(mine, kind, ins, outs, in_splits=splits)
        coordinator(kind, theirs_in, theirs, splits)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, theirs, strict=True)), (kind, rows)
        assert folding.answered_in_rank(g, {"kind": kind, "ins": [], "outs": []}) is None
    got = folding.contributions.to_json()
    assert got[kind]["mirror"] == 2 * (n - 1) and got["all_to_all"]["mirror"] == 2 * 4 * (n - 1)
    wrong = [torch.empty(1 + outs[0].numel(), dtype=dtype)] + outs[1:]
    assert not local_fold.answerable(mine, "all_to_all_list", lists, wrong, {})  # the coordinator says why
    if fold.get("coords"):  # the rank's plan without the fold's coordinates would choose other pieces
        plain = local_fold.lone_plan(ranks, fold["rep"], me)
        assert [plain.counterpart(me, q) for q in range(n)] != [mine.counterpart(me, q) for q in range(n)]


def test_an_all_to_all_written_into_the_members_buffers_is_the_executors_answer():
    """nccl_prune.host.execute with into= for all_to_all over two live members whose outputs are their own
    inputs (in place): each piece read before anything is written, the result that of the executor without
    into; a buffer of the wrong size is refused by name."""
    from nccl_prune import PruneError, plan_group
    from nccl_prune.host import execute

    plan = plan_group([0, 1, 2, 3, 4, 5], [0, 0, 0, 3, 3, 3])
    gen = torch.Generator().manual_seed(5)
    ins = {0: [torch.randn(12, generator=gen)], 3: [torch.randn(12, generator=gen)]}
    splits = {0: [1, 2, 3, 1, 2, 3], 3: [3, 2, 1, 3, 2, 1]}
    want = execute("all_to_all", plan, ins, in_splits=splits)
    sizes = {p: want[p][0].numel() for p in want}
    want = {p: [t.clone() for t in v] for p, v in want.items()}
    bufs = {p: [torch.cat([ins[p][0], torch.zeros(sizes[p] - 12)])] for p in ins}  # room for what it receives
    execute("all_to_all", plan, {p: [bufs[p][0][:12]] for p in ins}, in_splits=splits, into=bufs)
    assert all(torch.equal(bufs[p][0], want[p][0]) for p in ins)
    with pytest.raises(PruneError, match="output buffers of position 0"):
        execute("all_to_all", plan, ins, in_splits=splits, into={0: [torch.empty(1)], 3: [torch.empty(1)]})
    lists = {p: [torch.randn(k, generator=gen) for k in range(1, 7)] for p in ins}
    want = execute("all_to_all_list", plan, lists)
    outs = {p: [torch.empty(t.numel()) for t in want[p]] for p in ins}
    execute("all_to_all_list", plan, lists, into=outs)
    assert all(torch.equal(a, b) for p in ins for a, b in zip(outs[p], want[p], strict=True))


def test_the_coordinator_counts_an_answer_in_the_rank_and_refuses_one_outside_the_rule():
    from prism_megatron.runtime.folding import Folding
    from prism_megatron.runtime.groups import Group

    folding = Folding(make_fold([r - r % 4 for r in range(8)], 8).to_json())
    lone, world = Group(0, "tp", [0, 1, 2, 3], "nccl"), Group(1, "world", list(range(8)), "nccl")
    assert folding.fold_group(lone) is None and folding.fold_group(world) is None
    big = [(("l", 1 << 20), "float32", [1 << 18])]
    assert folding.answered_in_rank(lone, {"kind": "all_reduce", "ins": big, "outs": big}) is None
    assert folding.answered_in_rank(lone, {"kind": "all_gather", "ins": big, "outs": big, "in_place": True}) is None
    assert folding.answered_in_rank(lone, {"kind": "broadcast", "root": 0, "ins": big, "outs": []}) is None
    assert folding.contributions.to_json() == {
        "all_gather": {"mirror": 0, "recorded": 0, "keep": 3, "passthrough": 0},
        "all_reduce": {"mirror": 3, "recorded": 0, "keep": 0, "passthrough": 0},
        "broadcast": {"mirror": 0, "recorded": 0, "keep": 0, "passthrough": 0}}
    assert "the group has live members [0, 4]" in folding.answered_in_rank(
        world, {"kind": "all_reduce", "ins": big, "outs": big})
    a2a = {"kind": "all_to_all", "ins": big, "outs": big, "in_splits": [1 << 18] * 4, "out_splits": [1 << 18] * 4}
    assert folding.answered_in_rank(lone, a2a) is None
    assert folding.contributions.to_json()["all_to_all"] == {"mirror": 3, "recorded": 0, "keep": 0, "passthrough": 0}
    assert "answered in the rank only" in folding.answered_in_rank(lone, {"kind": "gather", "root": 0, "ins": big,
                                                                          "outs": big})
    small = [(("i", b"\0" * 8), "int64", [1])]
    assert "RECORDED_BROADCAST_RULE" in folding.answered_in_rank(
        lone, {"kind": "broadcast", "root": 0, "ins": small, "outs": []})


def _granting_once() -> tuple[Any, Callable[[int], list[dict]]]:
    """A coordinator that grants the first slot and nothing after it: (its listener, a function waiting for the
    first n ops it got)."""
    import threading
    import time
    from multiprocessing.connection import Listener

    from prism_megatron.runtime import protocol as P

    listener = Listener(("127.0.0.1", 0), authkey=b"prism-settled-test")
    got: list[dict] = []

    def coordinator() -> None:
        conn = listener.accept()
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            got.append(msg)
            if msg["t"] == P.ACQUIRE:
                conn.send({"t": P.GRANT})

    def ops(n: int) -> list[dict]:
        deadline = time.monotonic() + 10
        while sum(m["t"] == P.OP for m in got) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return [m for m in got if m["t"] == P.OP]

    threading.Thread(target=coordinator, daemon=True).start()
    return listener, ops


def _client(listener: Any, world: int) -> Any:
    import secrets

    from prism_megatron.runtime.client import RankClient

    client = RankClient(listener.address, b"prism-settled-test", 0, world, f"prism-test-{secrets.token_hex(4)}")
    client.acquire()
    return client


def test_a_collective_answered_in_the_rank_completes_there_without_waiting_for_the_coordinator():
    """local_fold.SETTLED_RULE: a synchronous op the rank answered is sent marked settled, without asking to block,
    its Work complete (its ``after`` run) before submit returns, and a wait on it needs no word from the
    coordinator; an op the rank did not answer still blocks for its grant. The coordinator here grants the first
    slot and nothing after it."""
    import threading

    listener, ops = _granting_once()
    client = _client(listener, 4)
    x, ran = torch.arange(4.0), []
    work = client.submit(0, "all_reduce", [x], [x], inplace=True, answer=lambda: x.mul_(4),
                         after=lambda: ran.append(True), async_op=False, redop="sum")
    assert work.is_completed() and ran == [True] and x.tolist() == [0.0, 4.0, 8.0, 12.0]
    done = threading.Event()
    threading.Thread(target=lambda: (work.wait(), done.set()), daemon=True).start()
    assert done.wait(10), "the wait on a settled op waited for the coordinator"
    first = ops(1)
    assert len(first) == 1 and first[0]["settled"] and first[0]["local"] and "block" not in first[0]
    y = torch.ones(2)
    client.submit(0, "all_reduce", [y], [y], inplace=True, async_op=False, redop="sum")  # the coordinator's
    assert [m.get("block") for m in ops(2)] == [None, True]
    client._conn.close()
    listener.close()


def test_an_op_of_a_group_of_one_is_settled_in_the_rank_unless_an_earlier_op_still_writes_its_outputs():
    """SETTLED_RULE for groups of one (OpKind.local): a synchronous and an asynchronous all_reduce complete at
    their issue, marked settled, none asking to block; an op whose output an earlier async op of another group
    still has to write is not settled: it completes through the coordinator (which here answers nothing)."""
    import threading

    listener, ops = _granting_once()
    client = _client(listener, 2)
    x, works = torch.arange(3.0), []

    def issue() -> None:  # a synchronous op waiting for a grant would wait for ever here
        works.append(client.submit(0, "all_reduce", [x], [x], inplace=True, async_op=False, redop="sum", local=True))
        works.append(client.submit(0, "all_reduce", [x], [x], inplace=True, async_op=True, redop="sum", local=True))

    issuer = threading.Thread(target=issue, daemon=True)
    issuer.start()
    issuer.join(10)
    assert len(works) == 2, "a synchronous op of a group of one waited for the coordinator"
    assert all(w.is_completed() for w in works) and x.tolist() == [0.0, 1.0, 2.0]
    assert [(m["settled"], m.get("block")) for m in ops(2)] == [(True, None), (True, None)]
    y = torch.ones(2)
    pending = client.submit(1, "all_reduce", [y], [y], inplace=True, async_op=True, redop="sum")  # the coordinator's
    assert not pending.is_completed()
    z = torch.full((2,), 7.0)
    blocked = client.submit(0, "all_gather", [z], [y], async_op=True, local=True)  # y: the pending op's output
    assert not blocked.is_completed() and "settled" not in ops(4)[3]
    client._conn.close()
    listener.close()


def test_only_an_op_staged_through_host_memory_waits_for_the_device_at_issue(monkeypatch):
    """An op on device tensors that the rank answers where they are (a group of one, a lone folded member) queues
    behind the program's kernels as NCCL's would: the host does not wait for the device at its issue (which the
    one-clock trace would count as compute, and the real job does not do). An op staged through host memory
    does wait, on the program's clock: its copies need the kernels' results. Device tensors stood in for by
    telling the client its CPU tensors are on the device; the wait itself is recorded, not made."""
    from prism_megatron.runtime.client import RankClient

    listener, ops = _granting_once()
    client = _client(listener, 2)
    waited: list[bool] = []
    pause = RankClient._pause

    def spy(self, sync: bool = False) -> float:
        waited.append(sync)
        return pause(self, False)

    monkeypatch.setattr(RankClient, "_pause", spy)
    x, y = torch.arange(3.0), torch.ones(2)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        client.submit(0, "all_reduce", [x], [x], inplace=True, async_op=True, redop="sum", local=True)
        client.submit(0, "all_reduce", [x], [x], inplace=True, async_op=True, answer=lambda: x.mul_(2), redop="sum")
        client.submit(1, "all_reduce", [y], [y], inplace=True, async_op=True, redop="sum")  # staged
    assert waited == [False, False, True]
    assert x.tolist() == [0.0, 2.0, 4.0] and len(ops(3)) == 3
    client._conn.close()
    listener.close()
