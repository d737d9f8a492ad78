"""What a program running as a logical rank may ask prism while it runs.

``predicted_iteration_time(N)``: the predicted time of iteration N of the target job, once every
rank has ended it (the rank's slot is given back meanwhile). Outside prism it returns None at once,
so a training script can call it unconditionally where it logs its iteration time.
"""

from __future__ import annotations


def predicted_iteration_time(iteration: int) -> tuple[float | None, str] | None:
    """``(seconds or None, note)`` under prism; None when not running as a prism logical rank."""
    from prism_megatron.runtime import backend

    client = backend._installed
    if client is None:
        return None
    return client.predict(iteration)


def format_predicted_ms(answer: tuple[float | None, str] | None, measured_ms: float) -> str:
    """The value of Megatron's ``elapsed time per iteration (ms):`` field under emulation."""
    if answer is None:
        return f"{measured_ms:.1f}"
    seconds, note = answer
    if seconds is None:
        return f"{measured_ms:.1f} (emulation wall time, not a prediction: {note})"
    return f"{seconds * 1000:.1f} (predicted, {note}; emulation took {measured_ms:.1f})"
