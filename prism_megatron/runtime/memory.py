"""Memory-aware residency: which ranks' GPU state is on the device, and whom to evict for whom.

Pure bookkeeping around a swapper, so the policy is testable without a GPU. A rank about to get a
slot must be resident; if the device lacks room, blocked residents are swapped out first — those
whose pending ops will complete last (most members still missing), since they will not need the
GPU soon. Restores are scheduled by free memory, never by hope: a restore is only tried when the
accounting says it fits (a failed restore costs nothing but leaves the rank out).

A checkpointed rank's GPU state lives in host memory, so host RAM bounds how much can be swapped
out at once (a host may have less RAM than its GPUs have memory): a swap-out that
would not fit the host budget is not made, and a rank that needs one waits like any other.

Under `--swap auto` the CUDA profiler (GPU timing) and the checkpoint API exclude each other (the
driver refuses to lock a process the profiler ran in): a device's ranks run set-up and iteration 1
without the profiler, swapping if they must, and then `timing_verdict` decides from what they hold
whether the device goes on swapping (no GPU timing) or is pinned (no more swaps, GPU timing on).

A rank is admitted for its turn with room for its *expected peak* (runtime.peaks; the caller
says how much): while it computes, that reserve counts against the device, not what it held when it
last blocked, so ranks that grow in their turn never overrun the device together. Its report as it
blocks ends the reserve. A rank whose process has not started CUDA yet (it reports 0 bytes, e.g.
blocked in `init_process_group` before its first allocation) holds nothing to move, and the driver
refuses to lock such a process (CUDA_ERROR_NOT_INITIALIZED, bench/gpu/swap_bench.py): it is never a
victim, and its turns are admitted with room for what it may allocate, like any other's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prism_megatron.runtime.swap import BudgetSwapper, SwapNoRoom, Swapper, timed

TIMING_HEADROOM = 0.05  # of a device left free before GPU timing may pin it (a judgement, not measured)


@dataclass
class SwapStats:
    swaps_out: int = 0
    swaps_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    seconds: float = 0.0


@dataclass
class HostBudget:
    """Host memory that checkpointed GPU state may take, shared by every device of the job (bytes)."""

    capacity: int
    held: dict[int, int] = field(default_factory=dict)  # rank -> bytes of its checkpointed state

    def free(self) -> int:
        return self.capacity - sum(self.held.values())


@dataclass
class DeviceMemory:
    """One device's capacity, its resident ranks and their footprints (bytes)."""

    capacity: int
    swapper: Swapper
    footprint: dict[int, int] = field(default_factory=dict)
    resident: set[int] = field(default_factory=set)
    stats: dict[int, SwapStats] = field(default_factory=dict)
    host: HostBudget | None = None  # None: host memory not limited (the stand-in's tests)
    no_context: set[int] = field(default_factory=set)  # ranks without CUDA state yet: admitted, or reported 0
    pinned: bool = False  # GPU timing runs here: its ranks cannot be checkpointed, so no swaps any more
    reported: dict[int, int] = field(default_factory=dict)  # each rank's last report, as sent
    offset: dict[int, int] = field(default_factory=dict)  # NVML minus that report at the last cross-check
    reserve: dict[int, int] = field(default_factory=dict)  # computing ranks: room held for their turn's peak
    swapped: set[int] = field(default_factory=set)  # ranks whose state is checkpointed to host memory
    left: dict[int, int] = field(default_factory=dict)  # swapped-out ranks: device bytes they still hold
    reported_turn: set[int] = field(default_factory=set)  # computing ranks that reported since admission
    host_need_seen: dict[int, int] = field(default_factory=dict)  # rank -> host bytes its last swap-out plan needed

    def charge(self, rank: int) -> int:
        """What ``rank`` counts against the device: what it holds, or its reserve while it computes (a
        swapped-out rank: what the swap left, runtime.swap)."""
        if rank in self.swapped:
            return self.left.get(rank, 0)
        held = self.footprint.get(rank, 0) if rank in self.resident else 0
        return max(held, self.reserve.get(rank, 0))

    def _charged(self) -> set[int]:
        return self.resident | set(self.reserve) | self.swapped

    def used(self) -> int:
        return sum(self.charge(r) for r in self._charged())

    def _others(self, rank: int) -> int:
        """What every rank but ``rank`` counts against the device now."""
        return sum(self.charge(r) for r in self._charged() if r != rank)

    def _fits_back(self, rank: int) -> bool:
        """A swapped-out ``rank``'s state fits the device beside what the others count now (it may come back
        before anyone goes out)."""
        return self.footprint.get(rank, 0) <= self.capacity - self._others(rank)

    def most_for(self, rank: int) -> int:
        """The most ``rank`` can hold here with every other rank swapped out: the device less what the
        others keep when out (an in-process swap leaves the CUDA context, runtime.swap). A bound for a rank
        nothing is measured of is never more, or no eviction could ever make room for it."""
        return self.capacity - sum(self.left.get(r, 0) if r in self.swapped
                                   else self.swapper.residual(r, self.footprint.get(r, 0))
                                   for r in self._charged() if r != rank)

    def _frees(self, rank: int) -> int:
        """What swapping ``rank`` out is expected to free."""
        return self.charge(rank) - self.swapper.residual(rank, self.footprint.get(rank, 0))

    def report(self, rank: int, nbytes: int) -> None:
        """A rank's measured footprint (allocator reserved + context), sent as it blocks: it ran, so it
        is resident, unless it holds nothing on the GPU yet (then its estimate stays, see the module)."""
        self.stats.setdefault(rank, SwapStats())
        self.reported_turn.add(rank)
        if isinstance(self.swapper, BudgetSwapper):  # the stand-in enforces the same figures
            self.swapper.footprint[rank] = nbytes
            self.swapper.used[rank] = nbytes
        if nbytes == 0:
            self.no_context.add(rank)
            self.resident.discard(rank)
            return
        self.no_context.discard(rank)
        self.swapped.discard(rank)
        self.left.pop(rank, None)
        self.reported[rank] = nbytes
        self.footprint[rank] = max(nbytes + self.offset.get(rank, 0), 0)
        self.resident.add(rank)

    def cross_check(self, rank: int, nvml_bytes: int) -> tuple[int, int] | None:
        """What the driver holds for a resident rank whose report is current (it is blocked), by NVML:
        from now on its footprint is that, and later reports move it by what the allocator moves.
        Returns (reported, NVML) bytes, or None for a rank with nothing to compare."""
        if rank not in self.resident or rank in self.no_context or rank not in self.reported:
            return None
        self.offset[rank] = nvml_bytes - self.reported[rank]
        self.footprint[rank] = nvml_bytes
        if isinstance(self.swapper, BudgetSwapper):
            self.swapper.footprint[rank] = self.swapper.used[rank] = nvml_bytes
        return self.reported[rank], nvml_bytes

    def enforce(self, evictable: list[int], pids: dict[int, int], completes_last: Callable[[int], float]) -> None:
        """Swap blocked residents out, longest wait first, until what is resident fits the device."""
        if self.pinned:
            return
        order = sorted((r for r in evictable if self._victim(r)), key=completes_last, reverse=True)
        for r in order:
            if self.used() <= self.capacity:
                return
            if self._host_room() >= self._host_need(r):
                self._out(r, pids[r])

    def forget(self, rank: int) -> None:
        """The rank's process ended: its memory is free."""
        self.resident.discard(rank)
        self.swapped.discard(rank)
        self.left.pop(rank, None)
        if hasattr(self.swapper, "forget"):
            self.swapper.forget(rank)
        self.reserve.pop(rank, None)
        self.reported_turn.discard(rank)
        self.footprint.pop(rank, None)
        self.reported.pop(rank, None)
        self.offset.pop(rank, None)
        if self.host is not None:
            self.host.held.pop(rank, None)
        if isinstance(self.swapper, BudgetSwapper):
            self.swapper.used.pop(rank, None)

    def swap_out(self, rank: int, pid: int) -> None:
        """Checkpoint a resident rank (the caller guarantees it is blocked)."""
        self._out(rank, pid)

    def released(self, rank: int) -> None:
        """``rank`` gave its slot back: its reserve ends. Without a report since its admission (it gave
        the slot back without blocking on an op), it may hold up to the reserve: count that."""
        room = self.reserve.pop(rank, None)
        if room is not None and rank not in self.reported_turn and rank in self.resident:
            self.footprint[rank] = max(self.footprint.get(rank, 0), room)
        self.reported_turn.discard(rank)

    def make_resident(self, rank: int, need: int, evictable: list[int], pids: dict[int, int],
                      completes_last: Callable[[int], float]) -> bool:
        """Room for ``rank``'s turn: ``need`` bytes (its expected peak) while it computes, its state
        restored if it was swapped out, evicting from ``evictable`` (blocked, slot-less ranks) as needed.

        Returns False, changing nothing, when even evicting every candidate leaves too little room (the
        caller retries later).
        """
        if self.pinned:  # no swaps here: ranks share the device as under --swap none (their peaks fit)
            return self._restore(rank, pids) if rank in self.swapped else True
        need = max(need, self.footprint.get(rank, 0) if rank in self.resident or rank in self.swapped else 0)
        short = need - (self.capacity - self._others(rank))
        victims, freed = self._victims(rank, short, evictable, completes_last)
        # Where the host budget keeps the victims in, a swapped-out rank whose state fits the device as it is
        # comes back first: its host memory is then free for theirs (otherwise a rank out with a little state
        # can keep the one resident rank, whose state needs nearly all the budget, from ever going out).
        first = freed < short and rank in self.swapped and self.host is not None and self._fits_back(rank)
        if first:
            victims, freed = self._victims(rank, short, evictable, completes_last,
                                           host_extra=self.host.held.get(rank, 0))
        if freed < short:
            return False
        self.stats.setdefault(rank, SwapStats())
        if first and not self._restore(rank, pids):
            return False
        for r in victims:
            self._out(r, pids[r])
        if rank in self.swapped and not self._restore(rank, pids):
            return False
        self.reserve[rank] = need
        self.reported_turn.discard(rank)
        return True

    def make_room(self, rank: int, nbytes: int, evictable: list[int], pids: dict[int, int],
                  completes_last: Callable[[int], float]) -> bool:
        """``rank`` computes and its allocation found the device full, ``nbytes`` short: swap out blocked
        residents (those that wait longest first, within the host budget) until what they free covers it,
        and let the rank count as holding all that is left. False, changing nothing, where they cannot
        free that much (or the device is pinned: no swaps there)."""
        if self.pinned:
            return False
        victims, freed = self._victims(rank, nbytes, evictable, completes_last)
        if not victims or freed < nbytes:
            return False
        for r in victims:
            self._out(r, pids[r])
        self.reserve[rank] = max(self.reserve.get(rank, 0), self.capacity - self._others(rank))
        return True

    def _victims(self, rank: int, short: int, evictable: list[int],
                 completes_last: Callable[[int], float], host_extra: int = 0) -> tuple[list[int], int]:
        """Blocked residents to swap out for ``rank`` until they free ``short`` bytes (those that wait longest
        first, each only if its state fits what is left of the host budget, ``host_extra`` more where ``rank``
        comes back first), and what they free."""
        order = sorted((r for r in evictable if self._victim(r) and r != rank), key=completes_last, reverse=True)
        freed, host_free, victims = 0, self._host_room() + host_extra, []
        for r in order:
            if freed >= short:
                break
            host = self._host_need(r)
            if host > host_free:  # its state would not fit in host memory
                continue
            victims.append(r)
            freed += self._frees(r)
            host_free -= host
        return victims, freed

    def _restore(self, rank: int, pids: dict[int, int]) -> bool:
        try:
            dt = timed(self.swapper.restore, rank, pids[rank])
        except SwapNoRoom:
            return False
        s = self.stats[rank]
        s.swaps_in += 1
        s.bytes_in += self.footprint.get(rank, 0)
        s.seconds += dt
        self.swapped.discard(rank)
        self.left.pop(rank, None)
        self.resident.add(rank)
        if self.host is not None:
            self.host.held.pop(rank, None)
        return True

    def timing_verdict(self, peaks: dict[int, int] | None = None) -> tuple[bool, str]:
        """Once every rank of the device ended iteration 1: may GPU timing start here? Yes when the
        ranks' peaks (``peaks``: rank -> what it may reach in iteration 2 by iteration 1, device bytes:
        the governor's expectation, which counts state made at iteration 1's end, the optimizer's, as
        held through iteration 2's turns; default what they hold) together leave `TIMING_HEADROOM` of the
        device: they can all stay resident, so the device is pinned (no swaps from here; ranks swapped
        out are restored as they get a slot). No keeps swapping possible and the compute on one clock.
        Swaps before the verdict do not matter: the profiler starts only after it."""
        held = {r: self.footprint.get(r, 0) for r in self.resident}  # not reserves: those are bounds
        total = sum(held.values()) if peaks is None else sum(max(v, held.get(r, 0)) for r, v in peaks.items())
        swaps = sum(s.swaps_out for s in self.stats.values())
        held = f"{total / 2**30:.1f} of {self.capacity / 2**30:.1f} GiB"
        if total > (1 - TIMING_HEADROOM) * self.capacity:
            return False, (f"GPU timing stays off: the ranks' peaks expected from iteration 1 add up to {held}, "
                           f"less than {TIMING_HEADROOM:.0%} left for growth, so swaps may be needed; compute is "
                           "replayed on one clock")
        self.pinned = True
        before = f" ({swaps} swap(s) before)" if swaps else ""
        return True, (f"GPU timing on: the ranks' peaks expected from iteration 1 add up to {held}; all stay "
                      f"resident, no swaps from here{before}")

    def _victim(self, rank: int) -> bool:
        """Resident and holding GPU state of its own (it reported bytes): a checkpoint would free something."""
        return rank in self.resident and rank not in self.no_context

    def _host_room(self) -> float:
        return self.host.free() if self.host is not None else float("inf")

    def _host_need(self, rank: int) -> int:
        """Host bytes a swap out of ``rank`` takes (asked of the swapper only where host memory is limited;
        kept in ``host_need_seen`` for the hang report)."""
        footprint = self.footprint.get(rank, 0)
        if self.host is None:
            return footprint
        self.host_need_seen[rank] = self.swapper.host_bytes(rank, footprint)
        return self.host_need_seen[rank]

    def kept_in(self, evictable: list[int]) -> list[tuple[int, int]]:
        """The blocked residents no swap out may move for lack of host memory: (rank, host bytes it needs),
        by the latest figures asked."""
        if self.host is None:
            return []
        seen = {r: self.host_need_seen.get(r, self.footprint.get(r, 0)) for r in evictable if self._victim(r)}
        return [(r, n) for r, n in seen.items() if n > self.host.free()]

    def held_out(self, rank: int) -> str | None:
        """Why a swapped-out ``rank`` that waits for room keeps its host memory (for the hang report), or
        None: it is not out, or holds none, or could come back first (make_resident)."""
        if self.host is None or rank not in self.swapped or not self.host.held.get(rank) or self._fits_back(rank):
            return None
        gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
        line = (f"rank {rank} is out, its state taking {gib(self.host.held[rank])} of host memory until it comes "
                f"back, and it cannot come back first ({gib(self.footprint.get(rank, 0))} beside the residents' "
                f"{gib(self._others(rank))} do not fit {gib(self.capacity)}): a switch needs its state and theirs in "
                "host memory at once")
        if self.swapper.whole_state:
            line += ("; the checkpoint API moves all a rank holds on the device, --swap inprocess copies only the "
                     "blocks in use")
        return line

    def _out(self, rank: int, pid: int) -> None:
        dt = timed(self.swapper.checkpoint, rank, pid)
        s = self.stats[rank]
        s.swaps_out += 1
        s.bytes_out += self.footprint.get(rank, 0)
        s.seconds += dt
        self.resident.discard(rank)
        self.reserve.pop(rank, None)
        self.swapped.add(rank)
        self.left[rank] = self.swapper.residual(rank, self.footprint.get(rank, 0))
        if self.host is not None:
            self.host.held[rank] = self.swapper.host_bytes(rank, self.footprint.get(rank, 0))
