"""Each memory class of target reports, one line each, so runs of one recipe read side by side (issue 20).

Per class: its verdict, max allocated and max reserved (MiB; an OOM class's are its capture's up to the failing
allocation), headroom, prism's estimate of its peak (GiB), and for a class that ran out of memory its worst rank's
failing request, reserved + request - cap ("short"), what was allocated at the failure and the program's innermost
frame there; for a class that ran to its end, how far prism's estimate of its peak was from its max allocated
(the estimate is what weighs a class that ran out). Allocated bytes repeat between runs of one program; reserved
bytes are the caching allocator's and do not.
    python bench/targets/class_rows.py bench/targets/results/h100-2026-12-06-nocopy-*-report.json*
"""

from __future__ import annotations

import sys

from prism_megatron.report.schema import read_report

MIB = 2**20


def class_rows(report: dict) -> list[str]:
    """One line per memory class of ``report``."""
    ooms = {e["rank"]: e for e in report.get("oom") or []}
    lines = []
    for c in report["memory"]["classes"]:
        estimate = f"{c['estimate'] / 2**30:6.1f}G" if c.get("estimate") is not None else "      -"
        head = "-" if c["headroom"] is None else f"{c['headroom'] / MIB:8.1f}"
        line = (f"  {c['class']:9s} {c.get('verdict') or '-':5s} alloc {c['max_allocated'] / MIB:9.1f} "
                f"res {c['max_reserved'] / MIB:9.1f} head {head} est {estimate}")
        if c.get("estimate") is not None and not any(rank in ooms for rank in c["ranks"]) and c["max_allocated"]:
            line += f" | est/alloc {100 * (c['estimate'] / c['max_allocated'] - 1):+.1f}%"  # ran to its end
        for rank in c["ranks"]:
            e = ooms.get(rank)
            if e and e["requested"] is not None and e["cap"] is not None:
                where = e["where"][-1] if e.get("where") else "?"
                short = e["reserved"] + e["requested"] - e["cap"]
                line += (f" | req {e['requested'] / MIB:.0f} short {short / MIB:.0f}"
                         f" alloc@ {e['allocated'] / MIB:.1f} at {where}")
        lines.append(line)
    return lines


def main(paths: list[str]) -> None:
    for path in paths:
        print(f"== {path}")
        print("\n".join(class_rows(read_report(path))))


if __name__ == "__main__":
    main(sys.argv[1:])
