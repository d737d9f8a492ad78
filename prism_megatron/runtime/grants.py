"""Slot grants: who holds a compute slot. The scheduler (runtime.slots) picks the rank, the memory
governor admits it (its state resident), and grants are held back while a prediction runs."""

from __future__ import annotations

from collections.abc import Callable

from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.governor import MemoryGovernor
from prism_megatron.runtime.ranks import RankState, RankStatus
from prism_megatron.runtime.recorder import Recorder
from prism_megatron.runtime.slots import Grant, SlotScheduler


class SlotGrants:
    def __init__(self, slots: SlotScheduler, ranks: dict[int, RankState], governor: MemoryGovernor,
                 recorder: Recorder, device_names: list[str], send: Callable[[RankState, dict], None]) -> None:
        self.slots, self.ranks, self.governor, self.recorder = slots, ranks, governor, recorder
        self.device_names = device_names
        self._send = send
        self.paused: list[Grant] | None = None  # grants held back while a prediction is computed

    def request(self, rs: RankState) -> None:
        """``rs`` wants a slot."""
        rs.state = RankStatus.QUEUED
        self.apply(self.slots.request(rs.rank))

    def release(self, rs: RankState) -> None:
        """``rs`` stops computing: its slot turn goes into the trace and the slot to the next rank."""
        if rs.holding:
            rs.holding = False
            d, s = rs.grant_slot
            self.recorder.slot_turn(rs, self.device_names[d], s)
        self.governor.released(rs.rank)
        self.apply(self.slots.release(rs.rank))

    def apply(self, grants: list[Grant]) -> None:
        for g in grants:
            self.grant(g)

    def grant(self, g: Grant) -> None:
        if self.paused is not None:  # a prediction waits for the slots to drain
            self.paused.append(g)
            return
        if not self.governor.admit(g):
            return  # holds the slot; retried when memory frees up
        rs = self.ranks[g.rank]
        rs.state = RankStatus.RUNNING
        rs.holding, rs.grant_t = True, self.recorder.now()
        rs.grant_slot = (g.device, g.slot)
        self._send(rs, {"t": P.GRANT})

    def retry_room(self) -> None:
        """Grants that waited for device memory try again."""
        self.apply(self.governor.take_awaiting())

    def pause(self) -> None:
        if self.paused is None:
            self.paused = []

    def resume(self) -> None:
        held, self.paused = self.paused or [], None
        self.apply(held)
