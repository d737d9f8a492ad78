"""Seam: ``megatron.training.training.train_step`` - iteration boundaries in the trace.

``train`` calls ``train_step`` through its module globals once per iteration, so the wrapper
brackets each iteration with a ``span("iteration", iteration=N)`` (N as Megatron logs it, from
1) and tells the schedule hooks which iteration their units belong to. Checked against 0.16.1.
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.patches import schedules, seam
from prism_megatron.trace.markers import span

CHECKED = ("0.16.1",)
_done = False


def install() -> None:
    global _done
    if _done:
        return
    import megatron.training.training as training

    seam(training, "train", CHECKED)
    original = seam(training, "train_step", CHECKED, ("forward_step_func", "data_iterator", "model", "iteration"))

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        passed = kwargs.get("iteration")
        iteration = passed + 1 if isinstance(passed, int) else schedules.STATE.iteration + 1
        schedules.STATE.begin_iteration(iteration)
        with span("iteration", iteration=iteration):
            return original(*args, **kwargs)

    training.train_step = train_step
    _done = True
