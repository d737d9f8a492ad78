"""bench/gpu/host_sampler.py: each second's busy, stolen and idle share of the host's CPUs beside a truth call."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench

BEFORE = """cpu  100 0 50 800 10 0 0 40 0 0
cpu0 50 0 25 400 5 0 0 20 0 0
intr 1 2 3
"""
AFTER = """cpu  160 0 70 900 10 0 0 60 0 0
cpu0 80 0 35 430 5 0 0 50 0 0
intr 1 2 3
"""


def test_shares_split_the_interval_into_busy_stolen_and_idle():
    hs = load_bench("gpu/host_sampler.py")
    before, after = hs.read_stat(BEFORE), hs.read_stat(AFTER)
    assert set(after) == {"all", "0"}
    busy, steal, idle = hs.shares(before["all"], after["all"])  # 80 busy, 20 stolen, 100 idle of 200
    assert (busy, steal, idle) == (40.0, 10.0, 50.0)
    busy, steal, idle = hs.shares(before["0"], after["0"])  # 40 busy, 30 stolen, 30 idle of 100
    assert (busy, steal, idle) == (40.0, 30.0, 30.0)
    assert hs.shares(after["0"], after["0"]) == (0.0, 0.0, 0.0)  # no jiffies passed: no division by zero


def test_the_clock_is_the_mean_of_cpuinfo_and_absent_where_it_gives_none():
    hs = load_bench("gpu/host_sampler.py")
    assert hs.mean_mhz("cpu MHz\t\t: 2000.0\ncpu MHz\t\t: 3000.0\n") == 2500.0
    assert hs.mean_mhz("processor\t: 0\n") is None


def test_a_bad_interval_is_refused_by_value(capsys, tmp_path):
    hs = load_bench("gpu/host_sampler.py")
    with pytest.raises(SystemExit):
        hs.main([str(tmp_path / "x.csv"), "--interval", "0"])
    assert "--interval 0.0: expected a positive number of seconds" in capsys.readouterr().err


def test_one_gpu_truth_gives_each_step_the_mean_of_its_own_seconds(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    csv = tmp_path / "host-cpus.csv"
    csv.write_text("time,cpu,busy_pct,steal_pct,idle_pct,mhz\n"
                   "100.0,all,10.0,0.0,90.0,\n100.0,0,50.0,5.0,45.0,\n"  # before the step: left out
                   "101.0,all,20.0,1.0,79.0,\n101.0,0,90.0,9.0,1.0,\n"  # per-CPU rows: left out
                   "102.0,all,40.0,3.0,57.0,\n"
                   "104.0,all,80.0,0.0,20.0,\n")  # after the step: left out
    samples = truth.host_cpus(csv)
    assert samples == [(100.0, 10.0, 0.0), (101.0, 20.0, 1.0), (102.0, 40.0, 3.0), (104.0, 80.0, 0.0)]
    assert truth.step_cpus({"kind": "real", "started": 100.0, "seconds": 2.5}, samples) == (30.0, 2.0)
    assert truth.step_cpus({"kind": "real", "seconds": 2.5}, samples) is None  # recorded before steps had a start
    assert truth.step_cpus({"kind": "real", "started": 200.0, "seconds": 2.5}, samples) is None
