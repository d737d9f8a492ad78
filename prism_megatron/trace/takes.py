"""Two takes of one serial capture compared on what the second pass can change in time and memory: the routing.

A take again differs from the one before it only in the stand-ins' norms and the small reductions' recorded
inputs (``nccl_prune.SECOND_PASS_RULE``); those steer values, and shapes, the op sequence, time and memory
follow values only through MoE routing. So where a take routed every token as the one before it did (each
all-to-all's split sizes, in order), the recordings it added changed none of what the report's time and memory
rest on (``launcher.serial`` stops the second pass there under ``auto``).
"""

from __future__ import annotations

from pathlib import Path

from prism_megatron.trace.reader import PrismTrace, read_trace

__all__ = ["routing", "routing_change"]


def routing(trace: PrismTrace, rank: int) -> list[str]:
    """Rank ``rank``'s all-to-alls that recorded their split sizes, in issue order: each one's ``splits`` (JSON
    text: bytes to and from each group member, so tokens per destination and expert)."""
    return [o["splits"] for o in trace.ops_for_rank(rank) if o["kind"].startswith("all_to_all") and o["splits"]]


def routing_change(earlier: Path, later: Path, rank: int) -> str | None:
    """None where rank ``rank``'s take at ``later`` routed every token as its take at ``earlier`` did: both
    complete, with the same number of all-to-alls that recorded split sizes (at least one), each equal; else
    what differs, or why it cannot be told."""
    takes = []
    for path in (earlier, later):
        trace = read_trace(path)
        if trace.incomplete is not None:
            return f"{path.name} did not complete ({trace.incomplete})"
        takes.append(routing(trace, rank))
    a, b = takes
    if not a or not b:
        return "no all-to-all recorded its split sizes: the routing cannot be compared"
    if len(a) != len(b):
        return f"{len(a)} all-to-alls in {earlier.name}, {len(b)} in {later.name}"
    differ = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    if differ:
        return f"{len(differ)} of {len(a)} all-to-alls routed differently (the first: #{differ[0] + 1})"
    return None
