"""Every way a job ends leaves nothing behind (ranks, their children, the coordinator, shared memory),
keeps the trace so far marked incomplete, and says last what happened; a trace that cannot be written
is said at once; a stuck rank is named; a bad destination or host is refused before the start."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PROGRAMS, launch_source, prism
from prism_megatron.launcher.config import LaunchConfig, LaunchError
from prism_megatron.launcher.preflight import RANK_FOOTPRINT, check_host_memory, lock_trace_dir
from prism_megatron.runtime.shm import SHM_DIR_ENV, shm_dir
from prism_megatron.trace import read_trace


def _start(tmp: Path, program: str, *args: str, world: int = 3, extra: tuple[str, ...] = ()) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OUT=str(tmp))
    return subprocess.Popen(
        [sys.executable, "-m", "prism_megatron", "launch", "-w", str(world), "--trace-dir", str(tmp / "trace"),
         "--log-ranks", "none", "--hang-timeout", "120", *extra, str(PROGRAMS / program), *args],
        cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_signals)


def _default_signals() -> None:
    """The launcher as from a terminal: a test run in the background (nohup, ``cmd &``) inherits SIGINT
    and SIGHUP ignored, which the launcher rightly keeps ignored."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _wait_for(cond, timeout: float = 60.0) -> None:
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < timeout, "timed out waiting for the job to get going"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"


def _children(tmp: Path, world: int) -> list[int]:
    _wait_for(lambda: all((tmp / f"child-{r}").exists() for r in range(world)))
    time.sleep(1.0)  # the ranks reach their collectives (shared memory in use)
    return [int((tmp / f"child-{r}").read_text()) for r in range(world)]


def _job_segments(job_pid: int) -> list[str]:
    return [p.name for p in shm_dir().glob(f"prism-{job_pid}-*")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_ends_everything_and_keeps_partial_trace(tmp_path, sig):
    p = _start(tmp_path, "blocks_with_child.py")
    children = _children(tmp_path, 3)
    assert _job_segments(p.pid)  # the job has shared memory to clean up
    t0 = time.monotonic()
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 15, err
    assert p.returncode == 128 + sig, err
    time.sleep(0.3)
    assert not [c for c in children if _alive(c)], "processes started by ranks survived the job"
    assert _job_segments(p.pid) == []
    name = signal.Signals(sig).name
    trace = read_trace(tmp_path / "trace")
    assert name in trace.incomplete and trace.ops.num_rows > 0
    last = err.strip().splitlines()[-1]
    assert name in last and "marked incomplete" in last and "logs in" in last, err


def test_killed_launcher_leaves_nothing(tmp_path):
    """SIGKILL (as the kernel's OOM killer sends it): ranks die with the launcher, the coordinator ends
    their children, removes the shared memory and keeps the trace so far."""
    p = _start(tmp_path, "blocks_with_child.py")
    children = _children(tmp_path, 3)
    p.kill()
    p.communicate(timeout=30)
    # the coordinator ends the job and writes the trace: seconds alone, more on a 2-core machine under the suite
    _wait_for(lambda: (tmp_path / "trace" / "manifest.json").exists(), timeout=90)
    time.sleep(0.5)
    assert not [c for c in children if _alive(c)]
    assert _job_segments(p.pid) == []
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path / "trace.logs") not in ps  # the coordinator (its config names the logs) is gone
    assert "launcher" in read_trace(tmp_path / "trace").incomplete


def test_stale_segments_of_dead_jobs_are_swept(tmp_path, monkeypatch):
    # a directory of its own: a job that other tests launch meanwhile sweeps /dev/shm too, and would say so
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = shm_dir() / f"prism-{dead.pid}-0badcafe-r0-0"
    live = shm_dir() / f"prism-{os.getpid()}-0badcafe-r0-0"
    stale.write_bytes(b"x" * 4096)
    live.write_bytes(b"x")
    try:
        p = prism("launch", "-w", "2", "--trace-dir", str(tmp_path / "trace"), "--log-ranks", "none",
                  str(PROGRAMS / "ring.py"), "1", cwd=tmp_path, timeout=120)
        assert p.returncode == 0, p.stderr
        assert not stale.exists() and live.exists()
        assert "shared-memory segment(s)" in p.stderr
    finally:
        stale.unlink(missing_ok=True)
        live.unlink(missing_ok=True)


def test_failed_trace_write_is_said_at_once(tmp_path):
    p = prism("launch", "-w", "2", "--trace-dir", str(tmp_path / "trace"), "--log-ranks", "none",
              str(PROGRAMS / "writes_into_trace.py"), str(tmp_path / "trace"), cwd=tmp_path, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "the trace could not be written" in p.stderr and "not a PrismTrace directory" in p.stderr


def test_trace_dir_with_other_data_is_refused_before_the_start(tmp_path):
    (tmp_path / "notrace").mkdir()
    (tmp_path / "notrace" / "notes.txt").write_text("mine")
    p = prism("launch", "-w", "2", "--trace-dir", "notrace", str(PROGRAMS / "ring.py"), cwd=tmp_path, timeout=60)
    assert p.returncode == 2
    assert "'notrace' holds other data (notes.txt...), not a PrismTrace" in p.stderr
    assert not (tmp_path / "notrace.logs").exists()


def test_second_job_on_a_trace_dir_is_refused(tmp_path):
    (tmp_path / "trace.logs").mkdir()
    fd = lock_trace_dir(tmp_path / "trace.logs")  # as a running job holds it
    try:
        p = prism("launch", "-w", "2", "--trace-dir", str(tmp_path / "trace"), str(PROGRAMS / "ring.py"),
                  cwd=tmp_path, timeout=60)
    finally:
        os.close(fd)
    assert p.returncode == 2
    assert f"'{tmp_path / 'trace'}' is in use by another prism job (launcher pid {os.getpid()})" in p.stderr


@pytest.mark.parametrize(("setup", "message"), [
    (lambda t: (t / "trace.logs").write_text("x"), "(TRACE_DIR.logs) exists and is not a directory"),
    (lambda t: (t / "out").mkdir(mode=0o555), "(read-only)"),
])
def test_unwritable_destination_is_one_line(tmp_path, setup, message):
    setup(tmp_path)
    if os.geteuid() == 0 and "read-only" in message:
        pytest.skip("root writes into read-only directories")
    trace = tmp_path / ("out/trace" if "read-only" in message else "trace")
    p = prism("launch", "-w", "2", "--trace-dir", str(trace), str(PROGRAMS / "ring.py"), cwd=tmp_path, timeout=60)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize(("how", "said"), [
    ("compute", "rank 1: computing: it has held a compute slot for"),
    ("stop", "rank 1: stopped (process"),
    ("outside", "rank 1: outside the runtime: it has held a compute slot for"),
])
def test_rank_that_keeps_the_others_waiting_is_named(tmp_path, how, said):
    env = dict(os.environ, STALL=how)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "prism_megatron", "launch", "-w", "3", "--slots-per-device", "2",
                        "--hang-timeout", "3", "--trace-dir", str(tmp_path / "trace"), "--log-ranks", "none",
                        str(PROGRAMS / "stalls.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 3, p.stderr
    assert "stall: rank(s) 1 kept the other ranks waiting for over 3 s" in p.stderr
    assert said in p.stderr, p.stderr
    assert time.monotonic() - t0 < 60
    assert "stall" in read_trace(tmp_path / "trace").incomplete


def test_group_timeout_raises_in_every_waiting_rank_as_gloo(tmp_path):
    """init_process_group(timeout=2 s), rank 1 late by 8 s: ranks 0 and 2 raise gloo's RuntimeError at 2 s."""
    p = prism("launch", "-w", "3", "--slots-per-device", "3", "--trace-dir", str(tmp_path / "trace"),
              "--log-ranks", "all", str(PROGRAMS / "group_timeout.py"), "2", "8", cwd=tmp_path, timeout=120)
    assert p.returncode == 1, p.stderr
    # gloo: "RuntimeError: [.../unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete"
    raised = re.findall(r"RAISED (\w+): \[[^]]+\] Timed out waiting 2000ms for all_reduce operation to complete "
                        r"\(rank (\d)", p.stdout)
    assert sorted(raised) == [("RuntimeError", "0"), ("RuntimeError", "2")], p.stdout
    assert "exited with code 7" in p.stderr


def test_barrier_only_one_member_calls_times_out_and_the_job_goes_on(tmp_path):
    """torch's test_barrier_timeout_*: rank 0 alone calls barrier on a group made with a 1 s timeout; it
    raises gloo's timeout error no earlier than that, the others never call it, and the job goes on."""
    out = tmp_path / "out.txt"
    launch_source(tmp_path, f"""
import datetime, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
g = dist.new_group(timeout=datetime.timedelta(seconds=1))
if dist.get_rank() == 0:
    t0 = time.time()
    try:
        dist.barrier(g)
        said = "no error"
    except RuntimeError as e:
        said = str(e)
    open({str(out)!r}, "w").write(f"{{time.time() - t0:.3f}} {{said}}")
t = torch.ones(2)
dist.all_reduce(t)
assert t.tolist() == [3.0, 3.0]
""", world_size=3, slots_per_device=3)
    took, said = out.read_text().split(" ", 1)
    assert re.search(r" Timed out waiting 1000ms for barrier operation to complete ", said), said
    assert float(took) >= 1.0 - 0.1, took  # torch's test allows 0.1 s early


def test_rank_that_exits_early_ends_the_job_without_the_full_timeout(tmp_path):
    t0 = time.monotonic()
    p = prism("launch", "-w", "3", "--hang-timeout", "120", "--trace-dir", str(tmp_path / "trace"),
              "--log-ranks", "none", str(PROGRAMS / "early_exit.py"), cwd=tmp_path, timeout=120)
    assert p.returncode == 3, p.stderr
    assert time.monotonic() - t0 < 60
    assert "rank 1: exited (code 0)" in p.stderr and "code None" not in p.stderr


def test_world_size_that_cannot_fit_is_refused_saying_what_would(tmp_path):
    cfg = LaunchConfig(script=PROGRAMS / "ring.py", world_size=1000)
    with pytest.raises(LaunchError, match=r"at most (\d+) ranks fit.*fewer ranks.*fold"):
        check_host_memory(cfg, available=100 * RANK_FOOTPRINT)
    check_host_memory(LaunchConfig(script=PROGRAMS / "ring.py", world_size=10), available=100 * RANK_FOOTPRINT)
    p = prism("launch", "-w", "65536", str(PROGRAMS / "ring.py"), cwd=tmp_path, timeout=60)
    assert p.returncode == 2 and "--world-size 65536 needs about" in p.stderr, p.stderr


def test_listens_on_loopback_unless_asked(tmp_path):
    p = prism("launch", "-w", "2", "--trace-dir", str(tmp_path / "trace"), "--log-ranks", "none",
              str(PROGRAMS / "ring.py"), "1", cwd=tmp_path, timeout=120)
    assert p.returncode == 0 and "listen on 127.0.0.1 (loopback only" in p.stderr, p.stderr
    p = prism("launch", "-w", "2", "--listen", "everywhere", str(PROGRAMS / "ring.py"), cwd=tmp_path, timeout=60)
    assert p.returncode == 2 and "--listen 'everywhere' is not an IP address" in p.stderr


def test_sparse_all_reduce_is_refused_clearly(tmp_path):
    prog = tmp_path / "sparse.py"
    prog.write_text("import torch, torch.distributed as dist\ndist.init_process_group('gloo')\n"
                    "t = torch.sparse_coo_tensor(torch.tensor([[0, 3]]), torch.tensor([1.0, 2.0]), (4,))\n"
                    "dist.all_reduce(t)\n")
    p = prism("launch", "-w", "2", "--trace-dir", str(tmp_path / "trace"), "--log-ranks", "none", str(prog),
              cwd=tmp_path, timeout=120)
    assert p.returncode == 1
    assert "all_reduce of a torch.sparse_coo tensor is not supported" in p.stderr and ".to_dense()" in p.stderr


def test_export_to_an_unwritable_place_is_one_line(tmp_path):
    from prism_megatron.trace import write_trace

    write_trace(tmp_path / "t", {"world_size": 1, "groups": [], "ranks": [{"rank": 0, "exit_code": 0,
                                                                            "device": "cpu"}]}, ops=[])
    (tmp_path / "afile").write_text("")
    p = prism("trace", "chrome", str(tmp_path / "t"), str(tmp_path / "afile" / "x.json"), cwd=tmp_path)
    assert p.returncode == 1 and "cannot write" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_coordinator_of_a_large_job_starts(tmp_path):
    """The coordinator's config (a rank map) of 20,000 ranks is more than one argument may hold."""
    from prism_megatron.launcher.launch import _Job

    cfg = LaunchConfig(script=PROGRAMS / "ring.py", world_size=20000, trace_dir=tmp_path / "trace").validate()
    cfg.log_dir.mkdir()
    job = _Job(cfg)
    try:
        address, store_port = job.start_coordinator()
        assert address[0] == "127.0.0.1" and store_port > 0
    finally:
        job.cleanup()
    assert job.coord.returncode is not None


def test_a_stopped_run_still_writes_its_report(tmp_path):
    """``run`` stopped by a time limit (SIGTERM) keeps its trace so far and makes the report of it: what was
    captured before the stop is what the user paid for."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OUT=str(tmp_path), WANDB_MODE="disabled")
    p = subprocess.Popen(
        [sys.executable, "-m", "prism_megatron", "run", "--prism-emulate", "--prism-world-size", "3",
         "--prism-fold", "off", "--prism-trace-dir", str(tmp_path / "trace"), str(PROGRAMS / "blocks_with_child.py")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_default_signals)
    _children(tmp_path, 3)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "the run was stopped (exit 143); the report covers what it captured" in err, err
    assert (tmp_path / "trace" / "report.json").exists(), err
    assert "SIGTERM" in read_trace(tmp_path / "trace").incomplete
