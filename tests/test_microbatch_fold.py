"""Micro-batch folding: a capture of m_c micro-batches per iteration replayed at the target's M."""

from __future__ import annotations

import pytest

from prism_megatron.calibration.costmodel import CollectiveCostModel
from prism_megatron.calibration.profiles import load_profile
from prism_megatron.replay import Comm, GraphError, replay
from prism_megatron.replay.graph import Graph, Mark
from prism_megatron.replay.microbatch_fold import expand_microbatches, interleaved_alignment
from prism_megatron.replay.stage_schedule import ScheduleError, interleaved_steps, schedule_table
from prism_megatron.replay.synthesize import fold_graph
from prism_megatron.replay.synthetic import Shape, class_fold, megatron_1f1b
from prism_megatron.trace import TraceFormatError
from prism_megatron.trace.microbatches import (
    MicrobatchFold,
    interleaved_cut,
    minimum_captured,
    minimum_interleaved,
    parse_microbatches,
)

COST = CollectiveCostModel(load_profile("h100-nvlink-ib400"), gpus_per_node=4)


def _canonical(graph, rank):
    """A rank's events with groups named by their ranks, unit markers with their micro-batch."""
    out = []
    for ev in graph.events[rank]:
        if isinstance(ev, Comm):
            out.append((ev.kind, graph.groups[ev.group].ranks, ev.seq, ev.peer, ev.root, ev.nbytes, ev.async_op,
                        ev.label))
        elif isinstance(ev, Mark):
            out.append((ev.name, ev.phase, ev.attrs.get("microbatch"), ev.attrs.get("iteration")))
        else:
            out.append(ev)
    return out


def _same_times(a, b, ranks):
    assert a.iteration_times() == b.iteration_times()
    for r in ranks:
        assert a.rank_end[r] == b.rank_end[r], r
        assert a.breakdown(r) == b.breakdown(r), r
        assert a.event_times[r] == b.event_times[r], r


def _record(shape: Shape, captured: int) -> MicrobatchFold:
    warmup = tuple(shape.warmup(p) for p in range(shape.pp))
    return MicrobatchFold(shape.microbatches, captured, "1f1b" if shape.pp > 1 else "no_pipelining", warmup)


def _shapes(pp: int, extra: int, **kw) -> tuple[Shape, Shape, MicrobatchFold]:
    """The job at M = m_c + extra micro-batches, the same job at its minimum m_c, and the fold record."""
    m_c = minimum_captured([pp - p - 1 for p in range(pp)])
    full = Shape(pp=pp, microbatches=m_c + extra, **kw)
    small = Shape(pp=pp, microbatches=m_c, **kw)
    return full, small, _record(full, m_c)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 6, 7, 8])
def test_expanded_capture_is_the_full_job_event_for_event_and_time_for_time(pp):
    """Every stage's units at M from a capture of max(warm-up) + 2: the same events, the same replay."""
    for extra, tp, dp, gpu in ((0, 1, 2, False), (1, 2, 1, True), (11, 2, 2, pp % 2 == 0)):
        kw = dict(tp=tp, dp=dp, iterations=2, layers_per_stage=1, gpu_times=gpu)
        full_shape, small_shape, mb = _shapes(pp, extra, **kw)
        full, small = megatron_1f1b(full_shape), megatron_1f1b(small_shape)
        expanded = expand_microbatches(small, mb)
        assert mb.describe() in expanded.notes
        for r in range(full_shape.world_size):
            assert _canonical(expanded, r) == _canonical(full, r), (pp, extra, r)
        _same_times(replay(expanded, COST), replay(full, COST), range(full_shape.world_size))


@pytest.mark.parametrize("pp", [4, 6])
def test_expansion_before_a_class_fold_synthesises_the_full_job(pp):
    """Live ranks expanded first, then the folded middle stages restaged from them at M."""
    full_shape, small_shape, mb = _shapes(pp, 7, tp=2, dp=2, iterations=2, layers_per_stage=1)
    full = megatron_1f1b(full_shape)
    folded = fold_graph(megatron_1f1b(small_shape), gpus_per_node=4, **class_fold(small_shape))
    expanded = expand_microbatches(folded, mb)
    assert sorted(expanded.events) == list(folded.fold.live)
    fast = replay(expanded, COST)
    assert "one pipeline" in fast.method
    _same_times(fast, replay(full, COST), fast.graph.ranks)
    everyone = replay(expanded, COST, fold_method="full")
    _same_times(everyone, replay(full, COST), range(full_shape.world_size))


def test_record_and_sentence():
    mb = MicrobatchFold(64, 6, "1f1b", (3, 2, 1, 0))
    assert mb.describe() == ("micro-batches: 6 of 64 run per iteration; 58 replayed as copies of micro-batch 4's "
                             "forward/backward")
    assert [mb.source(i) for i in (0, 3, 4, 5, 40, 62, 63)] == [0, 3, 4, 4, 4, 4, 5]
    assert minimum_captured([0]) == 3 and minimum_captured([1, 0]) == 3 and minimum_captured([7, 6, 0]) == 9
    assert parse_microbatches(mb.to_json(), "m.json") == mb
    with pytest.raises(TraceFormatError, match=r"'job.microbatches.captured' is 4, expected an integer >= 5"):
        parse_microbatches({**mb.to_json(), "captured": 4}, "m.json")
    with pytest.raises(TraceFormatError, match=r"'job.microbatches.target' is 4, expected an integer >= captured"):
        parse_microbatches({**mb.to_json(), "target": 4}, "m.json")
    with pytest.raises(TraceFormatError, match=r"'job.microbatches.schedule' is 'interleaved'"):
        parse_microbatches({**mb.to_json(), "schedule": "interleaved"}, "m.json")
    with pytest.raises(TraceFormatError, match=r"'job.microbatches.version' is 3"):
        parse_microbatches({**mb.to_json(), "version": 3}, "m.json")


def test_what_does_not_fit_is_an_error_naming_rank_and_microbatch():
    full_shape, small_shape, mb = _shapes(4, 3, tp=1, dp=1, iterations=1, layers_per_stage=1)
    small = megatron_1f1b(small_shape)
    too_many = MicrobatchFold(8, 4, "1f1b", (2, 1, 0, 0))  # the record says 4 ran; the trace holds 5
    with pytest.raises(ScheduleError, match=r"rank 0, micro-batch 4 event \d+: forward unit .* is not a "
                                            r"non-interleaved unit of a captured micro-batch 0..3"):
        expand_microbatches(small, too_many)
    assert isinstance(ScheduleError("x"), GraphError)
    events = list(small.events[1])  # stage 1 without its micro-batch 2 backward
    at = next(i for i, e in enumerate(events) if isinstance(e, Mark) and e.name == "backward"
              and e.phase == "B" and e.attrs["microbatch"] == 2)
    end = next(i for i in range(at + 1, len(events)) if isinstance(events[i], Mark) and events[i].name == "backward")
    cut = Graph(small.groups, {**small.events, 1: events[:at] + events[end + 1:]})
    with pytest.raises(ScheduleError, match=r"rank 1, micro-batch 2, iteration 0: no backward unit"):
        expand_microbatches(cut, mb)
    no_send = [e for e in small.events[2] if not (isinstance(e, Comm) and e.kind == "send" and e.peer == 3)]
    with pytest.raises(ScheduleError, match=r"rank 2, micro-batch 0, iteration 0: 0 send_next p2p op\(s\) for 5 "
                                            r"captured micro-batches; stage 2 of 4 has 5"):
        expand_microbatches(Graph(small.groups, {**small.events, 2: no_send}), mb)
    evaluation = {r: [Mark(e.name, e.phase, {**e.attrs, "eval": True}) if isinstance(e, Mark) and e.name in
                      ("forward", "backward") else e for e in evs] for r, evs in small.events.items()}
    with pytest.raises(ScheduleError, match=r"rank 0: iteration 0 runs forward units only \(evaluation\)"):
        expand_microbatches(Graph(small.groups, evaluation), mb)
    wrong = MicrobatchFold(8, 5, "1f1b", (3, 1, 1, 0))  # stage 1 ran 2 warm-up forwards, not 1
    with pytest.raises(ScheduleError, match=r"rank 1, micro-batch 2, iteration 0: its units run in an order that "
                                            r"is not 1F1B for stage 1 \(warm-up 1\): unit 2 is \('F', 2\)"):
        expand_microbatches(small, wrong)


# --- Megatron's interleaved schedule (VPP) ---------------------------------------------------------------


def _vpp(pp: int, group: int, overlap: bool, extra_groups: int, vpp: int = 2,
         **kw) -> tuple[Shape, Shape, MicrobatchFold]:
    """An interleaved job (``vpp`` chunks) at M = m_c + extra_groups·group, the same job at m_c, and the record."""
    shape = Shape(pp=pp, vpp=vpp, group=group, overlap_p2p=overlap, wait_sends=overlap and pp == 4, **kw)
    warmup = tuple(shape.warmup(p) for p in range(pp))
    m_c = minimum_interleaved(warmup, vpp, group, 100 * group)
    full = Shape(**{**shape.__dict__, "microbatches": m_c + extra_groups * group})
    small = Shape(**{**shape.__dict__, "microbatches": m_c})
    return full, small, MicrobatchFold(full.microbatches, m_c, "interleaved", warmup, chunks=vpp, group=group,
                                       overlap_p2p=overlap, wait_sends=shape.wait_sends)


@pytest.mark.parametrize("pp,group,overlap", [(2, 2, False), (2, 2, True), (4, 4, False), (4, 4, True),
                                              (2, 4, True)])
def test_an_expanded_interleaved_capture_is_the_full_job_event_for_event_and_time_for_time(pp, group, overlap):
    """PP2/PP4 x VPP2 captured at m_c (3 groups) and expanded to M: every stage's units, p2p calls and waits
    are those of the job built at M, and so is its replay."""
    for extra, tp, dp, gpu in ((0, 1, 2, False), (1, 2, 1, True), (3, 1, 1, False)):
        kw = dict(tp=tp, dp=dp, iterations=2, layers_per_stage=1, gpu_times=gpu)
        full_shape, small_shape, mb = _vpp(pp, group, overlap, extra, **kw)
        assert mb.captured == 3 * group
        full, small = megatron_1f1b(full_shape), megatron_1f1b(small_shape)
        expanded = expand_microbatches(small, mb)
        assert mb.describe() in expanded.notes
        for r in range(full_shape.world_size):
            assert _canonical(expanded, r) == _canonical(full, r), (pp, extra, r)
        _same_times(replay(expanded, COST), replay(full, COST), range(full_shape.world_size))


@pytest.mark.parametrize("vpp,overlap_grad", [(2, False), (3, True)])
def test_an_interleaved_expansion_before_a_class_fold_synthesises_the_full_job(vpp, overlap_grad):
    """Also with DP ops in the schedule (overlap grad reduce / param gather): expanded, then restaged."""
    full_shape, small_shape, mb = _vpp(4, 4, True, 2, vpp=vpp, tp=2, dp=2, iterations=2, layers_per_stage=1,
                                       overlap_grad=overlap_grad)
    full = megatron_1f1b(full_shape)
    folded = fold_graph(megatron_1f1b(small_shape), gpus_per_node=4, **class_fold(small_shape))
    everyone = replay(expand_microbatches(folded, mb), COST, fold_method="full")
    _same_times(everyone, replay(full, COST), range(full_shape.world_size))


def _held(steps: list, table: list[tuple[int, int]], chunks: int) -> set[tuple[int, ...]]:
    """Every set of activations a stage holds at once, as units per chunk, over its program."""
    held, seen = [0] * chunks, set()
    for step in steps:
        if step[0] in ("F", "B"):
            chunk = table[step[1]][1]
            held[chunk if step[0] == "F" else chunks - 1 - chunk] += 1 if step[0] == "F" else -1
            seen.add(tuple(held))
    return seen


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_interleaved_rule_holds_for_every_layout_and_the_capture_holds_the_targets_activations(pp):
    """For PP x VPP2-3, groups of PP and more, overlapped p2p or not and every valid M up to 6 groups beyond
    m_c: every stage's program at M is its program at m_c with whole periods inserted (no ScheduleError), each
    target unit replays a captured unit of its chunk, and the sets of activations held at once (units per
    chunk) over the target's program are the capture's: the captured peak is the target's."""
    for chunks in (2, 3):
        for group in (pp, pp + 1, 2 * pp):
            warmup = tuple(2 * (pp - p - 1) + (chunks - 1) * group for p in range(pp))
            for rest in sorted({0, pp} - ({pp} if group == pp else set())):
                m_c = minimum_interleaved(warmup, chunks, group, 20 * group + rest)
                assert m_c - group < group or any(interleaved_cut(w, chunks, group, m_c - group) is None
                                                   for w in warmup)  # the least: one group fewer does not do
                for m in range(m_c, m_c + 7 * group, group):
                    table_t, table_c = schedule_table(m, chunks, group), schedule_table(m_c, chunks, group)
                    for overlap in (False, True):
                        mb = MicrobatchFold(m, m_c, "interleaved", warmup, chunks=chunks, group=group,
                                            overlap_p2p=overlap)
                        for stage in range(pp):
                            steps, units, ops = interleaved_alignment(pp, stage, mb)
                            assert sorted(units) == sorted(s for s in steps if s[0] in ("F", "B"))
                            assert all(table_t[a[1]][1] == table_c[b[1]][1] for a, b in units.items())
                            assert len(set(ops)) == sum(len(s[1]) for s in steps if s[0] == "call")
                            captured = interleaved_steps(pp, stage, chunks, group, m_c, warmup[stage], overlap)
                            assert _held(steps, table_t, chunks) == _held(captured, table_c, chunks), (m, stage)


def test_interleaved_record_and_refusals():
    mb = MicrobatchFold(64, 12, "interleaved", (10, 8, 6, 4), chunks=2, group=4, overlap_p2p=True)
    assert mb.describe() == ("micro-batches: 12 of 64 run per iteration (interleaved, 2 chunks, groups of 4); 52 "
                             "replayed as 13 copies of a steady group's forward/backward units in every chunk")
    doc = mb.to_json()
    assert (doc["version"], doc["rule"], doc["chunks"], doc["group"]) == (2, "steady-group-copy", 2, 4)
    assert parse_microbatches(doc, "m.json") == mb
    assert MicrobatchFold(8, 5, "1f1b", (3, 2, 1, 0)).to_json()["version"] == 1  # readable as before
    for change, match in [({"captured": 8}, r"'job.microbatches.captured' is 8, expected target 64 less a multiple "
                                            r"of group 4, at least 12"),
                          ({"captured": 14}, r"'job.microbatches.captured' is 14"),
                          ({"target": 66}, r"'job.microbatches.target' is 66, expected an integer >= group 4 whose "
                                           r"remainder by it is 0 or >= PP 4"),
                          ({"group": 3}, r"'job.microbatches.group' is 3, expected an integer >= PP \(4\)"),
                          ({"chunks": 1}, r"'job.microbatches.chunks' is 1"),
                          ({"rule": "steady-copy"}, r"'job.microbatches.rule' is 'steady-copy', expected "
                                                    r"'steady-group-copy'"),
                          ({"version": 1}, r"'job.microbatches.schedule' is 'interleaved', expected one of "
                                           r"no_pipelining, 1f1b \(version 1\)")]:
        with pytest.raises(TraceFormatError, match=match):
            parse_microbatches({**doc, **change}, "m.json")


def test_an_interleaved_capture_that_does_not_fit_is_an_error_naming_rank_and_microbatch():
    full_shape, small_shape, mb = _vpp(2, 2, False, 2, tp=1, dp=1, iterations=1, layers_per_stage=1)
    small = megatron_1f1b(small_shape)
    other = MicrobatchFold(mb.target, mb.captured, "interleaved", mb.warmup, chunks=2, group=2, overlap_p2p=True)
    with pytest.raises(ScheduleError, match=r"rank 0 \(stage 0, interleaved\) event \d+ \(recv with rank 1\), "
                                            r"iteration 0: stands where Megatron's interleaved schedule at 6 "
                                            r"micro-batches \(warm-up 4\) has \('send_next', \d+\)"):
        expand_microbatches(small, other)  # batched p2p captured, overlapped p2p recorded
    events = [e for e in small.events[1] if not (isinstance(e, Mark) and e.attrs.get("microbatch") == 5
                                                 and e.attrs.get("chunk") == 1 and e.name == "forward")]
    with pytest.raises(ScheduleError, match=r"rank 1, micro-batch \d+ \(stage 1, interleaved\), iteration 0: its "
                                            r"(forward|backward) unit of chunk \d stands where"):
        expand_microbatches(Graph(small.groups, {**small.events, 1: events}), mb)
    odd = MicrobatchFold(mb.target + 1, mb.captured, "interleaved", mb.warmup, chunks=2, group=2)
    with pytest.raises(ScheduleError, match=r"6 captured micro-batches have no steady group to stand for the other "
                                            r"5 \(it needs target 11 less a multiple of 2"):
        expand_microbatches(small, odd)


# --- data-parallel ops within the schedule (overlap-grad-reduce, overlap-param-gather) ---------------------


@pytest.mark.parametrize("pp,vpp,group", [(1, 1, 0), (2, 1, 0), (4, 1, 0), (2, 2, 2), (4, 2, 4), (2, 2, 4),
                                           (2, 3, 2), (4, 4, 4)])
def test_dp_ops_of_first_and_last_units_are_placed_as_megatron_issues_them_at_m(pp, vpp, group):
    """Param all-gathers in each chunk's first forward (1F1B) or dispatched by the schedule right before the
    forward `stage` units ahead of a chunk's first (interleaved, aligned param gather: a collective directly
    preceding a unit), grad reduce-scatters in the first stage's last backward (1F1B) or after the backward
    `stage` units past each chunk's last (interleaved, aligned grad sync): the expansion is the job built at M
    event for event, the copied steady units carrying no DP op."""
    for extra in (1, 3):
        kw = dict(tp=2, dp=2, iterations=2, layers_per_stage=1, overlap_grad=True)
        if vpp > 1:
            full_shape, small_shape, mb = _vpp(pp, group, True, extra, vpp=vpp, **kw)
            small = megatron_1f1b(small_shape)
            last = small.events[small_shape.rank(0, 0, pp - 1)]  # its first gathers precede its first receive
            gathers = [i for i, e in enumerate(last) if isinstance(e, Comm) and e.kind == "all_gather"]
            assert any(isinstance(last[i + 1], Mark) and last[i + 1].name == "forward"
                       for i in gathers) == (vpp > 2)  # a gather right before a unit's begin marker
        else:
            full_shape, small_shape, mb = _shapes(pp, extra, **kw)
        full, small = megatron_1f1b(full_shape), megatron_1f1b(small_shape)
        expanded = expand_microbatches(small, mb)
        for r in range(full_shape.world_size):
            assert _canonical(expanded, r) == _canonical(full, r), (pp, extra, r)
        _same_times(replay(expanded, COST), replay(full, COST), range(full_shape.world_size))


def test_a_dp_op_in_a_copied_unit_or_not_after_a_unit_is_refused_by_name():
    full_shape, small_shape, mb = _shapes(2, 2, tp=1, dp=2, iterations=1, layers_per_stage=1, overlap_grad=True)
    small = megatron_1f1b(small_shape)
    dp = next(g.id for g in small.groups.values() if g.name == "dp" and 0 in g.ranks)
    events = list(small.events[0])  # a reduce-scatter inside the copied steady backward (micro-batch 1)
    at = next(i for i, e in enumerate(events) if isinstance(e, Mark) and e.name == "backward" and e.phase == "B"
              and e.attrs["microbatch"] == mb.copied)
    seqs = [e.seq for e in events if isinstance(e, Comm) and e.group == dp]
    moved = [e for e in events if isinstance(e, Comm) and e.group == dp and e.kind == "reduce_scatter"][0]
    rest = [e for e in events if e is not moved]
    rest.insert(at + 1, moved)
    renumbered, n = [], 0
    for e in rest:
        if isinstance(e, Comm) and e.group == dp:
            e, n = Comm(**{**e.__dict__, "seq": seqs[n]}), n + 1
        renumbered.append(e)
    with pytest.raises(ScheduleError, match=r"rank 0, iteration 0: captured unit \('B', 1\) issues reduce_scatter "
                                            r"on group \d+, which the other units of its kind do not .* replays "
                                            r"that unit \d+ times"):
        expand_microbatches(Graph(small.groups, {**small.events, 0: renumbered}), mb)
    after_p2p = list(renumbered)  # the same op right after the first p2p op, no unit before it
    after_p2p.remove(moved)
    p2p = next(i for i, e in enumerate(after_p2p) if isinstance(e, Comm) and e.is_p2p)
    after_p2p.insert(p2p + 1, moved)
    with pytest.raises(ScheduleError, match=r"rank 0 event \d+ \(reduce_scatter on group \d+\) lies between the "
                                            r"units of iteration 0, is not a pipeline p2p op and does not directly "
                                            r"follow a unit"):
        expand_microbatches(Graph(small.groups, {**small.events, 0: after_p2p}), mb)
