"""Compute slots: a device offers N slots; a rank computes only while it holds one.

The scheduler is pure bookkeeping (no I/O) so it can be tested alone; the coordinator calls it and
sends the grants. The policy decides who is next among the ranks queued for a device; FIFO (the
default) cannot starve anyone.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


class FifoPolicy:
    """Grant in the order ranks asked."""

    name = "fifo"

    def pick(self, queue: deque[int]) -> int:
        return queue.popleft()


class ResidentFirstPolicy:
    """Prefer queued ranks whose state is on the device (no restore, no eviction); FIFO among equals.

    A rank passed over `max_skips` times goes next regardless, so no one starves.
    """

    name = "resident-first"

    def __init__(self, is_resident, max_skips: int = 4) -> None:
        self._resident = is_resident
        self.max_skips = max_skips
        self._skips: dict[int, int] = {}

    def pick(self, queue: deque[int]) -> int:
        head = queue[0]
        if self._skips.get(head, 0) < self.max_skips and not self._resident(head):
            for i, r in enumerate(queue):
                if self._resident(r):
                    self._skips[head] = self._skips.get(head, 0) + 1
                    del queue[i]
                    return r
        self._skips.pop(head, None)
        return queue.popleft()


@dataclass(frozen=True)
class Grant:
    rank: int
    device: int
    slot: int


class SlotScheduler:
    """Slots of `num_devices` devices; ranks are pinned to a device by `device_of`."""

    def __init__(self, num_devices: int, slots_per_device: int, device_of: dict[int, int] | None = None,
                 policy: FifoPolicy | ResidentFirstPolicy | None = None) -> None:
        if num_devices < 1 or slots_per_device < 1:
            raise ValueError(f"need at least one device and one slot, got {num_devices} x {slots_per_device}")
        self.slots_per_device = slots_per_device
        self._free = [list(range(slots_per_device - 1, -1, -1)) for _ in range(num_devices)]
        self._queues: list[deque[int]] = [deque() for _ in range(num_devices)]
        self._device_of = device_of or {}
        self._num_devices = num_devices
        self.holding: dict[int, tuple[int, int]] = {}  # rank -> (device, slot)
        self.policy = policy or FifoPolicy()

    def device_of(self, rank: int) -> int:
        return self._device_of.get(rank, rank % self._num_devices)

    def request(self, rank: int) -> list[Grant]:
        """Queue `rank` for a slot on its device; returns the grants that became possible."""
        if rank in self.holding:
            raise RuntimeError(f"rank {rank} asked for a slot while holding one")
        d = self.device_of(rank)
        if rank in self._queues[d]:
            raise RuntimeError(f"rank {rank} is already queued for a slot")
        self._queues[d].append(rank)
        return self._grant(d)

    def release(self, rank: int) -> list[Grant]:
        """Give `rank`'s slot back (no-op when it holds none); returns new grants."""
        held = self.holding.pop(rank, None)
        if held is None:
            d = self.device_of(rank)
            if rank in self._queues[d]:
                self._queues[d].remove(rank)
            return []
        d, s = held
        self._free[d].append(s)
        return self._grant(d)

    def queued(self) -> set[int]:
        return {r for q in self._queues for r in q}

    def _grant(self, d: int) -> list[Grant]:
        grants = []
        while self._free[d] and self._queues[d]:
            rank = self.policy.pick(self._queues[d])
            slot = self._free[d].pop()
            self.holding[rank] = (d, slot)
            grants.append(Grant(rank, d, slot))
        return grants
