"""Which kind of rank a rank is, from its ``layout`` mark.

Ranks of one pipeline stage (and one expert rank) hold the same layers, so they need the same
memory and do the same work: the report compares classes, not thousands of single ranks.
"""

from __future__ import annotations

from typing import Any

UNKNOWN = "unknown"
ALL_RANKS = "all ranks"


def rank_class(layout: dict[str, Any] | None) -> str:
    """'stage P of N (first|last)' when pipelined, plus ' · expert rank E' with expert parallelism.

    P is the pipeline rank as Megatron numbers it (from 0). 'all ranks' when there is neither
    pipeline nor expert parallelism, 'unknown' without a layout mark.
    """
    if not layout:
        return UNKNOWN
    pp, pp_size = int(layout.get("pp") or 0), int(layout.get("pp_size") or 1)
    ep, ep_size = int(layout.get("ep") or 0), int(layout.get("ep_size") or 1)
    parts = []
    if pp_size > 1:
        end = " (first)" if pp == 0 else " (last)" if pp == pp_size - 1 else ""
        parts.append(f"stage {pp} of {pp_size}{end}")
    if ep_size > 1:
        parts.append(f"expert rank {ep}")
    return " · ".join(parts) or ALL_RANKS


def class_order(name: str) -> tuple:
    """Sort key: stages and expert ranks in numeric order, 'unknown' last."""
    nums = [int(w) for w in name.replace("(", " ").split() if w.isdigit()]
    return (name == UNKNOWN, nums, name)
