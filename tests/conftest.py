"""Shared helpers: run the prism CLI or real torchrun as subprocesses, as a user would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).parent / "programs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_a_free_port(start: Callable[[int], subprocess.CompletedProcess], tries: int = 3) -> subprocess.CompletedProcess:
    """``start(port)`` on a port free when picked; again on another where another process bound it first (a
    port is picked, then bound by the started program: tests running side by side can take it in between)."""
    for _ in range(tries - 1):
        done = start(free_port())
        if done.returncode == 0 or not any("EADDRINUSE" in out or "Address already in use" in out
                                           for out in (done.stdout or "", done.stderr or "")):
            return done
    return start(free_port())


def prism(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m prism_megatron ARGS` in `cwd`; returns the completed process (text output)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "prism_megatron", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def torchrun(nproc: int, script: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The same program under real gloo: `nproc` processes started by torchrun."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return on_a_free_port(lambda port: subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={port}",
         str(script), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env))


@pytest.fixture
def programs() -> Path:
    return PROGRAMS


def launch_source(tmp_path: Path, source: str, world_size: int = 2, slots_per_device: int = 1, **options):
    """Write ``source`` as a program and launch it in-process as ``world_size`` logical ranks on CPU (ranks
    fork from this process, so a test's monkeypatches reach them); returns the trace it wrote.
    ``options``: more LaunchConfig fields."""
    from prism_megatron.launcher.config import LaunchConfig
    from prism_megatron.launcher.launch import launch
    from prism_megatron.trace import read_trace

    prog = tmp_path / "program.py"
    prog.write_text(source)
    trace = tmp_path / "trace"
    code = launch(LaunchConfig(prog, world_size=world_size, trace_dir=trace, log_ranks=[],
                               slots_per_device=slots_per_device, **options).validate())
    assert code == 0, f"exit {code}; logs in {trace}.logs"
    return read_trace(trace)


def two_ranks_asking_for_one_device(swapper, capacity: int, host_capacity: int):
    """A coordinator (no sockets) whose ranks 0 and 1 share one device of ``capacity`` bytes with ``swapper``,
    both said hello and asked for its one slot: rank 0 holds it. Returns (coordinator, the ranks granted in
    order, each rank's connection stand-in, the device's memory)."""
    from prism_megatron.runtime import protocol as P
    from prism_megatron.runtime.coordinator import Coordinator

    coord = Coordinator(world_size=2, num_devices=1, slots_per_device=1, device_of={0: 0, 1: 0},
                        device_names=["cuda:0"], hang_timeout=60.0, authkey=b"k" * 16)
    granted: list[int] = []
    coord._send = lambda rs, msg: granted.append(rs.rank) if msg["t"] == P.GRANT else None
    coord._progress = lambda: None
    coord.governor.enable_swap(swapper, [capacity], host_capacity=host_capacity)
    conns = [object(), object()]
    for r in range(2):
        coord._dispatch(conns[r], {"t": P.HELLO, "rank": r, "pid": 1000 + r})
    coord._dispatch(conns[0], {"t": P.ACQUIRE})
    coord._dispatch(conns[1], {"t": P.ACQUIRE})
    return coord, granted, conns, coord.governor.memory[0]


@pytest.fixture(scope="session")
def megatron_runs(tmp_path_factory):
    """Megatron captures shared by the files that read them: each distinct command runs once (megatron_runs.py)."""
    from megatron_runs import Captures

    return Captures(tmp_path_factory.mktemp("megatron-runs"))


@pytest.fixture(scope="session")
def published_run(tmp_path_factory) -> dict:
    """``run --recipe mini-dense-tp2pp2`` (core driver, the full capture) as a user runs it, with everything that
    follows a capture but calibration (test_publish's, which changes the report's figures): memory tracked,
    Megatron's --fake-process-group anchor, the report and an offline W&B run. Read by test_publish (report,
    W&B) and test_memory (anchor): one capture for both. {"proc", "dir" (the cwd: prism-trace/ there)}."""
    d = tmp_path_factory.mktemp("published")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(d), "WANDB_CONFIG_DIR": str(d / "cfg"),
           "WANDB_CACHE_DIR": str(d / "cache"), "WANDB_DATA_DIR": str(d / "data")}
    p = subprocess.run([sys.executable, "-m", "prism_megatron", "run", "--recipe", "mini-dense-tp2pp2",
                        "--prism-driver", "core", "--prism-track-memory", "on", "--prism-anchor-fake-pg",
                        "--prism-fold", "off"],  # the full capture fold auto would choose, without planning it
                       cwd=d, capture_output=True, text=True, timeout=900, env=env)
    return {"proc": p, "dir": d}


#: session fixtures that run jobs for the tests of several files: their tests share one pytest-xdist worker
#: (each worker has its own session, so split they would run every job once per worker)
SHARED_SESSION_FIXTURES = ("megatron_runs", "published_run")


def pytest_collection_modifyitems(config, items) -> None:
    """Two xdist workers (pytest.ini) take whole groups: a file, or every test that reads one of the shared
    session fixtures. Those groups hold the longest jobs, so they are queued first (the scheduler hands groups
    out in collection order); a file's module fixtures stay in one worker."""
    def group(item) -> str:
        shared = [f for f in SHARED_SESSION_FIXTURES if f in item.fixturenames]
        return shared[0] if shared else item.nodeid.split("::")[0]

    for item in items:
        item.add_marker(pytest.mark.xdist_group(group(item)))
    items.sort(key=lambda item: group(item) not in SHARED_SESSION_FIXTURES)  # stable: file order kept otherwise


#: Megatron's parse of each command planned in this session (namespace or error), by command and environment
_PARSES: dict[tuple, object] = {}


@pytest.fixture(autouse=True)
def parse_each_command_once(monkeypatch):
    """Planning in this process reads Megatron's parse of a command once per session (a child interpreter
    that imports Megatron: seconds on two cores); planning the same command again, in another test, under
    another fold mode, or choosing its micro-batch count (``--prism-fold-microbatches``) gets that parse's
    namespace (a copy) or its error again. The key holds the parser's environment (this process's with the
    ``env`` given, but the per-test PYTEST_CURRENT_TEST), so a test that changes what the child would see
    gets its own parse. Returns the session's parses, by command."""
    import argparse

    from prism_megatron.megatron import megatron_args, plan

    real, real_ask = megatron_args.parse_megatron_args, megatron_args.ask_megatron_args

    def _key(script, script_args, world_size, env, kw) -> tuple:
        child = {**os.environ, **(env or {})}  # the parser's environment (megatron_args)
        child.pop("PYTEST_CURRENT_TEST", None)
        return (str(script), tuple(script_args), world_size, tuple(sorted(child.items())), tuple(sorted(kw.items())),
                sys.executable)

    def ask(script, script_args, world_size, env=None):  # a parse given again is not asked of a child
        if _key(script, script_args, world_size, env, {}) not in _PARSES:
            real_ask(script, script_args, world_size, env)

    def once(script, script_args, world_size, env=None, **kw):
        key = _key(script, script_args, world_size, env, kw)
        if key not in _PARSES:
            try:
                _PARSES[key] = real(script, script_args, world_size, env, **kw)
            except Exception as e:  # given again, as the parser would give it again
                _PARSES[key] = e
        if isinstance(_PARSES[key], Exception):
            raise _PARSES[key]
        return argparse.Namespace(**vars(_PARSES[key]))

    monkeypatch.setattr(plan, "parse_megatron_args", once)  # imported by name when plan is imported
    monkeypatch.setattr(plan, "ask_megatron_args", ask)
    monkeypatch.setattr(megatron_args, "parse_megatron_args", once)  # microbatch_mode imports it when it parses
    return _PARSES
