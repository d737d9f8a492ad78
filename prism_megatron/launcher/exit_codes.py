"""Exit codes of ``launch``/``run``, shared by the launcher and the ranks."""

OK = 0
RANK_FAILED = 1
BAD_INPUT = 2
HANG = 3
MISMATCH = 4
#: A rank ran out of memory under the target GPU's cap: a prediction, the trace and report are written.
OOM = 5
