"""Host memory for swapped-out GPU state: does this job's fit the host budget, and what limits it.

Ranks that share a device beyond its capacity keep the state of those not resident in host RAM
(runtime.swap), bounded by the host budget (``--host-memory``, by default
90% of the RAM available at start). Per device, with each rank's state at its peak: at least what
does not fit on the device is out at any time, and at most everything but one rank (a rank whose
peak is not known yet computes alone). `plan` and the coordinator (at start from bounds, after
iteration 1 from measured peaks) both ask here.
"""

from __future__ import annotations

from collections.abc import Sequence

HOST_LIMIT_HINT = ("swapped-out state may not fit host memory: --host-memory sets the budget (default 90% of the "
                   "RAM available at start); fewer ranks per device, a larger --device-memory where the GPU has it, "
                   "or a host with more RAM lower the need. Swaps that do not fit wait, and a job that cannot go on "
                   "ends with a report naming the host budget")


def swapped_out_bounds(footprints: Sequence[Sequence[int]], capacities: Sequence[int]) -> tuple[int, int]:
    """(least, most) bytes of the ranks' state out at once over every device (see the module)."""
    least = most = 0
    for sizes, cap in zip(footprints, capacities, strict=True):
        if any(s < 0 for s in sizes) or cap <= 0:
            raise ValueError(f"swap_host_need: negative footprint or non-positive capacity ({list(sizes)}, {cap})")
        total = sum(sizes)
        least += max(0, total - cap)
        most += total - min(sizes) if total > cap else 0
    return least, most


def swap_host_need(footprints: Sequence[Sequence[int]], capacities: Sequence[int] | int,
                   host_budget: int | None, measured: bool = True) -> tuple[bool, str]:
    """Whether swapped-out state fits ``host_budget`` bytes (None: not limited), and a message.

    ``footprints``: per device, each rank's peak (bytes); ``capacities``: each device's bytes (one
    figure for all). ``measured``: the footprints are measured peaks; otherwise bounds, of which only
    the most that may be out means something. Returns (fits, message); with measured peaks, fits is
    False only when even the least that must be out exceeds the budget.
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
    what = "peaks measured by iteration 1"
    if least == most == 0:
        return True, f"every rank's state fits its device by {what}: no swaps, no host memory needed"
    need = f"swapped-out state needs {gib(least)} to {gib(most)} of host memory (from {what})"
    if host_budget is None:
        return True, f"{need}; host memory is not limited here"
    if host_budget >= most:
        return True, f"{need}: fits the host budget of {gib(host_budget)}"
    if host_budget >= least:
        return True, (f"{need}; the host budget of {gib(host_budget)} holds the least, not the most: some swaps "
                      "wait for host room")
    return False, f"{need}; the host budget of {gib(host_budget)} is less than the least that must be out"
