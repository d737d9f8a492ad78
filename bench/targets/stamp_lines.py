"""Pass a run's output through unchanged, and write prism's own lines with the seconds since the run began
to a second file (the run's lines carry no times; a device run's phases are read off this file): prism's
lines, Megatron's iteration lines and its set-up markers (`[after model, ... are built] datetime: ...`, `time to
initialize megatron`), which split a capture's start into its interpreter, Megatron's set-up and the model's build.

    python3 -m prism_megatron run ... 2>&1 | python3 bench/targets/stamp_lines.py OUT/times.txt > OUT/run.log
"""

from __future__ import annotations

import sys
import time

#: The starts of the lines stamped besides Megatron's iteration lines.
STAMPED = ("prism", "predicted iteration", "fits", "OOM", "[after ", "[before ", "time to initialize megatron")


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} TIMES_FILE  (the run's output on stdin)")
    t0 = time.monotonic()
    with open(sys.argv[1], "w", encoding="utf-8") as times:
        times.write("# s since the run began, then the line (prism's own lines, Megatron's iteration lines and its "
                    "set-up markers)\n")
        for line in sys.stdin:
            sys.stdout.write(line)
            sys.stdout.flush()
            if line.startswith(STAMPED) or " iteration " in line[:60]:
                times.write(f"{time.monotonic() - t0:8.1f}  {line[:200].rstrip()}\n")
                times.flush()
        times.write(f"{time.monotonic() - t0:8.1f}  (end of the run's output)\n")


if __name__ == "__main__":
    main()
