"""Shared helpers: run the prism CLI or real torchrun as subprocesses, as a user would."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAMS = Path(__file__).parent / "programs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prism(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m prism_megatron ARGS` in `cwd`; returns the completed process (text output)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "prism_megatron", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


def torchrun(nproc: int, script: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """The same program under real gloo: `nproc` processes started by torchrun."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
                           f"--master-port={free_port()}", str(script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=env)


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


@pytest.fixture(scope="session")
def megatron_runs(tmp_path_factory):
    """Megatron captures shared by the files that read them: each distinct command runs once (megatron_runs.py)."""
    from megatron_runs import Captures

    return Captures(tmp_path_factory.mktemp("megatron-runs"))


@pytest.fixture
def parse_each_command_once(monkeypatch):
    """Within a test, planning reads Megatron's parse of a command once (a child interpreter that imports
    Megatron: seconds); planning the same command again, say under another fold mode, or choosing its
    micro-batch count (``--prism-fold-microbatches``) gets that parse's namespace (a copy) or its error
    again. Returns the parses made, by command."""
    import argparse

    from prism_megatron.megatron import megatron_args, plan

    real = megatron_args.parse_megatron_args
    parsed: dict[tuple, object] = {}

    def once(script, script_args, world_size, env=None, **kw):
        key = (str(script), tuple(script_args), world_size, tuple(sorted((env or {}).items())), tuple(sorted(kw)))
        if key not in parsed:
            try:
                parsed[key] = real(script, script_args, world_size, env, **kw)
            except Exception as e:  # given again, as the parser would give it again
                parsed[key] = e
        if isinstance(parsed[key], Exception):
            raise parsed[key]
        return argparse.Namespace(**vars(parsed[key]))

    monkeypatch.setattr(plan, "parse_megatron_args", once)  # imported by name when plan is imported
    monkeypatch.setattr(megatron_args, "parse_megatron_args", once)  # microbatch_mode imports it when it parses
    return parsed
