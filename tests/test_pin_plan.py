"""PRISM_PIN_CORES places each rank process on a physical core of its own, never on the hyperthread
sibling of another rank or of the core left to the coordinator."""

from __future__ import annotations

from prism_megatron.launcher.rank import pin_plan


def _smt(pairs: int, stride: int):
    """A machine whose logical CPUs c and c + stride share a core (Linux's usual numbering)."""
    return lambda c: frozenset({c % stride, c % stride + stride}) if c < pairs * 2 else frozenset({c})


def test_one_logical_cpu_per_physical_core_the_first_core_left_free():
    cores = list(range(16))  # 8 physical cores, siblings (c, c + 8)
    plan = pin_plan(cores, 4, _smt(8, 8))
    assert plan == [1, 2, 3, 4]
    taken = {frozenset({c % 8, c % 8 + 8}) for c in plan}
    assert len(taken) == 4 and frozenset({0, 8}) not in taken


def test_adjacent_siblings_are_not_given_to_two_ranks():
    cores = list(range(16))  # siblings (2k, 2k + 1), as some virtual machines number them
    plan = pin_plan(cores, 6, lambda c: frozenset({c - c % 2, c - c % 2 + 1}))
    assert plan == [2, 4, 6, 8, 10, 12]  # not 1 (the coordinator's core's sibling), not 3 beside 2


def test_more_processes_than_physical_cores_falls_back_to_logical_cpus_then_to_none():
    cores = list(range(16))
    assert pin_plan(cores, 8, _smt(8, 8)) == list(range(1, 9))  # 7 free physical cores: logical CPUs 1..8
    assert pin_plan(cores, 16, _smt(8, 8)) is None  # not even one logical CPU each beside the coordinator's


def test_without_topology_every_logical_cpu_is_its_own_core():
    assert pin_plan([0, 1, 2, 3], 3, lambda c: frozenset({c})) == [1, 2, 3]
    assert pin_plan([4, 5, 6], 2, lambda c: frozenset({c})) == [5, 6]  # an affinity mask that starts at 4


def test_a_folded_launch_pins_each_live_rank_to_its_planned_core(monkeypatch, tmp_path):
    """`_pin` reads the launch's live ranks (a fold forks only those) and sets this process's affinity."""
    import os
    from types import SimpleNamespace

    from prism_megatron.launcher import rank as rank_mod

    got: list[set[int]] = []
    monkeypatch.setenv("PRISM_PIN_CORES", "1")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: got.append(set(cpus)), raising=False)
    monkeypatch.setattr(rank_mod, "pin_plan", lambda cores, n: pin_plan(cores, n, lambda c: frozenset({c})))
    from prism_megatron.launcher.config import LaunchConfig

    cfg = SimpleNamespace(fold={"live": [0, 1, 4, 5]}, world_size=8)
    cfg.live_ranks = LaunchConfig.live_ranks.fget(cfg)  # the property's own code on a stand-in config
    rank_mod._pin(cfg, 4)
    assert got == [{3}]  # live ranks 0, 1, 4, 5 on cores 1-4: rank 4 is the third
