"""Coordinators started ahead of the launch that uses them (launcher.coordinator_ahead): the lock they are
handed is the launcher's, one that died waiting is replaced, and none outlives its block."""

from __future__ import annotations

import os
import socket

import pytest

from prism_megatron.launcher import coordinator_ahead
from prism_megatron.launcher.config import LaunchError
from prism_megatron.launcher.preflight import lock_trace_dir
from prism_megatron.runtime.config import LOCK_SOCKET_ENV


def test_the_lock_sent_ahead_is_the_launchers_own_and_outlives_it(tmp_path, monkeypatch):
    """A coordinator that inherits the trace directory's lock holds it after the launcher exits; one started
    ahead gets the descriptor over a socket pair instead, and must hold it the same way."""
    from prism_megatron.runtime.sidecar import _receive_lock

    fd = lock_trace_dir(tmp_path)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    socket.send_fds(ours, [b"L"], [fd])
    monkeypatch.setenv(LOCK_SOCKET_ENV, str(theirs.detach()))
    [held] = _receive_lock()
    assert LOCK_SOCKET_ENV not in os.environ  # read once: a rank it started would not find it
    os.close(fd)  # the launcher is gone ...
    with pytest.raises(LaunchError, match="in use by another prism job"):
        lock_trace_dir(tmp_path)  # ... and the coordinator still holds the job's directory
    os.close(held)
    os.close(lock_trace_dir(tmp_path))  # both closed: free
    ours.close()
    monkeypatch.delenv(LOCK_SOCKET_ENV, raising=False)
    assert _receive_lock() == []  # started for its job: it inherited the lock instead


def test_one_waits_only_inside_the_block_and_a_dead_one_is_replaced():
    coordinator_ahead.start_next()
    assert coordinator_ahead._spare is None  # outside a serial capture nothing is started ahead
    with coordinator_ahead.coordinators_ahead():
        coordinator_ahead.start_next()
        first = coordinator_ahead._spare
        assert first is not None and first.proc.poll() is None
        coordinator_ahead.start_next()
        assert coordinator_ahead._spare is first  # one at a time
        first.proc.kill()
        first.proc.wait()
        assert coordinator_ahead.take() is None  # it died waiting: the launch starts its own
        coordinator_ahead.start_next()
        second = coordinator_ahead._spare
        assert second is not first and second.proc.poll() is None
    assert coordinator_ahead._spare is None and second.proc.poll() is not None  # stopped on leaving the block


def test_the_first_launch_adopts_the_coordinator_started_before_it_in_the_same_environment(tmp_path, monkeypatch):
    """The run command starts its first launch's coordinator while it plans (``start_first``): the launch adopts
    it (its log says so) where the environment is still the one it started in, bar what only the ranks read; a
    variable changed since is a reason to stop it and start one for the launch."""
    from pathlib import Path

    from prism_megatron.launcher.launch import LaunchConfig, launch

    programs = Path(__file__).parent / "programs"
    monkeypatch.delenv(coordinator_ahead.EXPERT_TOKENS_ENV, raising=False)
    coordinator_ahead.start_first()
    spare = coordinator_ahead._spare
    assert spare is not None and spare.proc.poll() is None
    monkeypatch.setenv(coordinator_ahead.EXPERT_TOKENS_ENV, "translated")  # set once the fold is planned
    assert coordinator_ahead.environ_changed(spare) == []
    cfg = LaunchConfig(script=programs / "ring.py", world_size=2, trace_dir=tmp_path / "adopted")
    assert launch(cfg) == 0
    assert coordinator_ahead._spare is None
    assert "started ahead of its job" in (cfg.log_dir / "coordinator.log").read_text()

    coordinator_ahead.start_first()
    stale = coordinator_ahead._spare
    monkeypatch.setenv("PRISM_SPIN_GRANT_US", "7")  # a variable the coordinator's job may read
    assert coordinator_ahead.environ_changed(stale) == ["PRISM_SPIN_GRANT_US"]
    cfg = LaunchConfig(script=programs / "ring.py", world_size=2, trace_dir=tmp_path / "fresh")
    assert launch(cfg) == 0
    assert stale.proc.poll() is not None  # stopped, not adopted
    assert "started ahead of its job" not in (cfg.log_dir / "coordinator.log").read_text()
    assert coordinator_ahead._spare is None
