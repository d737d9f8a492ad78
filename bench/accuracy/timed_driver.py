"""The core GPT driver, unchanged, with each rank's iteration boundaries time-stamped (real runs only).

``core_gpt.train`` wraps every iteration in ``span("iteration", iteration=k)``; outside prism no
marker sink is installed and the span is a no-op. Here a sink records, per rank, the wall-clock
time of each iteration's begin and end, so the real job's iteration time can be measured exactly
as the replay measures the prediction: from the first rank's begin to the last rank's end. On a
GPU the sink synchronises the device first, so the stamp is when the work finished, not when it
was queued. Stamps go to ``$ACCURACY_TIMES/rank-R.json`` at exit.

  torchrun --nproc-per-node 2 bench/accuracy/timed_driver.py CORE-DRIVER-FLAGS...
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import time
from pathlib import Path
from typing import Any

from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT
from prism_megatron.trace.markers import set_sink


class _Stamps:
    """Marker sink: ``[(iteration, phase, wall time)]`` of the ``iteration`` spans."""

    def __init__(self) -> None:
        self.stamps: list[tuple[int, str, float]] = []
        self.current = 0  # the E marker carries no attributes: it closes the last B
        self.cuda: bool | None = None

    def record_mark(self, name: str, phase: str, attrs: dict[str, Any]) -> None:
        if name != "iteration":
            return
        if self.cuda is None:
            import torch

            self.cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        if phase == "B":
            self.current = int(attrs["iteration"])
        self.stamps.append((self.current, phase, time.time()))

    def dump(self) -> None:
        out = Path(os.environ["ACCURACY_TIMES"]) / f"rank-{os.environ.get('RANK', '0')}.json"
        out.write_text(json.dumps(self.stamps))


if __name__ == "__main__":
    sink = _Stamps()
    set_sink(sink)
    atexit.register(sink.dump)
    runpy.run_path(str(CORE_DRIVER_SCRIPT), run_name="__main__")
