"""Serial capture of a folded run (``--prism-fold-capture serial``): one capture per live rank, merged
into one trace that reads like the fold captured together — the capture plans, self mirror and
stand-ins, the merge (groups lined up by what they are, sequence numbers kept, a failed capture named),
the trace's v6 record, and a generic pipeline captured both ways (same ops, same sequence numbers)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nccl_prune import RECORD_MAX_BYTES, STANDIN_RULE, Contributions, PruneError, plan_group, route_recv, standin_values
from prism_megatron.launcher.exit_codes import BAD_INPUT, OOM, RANK_FAILED
from prism_megatron.launcher.launch import LaunchConfig, launch
from prism_megatron.launcher.serial import capture_plan, capture_serially, captures_dir
from prism_megatron.report.units import fmt_bytes
from prism_megatron.runtime import local_fold
from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.folding import Folding
from prism_megatron.runtime.groups import Group
from prism_megatron.runtime.matching import Member
from prism_megatron.runtime.passthrough import PassThrough
from prism_megatron.trace import read_trace, write_trace
from prism_megatron.trace.fold import FoldClass, make_fold, parse_fold
from prism_megatron.trace.merge import merge_captures
from prism_megatron.trace.schema import TraceFormatError

PROGRAMS = Path(__file__).parent / "programs"


def _class_plan() -> dict:
    """TP2·PP2·DP2 at class depth (rank = tp + 2·dp + 4·pp): first stage onto rank 0, last onto rank 4."""
    rep = [4 * (r // 4) for r in range(8)]
    classes = [FoldClass("first", "stage 0", 4, (0,)), FoldClass("last", "stage 1", 4, (4,))]
    coords = [[r % 2, 0, (r // 2) % 2, r // 4] for r in range(8)]
    return make_fold(rep, 8, classes, [r // 4 for r in range(8)], depth="class", axes=("tp", "cp", "dp", "pp"),
                     sizes=(2, 1, 2, 2), coords=coords, schedule="1f1b", warmup=(1, 0)).to_json()


def test_a_capture_plan_keeps_one_live_rank_and_every_ranks_class_representative():
    plan = _class_plan()
    part = capture_plan(plan, 4, 1)
    fold = parse_fold(part, 8, "capture")
    assert fold.live == (4,) and set(fold.rep) == {4} and [c.name for c in fold.classes] == ["last"]
    assert fold.capture_mode == "serial" and fold.capture["rules"] == {"collectives": "self_mirror", "p2p": "standin"}
    assert fold.capture["part"] == {"rank": 4, "index": 1, "of": 2, "sandbox": [0, 4], "class_rep": plan["rep"],
                                       "answers": [], "p2p_answers": [], "reduction_answers": []}
    assert fold.depth == "class" and fold.schedule == "1f1b"  # the rest of the plan as captured together
    with pytest.raises(ValueError, match="rank 1 is not a live rank of the fold"):
        capture_plan(plan, 1, 0)


def test_a_captures_ranks_are_told_it_is_a_serial_capture():
    """Program-side rules for a capture of one live rank (patches.serial_embedding) install where the rank's
    environment says so: a capture's plan sets it, the fold captured together does not."""
    from prism_megatron.launcher.rank import rank_env
    from prism_megatron.launcher.serial import CAPTURE_ENV

    plan = _class_plan()
    part = LaunchConfig(script=PROGRAMS / "fold_pipeline.py", world_size=8, fold=capture_plan(plan, 4, 1))
    assert rank_env(part, 4, 1234)[CAPTURE_ENV] == "serial"
    together = LaunchConfig(script=PROGRAMS / "fold_pipeline.py", world_size=8, fold=plan)
    assert CAPTURE_ENV not in rank_env(together, 4, 1234)


def test_the_reader_checks_the_capture_record_and_its_version():
    plan = _class_plan()
    part = capture_plan(plan, 0, 0)
    bad = {**part, "capture": {**part["capture"], "mode": "sideways"}}
    with pytest.raises(TraceFormatError, match=r"job.fold.capture.mode' is 'sideways'"):
        parse_fold(bad, 8, "t")
    with pytest.raises(TraceFormatError, match=r"job.fold.capture' is present in a v5 trace"):
        parse_fold(part, 8, "t", trace_version=5)
    wrong = {**part, "capture": {**part["capture"], "part": {**part["capture"]["part"], "rank": 4}}}
    with pytest.raises(TraceFormatError, match=r"capture.part.rank' is 4"):
        parse_fold(wrong, 8, "t")
    merged = {**plan, "capture": {"mode": "serial", "rules": part["capture"]["rules"],
                                  "captures": [{"rank": 0, "trace": "a", "complete": True, "incomplete": None}]}}
    with pytest.raises(TraceFormatError, match=r"capture.captures' lists ranks \[0\]; .* each live rank once"):
        parse_fold(merged, 8, "t")
    ways = {**plan, "contributions": {"recv": {"standin": 2}}}
    assert parse_fold(ways, 8, "t").contribution_counts()["standin"] == 2
    with pytest.raises(TraceFormatError, match=r"contributions.recv' names way\(s\) \['standin'\]; a v5 trace"):
        parse_fold(ways, 8, "t", trace_version=5)


def _group(gid: int, name: str, ranks: list[int], folding: Folding) -> Group:
    g = Group(gid, name, ranks, "nccl")
    assert folding.fold_group(g) is None
    return g


def test_a_virtual_member_of_another_class_is_answered_by_self_mirror():
    folding = Folding(capture_plan(_class_plan(), 0, 0))
    pp = _group(0, "pp", [0, 4], folding)  # rank 4's class lives in the other capture
    tp = _group(1, "tp", [0, 1], folding)  # rank 1 is rank 0's class: mirror, as captured together
    world = _group(2, "world", list(range(8)), folding)
    for g in (pp, tp, world):
        folding.count(g, "all_reduce", None, False)
    assert folding.contributions.to_json() == {"all_reduce": {"mirror": 1 + 3, "recorded": 0, "keep": 0,
                                                              "passthrough": 0, "self_mirror": 1 + 4}}
    together = Folding(_class_plan())  # captured together: no self mirror, no stand-in
    g = _group(0, "world", list(range(8)), together)
    together.count(g, "all_reduce", None, False)
    assert together.contributions.to_json() == {"all_reduce": {"mirror": 6, "recorded": 0, "keep": 0,
                                                               "passthrough": 0}}


def _recv(rank: int, peer: int, dtype: str = "float32", shape=(4, 8), label: str = "") -> Member:
    nbytes = torch.empty(0, dtype=P.dtype_from_name(dtype)).element_size() * shape[0] * shape[1]
    msg = {"kind": "recv", "peer": peer, "ins": [], "outs": [(("r", nbytes), dtype, list(shape))], "label": label}
    return Member(rank, rank, msg, SimpleNamespace(seq=-1, kind="recv"))


def test_a_receive_with_no_live_rank_upstream_gets_a_seeded_stand_in():
    pair = plan_group([0, 4], [0, 0, 0, 0, 0])  # capture of rank 0: its pipeline neighbour 4 is virtual
    with pytest.raises(PruneError, match="its own later send"):
        route_recv(pair, 0, 1)  # captured together this is refused: one live rank on the ring
    assert route_recv(pair, 0, 1, standin=True).standin
    g = Group(0, "pp", [0, 4], "nccl")
    g.fold = pair
    c = Contributions()
    pt = PassThrough(c, standin=True)
    done = []
    for label in ("recv_forward", "send_forward_recv_backward", "recv_forward"):
        assert pt.handle(g, _recv(0, 1, label=label), None, lambda m, outs, src=-1: done.append(outs[0])) is None
    fwd, bwd, again = done
    assert fwd.shape == (32,) and torch.isfinite(fwd).all() and fwd.abs().min() > 0
    assert torch.equal(fwd, again) and torch.equal(fwd, standin_values(torch.float32, 32))  # seeded
    assert float(bwd.norm()) == pytest.approx(1.0)  # a gradient: L2 norm 1
    assert c.to_json() == {"recv": {"mirror": 0, "recorded": 0, "keep": 0, "passthrough": 0, "standin": 3}}
    problem = pt.handle(g, _recv(0, 1, dtype="int64"), None, lambda *a, **k: None)
    assert "torch.int64 receive" in problem and "integer values steer the program" in problem
    assert "seeded with" in STANDIN_RULE


def test_a_serial_capture_answers_a_peer_that_is_not_a_neighbour_by_the_label_s_direction():
    """Megatron's overlapped p2p of a two-stage pipeline sends one direction over the world group by global rank
    (PP2·VPP2: stage 0 is rank 0, stage 1 rank 4 of 8): in a serial capture rank 0 is the world group's only
    live member, so such a receive gets a stand-in, its direction from the op label (none named: refused), and
    such a send completes, consumed by no one. Captured together the same peer is refused by name."""
    from nccl_prune import route_send

    world = plan_group(list(range(8)), [0] * 8)
    with pytest.raises(PruneError, match="not its neighbour in the group's order"):
        route_recv(world, 0, 4)
    with pytest.raises(PruneError, match="not its neighbour"):  # 4 is no live rank of the fold: as together
        route_recv(world, 0, 4, standin=True)
    route = route_recv(world, 0, 4, standin=True, elsewhere=True)
    assert route.standin and route.step == 0 and route.consumer == 0
    assert route_send(world, 0, 4, standin=True, elsewhere=True).consumer is None
    with pytest.raises(PruneError, match="not its neighbour"):
        route_send(world, 0, 4, standin=True)
    g = Group(0, "0", list(range(8)), "nccl")
    g.fold = world
    c = Contributions()
    pt = PassThrough(c, standin=True, elsewhere=frozenset({4}))
    done = []
    for label in ("send_backward_recv_backward", "send_forward_recv_forward"):
        assert pt.handle(g, _recv(0, 4, label=label), None, lambda m, outs, src=-1: done.append(outs[0])) is None
    grad, act = done
    assert float(grad.norm()) == pytest.approx(1.0) and torch.equal(act, standin_values(torch.float32, 32))
    problem = pt.handle(g, _recv(0, 4, label=""), None, lambda *a, **k: None)
    assert "names no direction" in problem and "virtual rank 4" in problem
    assert c.to_json()["recv"]["standin"] == 2


def test_stand_ins_take_the_norm_a_capture_together_delivers_as_an_earlier_capture_recorded_it():
    """STANDIN_RULE's scale: TP2·PP2·DP2 at class depth, pipeline group [0, 4]. Capture 1 (rank 0) sends its
    activations to rank 4, virtual there: their L2 norms are recorded. Its gradient receive has no recording
    (rank 4 is captured later) nor a gradient of its own sent before: the unit fallback, counted, and what it
    sends backward after that is marked derived. Capture 2 (rank 4) receives from rank 0: each stand-in has
    the n-th recorded norm (a unit would put what the last stage computes off by the ratio: LayerNorm divides
    by the activations' scale); a receive past the recording takes its own gradient's scale (not derived)."""
    from tests.test_passthrough import _member, _Plane

    plan = _class_plan()
    first = Folding(capture_plan(plan, 0, 0))
    pp = _group(0, "pp", [0, 4], first)
    plane, sent = _Plane(), [torch.full((4, 8), 0.03 * (i + 1)) for i in range(3)] + [torch.full((4, 8), 0.2)]
    nothing = lambda *a, **k: None  # noqa: E731
    for i, x in enumerate(sent[:3]):
        plane.buffers[f"a{i}"] = x.reshape(-1).view(torch.uint8)
        m = _member("send", 0, 1, (4, 8), buf=f"a{i}")
        m.msg["label"] = "send_forward"
        assert first.pass_through(pp, m, plane, nothing) is None
    done: list[torch.Tensor] = []
    deliver = lambda m, outs, src=-1: done.append(outs[0])  # noqa: E731
    assert first.pass_through(pp, _recv(0, 1, label="recv_backward"), plane, deliver) is None
    assert float(done[-1].norm()) == pytest.approx(1.0)  # no recording, no gradient of its own: the unit
    plane.buffers["g"] = sent[3].reshape(-1).view(torch.uint8)
    m = _member("send", 0, 1, (4, 8), buf="g")
    m.msg["label"] = "send_backward"  # after the unit fallback: derived
    assert first.pass_through(pp, m, plane, nothing) is None
    part = first.to_json()["capture"]["part"]
    assert part["standins_unrecorded"] == 1
    assert part["p2p_norms"] == [{"group": ["pp", [0, 4], 0], "src": 0, "dst": 4,
                                  "norms": [[32, pytest.approx(float(x.norm())), int(i == 3)]
                                            for i, x in enumerate(sent)]}]
    last = Folding(capture_plan(plan, 4, 1, p2p_answers=part["p2p_norms"]))
    pp4 = _group(0, "pp", [0, 4], last)

    def recv4(label: str, shape=(4, 8)) -> Member:
        m = _recv(4, 0, shape=shape, label=label)
        m.grank = 1  # rank 4 is group position 1, its virtual neighbour rank 0 position 0
        return m

    for i in range(3):
        assert last.pass_through(pp4, recv4("recv_forward"), plane, deliver) is None
        assert float(done[-1].norm()) == pytest.approx(float(sent[i].norm()), rel=1e-6)
        assert torch.isfinite(done[-1]).all() and done[-1].abs().min() > 0  # a direction, never zeros
    plane.buffers["own"] = torch.full((32,), 0.5).view(torch.uint8)
    m = _member("send", 4, 0, (4, 8), buf="own")
    m.grank, m.msg["label"] = 1, "send_backward"
    assert last.pass_through(pp4, m, plane, nothing) is None
    # message 3 was recorded derived: its own gradient's scale is preferred
    assert last.pass_through(pp4, recv4("recv_backward"), plane, deliver) is None
    assert float(done[-1].norm()) == pytest.approx(float(torch.full((32,), 0.5).norm()), rel=1e-6)
    assert last.to_json()["capture"]["part"]["standins_unrecorded"] == 0
    again = Folding(capture_plan(plan, 4, 1, p2p_answers=part["p2p_norms"]))
    pp4 = _group(0, "pp", [0, 4], again)
    last = again
    problem = again.pass_through(pp4, recv4("recv_forward", shape=(8, 8)), plane, deliver)
    assert "posts 64 elements" in problem and "was 32 elements" in problem and "same program" in problem
    with pytest.raises(ValueError, match=r"capture.part.p2p_answers\[0\]' is not a recorded p2p stream"):
        Folding(capture_plan(plan, 4, 1, p2p_answers=[{"group": ["pp", [0, 4], 0], "src": 0}]))


def test_a_stand_in_s_recording_is_the_stream_a_capture_together_passes_through():
    """PP4 folded to stages 0, 1, 3 (stage 2 virtual, an identity stand-in together): rank 3's forward receive
    from virtual rank 2 is answered together by what rank 1 sent to rank 2; rank 1's backward receive from 2
    by what rank 3 sent to 2; a live neighbour's (rank 0 -> 1) is its own stream; a non-neighbour's (VPP's
    overlapped p2p over the world group) its own too. Norms scale, the direction is the seeded one."""
    from nccl_prune import recorded_stream

    ranks, sandbox = [0, 1, 2, 3], frozenset({0, 1, 3})
    assert recorded_stream(ranks, sandbox, 3, 2, +1) == (1, 2)
    assert recorded_stream(ranks, sandbox, 1, 2, -1) == (3, 2)
    assert recorded_stream(ranks, sandbox, 1, 0, +1) == (0, 1)
    assert recorded_stream(ranks, sandbox, 0, 3, 0) == (3, 0)
    with pytest.raises(PruneError, match="no live rank of the fold"):
        recorded_stream(ranks, frozenset({7}), 3, 2, +1)
    unit = standin_values(torch.float32, 100, norm=1.0)
    assert torch.allclose(standin_values(torch.float32, 100, norm=0.25), 0.25 * unit)
    assert torch.allclose(standin_values(torch.float32, 100, backward=True), unit)  # the fallback: norm 1
    assert float(standin_values(torch.bfloat16, 100, norm=3.0).float().norm()) == pytest.approx(3.0, rel=1e-2)
    assert torch.isinf(standin_values(torch.float32, 4, norm=float("inf"))).all()  # inf/NaN reach the checks
    with pytest.raises(PruneError, match=">= 0"):
        standin_values(torch.float32, 4, norm=-1.0)


def test_the_merged_line_counts_complete_captures_and_names_the_others():
    from prism_megatron.launcher.serial import merged_line

    caps = [{"rank": 0, "trace": Path("a"), "incomplete": None},
            {"rank": 16, "trace": Path("b"), "incomplete": "exited with code 1"},
            {"rank": 48, "trace": None, "incomplete": "not run: capture 2 failed first"}]
    line = merged_line(caps, Path("T"), [1.0, 2.0], [0.5])
    assert line.startswith("serial capture: merged 2 of 3 capture(s), 1 complete, into T (wall s per capture: "
                           "1.0, 2.0; again: 0.5)")
    assert "capture 2 (rank 16) incomplete: exited with code 1" in line
    assert "capture 3 (rank 48) not merged: not run: capture 2 failed first" in line
    ok = merged_line(caps[:1], Path("T"), [1.0])
    assert ok == "serial capture: merged 1 of 1 capture(s), 1 complete, into T (wall s per capture: 1.0)"


# ---- the merge -----------------------------------------------------------------------------------
def _op(rank: int, index: int, kind: str, group: int, seq: int, peer: int = -1) -> dict:
    return {"rank": rank, "index": index, "kind": kind, "group": group, "seq": seq, "peer": peer, "root": -1,
            "bytes": 64, "dtype": "torch.float32", "shapes": [[16]], "reduce_op": "sum" if peer < 0 else "",
            "async_op": False, "t_issue": 0.1 * index, "t_complete": 0.1 * index + 0.01, "compute_before": 0.05,
            "label": ""}


def _capture(path: Path, plan: dict, rank: int, index: int, groups: list[tuple[str, list[int]]], ops: list[dict],
             incomplete: str | None = None, marks: list[dict] | None = None) -> Path:
    part = capture_plan(plan, rank, index)
    counts = {"all_reduce": {"mirror": 1, "recorded": 0, "keep": 0, "passthrough": 0, "self_mirror": 2}}
    manifest = {"world_size": 8, "job": {"fold": {**part, "contributions": counts}, "argv": ["x"], "swap": rank},
                "groups": [{"id": i, "name": n, "ranks": r, "backend": "nccl"} for i, (n, r) in enumerate(groups)],
                "ranks": [{"rank": rank, "exit_code": 0, "device": "cpu"}]}
    return write_trace(path, manifest, ops=ops, incomplete=incomplete, marks=marks)


def test_the_merge_lines_groups_up_by_what_they_are_and_keeps_sequence_numbers(tmp_path):
    plan = _class_plan()
    # each capture declared its own groups in its own order: the ids differ, the groups do not
    a = _capture(tmp_path / "c0", plan, 0, 0, [("0", list(range(8))), ("7", [0, 4]), ("3", [0, 1])],
                 [_op(0, 0, "all_reduce", 2, 0), _op(0, 1, "all_reduce", 1, 0), _op(0, 2, "send", 1, 0, peer=4),
                  _op(0, 3, "all_reduce", 1, 1)])
    b = _capture(tmp_path / "c1", plan, 4, 1, [("0", list(range(8))), ("3", [4, 5]), ("7", [0, 4])],
                 [_op(4, 0, "all_reduce", 1, 0), _op(4, 1, "all_reduce", 2, 0), _op(4, 2, "recv", 2, 0, peer=0),
                  _op(4, 3, "all_reduce", 2, 1)])
    out = merge_captures(tmp_path / "merged", plan, [{"rank": 0, "trace": a, "incomplete": None},
                                                     {"rank": 4, "trace": b, "incomplete": None}])
    t = read_trace(out)
    assert t.incomplete is None and t.fold.live == (0, 4) and t.fold.rep == tuple(plan["rep"])
    assert [c.sandbox for c in t.fold.classes] == [(0,), (4,)]  # the plan as captured together
    groups = {g["id"]: (g["name"], tuple(g["ranks"])) for g in t.manifest["groups"]}
    assert sorted(groups.values()) == [("0", tuple(range(8))), ("3", (0, 1)), ("3", (4, 5)), ("7", (0, 4))]
    pp = {(o["rank"], o["index"]): (groups[o["group"]], o["seq"]) for o in t.ops.to_pylist()}
    assert pp[(0, 1)] == pp[(4, 1)] == (("7", (0, 4)), 0) and pp[(0, 3)] == pp[(4, 3)] == (("7", (0, 4)), 1)
    assert pp[(0, 2)] == pp[(4, 2)] == (("7", (0, 4)), 0)  # the send and its receive: one p2p pair's first
    assert t.fold.contributions == {"all_reduce": {"mirror": 2, "recorded": 0, "keep": 0, "passthrough": 0,
                                                   "self_mirror": 4}}
    cap = t.fold.capture
    assert cap["mode"] == "serial" and [(c["rank"], c["trace"], c["complete"]) for c in cap["captures"]] == [
        (0, "c0", True), (4, "c1", True)]
    assert t.manifest["job"]["argv"] == ["x"] and "swap" not in t.manifest["job"]  # what differs stays per capture
    assert [c["job"] for c in cap["captures"]] == [{"swap": 0}, {"swap": 4}]


def test_a_failed_capture_leaves_its_trace_and_the_merge_names_it(tmp_path):
    plan = _class_plan()
    a = _capture(tmp_path / "c0", plan, 0, 0, [("0", list(range(8)))], [_op(0, 0, "all_reduce", 0, 0)],
                 incomplete="rank 0 exited with code 1")
    out = merge_captures(tmp_path / "merged", plan, [
        {"rank": 0, "trace": a, "incomplete": "rank 0 exited with code 1"},
        {"rank": 4, "trace": None, "incomplete": "not run: capture 0 failed first"}])
    t = read_trace(out)
    assert t.incomplete == ("capture 1 of 2 (rank 0): rank 0 exited with code 1; capture 2 of 2 (rank 4): not run: "
                            "capture 0 failed first")
    assert [(c["rank"], c["complete"], c["trace"]) for c in t.fold.capture["captures"]] == [
        (0, False, "c0"), (4, False, "")]
    with pytest.raises(TraceFormatError, match=r"not the capture of rank 4"):  # a trace of another capture
        merge_captures(tmp_path / "m2", plan, [{"rank": 4, "trace": a, "incomplete": None},
                                               {"rank": 0, "trace": a, "incomplete": None}])


def _memory_mark(rank: int, peak: int) -> dict:
    attrs = {"allocated": peak, "reserved": peak, "max_allocated": peak, "max_reserved": peak, "cap": 1 << 30,
             "source": "cpu-accountant"}
    return {"rank": rank, "name": "memory", "phase": "i", "t": 1.0, "compute_clock": 1.0, "attrs": attrs}


def test_a_merge_with_an_incomplete_capture_is_not_replayed_and_the_report_says_which(tmp_path):
    """A serial run cut short (issue 20's Llama-3-70B run: capture 2 of 3 timed out, 3 not run): the other live
    ranks' p2p ops with the missing class have no partner. graph_from_trace refuses the merge naming the captures
    (it used to drop those ops as unmatched and fail later as a schedule error of a complete capture); the report
    says so plainly and still gives the memory the captures measured. The complete merge of the same captures
    keeps the p2p pair."""
    from prism_megatron.replay import IncompleteCaptureError, graph_from_trace
    from prism_megatron.replay.graph import Comm
    from prism_megatron.report.build import build_report

    plan = _class_plan()
    groups = [("0", list(range(8))), ("7", [0, 4])]
    a = _capture(tmp_path / "c0", plan, 0, 0, groups, [_op(0, 0, "all_reduce", 0, 0), _op(0, 1, "send", 1, 0, peer=4)],
                 marks=[_memory_mark(0, 3 << 20)])
    ops4 = [_op(4, 0, "all_reduce", 0, 0), _op(4, 1, "recv", 1, 0, peer=0)]
    cut = _capture(tmp_path / "c1", plan, 4, 1, groups, ops4[:1], incomplete="ended by SIGTERM",
                   marks=[_memory_mark(4, 1 << 20)])
    whole = _capture(tmp_path / "c1-whole", plan, 4, 1, groups, ops4, marks=[_memory_mark(4, 2 << 20)])

    both = [{"rank": 0, "trace": a, "incomplete": None}, {"rank": 4, "trace": whole, "incomplete": None}]
    complete = read_trace(merge_captures(tmp_path / "complete", plan, both))
    assert complete.fold.incomplete_captures() == []
    graph = graph_from_trace(complete)
    assert [e.kind for e in graph.events[0] if type(e) is Comm] == ["all_reduce", "send"]  # the pair is kept

    for name, second, said in (
            ("partial", {"rank": 4, "trace": cut, "incomplete": "ended by SIGTERM"},
             "capture 2 of 2 (rank 4, class last) incomplete: ended by SIGTERM"),
            ("missing", {"rank": 4, "trace": None, "incomplete": "not run: capture 1 failed first"},
             "capture 2 of 2 (rank 4, class last) not run: capture 1 failed first")):
        out = merge_captures(tmp_path / name, plan, [{"rank": 0, "trace": a, "incomplete": None}, second])
        trace = read_trace(out)
        assert [c.sentence for c in trace.fold.incomplete_captures()] == [said]
        with pytest.raises(IncompleteCaptureError, match=rf"{name}: {re.escape(said)}: a serially captured fold is "
                                                         "replayed only when all 2 of its captures completed"):
            graph_from_trace(trace)
        report = build_report(out)
        assert report["prediction"] is None
        why = report["prediction_error"]
        assert why.startswith(f"{said}: a serially captured fold is replayed only when all 2 "), why
        status = "incomplete" if second["trace"] else "not run"
        assert report["verdict"].startswith("fits: ")
        assert report["verdict"].endswith(f"; class(es) not measured in full: last (capture 2 of 2 {status})")
        peaks = {e["rank"]: e["max_allocated"] for e in report["memory"]["ranks"]}
        assert peaks == ({0: 3 << 20, 4: 1 << 20} if second["trace"] else {0: 3 << 20})


def _oom_mark(rank: int, reserved: int, requested: int) -> dict:
    attrs = {"allocated": reserved, "reserved": reserved, "max_allocated": reserved, "max_reserved": reserved,
             "cap": 1 << 30, "source": "cpu-accountant", "requested": requested, "message": "out of memory",
             "snapshot": None}
    return {"rank": rank, "name": "oom", "phase": "i", "t": 1.0, "compute_clock": 1.0, "attrs": attrs}


def test_the_report_of_a_serial_run_whose_classes_ran_out_of_memory_names_each_class(tmp_path):
    """Both captures of a merge ran out of memory under the cap (each class its own failing allocation): the
    verdict names each class's OOM, the worst first, and no class as "not measured in full"; no time prediction."""
    from prism_megatron.report.build import build_report

    plan = _class_plan()
    groups = [("0", list(range(8)))]
    why = "rank {} ran out of memory under the target's cap (predicted OOM)"
    a = _capture(tmp_path / "c0", plan, 0, 0, groups, [_op(0, 0, "all_reduce", 0, 0)], incomplete=why.format(0),
                 marks=[_oom_mark(0, 900 << 20, 200 << 20)])
    b = _capture(tmp_path / "c1", plan, 4, 1, groups, [_op(4, 0, "all_reduce", 0, 0)], incomplete=why.format(4),
                 marks=[_memory_mark(4, 1 << 20), _oom_mark(4, 1000 << 20, 300 << 20)])
    out = merge_captures(tmp_path / "merged", plan, [{"rank": 0, "trace": a, "incomplete": why.format(0)},
                                                     {"rank": 4, "trace": b, "incomplete": why.format(4)}])
    report = build_report(out)
    assert report["verdict"] == (
        "OOM: rank 4 (last) ran out of memory asking for 300.0 MiB with 1000.0 MiB allocated and 1000.0 MiB of its "
        "1.0 GiB cap reserved; rank 0 (first) ran out of memory asking for 200.0 MiB with 900.0 MiB allocated and "
        "900.0 MiB of its 1.0 GiB cap reserved")
    assert report["prediction"] is None and report["prediction_error"].startswith(
        "class(es) first, last ran out of memory under the target's cap (the verdict names each)")


# ---- a generic pipeline captured both ways -----------------------------------------------------
def _skeleton(trace) -> dict[int, list[tuple]]:
    """Per live rank, its ops as a capture together would give them: kind, bytes, group (name, ranks), seq, peer."""
    groups = {g["id"]: (g["name"], tuple(g["ranks"])) for g in trace.manifest["groups"]}
    return {r: [(o["kind"], o["bytes"], groups[o["group"]], o["seq"], o["peer"]) for o in trace.ops_for_rank(r)]
            for r in trace.fold.live}


def test_a_pipeline_captured_serially_issues_the_ops_of_the_capture_together(tmp_path):
    """fold_pipeline.py, 4 stages, stage 2 folded onto stage 1: captured together (0, 1 and 3 as processes) and
    serially (one at a time; each other stage's receives answered by stand-ins): the same ops with the
    same per-group sequence numbers, rank by rank. Its small reductions over the pipeline group (norms: a
    grad-norm-like sum of squares, a count, a found-inf flag) give every capture's final take what the capture
    together gives (RECORDED_REDUCTION_RULE), where self mirror would count each stage's own share 4 times."""
    fold = {**make_fold([0, 1, 1, 3], 8).to_json(), "layout": {"moe_layers": 0}}  # dense: auto would skip it
    base = dict(script=PROGRAMS / "fold_pipeline.py", world_size=4, hang_timeout=60, fold=fold)
    cfg = LaunchConfig(**base, script_args=[str(tmp_path / "r1"), "3", "norms"], trace_dir=tmp_path / "together")
    assert launch(cfg) == 0
    said: list[str] = []
    cfg = LaunchConfig(**base, script_args=[str(tmp_path / "r2"), "3", "norms"], trace_dir=tmp_path / "serial")
    assert capture_serially(cfg, launch, say=said.append, second="on") == 0
    together, serial = read_trace(tmp_path / "together"), read_trace(tmp_path / "serial")
    assert serial.fold.live == together.fold.live == (0, 1, 3) and serial.fold.rep == together.fold.rep
    assert _skeleton(serial) == _skeleton(together)
    assert serial.fold.capture_mode == "serial" and together.fold.capture_mode == "together"
    # every receive from a stage that was not a process in its capture got a stand-in: 3 per micro-batch
    # and stage (stage 0 backward, stage 1 forward and backward, stage 3 forward), none passed through
    recv = serial.fold.contributions["recv"]
    assert recv["standin"] == 4 * 3 and recv["passthrough"] == 0
    # each capture's latest take is merged (all are taken again below: capture 2 twice)
    assert [c["trace"] for c in serial.fold.capture["captures"]] == [
        f"serial.captures/capture-{i}-rank-{r}-take-{n}" for i, r, n in ((0, 0, 2), (1, 1, 3), (2, 3, 2))]
    for c in serial.fold.capture["captures"]:
        assert read_trace(tmp_path / c["trace"]).fold.live == (c["rank"],)
    assert any("serial capture 2/3: rank 1" in s for s in said) and captures_dir(tmp_path / "serial").is_dir()
    got = {r: torch.load(tmp_path / "r2" / f"rank-{r}.pt") for r in (0, 1, 3)}  # each rank's last capture
    assert all(torch.isfinite(x).all() for x in got[3]["fwd"])  # the last stage's inputs: stand-ins, finite
    # STANDIN_RULE: each stand-in has the norm of what the stream a capture together passes through carried, as
    # recorded by the capture that sent it: stage 1 adds 2000 going forward, stage 3 turns x into 2x + 40000,
    # stage 1 adds 20000 going backward; stage 0's micro-batch i is arange % 7 + 100 i, plus 1000
    norm = lambda x: float(x.double().norm())  # noqa: E731
    x0 = [(torch.arange(128 * 160) % 7).reshape(128, 160) + 100.0 * i + 1000.0 for i in range(3)]
    for i in range(3):
        assert norm(got[1]["fwd"][i]) == pytest.approx(norm(x0[i]), rel=1e-5)
        assert norm(got[3]["fwd"][i]) == pytest.approx(norm(got[1]["fwd"][i] + 2000.0), rel=1e-5)
        assert norm(got[1]["bwd"][i]) == pytest.approx(norm(2 * got[3]["fwd"][i] + 40000.0), rel=1e-5)
        assert norm(got[0]["bwd"][i]) == pytest.approx(norm(got[1]["bwd"][i] + 20000.0), rel=1e-5)
    # the reductions: together, stage 2 mirrors stage 1 (1.5 (1 + 2 * 4 + 16), 1 + 2 * 2 + 4, max 1); serially
    # each capture's final take the same, every member of another class answered from its recording
    want = torch.tensor([1.5 * (1 + 2 * 4 + 16), 1 + 2 * 2 + 4, 1.0], dtype=torch.float64)
    assert all(torch.equal(torch.load(tmp_path / "r1" / f"rank-{r}.pt")["norms"], want) for r in (0, 1, 3))
    assert {r: g["norms"].tolist() for r, g in got.items()} == dict.fromkeys((0, 1, 3), want.tolist())
    ways = serial.fold.contributions["all_reduce"]  # 3 ops per capture: 3 + 2 + 3 members of other classes
    assert ways["recorded"] == 3 * (3 + 2 + 3) and ways["self_mirror"] == 0, ways
    # SECOND_PASS_RULE: stages 0 and 1 had backward stand-ins without a recording in the first pass (their
    # senders are captured later): captured again, latest first; their second traces are the ones merged. The
    # first pass recorded stages 0 and 1's reductions after those stand-ins (derived: not used), so stages 1
    # and 3 are taken once more after that, first stage first, with the second takes' recordings
    assert [s.split(":")[0] for s in said if s.startswith("serial capture ") and "again:" in s] == [
        "serial capture 2/3 again", "serial capture 1/3 again", "serial capture 2/3 again", "serial capture 3/3 again"]
    assert "merged 3 of 3 capture(s), 3 complete" in said[-1]
    # the merged trace records it: captures 1, 2, 3 taken again, every merged capture's stand-ins and reductions
    # recorded
    record = serial.fold.capture
    assert record["second_pass"] == {"option": "on", "on": True, "why": "by --prism-fold-second-pass on", "moe": False}
    assert [(c.get("second_pass"), c["standins_unrecorded"], c["reductions_unrecorded"])
            for c in record["captures"]] == [("taken", 0, 0), ("taken", 0, 0), ("taken", 0, 0)]
    assert serial.fold.unrecorded_standins() == serial.fold.unrecorded_reductions() == ""


def test_a_capture_that_fails_stops_the_run_and_the_merged_trace_says_which(tmp_path):
    """fold_bad.py p2p: rank 0 sends to rank 2, virtual and not its neighbour: capture 1 (rank 0) is refused,
    capture 2 (rank 1) is not run; the merged trace is partial and names both."""
    cfg = LaunchConfig(script=PROGRAMS / "fold_bad.py", script_args=["p2p"], world_size=4, hang_timeout=60,
                       fold=make_fold([0, 1, 0, 1], 8).to_json(), trace_dir=tmp_path / "serial")
    said: list[str] = []
    assert capture_serially(cfg, launch, say=said.append) == BAD_INPUT
    t = read_trace(tmp_path / "serial")
    assert t.incomplete.startswith("capture 1 of 2 (rank 0): ") and "capture 2 of 2 (rank 1): not run" in t.incomplete
    first = read_trace(tmp_path / t.fold.capture["captures"][0]["trace"])  # the failed capture's own trace
    assert first.incomplete and first.fold.live == (0,)
    report = (tmp_path / "serial.captures" / "capture-0-rank-0.logs" / "fold-report.txt").read_text()
    assert "rank 0 sends to virtual rank 2" in report, report
    assert any("serial capture 1/2 (rank 0) failed" in s for s in said), said


# ---- broadcasts answered from an earlier capture ----------------------------------------------------
def _bcast_out(dtype: str, n: int) -> tuple:
    return (("r", n * torch.empty(0, dtype=P.dtype_from_name(dtype)).element_size()), dtype, [n])


def test_a_broadcast_from_another_class_is_answered_from_the_capture_that_rooted_it():
    """Megatron's do_train flags: rank 0 broadcasts them on the world group; a middle or last stage's capture
    must receive rank 0's values (self mirror would send its own, zeros on a stage without a data loader)."""
    plan = _class_plan()
    first = Folding(capture_plan(plan, 0, 0))
    world = _group(0, "world", list(range(8)), first)
    flags = torch.tensor([1, 0, 1], dtype=torch.int64)
    first.record_broadcast(world, 3, 0, flags, "int64")  # rank 0 roots it: recorded
    first.record_broadcast(world, 4, 5, flags, "int64")  # root 5 is the last stage's class: not this capture's
    tp = _group(1, "tp", [0, 1], first)
    first.record_broadcast(tp, 0, 0, flags, "int64")  # only this class's members: no later capture asks
    part = first.to_json()["capture"]["part"]
    assert [(b["group"], b["seq"], b["dtype"]) for b in part["broadcasts"]] == [(["world", list(range(8)), 0], 3,
                                                                                 "int64")]
    last = Folding(capture_plan(plan, 4, 1, part["broadcasts"]))
    world4 = _group(0, "world", list(range(8)), last)
    got, problem = last.broadcast_answer(world4, 3, 0, _bcast_out("int64", 3))
    assert problem is None and torch.equal(got, flags)
    last.count(world4, "broadcast", 0, False, recorded=(0,))
    assert last.contributions.to_json()["broadcast"]["recorded"] == 1
    got, problem = last.broadcast_answer(world4, 4, 0, _bcast_out("int64", 3))  # no recording of seq 4
    assert got is None and "integer values steer the program" in problem and "class's live rank 0" in problem
    assert last.broadcast_answer(world4, 4, 0, _bcast_out("float32", 3)) == (None, None)  # data: self mirror
    assert last.broadcast_answer(world4, 3, 4, _bcast_out("int64", 3)) == (None, None)  # its own root
    got, problem = last.broadcast_answer(world4, 3, 0, _bcast_out("int64", 4))
    assert got is None and "do not run the same program" in problem
    got, problem = first.broadcast_answer(world, 9, 4, _bcast_out("int32", 1))  # the last stage is captured later
    assert got is None and "captured after this one" in problem
    with pytest.raises(ValueError, match=r"capture.part.answers\[0\]' is not a recorded broadcast"):
        Folding(capture_plan(plan, 4, 1, [{"group": ["world"], "seq": 3}]))


def test_a_small_reduction_over_another_class_is_answered_from_that_class_s_capture():
    """RECORDED_REDUCTION_RULE in the coordinator: the model-parallel group [0, 1, 4, 5] of TP2·PP2·DP2. Rank 0's
    capture records its grad-norm square (nothing to answer from yet: counted unrecorded); rank 4's capture answers
    ranks 0 and 1 from it (recorded), rank 5 by mirror; a derived recording (made after a stand-in without a
    norm) is not used; a recording that does not fit is refused by name; larger or non-reducing ops are left."""
    plan = _class_plan()
    first = Folding(capture_plan(plan, 0, 0))
    mp = _group(0, "mp", [0, 1, 4, 5], first)
    tp = _group(1, "tp", [0, 1], first)
    sq = [torch.tensor([0.25])]
    assert first.reduction(mp, 7, "all_reduce", sq) == ({}, None) and first.reductions_unrecorded == 1
    assert first.reduction(tp, 7, "all_reduce", sq) == ({}, None)  # one class: neither recorded nor counted
    assert first.reduction(mp, 8, "all_gather", sq) == ({}, None)  # a gather: self mirror
    assert first.reduction(mp, 9, "all_reduce", [torch.zeros(RECORD_MAX_BYTES // 4 + 1)]) == ({}, None)  # too big
    first.passthrough._derived[True] = True  # a backward stand-in fell back: what follows is derived
    first.reduction(mp, 10, "all_reduce", sq)
    part = first.to_json()["capture"]["part"]
    assert [(r["seq"], r["rank"], r["kind"], r["derived"]) for r in part["reductions"]] == [
        (7, 0, "all_reduce", False), (10, 0, "all_reduce", True)]
    assert part["reductions_unrecorded"] == 2
    last = Folding(capture_plan(plan, 4, 1, reduction_answers=part["reductions"]))
    mp4 = _group(0, "mp", [0, 1, 4, 5], last)
    got, problem = last.reduction(mp4, 7, "all_reduce", [torch.tensor([1.0])])
    assert problem is None and set(got) == {0, 1} and all(torch.equal(got[q][0], sq[0]) for q in got)
    last.count(mp4, "all_reduce", None, False, recorded=tuple(sorted(got)))
    assert last.contributions.to_json()["all_reduce"] == {"mirror": 1, "recorded": 2, "keep": 0, "passthrough": 0,
                                                          "self_mirror": 0}
    assert last.reduction(mp4, 10, "all_reduce", [torch.tensor([1.0])]) == ({}, None)  # derived: self mirror
    assert last.reductions_unrecorded == 1
    _, problem = last.reduction(mp4, 7, "all_reduce", [torch.tensor([1.0, 2.0])])
    assert "do not run the same program" in problem and "rank 0" in problem
    _, problem = last.reduction(mp4, 7, "reduce", [torch.tensor([1.0])])
    assert "recorded op #7 of this group as all_reduce, this capture issues reduce" in problem
    # the rank leaves such an op to the coordinator (local_fold), and the coordinator refuses one answered there
    lone = local_fold.lone_plan([0, 1, 4, 5], [4] * 8, 2)
    assert local_fold.records(lone, plan["rep"]) and not local_fold.records(lone, None)
    one = [torch.tensor([1.0])]
    assert not local_fold.answerable(lone, "all_reduce", one, [torch.empty(1)], {}, records=True)
    assert local_fold.answerable(lone, "all_reduce", one, [torch.empty(1)], {}, records=False)
    big = [torch.zeros(RECORD_MAX_BYTES // 4 + 1)]
    assert local_fold.answerable(lone, "all_reduce", big, [torch.empty_like(big[0])], {}, records=True)
    msg = {"kind": "all_reduce", "ins": [(("i", b"\0" * 4), "float32", [1])]}
    assert "RECORDED_REDUCTION_RULE" in last.answered_in_rank(mp4, msg)
    with pytest.raises(ValueError, match=r"capture.part.reduction_answers\[0\]' is not a recorded reduction"):
        Folding(capture_plan(plan, 4, 1, reduction_answers=[{"group": ["mp", [0], 0], "seq": 1}]))


def test_a_merged_trace_says_which_captures_kept_reductions_without_a_recording(tmp_path):
    plan = _class_plan()
    captures = [{"rank": 0, "trace": "a", "complete": True, "incomplete": None, "reductions_unrecorded": 3},
                {"rank": 4, "trace": "b", "complete": True, "incomplete": None, "reductions_unrecorded": 0}]
    merged = {**plan, "capture": {"mode": "serial", "rules": {"collectives": "self_mirror", "p2p": "standin"},
                                  "captures": captures}}
    fold = parse_fold(merged, 8, "t")
    assert fold.unrecorded_reductions().startswith("capture 1 (3) answered reductions over another class's members "
                                                   "by self mirror")
    captures[1]["reductions_unrecorded"] = -1
    with pytest.raises(TraceFormatError, match=r"capture.captures\[1\].reductions_unrecorded' is -1"):
        parse_fold(merged, 8, "t")


def test_a_capture_whose_rank_ran_no_iteration_fails_the_serial_run_by_name(tmp_path):
    """Captures that each end with code 0, the second with no iteration: the run fails, the merged trace says
    which capture ran none."""
    plan = _class_plan()

    def fake_launch(cfg: LaunchConfig) -> int:
        part = cfg.fold["capture"]["part"]
        rank, iters = part["rank"], 2 if part["index"] == 0 else 0
        marks = [{"rank": rank, "name": "iteration", "phase": p, "t": 0.1 * i, "compute_clock": 0.0, "attrs": {}}
                 for i in range(iters) for p in ("B", "E")]
        manifest = {"world_size": 8, "job": {"fold": {**cfg.fold, "contributions": {}}},
                    "groups": [{"id": 0, "name": "0", "ranks": list(range(8)), "backend": "nccl"}],
                    "ranks": [{"rank": rank, "exit_code": 0, "device": "cpu"}]}
        write_trace(cfg.trace_dir, manifest, ops=[_op(rank, 0, "all_reduce", 0, 0)], marks=marks)
        return 0

    said: list[str] = []
    cfg = LaunchConfig(script=PROGRAMS / "fold_pipeline.py", world_size=8, fold=plan, trace_dir=tmp_path / "serial")
    assert capture_serially(cfg, fake_launch, say=said.append) == RANK_FAILED
    t = read_trace(tmp_path / "serial")
    assert t.incomplete == "capture 2 of 2 (rank 4): rank 4 ran no iteration (capture 1, rank 0, ran 2): its " \
                           "program ended early"
    assert [c["complete"] for c in t.fold.capture["captures"]] == [True, False]
    assert any("serial capture 2/2 (rank 4) failed" in s for s in said), said


# ---- --prism-fold-second-pass: the second pass where the stand-ins' norms change what prism predicts -----------
def _fake_serial_run(tmp_path: Path, plan: dict, mode: str, part: Callable[[int, int], dict],
                     ops: Callable[[int, int], list[dict]]) -> tuple[list[int], list[str], object]:
    """A fake serial run of ``plan`` under ``--prism-fold-second-pass mode``: each take of capture I (rank L) records
    ``part(L, take)`` in its trace's capture part (its unrecorded counts) and issues ``ops(L, take)``, over one
    iteration. Returns the capture indices launched, what was said and the merged trace."""
    launched: list[int] = []

    def fake_launch(cfg: LaunchConfig) -> int:
        own = cfg.fold["capture"]["part"]
        rank, take = own["rank"], launched.count(own["index"]) + 1
        launched.append(own["index"])
        marks = [{"rank": rank, "name": "iteration", "phase": p, "t": 0.1, "compute_clock": 0.0, "attrs": {}}
                 for p in ("B", "E")]
        fold = {**cfg.fold, "contributions": {}}
        fold["capture"] = {**fold["capture"], "part": {**own, **part(rank, take)}}
        manifest = {"world_size": 8, "job": {"fold": fold},
                    "groups": [{"id": 0, "name": "0", "ranks": list(range(8)), "backend": "nccl"}],
                    "ranks": [{"rank": rank, "exit_code": 0, "device": "cpu"}]}
        write_trace(cfg.trace_dir, manifest, ops=ops(rank, take), marks=marks)
        return 0

    said: list[str] = []
    cfg = LaunchConfig(script=PROGRAMS / "fold_pipeline.py", world_size=8, fold=plan, trace_dir=tmp_path / mode)
    assert capture_serially(cfg, fake_launch, say=said.append, second=mode) == 0
    return launched, said, read_trace(tmp_path / mode)


def _second_pass_run(tmp_path: Path, moe_layers: int | None, mode: str,
                     last: int = 0) -> tuple[list[int], list[str], object]:
    """_class_plan (its layout's moe_layers, None: the plan does not say): capture 1 (rank 0) gives 3 stand-ins no
    recording in its first take, none in a second; capture 2 (rank 4) ``last``."""
    plan = _class_plan() | ({} if moe_layers is None else {"layout": {"moe_layers": moe_layers}})
    return _fake_serial_run(tmp_path, plan, mode,
                            lambda rank, take: {"standins_unrecorded": (3 if take == 1 else 0) if rank == 0 else last},
                            lambda rank, take: [_op(rank, 0, "all_reduce", 0, 0)])


def test_auto_skips_the_second_pass_for_a_dense_fold_and_says_so_in_the_line_trace_and_report(tmp_path):
    from prism_megatron.report.build import provenance

    launched, said, t = _second_pass_run(tmp_path, 0, "auto")
    assert launched == [0, 1]  # 2 captures, not 3
    dense = ("second pass off for a dense fold: the grad norms and losses they log are not the job's; time and "
             "memory do not depend on them")
    assert f"serial capture: capture(s) 1 not captured again: {dense} (nccl_prune.SECOND_PASS_RULE)" in said, said
    record = t.fold.capture
    assert record["second_pass"] == {"option": "auto", "on": False, "why": "for a dense fold", "moe": False}
    assert [(c.get("second_pass"), c["standins_unrecorded"]) for c in record["captures"]] == [("skipped", 3), (None, 0)]
    assert f"; capture 1 kept stand-ins without a recorded norm ({dense}))" in provenance(None, fold=t.fold)


def test_the_second_pass_is_taken_for_moe_and_where_the_plan_does_not_say_and_off_never(tmp_path):
    from prism_megatron.report.build import provenance

    for layers, mode, launched_then, why in ((2, "auto", [0, 1, 0], "for a fold with MoE layers"),
                                             (None, "auto", [0, 1, 0], "where the fold plan does not say"),
                                             (0, "on", [0, 1, 0], "by --prism-fold-second-pass on")):
        launched, said, t = _second_pass_run(tmp_path / f"{layers}", layers, mode)
        assert launched == launched_then
        assert any(s.startswith("serial capture 1/2: 3 stand-in(s)") and why in s for s in said), said
        assert [c.get("second_pass") for c in t.fold.capture["captures"]] == ["taken", None]
        assert t.fold.unrecorded_standins() == "" and "kept stand-ins" not in provenance(None, fold=t.fold)
    # the last capture has no later one to record its senders: kept, said, whatever the option
    launched, said, t = _second_pass_run(tmp_path / "last", 2, "auto", last=2)
    assert launched == [0, 1, 0] and t.fold.unrecorded_standins() == (
        "capture 2 kept stand-ins without a recorded norm (no capture recorded their senders' norms: the grad norms "
        "and losses they log are not the job's)")
    launched, said, t = _second_pass_run(tmp_path / "off", 2, "off")
    assert launched == [0, 1] and t.fold.capture["second_pass"]["moe"] is True
    assert t.fold.unrecorded_standins() == (
        "capture 1 kept stand-ins without a recorded norm (second pass off by --prism-fold-second-pass off: the grad "
        "norms and losses they log are not the job's; nor, through MoE routing, are their tokens per expert, hence "
        "time and memory)")
    with pytest.raises(ValueError, match="--prism-fold-second-pass must be one of auto, on, off, got 'sometimes'"):
        capture_serially(LaunchConfig(script=PROGRAMS / "fold_pipeline.py", world_size=8, fold=_class_plan()),
                         launch, second="sometimes")


def _routed_run(tmp_path: Path, mode: str, splits_by_take: dict[int, str]) -> tuple[list[int], list[str], object]:
    """_class_plan with MoE layers: capture 1 (rank 0) gives 3 stand-ins no recording in its first take, capture 2
    (rank 4) 2 reductions no recording in its first; each take issues one all-to-all whose split sizes are
    ``splits_by_take`` of its take number (the routing)."""
    return _fake_serial_run(
        tmp_path, _class_plan() | {"layout": {"moe_layers": 2}}, mode,
        lambda rank, take: {"standins_unrecorded": 3 if take == 1 and rank == 0 else 0,
                            "reductions_unrecorded": 2 if take == 1 and rank == 4 else 0},
        lambda rank, take: [_op(rank, 0, "all_reduce", 0, 0),
                            {**_op(rank, 1, "all_to_all", 0, 1), "splits": splits_by_take[take]}])


def test_auto_stops_the_second_pass_where_a_take_again_routed_every_token_alike_and_on_does_not(tmp_path):
    """The first take again that routed as its take before did ends auto's second pass: the capture it would still
    take (capture 2, for its reductions) is skipped, said and recorded, with why time and memory do not depend on
    it; a take that routed differently, or --prism-fold-second-pass on, goes on to every take."""
    from prism_megatron.report.build import provenance
    from prism_megatron.trace.takes import routing_change

    alike = {1: "[[64, 0], [32, 32]]", 2: "[[64, 0], [32, 32]]", 3: "[[64, 0], [32, 32]]"}
    launched, said, t = _routed_run(tmp_path / "alike", "auto", alike)
    assert launched == [0, 1, 0]  # capture 2 is not taken again for its reductions
    assert any(s.startswith("serial capture 1/2: taken again, it routed every token as its take before did")
               for s in said), said
    why = "after capture 1, taken again, routed every token alike"
    assert t.fold.capture["second_pass"] == {"option": "auto", "on": False, "why": why, "moe": True, "unchanged": 1}
    assert [c.get("second_pass") for c in t.fold.capture["captures"]] == ["taken", "skipped"]
    skipped = (f"second pass off {why}: the grad norms and losses they log are not the job's; time and memory do "
               "not depend on them")
    assert f"serial capture: capture(s) 2 not captured again: {skipped} (nccl_prune.SECOND_PASS_RULE)" in said, said
    assert "capture 2 (2) answered reductions over another class's members by self mirror" in provenance(
        None, fold=t.fold)
    moved = {1: "[[64, 0], [32, 32]]", 2: "[[32, 32], [32, 32]]", 3: "[[32, 32], [32, 32]]"}
    launched, said, t = _routed_run(tmp_path / "moved", "auto", moved)
    assert launched == [0, 1, 0, 1]
    assert "serial capture 1/2, taken again: 1 of 1 all-to-alls routed differently (the first: #1); the second " \
           "pass goes on" in said, said
    assert t.fold.capture["second_pass"]["on"] and "unchanged" not in t.fold.capture["second_pass"]
    assert [c.get("second_pass") for c in t.fold.capture["captures"]] == ["taken", "taken"]
    launched, said, t = _routed_run(tmp_path / "on", "on", alike)
    assert launched == [0, 1, 0, 1] and not any("routed every token" in s for s in said)
    # the comparison itself: a take that did not complete, or recorded no split sizes, cannot tell
    root = tmp_path / "alike" / "auto.captures"
    assert routing_change(root / "capture-0-rank-0", root / "capture-0-rank-0-take-2", 0) is None
    assert routing_change(root / "capture-0-rank-0", root / "capture-1-rank-4", 0) == (
        "no all-to-all recorded its split sizes: the routing cannot be compared")
    # a merged record whose 'unchanged' names no capture is refused by name
    bad = {**t.fold.capture["second_pass"], "unchanged": 3}
    doc = {**t.fold.to_json(), "capture": {**t.fold.capture, "second_pass": bad}}
    with pytest.raises(TraceFormatError, match=r"capture.second_pass.*optionally 'unchanged': a capture number"):
        parse_fold(doc, 8, "t")


def test_the_second_pass_option_is_refused_with_a_bad_value_and_old_traces_read_without_its_record(tmp_path):
    from prism_megatron.megatron.run import RunError, parse_run_args

    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(RunError, match="invalid choice: 'sometimes'.*'auto', 'on', 'off'"):
        parse_run_args(["--prism-emulate", "--prism-world-size", "2", str(script), "--prism-fold-second-pass",
                        "sometimes"])
    plan = _class_plan()
    groups = [("0", list(range(8)))]
    caps = [{"rank": r, "trace": _capture(tmp_path / f"c{r}", plan, r, i, groups, [_op(r, 0, "all_reduce", 0, 0)]),
             "incomplete": None} for i, r in enumerate((0, 4))]
    old = read_trace(merge_captures(tmp_path / "old", plan, caps))  # a merge before the record: nothing said
    assert "second_pass" not in old.fold.capture and old.fold.unrecorded_standins() == ""
    with pytest.raises(TraceFormatError, match=r"capture.captures\[0\].second_pass.*expected one of taken, skipped"):
        read_trace(merge_captures(tmp_path / "bad", plan, [{**caps[0], "second_pass": "maybe"}, caps[1]]))


# ---- a capture that runs out of memory under the target's cap: a verdict, the later captures run ------------
def _oom_run(tmp_path: Path, mode: str) -> tuple[int, list[str], LaunchConfig]:
    """fold_oom.py under a 4 MiB cap: the even class (rank 0) keeps 8 MiB per iteration, the odd one 64 KiB."""
    from prism_megatron.memory.targets import resolve_target

    cfg = LaunchConfig(script=PROGRAMS / "fold_oom.py", script_args=[mode], world_size=4, hang_timeout=60,
                       fold=make_fold([0, 1, 0, 1], 8).to_json(), trace_dir=tmp_path / "serial",
                       target_gpu=resolve_target("0.004", 0).as_dict())
    said: list[str] = []
    return capture_serially(cfg, launch, say=said.append), said, cfg


def test_a_capture_that_runs_out_of_memory_is_its_class_verdict_and_the_later_captures_run(tmp_path):
    """Issue 20's per-class verdict: capture 1 (rank 0) runs out of memory under the cap in iteration 1, after the
    set-up broadcast it recorded; capture 2 (rank 1) still runs with that recording and fits. The run exits OOM as a
    run together with a predicted OOM does; the merged report names rank 0's failing allocation and rank 1's peak,
    and gives no time prediction, saying why."""
    from prism_megatron.report.build import build_report

    code, said, cfg = _oom_run(tmp_path, "oom")
    assert code == OOM, said
    assert any("serial capture 1/2 (rank 0, class like rank 0) ran out of memory under the target's cap: predicted "
               "OOM for its class; the later captures run" in s for s in said), said
    t = read_trace(tmp_path / "serial")
    assert [(c["rank"], c["complete"], bool(c["trace"])) for c in t.fold.capture["captures"]] == [
        (0, False, True), (1, True, True)]
    assert "predicted OOM" in t.fold.capture["captures"][0]["incomplete"]
    first = read_trace(tmp_path / t.fold.capture["captures"][0]["trace"])
    assert [b["group"][0] for b in first.fold.capture["part"]["broadcasts"]] == ["0"]  # recorded before its OOM
    assert t.fold.contributions["broadcast"]["recorded"] == 1  # capture 2 was answered from it
    assert sum(1 for m in t.marks.to_pylist() if m["rank"] == 1 and m["name"] == "iteration" and m["phase"] == "E") == 2

    # capture 2's coordinator was started while capture 1 ran; none waits once the captures are done
    from prism_megatron.launcher import coordinator_ahead

    logs = sorted((tmp_path / "serial.captures").glob("capture-*.logs"))
    assert [("started ahead of its job" in (d / "coordinator.log").read_text()) for d in logs] == [False, True]
    assert coordinator_ahead._spare is None and not coordinator_ahead._ahead

    report = build_report(tmp_path / "serial")
    cap = cfg.memory_cap
    [oom] = report["oom"]
    assert (oom["rank"], oom["class"], oom["requested"], oom["cap"]) == (0, "like rank 0", 8 << 20, cap)
    assert oom["reserved"] < oom["requested"]  # the failed allocation is not counted as held
    peak = {e["rank"]: e for e in report["memory"]["ranks"]}
    assert peak[0]["oom"] and not peak[1]["oom"] and 2 * (64 << 10) <= peak[1]["max_reserved"] < cap
    last = next(c for c in report["memory"]["classes"] if c["class"] == "like rank 1")
    # the failing allocation's site: the script's own line, no frame of torch, the accountant or the launcher
    line = 1 + (PROGRAMS / "fold_oom.py").read_text().splitlines().index(
        "        kept.append(torch.ones((8 * MiB if r % 2 == 0 else 64 * 1024) // 4))")
    assert oom["where"] == [f"fold_oom.py:{line} (<module>)"]
    assert report["verdict"] == (
        f"OOM: rank 0 (like rank 0) ran out of memory on 0.004 GiB asking for 8.0 MiB at fold_oom.py:{line} "
        f"(<module>) with {fmt_bytes(oom['allocated'])} allocated and {fmt_bytes(oom['reserved'])} of its "
        f"{fmt_bytes(cap)} cap reserved; class(es) that fit: like rank 1 (peak reserved "
        f"{fmt_bytes(last['max_reserved'])}, headroom {fmt_bytes(last['headroom'])})")
    assert report["prediction"] is None
    assert report["prediction_error"].startswith("class(es) like rank 0 ran out of memory under the target's cap "
                                                 "(the verdict names each): the job does not run on the target, so "
                                                 "there is no iteration time to predict"), report["prediction_error"]


def test_a_capture_that_runs_out_of_memory_before_a_broadcast_it_roots_leaves_a_later_capture_refused_by_name(tmp_path):
    """Rank 0 runs out of memory before its set-up broadcast: nothing recorded; capture 2 runs, reaches that
    broadcast and is refused by name, which stops the run with its own exit code."""
    code, said, _ = _oom_run(tmp_path, "early")
    assert code == BAD_INPUT, said
    t = read_trace(tmp_path / "serial")
    assert [c["complete"] for c in t.fold.capture["captures"]] == [False, False]
    report = (tmp_path / "serial.captures" / "capture-1-rank-1.logs" / "fold-report.txt").read_text()
    assert "broadcast of int64 from virtual rank 0, whose class's live rank 0 recorded no such broadcast" in report
    assert any("serial capture 2/2 (rank 1) failed" in s for s in said), said


def test_a_crash_in_a_capture_under_a_cap_still_stops_the_run(tmp_path):
    code, said, _ = _oom_run(tmp_path, "crash")
    assert code == RANK_FAILED, said
    t = read_trace(tmp_path / "serial")
    assert [(c["complete"], c["incomplete"]) for c in t.fold.capture["captures"]][1] == (
        False, "not run: capture 1 failed first")
    assert any("serial capture 1/2 (rank 0) failed" in s and "later captures are not run" in s for s in said), said


# ---- --prism-fold-resume: a serial run cut short is resumed without its finished captures ---------------------
def test_a_resumed_serial_run_captures_only_what_the_earlier_run_left_unfinished(tmp_path):
    """fold_pipeline.py captured serially, cut before its third capture (as a time limit cuts it); resumed, only
    the third runs, given the recordings the reused two made (its stand-ins are those of a run from scratch,
    value for value), and the merged trace is that of a run from scratch, each reused capture marked."""
    fold = {**make_fold([0, 1, 1, 3], 8).to_json(), "layout": {"moe_layers": 0}}
    base = dict(script=PROGRAMS / "fold_pipeline.py", world_size=4, hang_timeout=60, fold=fold)

    def cut(cfg: LaunchConfig) -> int:  # the third capture never starts: the run is stopped first
        return 143 if cfg.fold["capture"]["part"]["index"] == 2 else launch(cfg)

    cfg = LaunchConfig(**base, script_args=[str(tmp_path / "r"), "3", "norms"], trace_dir=tmp_path / "serial")
    said: list[str] = []
    assert capture_serially(cfg, cut, say=said.append, second="off") == 143
    assert read_trace(tmp_path / "serial").incomplete.startswith("capture 3 of 3 (rank 3): exited with code 143")
    first_run = json.loads((tmp_path / "serial.captures" / "capture-0-rank-0" / "manifest.json").read_text())["job"]

    launched: list[int] = []

    def counted(cfg: LaunchConfig) -> int:
        launched.append(cfg.fold["capture"]["part"]["index"])
        return launch(cfg)

    # the same command, but for where its trace goes and how long a hang may last (RESUME_IGNORES)
    again = LaunchConfig(**{**base, "hang_timeout": 90}, script_args=[str(tmp_path / "r"), "3", "norms"],
                         trace_dir=tmp_path / "serial")
    said = []
    assert capture_serially(again, counted, say=said.append, second="off", resume=True) == 0
    assert launched == [2], said
    for i, r in ((0, 0), (1, 1)):
        left = f"reused the trace an earlier run of this job left in {tmp_path}/serial.captures/capture-{i}-rank-{r} ("
        assert any(s.startswith(f"serial capture {i + 1}/3: rank {r} (class ") and left in s for s in said), said
    assert "reused from an earlier run: capture(s) 1, 2" in said[-1] and "3 complete" in said[-1]
    resumed = read_trace(tmp_path / "serial")
    assert resumed.incomplete is None
    record = resumed.fold.capture["captures"]
    assert [c.get("reused") for c in record] == [True, True, None]
    assert record[0]["job"]["job_id"] == first_run["job_id"] != record[2]["job"]["job_id"]
    from prism_megatron.report.build import provenance

    assert ("; captures 1, 2 reused from an earlier run of the same job on the same machine and software "
            "(--prism-fold-resume))") in provenance(None, fold=resumed.fold)

    scratch = LaunchConfig(**base, script_args=[str(tmp_path / "s"), "3", "norms"], trace_dir=tmp_path / "scratch")
    assert capture_serially(scratch, launch, say=[].append, second="off") == 0
    assert _skeleton(resumed) == _skeleton(read_trace(tmp_path / "scratch"))
    got, want = torch.load(tmp_path / "r" / "rank-3.pt"), torch.load(tmp_path / "s" / "rank-3.pt")
    assert all(torch.equal(a, b) for a, b in zip(got["fwd"], want["fwd"], strict=True)) and len(got["fwd"]) == 3
    assert torch.equal(got["norms"], want["norms"])


def _resume_run(tmp_path: Path, args: list[str], resume: bool, outcome: dict[int, str] | None = None,
                **changes) -> tuple[list[int], list[str], int]:
    """A fake serial run of _class_plan whose captures write the job record a launch writes; ``outcome``: capture
    index -> "oom" (its rank's predicted OOM) or "incomplete". Returns the captures launched, what was said and
    the exit code."""
    from prism_megatron.launcher.launch import job_record

    launched: list[int] = []

    def fake_launch(cfg: LaunchConfig) -> int:
        part = cfg.fold["capture"]["part"]
        rank, how = part["rank"], (outcome or {}).get(part["index"])
        launched.append(part["index"])
        marks = [{"rank": rank, "name": "iteration", "phase": p, "t": 0.1, "compute_clock": 0.0, "attrs": {}}
                 for p in ("B", "E")]
        code = OOM if how == "oom" else 0
        manifest = {"world_size": 8, "job": {**job_record(cfg), "job_id": "j", "wall_time_s": 2.5,
                                             "fold": {**cfg.fold, "contributions": {}}},
                    "groups": [{"id": 0, "name": "0", "ranks": list(range(8)), "backend": "nccl"}],
                    "ranks": [{"rank": rank, "exit_code": code, "device": "cpu"}]}
        write_trace(cfg.trace_dir, manifest, ops=[_op(rank, 0, "all_reduce", 0, 0)], marks=marks,
                    incomplete={"oom": "rank ran out of memory under the target's cap (predicted OOM)",
                                "incomplete": "ended by SIGTERM"}.get(how))
        return code

    said: list[str] = []
    cfg = LaunchConfig(script=PROGRAMS / "fold_pipeline.py", world_size=8, fold=_class_plan(), script_args=args,
                       trace_dir=tmp_path / "serial", **changes).validate()
    code = capture_serially(cfg, fake_launch, say=said.append, second="off", resume=resume)
    return launched, said, code


def test_resume_reuses_only_a_finished_capture_of_the_same_job_and_says_why_not(tmp_path):
    args = ["a", "--prism-trace-dir", "T1", "--lr", "1"]
    assert _resume_run(tmp_path, args, False, {1: "oom"})[0] == [0, 1]
    # where the trace goes is not what runs; a predicted OOM is its class's verdict: both reused, the OOM kept
    launched, said, code = _resume_run(tmp_path, ["a", "--prism-trace-dir=T2", "--lr", "1", "--prism-fold-resume"],
                                       True)
    assert (launched, code) == ([], OOM), said
    assert any("serial capture 2/2 (rank 4, class last) ran out of memory under the target's cap" in s for s in said)
    # another flag value: another job, captured again, the difference named
    launched, said, _ = _resume_run(tmp_path, ["a", "--prism-trace-dir", "T1", "--lr", "2"], True)
    assert launched == [0, 1]
    assert any(s.startswith("serial capture 1/2: rank 0 (class first): the trace in ") and s.endswith(
        "is not reused: its job's 'args' differs ([\"a\", \"--lr\", \"1\"] there, [\"a\", \"--lr\", \"2\"] here)")
        for s in said), said
    # without --prism-fold-resume nothing is reused; a capture that did not finish is taken again under it
    assert _resume_run(tmp_path, args, False, {1: "incomplete"})[0] == [0, 1]
    launched, said, _ = _resume_run(tmp_path, args, True)
    assert launched == [1] and any("is not reused: it did not complete (ended by SIGTERM)" in s for s in said), said
    # another machine or software (here: the slots per device a capture ran with) is not the same capture
    launched, said, _ = _resume_run(tmp_path, args, True, slots_per_device=2)
    assert launched == [0, 1] and any("its job's 'slots_per_device' differs (1 there, 2 here)" in s for s in said)


def test_a_take_of_a_capture_reads_as_the_same_only_with_the_same_recordings_it_was_given(tmp_path):
    """The plan a capture is given includes the recordings of the captures before it: a trace made with other
    recordings (another take) is not that capture's."""
    from prism_megatron.launcher.serial import resumable

    _resume_run(tmp_path, ["a"], False)
    cfg = LaunchConfig(script=PROGRAMS / "fold_pipeline.py", world_size=8, script_args=["a"]).validate()
    part = tmp_path / "serial.captures" / "capture-1-rank-4"
    same = dataclasses.replace(cfg, fold=capture_plan(_class_plan(), 4, 1), trace_dir=part)
    assert resumable(part, same) == (0, 2.5)
    answer = {"group": ["0", [0, 4], 0], "seq": 0, "src": 0, "dst": 4, "norm": 3.0}
    other = dataclasses.replace(same, fold=capture_plan(_class_plan(), 4, 1, p2p_answers=[answer]))
    assert resumable(part, other) == "its capture plan's 'capture' differs (given other recordings, or another fold)"
    (part / "manifest.json").write_text("{")
    assert resumable(part, same).startswith(f"{part / 'manifest.json'} cannot be read as a capture's manifest (")
