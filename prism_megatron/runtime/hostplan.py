"""Host memory for swapped-out GPU state: does this job's fit the host budget, and what limits it.

Ranks that share a device beyond its capacity keep the state of those not resident in host RAM
(runtime.swap), bounded by the host budget (``--host-memory``, by default
90% of the RAM available at start). Per device, with each rank's state at its peak: a rank that comes
in is still out while the ranks it displaces go out (they must leave first, or it would not fit), so
at a switch the host holds its state and theirs, whole ranks, at least what does not fit beside it;
at most every rank's state at once (the last resident leaving for one that is out). `plan` and the
coordinator (at start from bounds, after iteration 1 from measured peaks) both ask here. Where a swap
copies only the blocks in use (in-process swaps) these figures, from footprints, are upper bounds.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

HOST_LIMIT_HINT = ("swapped-out state may not fit host memory: --host-memory sets the budget (default 90% of the "
                   "RAM available at start); fewer ranks per device, a larger --device-memory where the GPU has it, "
                   "or a host with more RAM lower the need; --swap inprocess copies only the blocks in use, far fewer "
                   "bytes where the allocator caches much. Swaps that do not fit wait, and a job that cannot go on "
                   "ends with a report naming the host budget")


def available_host_memory() -> int:
    """Bytes of host RAM available now (Linux ``MemAvailable``): what swapped-out GPU state may take."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


EXACT_SUBSETS = 16  # ranks per device up to which whole-rank subsets are enumerated (2**15 sums per rank)


def _least_subset_sum(sizes: Sequence[int], at_least: int) -> int:
    """The smallest sum of whole entries of ``sizes`` that reaches ``at_least`` (``at_least`` itself where
    there are too many to enumerate: still a lower bound; all of them where none does, a rank larger than
    the device alone, which the caller refuses on its own terms)."""
    if len(sizes) >= EXACT_SUBSETS:
        return at_least
    sums = {0}
    for s in sizes:
        sums |= {x + s for x in sums}
    return min((x for x in sums if x >= at_least), default=sum(sizes))


def swapped_out_bounds(footprints: Sequence[Sequence[int]], capacities: Sequence[int]) -> tuple[int, int]:
    """(least, most) bytes of the ranks' state in host memory at once over every device (see the module):
    least, the worst switch (a rank coming in, still out, and the fewest bytes of whole ranks that must
    leave for it); most, every rank's state."""
    least = most = 0
    for sizes, cap in zip(footprints, capacities, strict=True):
        if any(s < 0 for s in sizes) or cap <= 0:
            raise ValueError(f"swap_host_need: negative footprint or non-positive capacity ({list(sizes)}, {cap})")
        total = sum(sizes)
        if total <= cap:
            continue
        least += max(s + _least_subset_sum([*sizes[:i], *sizes[i + 1:]], total - cap) for i, s in enumerate(sizes))
        most += total
    return least, most


def swap_host_need(footprints: Sequence[Sequence[int]], capacities: Sequence[int] | int,
                   host_budget: int | None, measured: bool = True, whole_state: bool = True,
                   basis: str = "peaks measured by iteration 1") -> tuple[bool, str]:
    """Whether swapped-out state fits ``host_budget`` bytes (None: not limited), and a message.

    ``footprints``: per device, each rank's peak (bytes); ``capacities``: each device's bytes (one
    figure for all). ``measured``: the footprints are measured peaks; otherwise bounds, of which only
    the most that may be out means something. ``whole_state``: a swap moves all a rank holds on the
    device (the checkpoint API); otherwise only the blocks in use, fewer bytes, known as it happens.
    ``basis``: where peaks that are not bounds come from, for the message (measured, or prism's estimates).
    Returns (fits, message); with measured peaks, fits is False only when even the least a switch holds
    exceeds the budget, and never where swaps copy only the blocks in use.
    """
    if isinstance(capacities, int):
        capacities = [capacities] * len(footprints)
    if len(capacities) != len(footprints):
        raise ValueError(f"swap_host_need: {len(footprints)} devices' footprints but {len(capacities)} capacities")
    least, most = swapped_out_bounds(footprints, capacities)
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    if not measured:  # bounds: only the most means something
        if most == 0:
            return True, "the ranks fit their devices whatever they hold: no swaps, no host memory needed"
        need = f"swapped-out state may need up to {gib(most)} of host memory before peaks are measured"
        if host_budget is None:
            return True, f"{need}: host memory is not limited here"
        if host_budget >= most:
            return True, f"{need}: fits the host budget of {gib(host_budget)}"
        return False, f"{need}, more than the host budget of {gib(host_budget)} (judged again after iteration 1)"
    what = basis
    if least == most == 0:
        return True, f"every rank's state fits its device by {what}: no swaps, no host memory needed"
    need = f"swapped-out state needs {gib(least)} to {gib(most)} of host memory (from {what})"
    if host_budget is None:
        return True, f"{need}; host memory is not limited here"
    if host_budget >= most:
        return True, f"{need}: fits the host budget of {gib(host_budget)}"
    if not whole_state:
        return True, (f"swapped-out state needs up to {gib(least)} to {gib(most)} of host memory by the ranks' "
                      f"footprints (from {what}); in-process swaps copy only the blocks in use, fewer bytes, so "
                      f"the host budget of {gib(host_budget)} is judged swap by swap")
    if host_budget >= least:
        return True, (f"{need}; the host budget of {gib(host_budget)} holds the least, not the most: some swaps "
                      "wait for host room")
    return False, (f"{need}; the host budget of {gib(host_budget)} is less than the least a switch holds: a rank "
                   "coming in is still out while those it displaces go out, each swap moving all the rank holds on "
                   "the device")
