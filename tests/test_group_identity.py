"""Group identity as torch has it: one name may stand for different groups on different ranks; members
that disagree about one group are a mismatch (runtime.groups)."""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import PROGRAMS, prism, torchrun
from prism_megatron.replay.graph import graph_from_trace
from prism_megatron.runtime.groups import GroupMismatch, GroupTable
from prism_megatron.trace import read_trace

#: the lines of tests/programs/group_identity.py --beyond-gloo, per rank (sums of global rank + 1)
BEYOND_GLOO = {
    0: ["members_only: ranks=[0, 2] sum=4", "remade0: sum=3", "remade1: sum=23", "remade_same_name: True"],
    1: ["members_only: ranks=[1, 3] sum=6", "remade0: sum=3", "remade1: sum=23", "remade_same_name: True"],
    2: ["members_only: ranks=[0, 2] sum=4", "remade0: sum=3", "remade1: sum=23", "remade_same_name: True"],
    3: ["members_only: ranks=[1, 3] sum=6", "remade0: sum=3", "remade1: sum=23", "remade_same_name: True"],
}


def test_every_way_torch_makes_groups_runs_as_under_gloo(tmp_path):
    gloo, ours = tmp_path / "gloo", tmp_path / "prism"
    gloo.mkdir()
    ours.mkdir()
    ran = torchrun(4, PROGRAMS / "group_identity.py", str(gloo), cwd=tmp_path, timeout=240)
    assert ran.returncode == 0, ran.stderr[-3000:]
    p = prism("launch", "-w", "4", "--devices", "cpu", "--hang-timeout", "30", "--trace-dir", str(tmp_path / "trace"),
              "--log-ranks", "none", str(PROGRAMS / "group_identity.py"), str(ours), "--beyond-gloo", cwd=tmp_path,
              timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    for r in range(4):
        expected = (gloo / f"rank-{r}.txt").read_text().splitlines()
        assert f"self: ranks=[{r}] sum={r + 1}" in expected and "epoch2_world: ranks=[0, 1, 2, 3] sum=10" in expected
        got = (ours / f"rank-{r}.txt").read_text().splitlines()
        assert [x for x in got if x.split(":")[0] not in {y.split(":")[0] for y in BEYOND_GLOO[r]}] == expected
        assert [x for x in got if x in BEYOND_GLOO[r]] == BEYOND_GLOO[r]
    trace = read_trace(tmp_path / "trace")
    groups = trace.manifest["groups"]
    assert len({g["id"] for g in groups}) == len(groups)
    named_one = [g["ranks"] for g in groups if g["name"] == "1"]  # self groups, in two epochs
    assert sorted(named_one) == sorted([[r] for r in range(4)] * 2)
    assert Counter(g["name"] for g in groups)["0"] == 2  # the world, made twice
    graph = graph_from_trace(trace)
    assert set(graph.groups) == {g["id"] for g in groups}


def test_members_that_disagree_about_a_group_end_the_job(tmp_path):
    p = prism("launch", "-w", "4", "--devices", "cpu", "--trace-dir", str(tmp_path / "trace"), "--log-ranks", "none",
              str(PROGRAMS / "group_mismatch.py"), cwd=tmp_path, timeout=120)
    assert p.returncode == 4, p.stderr
    assert "process group '1': rank " in p.stderr
    assert "with ranks [1, 2], rank 0 with ranks [0, 1]" in p.stderr or \
        "with ranks [0, 1], rank 1 with ranks [1, 2]" in p.stderr or \
        "with ranks [0, 1], rank 2 with ranks [1, 2]" in p.stderr


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_disagreement_is_found_whichever_member_declares_first(order):
    decl = {0: [0, 1], 1: [1, 2]}
    table = GroupTable()
    for r in range(3):
        table.declare(r, 0, "0", [0, 1, 2], world=True)
    first, second = order
    table.declare(first, 1, "1", decl[first], world=False)
    with pytest.raises(GroupMismatch, match=rf"process group '1': rank {second} created it with ranks "
                       rf"\{decl[second]}, rank {first} with ranks \{decl[first]}"):
        table.declare(second, 1, "1", decl[second], world=False)


def test_names_repeat_across_epochs_and_incarnations():
    table = GroupTable()
    world = [table.declare(r, 0, "0", [0, 1], world=True)[0] for r in (0, 1)]
    assert world == [0, 0]
    assert table.declare(0, 1, "1", [0], world=False) == (1, True)
    assert table.declare(1, 1, "1", [1], world=False) == (2, True)  # one name, another group
    for h in (2, 3):  # a hashed name made again after a destroy: the k-th time means the k-th incarnation
        ids = [table.declare(r, h, "abc", [0, 1], world=False)[0] for r in (0, 1)]
        assert ids[0] == ids[1]
    assert table.group_of(0, 2) != table.group_of(0, 3) and table.group_of(1, 3) == table.group_of(0, 3)
    again = [table.declare(r, 4, "0", [0, 1], world=True)[0] for r in (0, 1)]  # init_process_group again
    assert again[0] == again[1] and again[0] not in world
    assert table.declare(0, 5, "1", [0, 1], world=False)[0] == table.declare(1, 5, "1", [0, 1], world=False)[0]
