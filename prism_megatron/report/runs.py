"""A timeline row's runs merged to a resolution: what the report keeps and what the page draws.

A thousand-rank MoE job's median iteration holds about a hundred thousand runs per rank (each layer's
short waits), which neither a page nor a reader can tell apart. Runs narrower than the resolution are
merged into one entry per resolution step or so, which keeps every kind's share of its time.

An entry is ``[kind, start, end]`` (one run as it is) or ``[kind, start, end, {"segments": n,
"share_s": {kind: seconds}}]`` (n narrower runs merged; ``kind`` the one taking most of its time).
Merging merged entries again adds their counts and shares, so the page can draw the report's entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["merge_narrow", "parts"]


def parts(entry: Sequence[Any]) -> tuple[str, float, float, int, dict[str, float]]:
    """(kind, start, end, runs, seconds per kind) of an entry, merged or not."""
    kind, start, end = entry[0], entry[1], entry[2]
    if len(entry) > 3:
        return kind, start, end, entry[3]["segments"], entry[3]["share_s"]
    return kind, start, end, 1, {kind: end - start}


def merge_narrow(entries: Iterable[Sequence[Any]], width: float, digits: int | None = None) -> list[list[Any]]:
    """``entries`` (in time order) with each run of consecutive entries narrower than ``width`` merged into one
    entry per ``width`` or so; an entry ``width`` wide or wider stays as it is. ``digits``: shares rounded."""
    out: list[list[Any]] = []
    group: list[Sequence[Any]] = []

    def flush() -> None:
        if len(group) == 1:
            out.append(list(group[0]))
        elif group:
            share: dict[str, float] = {}
            count = 0
            for entry in group:
                _, _, _, n, seconds = parts(entry)
                count += n
                for kind, s in seconds.items():
                    share[kind] = share.get(kind, 0.0) + s
            top = max(share, key=lambda k: (share[k], k))
            if digits is not None:
                share = {k: round(v, digits) for k, v in share.items()}
            out.append([top, group[0][1], group[-1][2], {"segments": count, "share_s": share}])
        group.clear()

    for entry in entries:
        if entry[2] - entry[1] >= width:
            flush()
            group.append(entry)
            flush()
            continue
        group.append(entry)
        if group[-1][2] - group[0][1] >= width:
            flush()
    flush()
    return out
