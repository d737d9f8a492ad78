"""Rank processes as the operating system sees them: ending one with everything it started, and what it is doing.

Each rank leads its own process group (launcher.rank), so ending the group ends the processes the
program started too, as torchrun's ending of a worker does.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def kill_rank(pid: int) -> None:
    """End a rank and every process it started (its process group); quiet if they are gone."""
    if pid <= 0:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (R running, S sleeping, T stopped, Z zombie...), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2:].split(" ", 1)[0]
