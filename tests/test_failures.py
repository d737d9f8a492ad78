"""Mismatches, deadlocks, crashes and bad input end the job quickly with a report — and leave nothing behind."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PROGRAMS, prism
from prism_megatron.runtime.shm import shm_dir
from prism_megatron.trace import read_trace


def _launch(tmp: Path, program: str, world: int = 4, *extra: str, timeout_s: str = "3"):
    t0 = time.perf_counter()
    p = prism("launch", "-w", str(world), "--hang-timeout", timeout_s, "--trace-dir", str(tmp / "trace"),
              "--log-ranks", "none", *extra, str(PROGRAMS / program), cwd=tmp, timeout=180)
    return p, time.perf_counter() - t0


def _nothing_left(tmp: Path, program: str, why: str | None = None) -> None:
    """No process of the job, and its trace (if any) is marked partial with why (``why`` in it)."""
    time.sleep(0.3)
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    assert str(PROGRAMS / program) not in ps, ps
    assert "prism_megatron.runtime.sidecar" not in ps or str(tmp) not in ps
    if (tmp / "trace" / "manifest.json").exists():  # never a trace that looks complete
        trace = read_trace(tmp / "trace")
        assert trace.incomplete and (why is None or why in trace.incomplete), trace.incomplete


def _segments_of(stderr: str) -> list[str]:
    job = re.search(r"prism: job ([\w-]+):", stderr).group(1)
    return [p.name for p in shm_dir().glob(f"prism-{job}*")]


def test_mismatched_shapes_are_reported(tmp_path):
    p, took = _launch(tmp_path, "mismatch.py")
    assert p.returncode == 4, p.stderr
    err = p.stderr
    assert "collective #1" in err and "members disagree" in err and "different sizes" in err
    assert "rank 3: all_reduce" in err and "float32[5]" in err and "float32[4]" in err
    assert (tmp_path / "trace.logs" / "mismatch-report.txt").read_text().strip() in err
    assert took < 60
    _nothing_left(tmp_path, "mismatch.py")
    assert _segments_of(p.stderr) == []


def test_deadlock_is_reported_with_every_pending_op(tmp_path):
    p, took = _launch(tmp_path, "deadlock.py", 4, timeout_s="2")
    assert p.returncode == 3, p.stderr
    err = p.stderr
    assert "hang detected" in err
    assert "rank 0: recv #0 peer 1" in err and "rank 1: recv #0 peer 0" in err
    assert "recv rank 0 <- rank 1 on group '0': no matching send posted" in err
    assert "rank 2: barrier #0" in err and "rank 3: barrier #0" in err
    assert "missing 0-1" in err  # the barrier waits for the two deadlocked ranks
    assert (tmp_path / "trace.logs" / "hang-report.txt").exists()
    assert took < 60
    _nothing_left(tmp_path, "deadlock.py")


def test_crashing_rank_ends_job_with_its_traceback(tmp_path):
    p, took = _launch(tmp_path, "crash.py", 4, timeout_s="60")
    assert p.returncode == 1, p.stderr
    assert "rank 2 exited with code 1" in p.stderr
    assert "ValueError: boom on rank two" in p.stderr and "crash.py" in p.stderr
    assert took < 60  # did not wait for the hang timeout
    _nothing_left(tmp_path, "crash.py")


def test_killed_rank_is_reported(tmp_path, monkeypatch):
    prog = tmp_path / "killed.py"
    prog.write_text("import os, signal, torch, torch.distributed as dist\n"
                    "dist.init_process_group('gloo')\n"
                    "if dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                    "dist.barrier()\n")
    p = prism("launch", "-w", "3", "--trace-dir", str(tmp_path / "trace"), "--log-ranks", "none", str(prog),
              cwd=tmp_path, timeout=120)
    assert p.returncode == 1
    assert "rank 1 was killed by SIGKILL" in p.stderr


def test_rank_that_exits_early_leaves_others_hung(tmp_path):
    p, _ = _launch(tmp_path, "early_exit.py", 3, timeout_s="2")
    assert p.returncode == 3, p.stderr
    assert "rank 1: exited (code 0)" in p.stderr and "exited: 1" in p.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-w", "0"], "--world-size must be a positive integer, got 0"),
        (["-w", "4", "--devices", "gpu0"], "'gpu0' is neither 'cpu' nor a CUDA device index"),
        (["-w", "4", "--devices", "cpu,0"], "'cpu' cannot be mixed"),
        (["-w", "4", "--slots-per-device", "0"], "--slots-per-device must be a positive integer, got 0"),
        (["-w", "4", "--hang-timeout", "-1"], "--hang-timeout must be a positive number of seconds, got -1.0"),
        (["-w", "4", "--log-ranks", "9"], "--log-ranks: rank 9 is outside 0..3"),
        (["-w", "4", "--trace-dir", "/proc/nope/trace"], "cannot create '/proc/nope' (No such file or directory)"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path, monkeypatch, args, message):
    """In process (the exit code and message are click's; test_missing_script goes through the console script)."""
    from click.testing import CliRunner

    from prism_megatron.cli import main

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["launch", *args, str(PROGRAMS / "ring.py")])
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output


def test_a_trace_dir_whose_parents_are_missing_is_made_there(tmp_path):
    """A run's --trace-dir under directories not yet made: they are made (the launcher writes there), checked before
    the run plans anything; a file in the way is one clear error."""
    from prism_megatron.launcher.config import LaunchConfig, LaunchError

    cfg = LaunchConfig(script=PROGRAMS / "ring.py", world_size=2, trace_dir=tmp_path / "a" / "b" / "trace")
    cfg.check_trace_dir()
    assert (tmp_path / "a" / "b").is_dir() and not (tmp_path / "a" / "b" / "trace").exists()
    (tmp_path / "file").write_text("")
    blocked = LaunchConfig(script=PROGRAMS / "ring.py", world_size=2, trace_dir=tmp_path / "file" / "sub" / "t")
    with pytest.raises(LaunchError, match=r"/file' is a file, not a directory"):
        blocked.check_trace_dir()


def test_missing_script(tmp_path):
    p = prism("launch", "-w", "2", str(tmp_path / "nope.py"), cwd=tmp_path, timeout=60)
    assert p.returncode == 2
    assert "nope.py' does not exist" in p.stderr


def test_results_survive_many_ranks_few_slots(tmp_path):
    """64 ranks on 2 slots: same result as 64 ranks computed in one process would give."""
    out = tmp_path / "out"
    out.mkdir()
    env_out = dict(os.environ, RING_OUT=str(out))
    p = subprocess.run(
        [os.sys.executable, "-m", "prism_megatron", "launch", "-w", "16", "--slots-per-device", "2",
         "--trace-dir", str(tmp_path / "trace"), "--log-ranks", "none", str(PROGRAMS / "ring.py"), "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240, env=env_out)
    assert p.returncode == 0, p.stderr
    import torch

    # reference: the same arithmetic, in one process
    w = 16
    xs = [torch.randn(64, 64, generator=torch.Generator().manual_seed(r)) for r in range(w)]
    for _ in range(2):
        xs = [torch.tanh(x @ x) / 8 for x in xs]
        for _ in range(4):
            xs = [torch.tanh(x @ x) / 8 for x in xs]
        s = xs[0].clone()
        for x in xs[1:]:
            s += x
        xs = [(s + s) / 2 for _ in range(w)]
    for r in range(w):
        torch.testing.assert_close(torch.load(out / f"rank-{r}.pt"), xs[r])


def test_staging_segments_removed_from_outside_after_the_op_arrived(tmp_path):
    """Something outside the job unlinks a rank's /dev/shm segments while its op waits in the coordinator
    for the other member (a cleanup of shared memory by another program): the op still completes. The
    coordinator used to open a member's segment only when the last member arrived: FileNotFoundError."""
    p = prism("launch", "-w", "2", "--hang-timeout", "60", "--trace-dir", str(tmp_path / "trace"), "--log-ranks",
              "none", str(PROGRAMS / "segment_removed.py"), "after", cwd=tmp_path, timeout=180)
    assert p.returncode == 0, p.stderr


def test_staging_segment_removed_before_the_coordinator_saw_it_is_a_clear_error(tmp_path):
    p = prism("launch", "-w", "2", "--hang-timeout", "60", "--trace-dir", str(tmp_path / "trace"), "--log-ranks",
              "none", str(PROGRAMS / "segment_removed.py"), "before", cwd=tmp_path, timeout=180)
    assert p.returncode == 1, p.stderr
    report = (tmp_path / "trace.logs" / "staging-report.txt").read_text()
    assert re.search(r"rank 0: all_reduce \(op \d+\): staging segment \S+/prism-\S+-r0-0 is gone: something "
                     r"outside this job removed it", report), report
    assert "Traceback" not in p.stderr and "internal" not in p.stderr
    _nothing_left(tmp_path, "segment_removed.py")
