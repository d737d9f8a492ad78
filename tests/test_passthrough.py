"""p2p with a virtual pipeline neighbour: the pass-through rule (nccl_prune.passthrough) and the
coordinator's streams (runtime.passthrough) — which live send answers which live receive, when a
send's data are kept and that they are freed once received, and the refusals."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from nccl_prune import Contributions, PruneError, plan_group, route_recv, route_send
from nccl_prune.contributions import HOWS
from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.groups import Group
from prism_megatron.runtime.matching import Member
from prism_megatron.runtime.passthrough import PassThrough


def test_the_nearest_live_rank_upstream_answers_in_both_directions():
    plan = plan_group([0, 1, 2, 3], [0, 1, 1, 3])  # stage 2 virtual (mirrors stage 1)
    fwd = route_recv(plan, 3, 2)
    assert (fwd.stream, fwd.consumer, fwd.direction) == ((1, 2), 3, "forward")
    bwd = route_recv(plan, 1, 2)
    assert (bwd.stream, bwd.consumer, bwd.direction) == ((3, 2), 1, "backward")
    assert route_send(plan, 1, 2).stream == (1, 2) and route_send(plan, 1, 2).consumer == 3
    assert route_send(plan, 3, 2).stream == (3, 2) and route_send(plan, 3, 2).consumer == 1


def test_a_run_of_virtual_stages_and_a_ring():
    rep = [0, 1, 1, 1, 1, 5]  # stages 2-4 virtual: 1 -> [2, 3, 4] -> 5
    plan = plan_group(range(6), rep)
    assert route_recv(plan, 5, 4).stream == (1, 2) and route_send(plan, 1, 2).consumer == 5
    assert route_recv(plan, 1, 2).stream == (5, 4) and route_send(plan, 5, 4).consumer == 1
    # a ring (interleaved pipeline): the last position's forward neighbour is the first
    ring = plan_group([10, 11, 12, 13], _rep({13: 12}))
    r = route_recv(ring, 0, 3)  # rank 10 receives from virtual 13, just before it on the ring
    assert (r.stream, r.direction) == ((2, 3), "forward") and route_send(ring, 2, 3).consumer == 0
    assert route_recv(ring, 2, 3).stream == (0, 3)  # backward over the wrap: 10 -> 13 -> 12


def _rep(m: dict[int, int]) -> list[int]:
    """Every rank up to the largest key live, except the keys: rank -> its representative."""
    rep = list(range(max(m) + 1))
    for r, x in m.items():
        rep[r] = x
    return rep


def test_refusals_name_the_ranks():
    plan = plan_group([0, 1, 2, 3], [0, 1, 1, 3])
    with pytest.raises(PruneError, match=r"rank 0 sends to virtual rank 2 .* not its neighbour"):
        route_send(plan, 0, 2)
    with pytest.raises(PruneError, match=r"rank 0 receives from virtual rank 2 .* not its neighbour"):
        route_recv(plan, 0, 2)
    one = plan_group([4, 6, 8], _rep({6: 4, 8: 4}))  # one live rank on the ring
    with pytest.raises(PruneError, match=r"rank 4 receives from virtual rank 8 .* its own later send"):
        route_recv(one, 0, 2)
    assert route_send(one, 0, 1).consumer is None  # nobody consumes: nothing is kept
    pair = plan_group([0, 1], [0, 0])
    with pytest.raises(PruneError, match="its own later send"):
        route_recv(pair, 0, 1)


def test_contributions_count_passthrough_and_the_trace_reader_knows_every_how():
    from prism_megatron.trace.fold import CONTRIBUTION_WAYS

    assert CONTRIBUTION_WAYS == HOWS
    c = Contributions()
    c.add_passthrough("recv", 3)
    assert c.to_json() == {"recv": {"mirror": 0, "recorded": 0, "keep": 0, "passthrough": 3}}
    assert Contributions.from_json(c.to_json()).to_json() == c.to_json()


# ---- the coordinator's streams ------------------------------------------------------------------
class _Plane:
    """The data plane's read over tensors the test owns (a send's bytes in the rank's segment)."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def read(self, desc: tuple, dtype: str) -> torch.Tensor:
        return self.buffers[desc[1]].view(P.dtype_from_name(dtype))


def _group() -> Group:
    g = Group(0, "pp", [0, 1, 2, 3], "nccl")
    g.fold = plan_group(g.ranks, [0, 1, 1, 3])
    return g


def _member(kind: str, rank: int, peer: int, shape=(2, 3), dtype: str = "float32", buf: str = "") -> Member:
    nbytes = 4 * shape[0] * shape[1]
    if kind == "send":
        msg = {"kind": kind, "peer": peer, "ins": [(("s", buf, 0, nbytes), dtype, list(shape))], "outs": []}
    else:
        msg = {"kind": kind, "peer": peer, "ins": [], "outs": [(("r", nbytes), dtype, list(shape))]}
    return Member(rank, rank, msg, SimpleNamespace(seq=-1, kind=kind))


def test_streams_keep_a_copy_until_received_and_answer_waiting_receives():
    g, plane, c = _group(), _Plane(), Contributions()
    pt = PassThrough(c)
    done: list[tuple[int, str, list[torch.Tensor]]] = []

    def deliver(m, outs, src=-1):
        done.append((m.rank, m.kind, [o.clone() for o in outs]))

    plane.buffers["a"] = torch.arange(6, dtype=torch.float32).view(torch.uint8)
    assert pt.handle(g, _member("send", 1, 2, buf="a"), plane, deliver) is None
    assert done == [(1, "send", [])]  # complete at once
    assert pt.held() == (1, 24)
    plane.buffers["a"].view(torch.float32).fill_(-1)  # the sender reuses its buffer
    assert pt.handle(g, _member("recv", 3, 2), plane, deliver) is None
    assert done[-1][:2] == (3, "recv") and done[-1][2][0].tolist() == [0, 1, 2, 3, 4, 5]
    assert pt.held() == (0, 0)  # freed once received
    # a receive first: it waits, and the send answers it straight from its buffer (nothing kept)
    assert pt.handle(g, _member("recv", 1, 2), plane, deliver) is None
    assert done[-1][0] == 3 and pt.leftovers() == [
        "recv rank 1 <- virtual rank 2 on group 'pp': waits for rank 3's next send to virtual rank 2 (pass-through)"]
    plane.buffers["b"] = torch.full((6,), 5.0).view(torch.uint8)
    assert pt.handle(g, _member("send", 3, 2, buf="b"), plane, deliver) is None
    assert [d[:2] for d in done[-2:]] == [(1, "recv"), (3, "send")] and done[-2][2][0].tolist() == [5.0] * 6
    assert pt.held() == (0, 0) and pt.leftovers() == []
    assert c.to_json()["recv"]["passthrough"] == 2
    # in order: the n-th receive gets the n-th send
    for k in range(3):
        plane.buffers[f"s{k}"] = torch.full((6,), float(k)).view(torch.uint8)
        pt.handle(g, _member("send", 1, 2, buf=f"s{k}"), plane, deliver)
    assert pt.held() == (3, 72)
    for k in range(3):
        pt.handle(g, _member("recv", 3, 2), plane, deliver)
        assert done[-1][2][0].tolist() == [float(k)] * 6
    # the last stage never sends forward; a stage whose send nobody consumes keeps nothing
    one = Group(1, "ring", [0, 2], "nccl")
    one.fold = plan_group(one.ranks, [0, 1, 0, 3])
    pt.handle(one, _member("send", 0, 1, buf="a"), plane, deliver)
    assert pt.held() == (0, 0)


def test_a_stand_in_of_another_shape_or_dtype_is_fatal_naming_both():
    g, plane = _group(), _Plane()
    pt = PassThrough(Contributions())
    plane.buffers["a"] = torch.zeros(6).view(torch.uint8)
    pt.handle(g, _member("send", 1, 2, buf="a"), plane, lambda *a, **k: None)
    problem = pt.handle(g, _member("recv", 3, 2, shape=(3, 2)), plane, lambda *a, **k: None)
    assert problem is not None and "rank 3 receives float32[3, 2] from virtual rank 2 (forward, receive #0)" in problem
    assert "message #0 that rank 1 sent to virtual rank 2: float32[2, 3]" in problem
    assert "pass messages through" in problem
    pt.handle(g, _member("recv", 3, 2, dtype="int32"), plane, lambda *a, **k: None)  # waits
    problem = pt.handle(g, _member("send", 1, 2, buf="a"), plane, lambda *a, **k: None)
    assert problem is not None and "int32[2, 3]" in problem and "float32[2, 3]" in problem
    assert pt.handle(g, _member("send", 0, 2, buf="a"), plane, lambda *a, **k: None).startswith(
        "rank 0 sends to virtual rank 2")


def test_a_hang_report_names_the_receive_waiting_for_its_stand_in():
    from prism_megatron.runtime.groups import GroupTable
    from prism_megatron.runtime.hang import format_hang_report, waits_on_exited
    from prism_megatron.runtime.ranks import RankState, RankStatus

    table = GroupTable()
    gid, _ = table.declare(3, 0, "pp", [0, 1, 2, 3], world=False)
    g = table.by_id[gid]
    g.fold = plan_group(g.ranks, [0, 1, 1, 3])
    PassThrough(Contributions()).handle(g, _member("recv", 3, 2), _Plane(), lambda *a, **k: None)
    report = format_hang_report({3: RankState(3, None, state=RankStatus.BLOCKED)}, table,
                                SimpleNamespace(awaiting_room=[]), 5.0)
    assert "recv rank 3 <- virtual rank 2 on group 'pp': waits for rank 1's next send to virtual rank 2" in report
    ranks = {1: RankState(1, None, state=RankStatus.BLOCKED), 3: RankState(3, None, state=RankStatus.BLOCKED)}
    assert not waits_on_exited(ranks, table)
    ranks[1].state = RankStatus.DONE  # the rank whose send would answer it exited
    assert waits_on_exited(ranks, table)
