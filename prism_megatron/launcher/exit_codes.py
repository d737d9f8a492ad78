"""Exit codes of ``launch``/``run``, shared by the launcher and the ranks."""

OK = 0
RANK_FAILED = 1
BAD_INPUT = 2
HANG = 3
MISMATCH = 4
#: A rank ran out of memory under the target GPU's cap: a prediction, the trace and report are written.
OOM = 5
#: The physical device ran out of memory (ranks share it; not a prediction): the report says what each rank
#: held and what to do, and the trace so far is written, marked incomplete.
DEVICE_OOM = 6


def interrupted(code: int) -> bool:
    """Whether ``code`` is a job ended by a stop signal (128 + N, N in ``trace.schema.STOP_SIGNALS``: a user, a
    scheduler or a time limit stopped it): its trace so far is written, marked incomplete, and the report is
    still made of it."""
    import signal

    from prism_megatron.trace.schema import STOP_SIGNALS

    return code - 128 in {signal.Signals[name] for name in STOP_SIGNALS}
