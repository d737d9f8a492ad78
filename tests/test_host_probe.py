"""bench/gpu/host_probe.py: the host's cost per operation at three depths, recorded beside a target's prediction."""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_bench


def test_the_probe_measures_each_depth_and_says_where_there_is_no_gpu(capsys, monkeypatch):
    hp = load_bench("gpu/host_probe.py")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert hp.main(["--ops", "500", "--repeats", "3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["ops"] == 500 and r["repeats"] == 3 and r["cores"] >= 1 and r["cpu"]
    py_med, py_min = r["python_us"]
    aten_med, aten_min = r["aten_cpu_us"]
    assert 0 < py_min <= py_med and 0 < aten_min <= aten_med
    assert aten_min > py_min  # a dispatched op costs more than an empty call
    assert r["gpu"] is None and r["cuda_launch_us"] is None
    assert hp.main(["--ops", "200", "--repeats", "1"]) == 0
    table = capsys.readouterr().out
    assert "cuda-launch  no GPU visible" in table and "us per op (median; minimum" in table


def test_bad_counts_are_refused_by_value(capsys):
    hp = load_bench("gpu/host_probe.py")
    with pytest.raises(SystemExit):
        hp.main(["--ops", "0"])
    assert "--ops 0 and --repeats 5: expected at least 1 each" in capsys.readouterr().err
