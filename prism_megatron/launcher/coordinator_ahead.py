"""Coordinators started ahead of the launch that uses them.

A coordinator is a fresh interpreter (``python -m prism_megatron.runtime.sidecar -``) that imports torch and
the runtime before it reads its config: seconds before each launch can fork its ranks. Where one process
launches jobs one after another (a serial capture: one launch per rank class), each launch starts the next
one's coordinator while its own job runs; that interpreter imports, then waits on stdin for the config of the
job that adopts it. The adopting launch sends it the job's secrets and trace-directory lock as it would give
them to a coordinator it started itself: the authkey chosen at the start (in the environment), the lock's file
descriptor over a socket pair (so the lock is shared, as an inherited descriptor is), and the job's log, which
the coordinator takes as its stderr (``CoordinatorConfig.log_path``). One that is never adopted is stopped
when the block ends; one that died waiting is replaced by a fresh start. A caller with planning of its own to
do before its first launch (the run command: seconds of Megatron's parsing) starts that launch's coordinator
first (``start_first``); the launch adopts it where the environment it started in is still the launch's, bar
the variables only the ranks read (``RANKS_ONLY_ENV``), and otherwise stops it and starts its own.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import secrets
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import IO

from prism_megatron.launcher import fork_safe_cuda_checks
from prism_megatron.patches.moe_fold import ENV_VAR as EXPERT_TOKENS_ENV
from prism_megatron.patches.tp_fold_embedding import ENV_VAR as TP_MIRROR_ENV
from prism_megatron.runtime.config import LOCK_SOCKET_ENV

#: The command a coordinator runs (its config on stdin).
COMMAND = [sys.executable, "-m", "prism_megatron.runtime.sidecar", "-"]

#: Variables the run command sets once its fold is planned that only the ranks' program reads (their side of a
#: fold's rules); a coordinator started before they were set is still the launch's.
RANKS_ONLY_ENV = (EXPERT_TOKENS_ENV, TP_MIRROR_ENV)


@dataclasses.dataclass
class Spare:
    """A coordinator waiting for its job: its process, the authkey in its environment, our end of the socket
    pair, a temporary file holding what it said while waiting, and the environment it started in (ours then)."""

    proc: subprocess.Popen
    authkey: bytes
    lock_sock: socket.socket
    stderr: IO[bytes]
    environ: dict[str, str]

    def close(self) -> None:
        for f in (self.lock_sock, self.stderr):
            f.close()


_ahead = False
_spare: Spare | None = None
_exit_hook = False


@contextlib.contextmanager
def coordinators_ahead() -> Iterator[None]:
    """Within the block each launch starts the next launch's coordinator (``start_next``); on leaving it an
    unused one is stopped."""
    global _ahead
    outer, _ahead = _ahead, True
    try:
        yield
    finally:
        _ahead = outer
        if not outer:
            discard()


def start_next() -> None:
    """Start the next launch's coordinator, inside ``coordinators_ahead`` and where none waits yet. A start
    that fails is no error: the next launch starts its own."""
    if _ahead:
        _start()


def start_first() -> None:
    """Start the coordinator of this process's next launch now, outside any block: for a caller with planning
    to do before it launches. Stopped at exit where no launch took it."""
    global _exit_hook
    fork_safe_cuda_checks()  # as the launch sets it before it starts a coordinator: the same environment
    _start()
    if not _exit_hook:
        _exit_hook = True
        atexit.register(discard)


def _start() -> None:
    global _spare
    if _spare is not None:
        return
    authkey = secrets.token_bytes(16)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    err = tempfile.TemporaryFile()  # noqa: SIM115 - handed to the Spare, closed with it
    environ = dict(os.environ)
    env = dict(environ, PRISM_AUTHKEY=authkey.hex(), **{LOCK_SOCKET_ENV: str(theirs.fileno())})
    try:
        proc = subprocess.Popen(COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env,
                                text=True, pass_fds=(theirs.fileno(),))
    except OSError:
        ours.close()
        err.close()
        return
    finally:
        theirs.close()
    _spare = Spare(proc, authkey, ours, err, environ)


def environ_changed(spare: Spare) -> list[str]:
    """The variables, bar ``RANKS_ONLY_ENV``, whose value in this process differs from ``spare``'s start."""
    names = (set(spare.environ) | set(os.environ)) - set(RANKS_ONLY_ENV)
    return sorted(n for n in names if spare.environ.get(n) != os.environ.get(n))


def take() -> Spare | None:
    """The waiting coordinator for this launch, or None (none started, it died waiting, or it started in another
    environment than the launch's: start one)."""
    global _spare
    spare, _spare = _spare, None
    if spare is not None and (spare.proc.poll() is not None or environ_changed(spare)):
        abandon(spare)
        return None
    return spare


def adopt(spare: Spare, config_json: str, log_path: str, lock_fd: int | None) -> None:
    """Hand ``spare`` its job: what it said while waiting goes first into the job's log, then the lock (over
    the socket pair), then the config (``config_json`` must name ``log_path``). Raises OSError where it died
    meanwhile; the caller then stops it (``abandon``) and starts a coordinator itself."""
    spare.stderr.seek(0)
    with open(log_path, "wb") as log:
        log.write(spare.stderr.read())
    socket.send_fds(spare.lock_sock, [b"L"], [lock_fd] if lock_fd is not None else [])
    spare.proc.stdin.write(config_json)
    spare.proc.stdin.close()
    spare.close()


def discard() -> None:
    """Stop the waiting coordinator, if any."""
    global _spare
    spare, _spare = _spare, None
    if spare is not None:
        abandon(spare)


def abandon(spare: Spare) -> None:
    """Stop a coordinator no launch will use (its adoption failed, it died waiting, or none came)."""
    if spare.proc.poll() is None:
        spare.proc.kill()
    spare.proc.wait()
    for f in (spare.proc.stdin, spare.proc.stdout):
        with contextlib.suppress(OSError):
            if f is not None:
                f.close()
    spare.close()
