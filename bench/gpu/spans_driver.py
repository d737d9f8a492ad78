"""The training driver as a plain process runs it, with each micro-batch's forward and backward timed where an
emulated rank's trace marks them (``prism_megatron.patches.schedules``: Megatron's ``forward_step`` and
``backward_step``), so the real program's time splits as the rank's does.

An emulated rank's iterations ran ~5 % longer than the real program's on host-bound configs, GPU timing on or off
(docs/measurements.md, runs 32-34); the whole iteration cannot say whether the forward, the backward (the autograd
engine's thread on a GPU) or what lies between them (the optimizer, the data, the loss) is slower in the rank. The
spans are host wall time (the kernels they queue run on), as a one-clock rank's segments are. Each call of
``torch.distributed.broadcast`` or ``all_reduce`` is kept too (``collective``, duration 0): where an emulated rank's
trace cuts a forward into segments (the data's broadcasts before the model's body, the loss's all-reduces after it),
so the body can be set against the rank's. At exit it writes ``$SPANS_OUT`` (JSON): ``[[name, seconds from the
first span, duration in seconds], ...]`` in the order they began.

Two variables each give the plain process one thing an emulated rank's process has (the bisection of the rank's
slow compiled-call frames, docs/measurements.md): ``SPANS_MEMORY_HISTORY=1`` records the CUDA allocator's history as
the rank's memory probe does (``memory.probe.HISTORY``, turned on from the main thread before the program, which
also adds torch's thread-local RecordFunction callback for the snapshot's annotations), ``SPANS_IDLE_RECEIVER=1``
starts a thread blocked in a socket read, as the rank's ``prism-receiver`` is between the coordinator's messages.

  SPANS_OUT=spans.json python bench/gpu/spans_driver.py DRIVER_SCRIPT DRIVER-FLAGS...
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from prism_megatron.patches import schedules
from prism_megatron.trace import markers

HISTORY_ENV = "SPANS_MEMORY_HISTORY"
RECEIVER_ENV = "SPANS_IDLE_RECEIVER"


class _Timed:
    """A marker sink that keeps each span's start and duration (the two spans never nest)."""

    def __init__(self) -> None:
        self.spans: list[list[Any]] = []
        self._open: dict[str, float] = {}
        self._t0: float | None = None

    def record_mark(self, name: str, phase: str, attrs: dict[str, Any]) -> None:
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        if phase == "B":
            self._open[name] = now
        elif phase == "E" and name in self._open:
            start = self._open.pop(name)
            self.spans.append([name, start - self._t0, now - start])

    def collective(self) -> None:
        if self._t0 is not None:
            self.spans.append(["collective", time.perf_counter() - self._t0, 0.0])


def _time_collectives(sink: _Timed) -> None:
    """Keep when each broadcast and all-reduce is called (the seams of an emulated rank's segments)."""
    import torch.distributed as dist

    for name in ("broadcast", "all_reduce"):
        original = getattr(dist, name)

        def timed(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            sink.collective()
            return _original(*args, **kwargs)

        setattr(dist, name, timed)


def _as_a_rank() -> list[Any]:
    """What of an emulated rank's process the environment asks for, set up as the rank does before its program;
    returns what must live as long as the program (the receiver's socket pair)."""
    kept: list[Any] = []
    if os.environ.get(HISTORY_ENV) == "1":
        import torch

        from prism_megatron.memory.probe import HISTORY

        if not torch.cuda.is_available():
            raise SystemExit(f"{HISTORY_ENV}=1 records the CUDA allocator's history: no CUDA device here")
        torch.cuda.memory._record_memory_history(**HISTORY)
    if os.environ.get(RECEIVER_ENV) == "1":
        import socket
        import threading

        mine, theirs = socket.socketpair()
        threading.Thread(target=mine.recv, args=(1,), name="idle-receiver", daemon=True).start()
        kept += [mine, theirs]
    return kept


def main() -> int:
    out = os.environ.get("SPANS_OUT")
    if len(sys.argv) < 2 or not out:
        print("usage: SPANS_OUT=FILE spans_driver.py DRIVER_SCRIPT [FLAGS...]", file=sys.stderr)
        return 2
    driver, *flags = sys.argv[1:]
    kept = _as_a_rank()  # noqa: F841 - the receiver's sockets live as long as the program
    sink = _Timed()
    schedules.install()
    markers.set_sink(sink)
    _time_collectives(sink)
    atexit.register(lambda: Path(out).write_text(json.dumps(sink.spans)))  # also where the driver exits itself
    sys.argv = [driver, *flags]
    runpy.run_path(driver, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
