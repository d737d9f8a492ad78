"""nccl_prune on host tensors: a folded op equals the full op over every member, each virtual member
holding its mirror's inputs (property tests over random groups, shapes, dtypes and reduce ops), and the
plan's refusals."""

from __future__ import annotations

import random

import pytest
import torch

from nccl_prune import (
    RECORD_MAX_BYTES,
    RECORDED_KINDS,
    Contributions,
    PruneError,
    check_p2p,
    execute,
    is_in_place_all_gather,
    other_classes,
    plan_group,
    recordable,
    recorded_inputs,
)
from nccl_prune.contributions import KINDS, virtual_contributions
from prism_megatron.runtime import collectives as C
from tests.nccl_prune_cases import (
    FLOATS,
    INTS,
    a2a_full_pieces,
    assert_reduced_close,
    full_inputs,
    ops_for,
    random_plan,
    random_tensor,
)

DTYPES = (*FLOATS, *INTS, torch.bool)


def test_plan_fields_and_multiplicity():
    rep = list(range(16))
    rep[9], rep[13], rep[5] = 1, 1, 3  # group [1, 5, 9, 13, 3]: live 1 and 3
    plan = plan_group([1, 5, 9, 13, 3], rep)
    assert plan.ranks == (1, 5, 9, 13, 3)
    assert plan.live_positions == (0, 4)
    assert plan.mirror == (0, 4, 0, 0, 4)
    assert plan.multiplicity[0] == 3 and plan.multiplicity[4] == 2
    assert plan.shift == (0, 2, 8, 12, 0)
    assert plan.virtual_positions == (1, 2, 3) and plan.live_index(4) == 1


def test_plan_none_without_live_member_and_errors():
    rep = [0, 0, 0, 0, 4, 4, 4, 4]
    assert plan_group([5, 6, 7], rep) is None  # never materialised: no error even though reps lie outside
    with pytest.raises(PruneError, match=r"virtual rank 2 of group \[4, 2\] mirrors rank 0, which is not a member"):
        plan_group([4, 2], rep)
    bad = [0, 0, 1]  # rank 2 mirrors rank 1, which is itself virtual
    with pytest.raises(PruneError, match="rank 2 .* mirrors rank 1, which is not live"):
        plan_group([0, 1, 2], bad)
    with pytest.raises(PruneError, match="listed twice"):
        plan_group([0, 0], rep)
    with pytest.raises(PruneError, match="outside the world of 8"):
        plan_group([0, 9], rep)


def test_p2p_with_virtual_peer_is_refused_naming_both_ranks():
    plan = plan_group([3, 7], [0, 1, 2, 3, 4, 5, 6, 3])
    check_p2p(plan, 0, 0)
    with pytest.raises(PruneError, match=r"rank 3 \(sender\) and rank 7 \(receiver\): rank 7 is virtual"):
        check_p2p(plan, 0, 1)
    with pytest.raises(PruneError, match="p2p op"):
        execute("send", plan, {0: [torch.ones(1)]})


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_reduce_and_reduce_scatter_equal_full_execution_with_mirrored_inputs(dtype):
    rng = random.Random(hash(str(dtype)) % 1000)
    g = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    for trial in range(12):
        plan, _ = random_plan(rng)
        n = plan.size
        for op in ops_for(dtype):
            factor = rng.choice([0.5, 1.75, -3.0]) if op == "premul_sum" else None
            shapes = [(rng.randint(1, 4), n * rng.randint(1, 3)) for _ in range(rng.randint(1, 2))]  # coalesced
            live = {p: [random_tensor(g, s, dtype, op) for s in shapes] for p in plan.live_positions}
            full = full_inputs(plan, live)
            what = f"trial {trial} {op} {dtype} plan {plan.ranks} mirror {plan.mirror}"
            outs = execute("all_reduce", plan, live, op=op, factor=factor)
            rs = execute("reduce_scatter", plan, live, op=op, factor=factor)
            for j in range(len(shapes)):
                terms = [f[j] for f in full]
                want = C.reduce(terms, op, factor)
                want_chunks = C.reduce_scatter(terms, op, factor)
                for p in plan.live_positions:
                    assert_reduced_close(outs[p][j], want, terms, op, factor, what)
                    assert_reduced_close(rs[p][j], want_chunks[p], [t.reshape(-1).chunk(n)[p] for t in terms],
                                         op, factor, what + f" reduce_scatter pos {p}")
            sizes = [rng.randint(1, 3) for _ in range(n)]
            lists = {p: [random_tensor(g, (sizes[i],), dtype, op) for i in range(n)] for p in plan.live_positions}
            got = execute("reduce_scatter_list", plan, lists, op=op, factor=factor)
            want_l = C.reduce_scatter_lists(full_inputs(plan, lists), op, factor)
            for p in plan.live_positions:
                assert_reduced_close(got[p][0], want_l[p], [f[p] for f in full_inputs(plan, lists)], op, factor,
                                     what + " reduce_scatter_list")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool], ids=str)
def test_no_virtual_member_gives_bitwise_the_runtime_result(dtype):
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 5):
        plan = plan_group(list(range(n)), list(range(n)))
        for op in ops_for(dtype):
            factor = 0.3 if op == "premul_sum" else None
            ins = {p: [random_tensor(g, (3, 2 * n), dtype, op)] for p in range(n)}
            got = execute("all_reduce", plan, ins, op=op, factor=factor)
            want = C.reduce([ins[p][0] for p in range(n)], op, factor)
            assert all(torch.equal(got[p][0], want) and got[p][0].dtype == want.dtype for p in range(n)), (op, n)
            rs = execute("reduce_scatter", plan, ins, op=op, factor=factor)
            want_rs = C.reduce_scatter([ins[p][0] for p in range(n)], op, factor)
            assert all(torch.equal(rs[p][0], want_rs[p]) for p in range(n)), (op, n)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "premul_sum"])
def test_all_reduce_into_out_and_into_the_first_input(op):
    plan = plan_group([0, 1, 2], [0, 1, 0])  # position 0 counts twice
    factor = 0.5 if op == "premul_sum" else None
    for dtype in (torch.float32, torch.int32):
        if op == "premul_sum" and dtype == torch.int32:
            continue
        x = {0: [torch.tensor([1, 2, 3], dtype=dtype)], 1: [torch.tensor([4, 5, 7], dtype=dtype)]}
        want = execute("all_reduce", plan, x, op=op, factor=factor)[0][0]
        buf = torch.full_like(want, 9)
        got = execute("all_reduce", plan, x, op=op, factor=factor, out=[buf])
        assert got[0][0] is buf and got[1][0] is buf and torch.equal(buf, want)
        first = x[0][0].clone()
        got = execute("all_reduce", plan, {0: [first], 1: x[1]}, op=op, factor=factor, out=[first])
        assert got[0][0].data_ptr() == first.data_ptr() and torch.equal(first, want), (op, dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32, torch.bool], ids=str)
def test_results_written_into_the_members_buffers_are_bitwise_the_executors(dtype):
    """``into=`` (the executor in a rank): the same bits as new tensors, for every kind it takes, with the
    buffers a rank passes: separate memory, its own input (in-place all_reduce, reduce_scatter into its
    own chunk), its own chunk of the output (in-place all_gather)."""
    rng = random.Random(11)
    g = torch.Generator().manual_seed(11)
    for _ in range(12):
        plan, _ = random_plan(rng)
        n, live = plan.size, plan.live_positions
        for op in ops_for(dtype):
            factor = 0.5 if op == "premul_sum" else None

            def fresh(shape, op=op, live=live):
                return {p: [random_tensor(g, shape, dtype, op), random_tensor(g, (3,), dtype, op)] for p in live}

            x = fresh((n * 2,))
            want = execute("all_reduce", plan, x, op=op, factor=factor)
            own = {p: [t.clone() for t in v] for p, v in x.items()}  # in place: each member's input
            got = execute("all_reduce", plan, own, op=op, factor=factor, into=own)
            assert all(torch.equal(_bits(got[p][j]), _bits(want[p][j])) and got[p][j] is own[p][j]
                       for p in live for j in range(2)), (op, plan)
            x = {p: [v[0]] for p, v in fresh((n * 2,)).items()}
            want = execute("reduce_scatter", plan, x, op=op, factor=factor)
            bufs = {p: [torch.empty(2, dtype=dtype)] for p in live}
            got = execute("reduce_scatter", plan, x, op=op, factor=factor, into=bufs)
            assert all(torch.equal(_bits(got[p][0]), _bits(want[p][0])) for p in live), (op, plan)
            own = {p: [v[0].clone()] for p, v in x.items()}  # each member's output is its own chunk
            got = execute("reduce_scatter", plan, own, op=op, factor=factor,
                          into={p: [own[p][0][p * 2:(p + 1) * 2]] for p in live})
            assert all(torch.equal(_bits(own[p][0][p * 2:(p + 1) * 2]), _bits(want[p][0])) for p in live), (op, plan)
            lists = {p: [random_tensor(g, (q + 1,), dtype, op) for q in range(n)] for p in live}
            want = execute("reduce_scatter_list", plan, lists, op=op, factor=factor)
            got = execute("reduce_scatter_list", plan, lists, op=op, factor=factor,
                          into={p: [torch.empty(p + 1, dtype=dtype)] for p in live})
            assert all(torch.equal(_bits(got[p][0]), _bits(want[p][0])) for p in live), (op, plan)
        x = {p: [random_tensor(g, (2,), dtype), random_tensor(g, (3,), dtype)] for p in live}
        want = execute("all_gather", plan, x)
        got = execute("all_gather", plan, x, into={p: [torch.empty(2 * n, dtype=dtype), torch.empty(3 * n, dtype=dtype)]
                                                   for p in live})
        assert all(torch.equal(_bits(got[p][j]), _bits(want[p][j])) for p in live for j in range(2))
        want = execute("all_gather_list", plan, {p: [v[0]] for p, v in x.items()})
        got = execute("all_gather_list", plan, {p: [v[0]] for p, v in x.items()},
                      into={p: [torch.empty(2, dtype=dtype) for _ in range(n)] for p in live})
        assert all(torch.equal(_bits(got[p][q]), _bits(want[p][q])) for p in live for q in range(n))
        bufs = {p: random_tensor(g, (n * 2,), dtype) for p in live}  # in place: the chunks are kept
        ins = {p: [bufs[p][p * 2:(p + 1) * 2]] for p in live}
        cur = {p: [bufs[p]] for p in live}
        want = execute("all_gather", plan, ins, in_place=True, current=cur)
        before = {p: bufs[p].clone() for p in live}
        got = execute("all_gather", plan, ins, in_place=True, current=cur, into=cur)
        assert all(got[p][0] is bufs[p] and torch.equal(_bits(bufs[p]), _bits(want[p][0])) for p in live)
        if len(live) == 1:  # every other chunk kept, its own in place: nothing moved
            assert all(torch.equal(_bits(bufs[p]), _bits(before[p])) for p in live)


def test_a_reduction_into_a_members_input_reads_every_input_before_writing_it():
    """A recorded virtual member contributes the first term while ``out`` is the live member's input:
    the result is the reduction of the inputs as they were, not of an overwritten one."""
    plan = plan_group([0, 1], [1, 1])  # position 0 virtual (mirrors 1), recorded
    x = torch.tensor([1.0, 2.0])
    want = execute("all_reduce", plan, {1: [x.clone()]}, op="sum", recorded={0: [torch.tensor([10.0, 20.0])]})
    mine = x.clone()
    got = execute("all_reduce", plan, {1: [mine]}, op="sum", recorded={0: [torch.tensor([10.0, 20.0])]}, out=[mine])
    assert want[1][0].tolist() == [11.0, 22.0] and got[1][0].tolist() == [11.0, 22.0] and mine.tolist() == [11.0, 22.0]
    with pytest.raises(PruneError, match="buffers of position 1 hold \\[3\\] elements, expected \\[2\\]"):
        execute("all_reduce", plan, {1: [x]}, op="sum", into={1: [torch.empty(3)]})
    with pytest.raises(PruneError, match="broadcast: results cannot be written"):
        execute("broadcast", plan, {1: [x]}, root=1, into={1: []})


def test_reduce_gather_broadcast_scatter_roots():
    rep = [0, 1, 0, 1, 4, 5]  # group [0, 1, 2, 3]: live 0 and 1; 2 mirrors 0, 3 mirrors 1
    plan = plan_group([0, 1, 2, 3], rep)
    x = {0: [torch.tensor([1.0, 2.0])], 1: [torch.tensor([10.0, 20.0])]}
    assert torch.equal(execute("reduce", plan, x, op="sum", root=1)[1][0], torch.tensor([22.0, 44.0]))
    assert execute("reduce", plan, x, op="sum", root=2) == {0: [], 1: []}  # a virtual root: nothing reaches
    got = execute("gather", plan, x, root=0)
    assert [t.tolist() for t in got[0]] == [[1, 2], [10, 20], [1, 2], [10, 20]] and got[1] == []
    # broadcast from virtual rank 3: its mirror (position 1) passes its buffer as it stands
    b = execute("broadcast", plan, {0: [], 1: [torch.tensor([7.0])]}, root=3)
    assert b[0][0].tolist() == [7.0] and b[1][0].tolist() == [7.0]
    with pytest.raises(PruneError, match="broadcast from virtual rank 3: its mirror, rank 1, passed no buffer"):
        execute("broadcast", plan, {0: [], 1: []}, root=3)
    pieces = [torch.tensor([float(i)]) for i in range(4)]
    s = execute("scatter", plan, {0: pieces, 1: []}, root=0)
    assert s[0][0].item() == 0.0 and s[1][0].item() == 1.0
    with pytest.raises(PruneError, match="scatter from virtual rank 2: its mirror, rank 0, holds no scatter list"):
        execute("scatter", plan, {0: [], 1: []}, root=2)
    s = execute("scatter", plan, {0: [], 1: []}, root=2, recorded={2: pieces})
    assert s[1][0].item() == 1.0
    assert execute("barrier", plan, {0: [], 1: []}) == {0: [], 1: []}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool], ids=str)
def test_all_gather_mirror_equals_full_and_keep_leaves_virtual_chunks(dtype):
    rng = random.Random(5)
    g = torch.Generator().manual_seed(5)
    for _ in range(20):
        plan, _ = random_plan(rng)
        n = plan.size
        live = {p: [random_tensor(g, (2, 3), dtype), random_tensor(g, (1,), dtype)] for p in plan.live_positions}
        got = execute("all_gather", plan, live)
        full = full_inputs(plan, live)
        for j in range(2):
            want = torch.cat([f[j].reshape(-1) for f in full])
            assert all(torch.equal(got[p][j], want) for p in plan.live_positions)
        got_l = execute("all_gather_list", plan, {p: [v[0]] for p, v in live.items()})
        assert all(torch.equal(got_l[p][q], full[q][0].reshape(-1)) for p in plan.live_positions for q in range(n))
        # in place: each live member's buffer holds stale values; its own chunk is its input
        bufs = {p: random_tensor(g, (n * 6,), dtype) for p in plan.live_positions}
        ins = {p: [bufs[p][p * 6:(p + 1) * 6]] for p in plan.live_positions}
        assert all(is_in_place_all_gather(bufs[p], ins[p][0], p) for p in plan.live_positions)
        assert not is_in_place_all_gather(bufs[plan.live_positions[0]], ins[plan.live_positions[0]][0].clone(),
                                          plan.live_positions[0])
        kept = execute("all_gather", plan, ins, in_place=True, current={p: [bufs[p]] for p in bufs})
        for p in plan.live_positions:
            for q in range(n):
                chunk = kept[p][0][q * 6:(q + 1) * 6]
                want = ins[q][0] if plan.is_live(q) else bufs[p][q * 6:(q + 1) * 6]
                assert torch.equal(chunk, want), (p, q, plan.mirror)
        counts = virtual_contributions("all_gather", plan, in_place=True)
        assert counts == {"mirror": 0, "recorded": 0, "keep": plan.num_virtual, "passthrough": 0}
    with pytest.raises(PruneError, match="current output buffers"):
        execute("all_gather", plan, ins, in_place=True)


def test_all_to_all_uneven_equals_full_with_the_a2a_rule():
    rng = random.Random(11)
    g = torch.Generator().manual_seed(11)
    for _ in range(40):
        plan, _ = random_plan(rng)
        n = plan.size
        splits = {p: [rng.randint(0, 3) for _ in range(n)] for p in plan.live_positions}
        live = {p: [torch.randint(0, 1000, (sum(splits[p]),), generator=g)] for p in plan.live_positions}
        pieces = {p: list(live[p][0].split(splits[p])) for p in live}
        full = a2a_full_pieces(plan, pieces)
        want = [torch.cat([full[m][j].reshape(-1) for m in range(n)]) for j in range(n)]
        got = execute("all_to_all", plan, live, in_splits=splits)
        got_l = execute("all_to_all_list", plan, pieces)
        for p in plan.live_positions:
            assert torch.equal(got[p][0], want[p])
            assert torch.equal(torch.cat(got_l[p]), want[p])


def test_all_to_all_counterpart_by_shift_hand_checked():
    # group [10, 20, 30, 40, 50]: only 30 live; 10 and 50 mirror it from two replicas below and above
    rep = list(range(60))
    for r in (10, 20, 40, 50):
        rep[r] = 30
    plan = plan_group([10, 20, 30, 40, 50], rep)
    # 50 (shift +20) sends to 30 what 30 sends to 30 - 20 = 10 (position 0); 10 (shift -20) -> 50 (pos 4)
    assert [plan.counterpart(2, q) for q in range(5)] == [4, 3, 2, 1, 0]
    pieces = [torch.tensor([100 + j]) for j in range(5)]
    got = execute("all_to_all_list", plan, {2: pieces})[2]
    assert [t.item() for t in got] == [104, 103, 102, 101, 100]
    # a data-parallel-like group: the counterpart (rank 0 - 4 = -4) is outside the group, so it is l itself
    rep = [0, 1, 2, 3, 0, 5, 6, 7, 0]
    plan = plan_group([0, 4, 8], rep)
    assert [plan.counterpart(0, q) for q in range(3)] == [0, 0, 0]


def test_all_to_all_single_translated_mirror_for_folded_expert_peers():
    """EP4 folded onto ep 0 (class depth of TP1·PP2·EP4·DP4): virtual expert rank j sends live rank 4 what
    rank 4 sends to EP offset -j (mod 4), under uneven splits; with the dispatcher's counts rotated by the
    same rule (patches.moe_fold) the splits agree, dispatch and combine, and the live rank receives
    exactly the tokens its router sends out."""
    from prism_megatron.patches.moe_fold import rotate_peer_counts
    from prism_megatron.runtime.folding import untranslation

    rep = [0] * 4 + [4] * 4
    plan_json = {"rep": rep, "live": [0, 4], "sizes": [1, 1, 4, 2], "coords": [[0, 0, r % 4, r // 4] for r in range(8)]}
    plan = plan_group([4, 5, 6, 7], rep, untranslation(plan_json))
    assert [plan.counterpart(0, q) for q in range(4)] == [0, 3, 2, 1]
    assert plan_group([4, 5, 6, 7], rep).counterpart(0, 1) == 0  # without coordinates: the v1 rule (itself)
    # routing: 8 experts, 2 per EP rank; tokens per expert of the live rank
    counts = torch.tensor([2, 1, 0, 0, 1, 1, 0, 1])
    input_splits = counts.reshape(4, 2).sum(1).tolist()
    assert input_splits == [3, 0, 2, 1]
    gathered = rotate_peer_counts(counts.repeat(4), ep_size=4, tp_size=1, num_experts=8, ep_rank=0)
    output_splits = gathered.reshape(4, 1, 8)[:, 0, 0:2].sum(-1).tolist()  # Megatron's preprocess, local experts 0-1
    # peer 1 routes to expert e + 2 what rank 4 routes to expert e
    assert gathered.reshape(4, 8)[1].tolist() == [0, 1, 2, 1, 0, 0, 1, 1]
    assert output_splits == [3, 1, 2, 0]
    tokens = torch.arange(100, 106)  # dispatch: pieces to offsets 0..3 = [100 101 102] [] [103 104] [105]
    got = execute("all_to_all", plan, {0: [tokens]}, in_splits={0: input_splits})[0][0]
    assert got.tolist() == [100, 101, 102, 105, 103, 104]
    pieces = [len(x) for x in ([100, 101, 102], [105], [103, 104], [])]
    assert pieces == output_splits and got.numel() == sum(input_splits)
    # combine: the live rank sends back by output_splits and receives by its dispatch's input_splits
    back = torch.arange(200, 206)  # pieces [200 201 202] [203] [204 205] []
    got = execute("all_to_all", plan, {0: [back]}, in_splits={0: output_splits})[0][0]
    # from 0 its own piece; from 1 the piece to offset 3 ([]), from 2 to 2, from 3 to 1: sizes = input_splits
    assert got.tolist() == [200, 201, 202, 204, 205, 203]


@pytest.mark.parametrize("tp, ep", [(1, 4), (2, 4), (2, 8), (4, 8)])
def test_rotated_counts_say_what_the_translated_all_to_all_delivers(tp, ep):
    """For every folded expert peer, the count the dispatcher reads for the live rank's experts (row e,
    its block) is the size of the piece the coordinator delivers from that peer (the piece its mirror
    sends to the counterpart): ETP1 under TP ``tp`` (EP position = tp + TP·q, the plan's axes tp, cp,
    ep, edp, pp with ep = q) translates digit by digit, not by a roll of EP positions. The all-to-all's
    total cannot tell them apart; the per-expert sorting after it can."""
    from prism_megatron.patches.moe_fold import rotate_peer_counts
    from prism_megatron.runtime.folding import untranslation

    rep = [0] * ep  # one stage, EP group = the whole stage, live rank 0
    coords = [[e % tp, 0, e // tp, 0, 0] for e in range(ep)]
    fold = {"rep": rep, "coords": coords, "sizes": [tp, 1, ep // tp, 1, 1]}
    plan = plan_group(list(range(ep)), rep, untranslation(fold))
    local = 2
    counts = torch.randperm(ep * local) * 7 + 1  # distinct per expert
    rows = rotate_peer_counts(counts.repeat(ep), ep_size=ep, tp_size=1, num_experts=ep * local, ep_rank=0,
                              inner=tp).reshape(ep, ep, local)
    block = counts.reshape(ep, local)
    for e in range(ep):
        assert torch.equal(rows[e, 0], block[plan.counterpart(0, e)]), (e, plan.counterpart(0, e))
        assert sorted(rows[e].reshape(-1).tolist()) == sorted(counts.tolist())  # a permutation of blocks
    if tp > 1:  # a roll of EP positions would name other pieces
        rolled = rotate_peer_counts(counts.repeat(ep), ep, 1, ep * local, 0).reshape(ep, ep, local)
        assert any(not torch.equal(rolled[e, 0], block[plan.counterpart(0, e)]) for e in range(ep))


def test_uneven_split_mismatch_is_an_error():
    plan = plan_group([0, 1], [0, 0])
    with pytest.raises(PruneError, match=r"splits \[1, 1\] of member 0 do not match 2 members and 3"):
        execute("all_to_all", plan, {0: [torch.ones(3)]}, in_splits={0: [1, 1]})


def test_recorded_inputs_replace_the_mirror():
    rep = [0, 0, 0]
    plan = plan_group([0, 1, 2], rep)
    x = {0: [torch.tensor([1.0, 0.0])]}
    got = execute("all_reduce", plan, x, op="max", recorded={2: [torch.tensor([0.0, float("inf")])]})
    assert got[0][0].tolist() == [1.0, float("inf")]  # an inf flag a virtual rank raised is seen
    s = execute("all_reduce", plan, x, op="sum", recorded={2: [torch.tensor([5.0, 5.0])]})
    assert s[0][0].tolist() == [7.0, 5.0]  # 2 x mirror + recorded
    c = Contributions()
    c.add("all_reduce", plan, recorded={2})
    c.add("all_reduce", plan)
    c.add("barrier", plan)
    c.add("broadcast", plan, root=0)
    none = {"mirror": 0, "recorded": 0, "keep": 0, "passthrough": 0}
    assert c.to_json() == {"all_reduce": {**none, "mirror": 3, "recorded": 1}, "barrier": none, "broadcast": none}
    assert Contributions.from_json(c.to_json()).to_json() == c.to_json()
    with pytest.raises(PruneError, match="not a virtual member"):
        execute("all_reduce", plan, x, op="sum", recorded={0: x[0]})
    with pytest.raises(ValueError, match="unknown field"):
        Contributions.from_json({"all_reduce": {"mirrored": 1}})


def test_a_serial_captures_reduction_takes_each_other_class_s_recording_as_together():
    """RECORDED_REDUCTION_RULE: the model-parallel group of TP2·PP2 (ranks 0, 1 stage 0; 4, 5 stage 1), classes
    live on 0 and 4. Serial capture of rank 4 (every rep 4): 0 and 1 are of rank 0's class (recorded), 5 of its
    own (mirror). A grad norm's squares summed: what the fold together sums, not rank 4's square four times."""
    class_rep = [0, 0, 0, 0, 4, 4, 4, 4]
    plan = plan_group([0, 1, 4, 5], [4] * 8)
    others = other_classes(plan, class_rep)
    assert others == {0: 0, 1: 0}  # position -> its class's live rank; position 3 (rank 5) is rank 4's class
    assert other_classes(plan_group([4, 5], [4] * 8), class_rep) == {}  # a TP group: one class
    mine = [torch.tensor([0.25], dtype=torch.float32), torch.tensor([3], dtype=torch.int64)]  # squares, zeros
    theirs = [torch.tensor([4.0]), torch.tensor([7])]
    rec = recorded_inputs(plan, others, {0: theirs}, mine)
    assert rec == {0: theirs, 1: theirs}
    got = execute("all_reduce", plan, {2: mine}, op="sum", recorded=rec)[2]
    together = execute("all_reduce", plan_group([0, 1, 4, 5], class_rep), {0: theirs, 2: mine}, op="sum")[0]
    assert [t.tolist() for t in got] == [t.tolist() for t in together] == [[8.5], [20]]
    assert [t.tolist() for t in execute("all_reduce", plan, {2: mine}, op="sum")[2]] == [[1.0], [12]]  # self mirror
    assert recorded_inputs(plan, others, {}, mine) == {}  # no recording: self mirror, the caller counts it
    with pytest.raises(PruneError, match=r"rank 0 contributed .* \[\(torch.float32, 2\), .*do not run the same"):
        recorded_inputs(plan, others, {0: [torch.zeros(2), theirs[1]]}, mine)
    with pytest.raises(PruneError, match="captures do not run the same program"):
        recorded_inputs(plan, others, {0: [theirs[0].double(), theirs[1]]}, mine)
    c = Contributions()
    c.add("all_reduce", plan, recorded=rec)
    assert c.to_json()["all_reduce"] == {"mirror": 1, "recorded": 2, "keep": 0, "passthrough": 0}
    # the bound: all inputs together, reductions only (a gather's result is each member's own value)
    assert recordable("all_reduce", RECORD_MAX_BYTES) and not recordable("all_reduce", RECORD_MAX_BYTES + 1)
    assert all(recordable(k, 8) for k in ("reduce", "reduce_scatter", "reduce_scatter_list"))
    assert not any(recordable(k, 8) for k in ("all_gather", "all_gather_list", "broadcast", "all_to_all", "barrier"))
    assert RECORDED_KINDS <= {k for k, v in KINDS.items() if v.reducing}


def test_every_kind_has_a_rule_and_bad_kinds_are_refused():
    assert {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "barrier", "send"} <= set(KINDS)
    plan = plan_group([0], [0])
    with pytest.raises(PruneError, match="op kind 'all_gather_object' has no pruning rule"):
        execute("all_gather_object", plan, {0: []})
    with pytest.raises(PruneError, match=r"expected the live positions \[0\]"):
        execute("all_reduce", plan, {1: []}, op="sum")


def test_package_imports_neither_megatron_nor_prism_megatron():
    import os
    import subprocess
    import sys

    code = ("import sys, nccl_prune, nccl_prune.dist_executor; "
            "bad = [m for m in sys.modules if m.startswith(('prism_megatron', 'megatron'))]; "
            "print(bad); sys.exit(1 if bad else 0)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
