"""Seam: ``megatron.training.training.train_step`` - iteration boundaries in the trace.

``train`` calls ``train_step`` through its module globals once per iteration, so the wrapper
brackets each iteration with a ``span("iteration", iteration=N)`` (N as Megatron logs it, from
1) and tells the schedule hooks which iteration their units belong to. ``evaluate`` (called by
``evaluate_and_print_results`` through the same module) becomes a span ``evaluate`` whose forward
units carry ``eval=True``, so they are not mistaken for the iteration's training units.
Checked against 0.16.1.
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.patches import once, schedules, seam
from prism_megatron.trace.markers import span

CHECKED = ("0.16.1",)


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
        with span("iteration", iteration=iteration):
            return original(*args, **kwargs)

    original_evaluate = seam(training, "evaluate", CHECKED, ("forward_step_func", "data_iterator", "model"))

    @functools.wraps(original_evaluate)
    def evaluate(*args: Any, **kwargs: Any) -> Any:
        schedules.STATE.evaluating = True
        try:
            with span("evaluate", iteration=schedules.STATE.iteration):
                return original_evaluate(*args, **kwargs)
        finally:
            schedules.STATE.evaluating = False

    training.train_step = train_step
    training.evaluate = evaluate
