"""Checks made before a job starts, so that it cannot fail at its end for a reason known at its start.

The trace destination (writable, not someone else's data, room for the trace, one job at a time per
directory: a lock held for the job's life, by the launcher and its coordinator), the host memory the
ranks will take, and the shared memory dead jobs left behind.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from prism_megatron.launcher.config import LaunchConfig, LaunchError
from prism_megatron.runtime.hostplan import available_host_memory

#: Host memory (PSS) of one running CPU rank: torch imported, the program's first collectives done; an
#: idle rank forked from the template shares most of its pages, a running one does not (measured by
#: bench/faults.py's footprint row, which prints the figure this machine gives).
RANK_FOOTPRINT = 55 * 2**20
#: The coordinator and the launcher: torch imported, the job's records.
SIDECAR_FOOTPRINT = 400 * 2**20
#: Disk a trace and its logs take per rank (ops, markers, slot turns and the rank's log), and at least:
#: a floor that a short run stays under, not a bound (a long run's trace grows with its iterations).
TRACE_BYTES_PER_RANK = 256 * 2**10
TRACE_BYTES_MIN = 32 * 2**20


def check_trace_destination(cfg: LaunchConfig) -> None:
    """The trace and its logs can be written where asked, and replace nothing but an older trace (the directory
    itself and its parent were checked by ``LaunchConfig.validate``: ``check_trace_dir``)."""
    trace, logs = cfg.trace_dir, cfg.log_dir
    if trace.is_dir() and not _is_trace_or_empty(trace):
        shown = ", ".join(sorted(p.name for p in trace.iterdir())[:3])
        raise LaunchError(f"--trace-dir {str(trace)!r} holds other data ({shown}...), not a PrismTrace: "
                          "refusing to replace it; give a new or empty directory")
    if logs.exists() and not logs.is_dir():
        raise LaunchError(f"the log directory {str(logs)!r} (TRACE_DIR.logs) exists and is not a directory; "
                          "move it away or give another --trace-dir")
    if logs.is_dir() and not os.access(logs, os.W_OK | os.X_OK):
        raise LaunchError(f"--trace-dir {str(trace)!r}: cannot write in {str(logs)!r} (read-only)")
    need = max(TRACE_BYTES_MIN, len(cfg.live_ranks) * TRACE_BYTES_PER_RANK)
    free = shutil.disk_usage(trace.resolve().parent).free
    if free < need:
        raise LaunchError(f"--trace-dir {str(trace)!r}: {free / 2**20:.0f} MiB free on its filesystem, a "
                          f"{len(cfg.live_ranks)}-rank trace and its logs need about {need / 2**20:.0f} MiB")


def _is_trace_or_empty(path: Path) -> bool:
    if not any(path.iterdir()):
        return True
    try:
        manifest = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == "prismtrace"


def lock_trace_dir(log_dir: Path) -> int:
    """Hold the trace directory for this job: a lock in its log directory (TRACE_DIR.logs), kept by the
    launcher and its coordinator and released when both exited. Returns the lock's fd. A second job on the
    same directory is refused, naming the first one's launcher."""
    fd = os.open(log_dir / "job.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        trace = log_dir.with_name(log_dir.name.removesuffix(".logs"))
        raise LaunchError(f"--trace-dir {str(trace)!r} is in use by another prism job (launcher pid "
                          f"{holder}): two jobs would overwrite each other's trace and logs; wait for it to "
                          "end or give another --trace-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def check_host_memory(cfg: LaunchConfig, available: int | None = None) -> None:
    """Refuse a job whose running ranks (a folded job's live ones) cannot fit in the host's available
    memory (a host that runs out kills the job without a word), saying what would fit."""
    available = available_host_memory() if available is None else available
    running = len(cfg.live_ranks)
    need = running * RANK_FOOTPRINT + SIDECAR_FOOTPRINT
    if need <= available:
        return
    fit = max(0, (available - SIDECAR_FOOTPRINT) // RANK_FOOTPRINT)
    what = f"--world-size {cfg.world_size}" if running == cfg.world_size else f"a fold's {running} live ranks"
    raise LaunchError(
        f"{what} needs about {need / 2**30:.1f} GiB of host memory ({running} running "
        f"ranks x {RANK_FOOTPRINT / 2**20:.0f} MiB + {SIDECAR_FOOTPRINT / 2**20:.0f} MiB for the coordinator and "
        f"launcher), this host has {available / 2**30:.1f} GiB available: at most {fit} ranks fit. Run fewer "
        "ranks, or fold the job so that only one rank per class runs (Phase 2: `prism-megatron plan`, "
        "`--prism-fold`)")
