"""Seam: ``megatron.training.training.train_step`` - iteration boundaries in the trace.

``train`` calls ``train_step`` through its module globals once per iteration, so the wrapper
brackets each iteration with a ``span("iteration", iteration=N)`` (N as Megatron logs it, from
1) and tells the schedule hooks which iteration their units belong to. ``evaluate`` (called by
``evaluate_and_print_results`` through the same module) becomes a span ``evaluate`` whose forward
units carry ``eval=True``, so they are not mistaken for the iteration's training units;
``save_checkpoint_and_time`` a span ``checkpoint_save``. Megatron's iteration timer stops for both,
so the replay leaves them out of the iteration's time (``trace.markers.TIMER_PAUSES``).
On the last rank (Megatron's logger), each logged iteration then waits for its predicted time
(``runtime.live``), which ``print_rank_last`` (looked up in the same module) puts into the
``elapsed time per iteration (ms)`` field, saying it is predicted, beside what emulating that iteration took
(the rank's own ``train_step``). Megatron's own figure is not that: with ``--log-interval`` above 1 it is
the interval's mean, and megatron-core 0.19 logs the first iteration without resetting its timer, so
its second figure is the mean of the first two.
Checked against the supported releases (``megatron.versions``).
"""

from __future__ import annotations

import functools
import re
import time
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, schedules, seam
from prism_megatron.runtime.backend import logs_as_last_rank, stands_for_last_rank
from prism_megatron.trace.markers import CHECKPOINT_SAVE, EVALUATE, span

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table


def _mark_wandb_run() -> None:
    """Megatron's W&B writer (last rank, ``--wandb-project``): where its run is, so the report can log
    the predicted figures into it after the capture (``report.publish``)."""
    from pathlib import Path

    from megatron.training import get_wandb_writer

    from prism_megatron.trace.markers import mark

    writer = get_wandb_writer()
    run = getattr(writer, "run", None)
    if run is None:
        return
    root = getattr(run.settings, "root_dir", None) or str(Path(run.dir).parents[2])
    mark("wandb_run", id=run.id, project=run.project, entity=run.entity or None, dir=str(root))


#: on the last rank, per logged iteration: the prediction ``(seconds | None, note)`` and the iteration's train_step
#: wall time here
_PREDICTED: dict[int, tuple[tuple, float]] = {}
_ELAPSED = re.compile(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+)")


def _ask_prediction(iteration: int, emulated_s: float) -> None:
    """On the rank that prints Megatron's log (the last, or in a fold the live rank standing for it), where
    it will log: the predicted time, and what emulating the iteration took."""
    from megatron.training import get_args

    from prism_megatron.runtime.live import predicted_iteration_time

    if logs_as_last_rank() and iteration % get_args().log_interval == 0:
        answer = predicted_iteration_time(iteration)
        if answer is not None:
            _PREDICTED[iteration] = (answer, emulated_s)


def _with_prediction(message: str) -> str:
    """Megatron's iteration line with the predicted time in its ``elapsed time per iteration`` field."""
    from prism_megatron.runtime.live import format_predicted_ms

    m = _ELAPSED.search(message)
    if m is None or int(m.group(1)) not in _PREDICTED:
        return message
    answer, emulated_s = _PREDICTED.pop(int(m.group(1)))
    shown = format_predicted_ms(answer, emulated_s * 1000)
    return message[:m.start(2)] + shown + message[m.end(2):]


@once
def install() -> None:
    import megatron.training.training as training

    seam(training, "train", CHECKED)
    original = seam(training, "train_step", CHECKED, ("forward_step_func", "data_iterator", "model", "iteration"))

    first = [True]

    @functools.wraps(original)
    def train_step(*args: Any, **kwargs: Any) -> Any:
        if first[0]:  # parallel_state and args are set up by now
            first[0] = False
            from megatron.training import get_args

            from prism_megatron.megatron.workload import mark_rank

            margs = get_args()
            mark_rank(margs, getattr(margs, "padded_vocab_size", None))
            _mark_wandb_run()
        passed = kwargs.get("iteration")
        iteration = passed + 1 if isinstance(passed, int) else schedules.STATE.iteration + 1
        schedules.STATE.begin_iteration(iteration)
        started = time.perf_counter()
        with span("iteration", iteration=iteration):
            result = original(*args, **kwargs)
        _ask_prediction(iteration, time.perf_counter() - started)
        return result

    original_evaluate = seam(training, "evaluate", CHECKED, ("forward_step_func", "data_iterator", "model"))

    @functools.wraps(original_evaluate)
    def evaluate(*args: Any, **kwargs: Any) -> Any:
        schedules.STATE.evaluating = True
        try:
            with span(EVALUATE, iteration=schedules.STATE.iteration):
                return original_evaluate(*args, **kwargs)
        finally:
            schedules.STATE.evaluating = False

    original_save = seam(training, "save_checkpoint_and_time", CHECKED, ("iteration", "model", "optimizer"))

    @functools.wraps(original_save)
    def save_checkpoint_and_time(*args: Any, **kwargs: Any) -> Any:
        with span(CHECKPOINT_SAVE, iteration=schedules.STATE.iteration):
            return original_save(*args, **kwargs)

    original_print = seam(training, "print_rank_last", CHECKED)

    @functools.wraps(original_print)
    def print_rank_last(message: Any) -> Any:
        text = _with_prediction(message) if isinstance(message, str) else message
        if stands_for_last_rank():  # a folded job's last rank is virtual: its representative prints for it
            print(text, flush=True)
            return None
        return original_print(text)

    training.train_step = train_step
    training.evaluate = evaluate
    training.save_checkpoint_and_time = save_checkpoint_and_time
    training.print_rank_last = print_rank_last
