"""bench/gpu/thread_sampler.py: each Python thread's CPU, run-queue and switch counters beside a truth call; and
one_gpu_truth.py's per-iteration reading of them over a step's measured iterations."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from bench_scripts import ROOT, load_bench

STAT = ("4242 (pt_autograd (0)) S 4200 4242 4242 0 -1 4194560 100 0 0 0 250 30 0 0 20 0 40 0 1000 "
        "1000000 2000 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 7 0 0 0 0 0 0 0 0 0 0 0 0 0")
STATUS = "Name:\tpt_autograd\nvoluntary_ctxt_switches:\t812\nnonvoluntary_ctxt_switches:\t9\n"


def test_stat_and_status_are_read_whatever_the_thread_calls_itself():
    ts = load_bench("gpu/thread_sampler.py")
    comm, ppid, ns, cpu = ts.parse_stat(STAT)
    assert (comm, ppid, cpu) == ("pt_autograd (0)", 4200, 7)
    assert ns == pytest.approx(280 * 1e9 / os.sysconf("SC_CLK_TCK"))  # utime 250 + stime 30 ticks
    assert ts.parse_switches(STATUS) == (812, 9)


def test_only_python_interpreters_are_sampled_not_shells_that_mention_one():
    ts = load_bench("gpu/thread_sampler.py")
    assert ts.is_python(["/usr/bin/python3.12", "-m", "prism_megatron"])
    assert ts.is_python(["python", "x.py"])
    assert not ts.is_python(["bash", "-c", "python3 x.py"])
    assert not ts.is_python(["timeout", "600", "python3"])
    assert not ts.is_python([])


def test_the_sampler_sees_a_busy_python_thread_and_refuses_a_bad_interval(tmp_path, capsys):
    ts = load_bench("gpu/thread_sampler.py")
    with pytest.raises(SystemExit):
        ts.main([str(tmp_path / "x.jsonl"), "--interval", "-1"])
    assert "--interval -1.0: expected a positive number of seconds" in capsys.readouterr().err
    out = tmp_path / "threads.jsonl"
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    sampler = subprocess.Popen([sys.executable, str(ROOT / "bench/gpu/thread_sampler.py"), str(out),
                                "--interval", "0.3"])
    try:
        busy.wait(timeout=30)
        time.sleep(0.5)
    finally:
        sampler.kill()
        sampler.wait()
    truth = load_bench("gpu/one_gpu_truth.py")
    procs, samples = truth.host_threads(out)
    assert busy.pid in procs and "while time.time()" in procs[busy.pid]["cmd"]
    mine = [rows[(busy.pid, busy.pid)] for _, rows in samples if (busy.pid, busy.pid) in rows]
    assert len(mine) >= 3
    spent = (mine[-1][3] - mine[0][3]) / 1e9
    assert 0.3 < spent < 3.5  # on a CPU most of the seconds it was seen (a shared CI machine may preempt it)
    assert all(a[3] <= b[3] for a, b in zip(mine, mine[1:], strict=False))  # cumulative


def _line(t: float, rows: list[list]) -> str:
    return json.dumps({"t": t, "threads": rows})


def test_a_steps_threads_per_iteration_over_its_measured_window(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    f = tmp_path / "host-threads.jsonl"
    # the main thread: 0.5 s on a CPU, 10 ms runnable, 100 voluntary and 2 involuntary switches per second; a
    # second thread appears mid-window with 0.2 s on a CPU (all inside it); a third never moves in the window
    lines = [json.dumps({"t": 99.0, "pid": 7, "ppid": 1, "cmd": "python driver.py --flags"})]
    for i, t in enumerate((109.0, 110.0, 111.0, 112.0, 113.0, 114.0)):
        rows = [[7, 7, "python", int(0.5e9 * i), int(0.01e9 * i), 100 * i, 2 * i, i % 2]]
        if t == 109.0:
            rows.append([7, 9, "idle", 5, 0, 1, 0, 3])
        if t == 111.0:
            rows.append([7, 8, "pt_autograd_0", int(0.2e9), 0, 40, 0, 5])
        lines.append(_line(t, rows))
    f.write_text("\n".join(lines) + '\n{"t": 115.0, "thr')  # killed mid-line: the partial line is dropped
    threads = truth.host_threads(f)
    # iterations 2..5 logged at 10..13 s after the step's start (100): 1 s of wall each; measured from 3
    step = {"kind": "emu1", "started": 100.0, "measured_from": 3,
            "iterations": {str(k): {"ms": 1.0, "at": float(8 + k)} for k in (1, 2, 3, 4, 5)}}
    got = truth.step_threads(step, threads)
    assert got["wall_ms"] == pytest.approx(1000.0)
    main, second = got["threads"]
    assert (main["tid"], main["main"], main["cmd"]) == (7, True, "python driver.py --flags")
    assert main["on_cpu_ms"] == pytest.approx(500.0)
    assert main["runqueue_ms"] == pytest.approx(10.0)
    assert (main["voluntary"], main["involuntary"]) == (pytest.approx(100.0), pytest.approx(2.0))
    assert main["cpus"] == [0, 1]
    assert (second["tid"], second["main"]) == (8, False)
    assert second["on_cpu_ms"] == pytest.approx(200.0 / 3)  # 0.2 s over the 3 sampled seconds
    assert truth.step_threads({**step, "started": 500.0}, threads) is None  # no samples in its window
    assert truth.step_threads({"kind": "real", "iterations": {}}, threads) is None
