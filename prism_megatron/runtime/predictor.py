"""Live prediction: a rank asks for the predicted time of an iteration (Megatron's log line carries
it); it is answered once every rank has ended that iteration, by replaying the trace so far."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prism_megatron.runtime.ranks import RankState, RankStatus

#: The note a rank gets where the run has no predictor (``--prism-live-prediction off``, ``launch``).
NO_LIVE_PREDICTION = "no live prediction in this run"


class LivePredictor:
    def __init__(self) -> None:
        self.predictor: Any = None  # f(trace_dir, iteration, **options) -> (seconds | None, note)
        self.live_trace: Path | None = None
        self.options: dict = {}
        self.waiting: list[tuple[RankState, int]] = []
        self.iterations_done = 0  # 'iteration' spans ended, summed over ranks (progress of a capture)
        self.iterations_ended: dict[int, int] = {}  # rank -> 'iteration' spans it ended
        #: iteration -> the seconds answered (None: no prediction), for the trace: the report checks its own
        #: figures against what Megatron's log line said
        self.answered: dict[int, float | None] = {}

    def set(self, predictor: Any, live_trace: Path, options: dict | None = None) -> None:
        """``predictor(trace_dir, iteration, **options) -> (seconds | None, note)``, given by the launcher
        (the runtime knows no replay): it reads a snapshot of the trace so far, written to ``live_trace``."""
        self.predictor, self.live_trace, self.options = predictor, live_trace, options or {}

    def iteration_ended(self, rank: int) -> int:
        """``rank`` ended an iteration; returns how many it has ended."""
        self.iterations_done += 1
        self.iterations_ended[rank] = self.iterations_ended.get(rank, 0) + 1
        return self.iterations_ended[rank]

    def ready(self, ranks: dict[int, RankState], world_size: int) -> list[tuple[RankState, int]]:
        """The waiting ranks whose iteration every rank has ended (or exited before)."""
        self.waiting = [(rs, it) for rs, it in self.waiting if rs.state != RankStatus.DONE]  # died waiting
        return [(rs, it) for rs, it in self.waiting if len(ranks) == world_size and all(
            self.iterations_ended.get(r.rank, 0) >= it or r.state == RankStatus.DONE for r in ranks.values())]

    def answer(self, iteration: int, snapshot: Callable[[Path], object]) -> tuple[float | None, str]:
        """The predicted time of ``iteration`` and what it rests on; ``snapshot`` writes the trace so far."""
        if self.predictor is None:
            return None, NO_LIVE_PREDICTION
        try:
            snapshot(self.live_trace)
            seconds, note = self.predictor(self.live_trace, iteration, **self.options)
        except Exception as e:  # a failed prediction must not end the capture
            seconds, note = None, f"prediction failed: {type(e).__name__}: {e}"
        finite = isinstance(seconds, (int, float)) and math.isfinite(seconds)
        self.answered[iteration] = float(seconds) if finite else None
        return seconds, note
