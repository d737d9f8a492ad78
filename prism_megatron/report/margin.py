"""Per-class memory verdicts, and the margin a Transformer Engine substitution puts on them.

A target recipe that publishes ``--transformer-impl transformer_engine`` runs here as Megatron's local
spec (torch norms and linears, prism's fused attention): its measured peak is that program's, and TE's
own kernels keep somewhat different activations and workspaces. So where the recipe records that
substitution, a class whose peak lies within ``TE_SUBSTITUTION_MARGIN`` of the target's cap (either
side) is not called fits or OOM but "within the TE-substitution margin": the rendered program's bytes
cannot decide it. The margin and its basis: docs/features.md.

A class that ran out of memory under the cap stopped at its failing allocation, so what it reserved plus
what it asked for is the least it needed, not its peak: a class that needs 130 GiB fails its first request
past 76 GiB just as one that needs 77 GiB does. Its need is therefore the larger of that and prism's own
estimate of the class's peak (``memory.estimate``, recorded in the trace's ``job.memory_estimates``);
without an estimate the need is unknown beyond the failing allocation and the class is plain OOM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prism_megatron.recipe.schema import te_substituted

__all__ = ["TE_SUBSTITUTION_MARGIN", "FITS", "OOM", "WITHIN_MARGIN", "te_substituted", "class_needs", "class_caps",
           "class_verdicts", "class_estimates", "oom_classes"]

#: fraction of the target GPU's cap: |cap - peak| <= margin x cap is within the margin (docs/features.md)
TE_SUBSTITUTION_MARGIN = 0.05
FITS, OOM, WITHIN_MARGIN = "fits", "OOM", "within the TE-substitution margin"


def class_needs(memory: dict[str, Any], oom: list[dict[str, Any]],
                estimates: dict[str, int] | None = None) -> dict[str, int | None]:
    """Class -> what it needs (bytes): its worst rank's max reserved, or, where it ran out of memory, the
    larger of what it reserved plus what it asked for (the least it needed: the capture stopped there) and
    ``estimates[class]`` (prism's estimate of its peak). None where an OOM entry recorded no request."""
    estimates = estimates or {}
    need: dict[str, int | None] = {c["class"]: c["max_reserved"] for c in memory["classes"]}
    for e in oom:
        asked = None if e["requested"] is None else e["reserved"] + e["requested"]
        have = need.get(e["class"])
        need[e["class"]] = None if asked is None else max(asked, have or 0)
    for name in oom_classes(memory, oom):
        estimate, have = estimates.get(name), need.get(name)
        if estimate is not None and have is not None:
            need[name] = max(have, estimate)
    return need


def class_caps(memory: dict[str, Any], oom: Sequence[dict[str, Any]] = ()) -> dict[str, int]:
    """Class -> the largest cap of its ranks and of its ``oom`` entries (an entry carries its rank's cap, where
    that rank has no row), bytes; classes without a cap are left out."""
    caps: dict[str, int] = {}
    for r in (*memory["ranks"], *oom):
        if r["cap"] is not None:
            caps[r["class"]] = max(caps.get(r["class"], 0), r["cap"])
    return caps


def class_verdicts(memory: dict[str, Any], oom: list[dict[str, Any]], margin: float | None,
                   estimates: dict[str, int] | None = None) -> dict[str, str | None]:
    """Class -> its verdict (None where no cap was set), judged on ``class_needs``: a class that ran out of
    memory is OOM, or within ``margin`` (a fraction of the cap; None: plain fits/OOM) where its need is; one
    without an estimate is plain OOM (its need is known only to pass its failing request)."""
    estimates = estimates or {}
    caps = class_caps(memory)
    need = class_needs(memory, oom, estimates)
    dead = oom_classes(memory, oom)
    out: dict[str, str | None] = {}
    for c in memory["classes"]:
        name, cap = c["class"], caps.get(c["class"])
        if cap is None:
            out[name] = None
            continue
        peak = need.get(name)
        plain = OOM if name in dead or (peak is not None and peak > cap) else FITS
        known = name not in dead or name in estimates
        near = margin is not None and known and peak is not None and abs(cap - peak) <= margin * cap
        out[name] = WITHIN_MARGIN if near else plain
    return out


def oom_classes(memory: dict[str, Any], oom: list[dict[str, Any]]) -> set[str]:
    """The classes a rank of which ran out of memory under the cap."""
    return {r["class"] for r in memory["ranks"] if r["oom"]} | {e["class"] for e in oom}


def class_estimates(memory: dict[str, Any], by_rank: dict[int, int]) -> dict[str, int]:
    """Class -> prism's estimate of its peak from ``by_rank`` (rank -> bytes, the ranks that ran: the trace's
    ``job.memory_estimates``); the largest of a class's ranks."""
    out: dict[str, int] = {}
    for r in memory["ranks"]:
        if r["rank"] in by_rank:
            out[r["class"]] = max(out.get(r["class"], 0), by_rank[r["rank"]])
    return out
