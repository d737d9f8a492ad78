"""Whether the coordinator must end the job itself: its launcher died, never connected, or a signal
ended the job and the launcher did not (nothing of a job may outlive both)."""

from __future__ import annotations

import os
import time

#: Seconds the coordinator waits for its launcher's control connection before it gives up and exits
#: (a launcher that died during start-up must not leave it running).
CONNECT_TIMEOUT = 60.0
#: Seconds a signalled coordinator leaves a live launcher to end the job (a job stop signals every process).
ENDING_GRACE = 30.0


class LauncherWatch:
    """The coordinator's view of its launcher (``launcher_pid``: 0 when none is watched)."""

    def __init__(self) -> None:
        self.launcher_pid = 0
        self.ending: str | None = None  # set by a signal: why the job must end (handled in the loop)
        self.ending_since = 0.0
        self._t_start = time.monotonic()

    def signalled(self, why: str) -> None:
        self.ending, self.ending_since = why, time.monotonic()

    def _died(self) -> bool:
        return bool(self.launcher_pid) and os.getppid() != self.launcher_pid

    def reason_to_end(self, connected: bool) -> str | None:
        """Why the coordinator must end the job now (``connected``: the launcher's control connection
        came), or None while the launcher is there to do it."""
        if self.ending is not None and (not connected or self._died()
                                        or time.monotonic() - self.ending_since > ENDING_GRACE):
            return self.ending  # else the launcher, signalled too, ends the job itself first
        if self._died():
            return f"the launcher (pid {self.launcher_pid}) died"
        if not connected and time.monotonic() - self._t_start > CONNECT_TIMEOUT:
            return f"no launcher connected within {CONNECT_TIMEOUT:.0f} s"
        return None

    def why_gone(self) -> str:
        """Why the launcher's connection closed: it died (it is reparented away soon after its sockets
        close), or it closed it."""
        for _ in range(20):
            if self._died():
                return f"the launcher (pid {self.launcher_pid}) died"
            time.sleep(0.05)
        return "lost the launcher's connection"
