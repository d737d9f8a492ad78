"""Progress of a long emulation, one line at a time, with an estimate of the time left.

Ranks write straight to the terminal (they are forked with its descriptors), so a live progress bar
would be torn by their output; a periodic line survives it and reads well in a log file too.
"""

from __future__ import annotations

import time


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 5400:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """Start-up (ranks connected) then capture (iterations ended on every rank) with time left."""

    def __init__(self, world_size: int, iterations: int | None, clock=time.perf_counter) -> None:
        self.world_size = world_size
        self.iterations = iterations  # per rank, when known (Megatron's --train-iters)
        self.clock = clock
        self.t0 = clock()
        self.connected = self.finished = self.done = 0
        self.t_capture: float | None = None  # when every rank had connected

    def update(self, connected: int, finished: int, done: int) -> None:
        self.connected, self.finished, self.done = connected, finished, done
        if self.t_capture is None and connected >= self.world_size:
            self.t_capture = self.clock()

    def line(self) -> str:
        now = self.clock()
        elapsed = now - self.t0
        w = self.world_size
        if self.t_capture is None:
            left = ""
            if self.connected:
                left = f", ~{_duration((w - self.connected) * elapsed / self.connected)} left to start"
            return f"starting ranks: {self.connected}/{w} connected, {_duration(elapsed)}{left}"
        head = f"capture: {self.finished}/{w} ranks finished"
        if not self.iterations:
            return f"{head}, {self.done} rank-iterations done, {_duration(elapsed)} elapsed"
        total = w * self.iterations
        frac = min(self.done / total, 1.0)
        left = ""
        if self.done:
            spent = now - self.t_capture
            left = f", ~{_duration(spent * (total - self.done) / self.done)} left"
        return (f"{head}, iterations {self.done}/{total} over all ranks ({100 * frac:.0f}%), "
                f"{_duration(elapsed)} elapsed{left}")
