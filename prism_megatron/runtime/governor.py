"""The memory governor: which ranks' GPU state is resident on each device (admission at a grant,
swaps of blocked ranks when residents outgrow the device, NVML's view of their footprints), and
under --swap auto with GPU timing, each device's verdict on whether its ranks may time GPU segments."""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import StrEnum

from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.groups import GroupTable
from prism_megatron.runtime.memory import DeviceMemory, HostBudget
from prism_megatron.runtime.nvml import FootprintCheck
from prism_megatron.runtime.ranks import RankState, RankStatus
from prism_megatron.runtime.slots import Grant, ResidentFirstPolicy, SlotScheduler
from prism_megatron.runtime.swap import Swapper


class SwapMode(StrEnum):
    """How ranks that share a device keep their state (the launcher's --swap, resolved)."""

    NONE = "none"  # share it without swaps
    CHECKPOINT = "checkpoint"  # swap blocked ranks out whenever the residents outgrow the device
    AUTO = "auto"  # as checkpoint, where a swapper is available; without swaps otherwise


class SwapPolicy(StrEnum):
    """Which queued rank a freed slot goes to."""

    RESIDENT_FIRST = "resident-first"  # preferably one whose state is on the device: fewer swaps
    FIFO = "fifo"  # arrival order


class MemoryGovernor:
    def __init__(self, world_size: int, ranks: dict[int, RankState], slots: SlotScheduler, groups: GroupTable,
                 device_names: list[str], fatal: Callable[[str, str], None],
                 send: Callable[[RankState, dict], None]) -> None:
        self.world_size = world_size
        self.ranks, self.slots, self.groups, self.device_names = ranks, slots, groups, device_names
        self._fatal, self._send = fatal, send
        self.memory: list[DeviceMemory] | None = None  # set when swapping is on (see enable_swap)
        self.footprint_check: FootprintCheck | None = None  # NVML's figures for swapping ranks (runtime.nvml)
        self.awaiting_room: list[Grant] = []  # granted a slot, waiting for device memory
        self.times_gpu = False  # ranks time GPU segments: each is told when its timer may start (P.TIMING)
        # --swap auto with GPU timing: a device's ranks start the profiler only once timing_verdict allows
        self.timing_gated = False
        self.timing: dict[int, dict] = {}  # device -> {"on", "why"}: the verdicts given
        self._timing_waits: dict[int, set[int]] = {}  # device -> ranks yet to end iteration 1 (or exit)
        self._timing_ended: set[int] = set()  # devices where some rank ended iteration 1

    def enable_swap(self, swapper: Swapper, capacities: list[int], policy: str = SwapPolicy.RESIDENT_FIRST,
                    host_capacity: int | None = None, gate_timing: bool = False) -> None:
        """Keep at most each device's capacity of ranks' state resident, swapping blocked ranks out.

        With `resident-first`, the slot goes preferably to a queued rank whose state is on the device,
        which cuts swaps (bench: `python bench/swap_policy.py`); `fifo` keeps plain arrival order.
        ``host_capacity``: bytes of host memory the checkpointed state of all devices may take.
        ``gate_timing`` (--swap auto with GPU timing): ranks time their GPU segments only once their
        device's verdict allows it (see runtime.memory.DeviceMemory.timing_verdict).
        """
        policy = SwapPolicy(policy)
        self.timing_gated = gate_timing
        if gate_timing:
            for r in self.slots._device_of or range(self.world_size):  # the ranks that run (live, when folded)
                self._timing_waits.setdefault(self.slots.device_of(r), set()).add(r)
        host = HostBudget(host_capacity) if host_capacity is not None else None
        self.memory = [DeviceMemory(c, swapper, host=host) for c in capacities]
        if policy == SwapPolicy.RESIDENT_FIRST:
            mem = self.memory
            self.slots.policy = ResidentFirstPolicy(lambda r: r in mem[self.slots.device_of(r)].resident)

    # ---- GPU timing ------------------------------------------------------------------------------
    def hello(self, rs: RankState) -> None:
        """A rank connected: where nothing gates timing, its timer may start at once."""
        if self.times_gpu and not self.timing_gated:
            self._send(rs, {"t": P.TIMING, "on": True, "why": ""})

    def timing_verdicts(self) -> dict:
        """Per device name: whether GPU timing ran there under --swap auto, and why."""
        return {self.device_names[d]: v for d, v in sorted(self.timing.items())}

    def decide_timing(self, rank: int, ended: bool) -> None:
        """``rank`` ended iteration 1 (``ended``) or exited: give its device's verdict once every rank
        on it has done one or the other, and one of them ended an iteration."""
        device = self.slots.device_of(rank)
        waits = self._timing_waits.get(device)  # None unless timing is gated
        if waits is None or device in self.timing:
            return
        waits.discard(rank)
        if ended:
            self._timing_ended.add(device)
        if waits or device not in self._timing_ended:
            return
        on, why = self.memory[device].timing_verdict()
        self.timing[device] = {"on": on, "why": why}
        print(f"prism: {self.device_names[device]}: {why}", file=sys.stderr, flush=True)
        for rs in self.ranks.values():
            if rs.state != RankStatus.DONE and self.slots.device_of(rs.rank) == device:
                self._send(rs, {"t": P.TIMING, "on": on, "why": why})

    # ---- residency -------------------------------------------------------------------------------
    def swap_stats(self) -> dict:
        if self.memory is None:
            return {}
        return {str(r): vars(s) for m in self.memory for r, s in sorted(m.stats.items()) if s.swaps_out or s.swaps_in}

    def admit(self, g: Grant) -> bool:
        """Make the granted rank's state resident (swapping others out); False: it waits for room."""
        if self.memory is None:
            return True
        mem = self.memory[g.device]
        evictable = self._evictable(g.device, exclude=g.rank)
        pids = {r: rs.pid for r, rs in self.ranks.items()}
        try:
            ok = mem.make_resident(g.rank, evictable, pids, self._completes_last)
        except Exception as e:  # a failing checkpoint API is the job's end, with what to do
            self._fatal("swap", f"prism: swapping on {self.device_names[g.device]} failed: {e}")
            ok = False
        if not ok:
            self.awaiting_room.append(g)  # holds the slot; retried when memory frees up
        return ok

    def take_awaiting(self) -> list[Grant]:
        """The grants waiting for room, to try again."""
        waiting, self.awaiting_room = self.awaiting_room, []
        return waiting

    def _evictable(self, device: int, exclude: int = -1) -> list[int]:
        """Ranks on `device` not computing: blocked in an op, or queued for a slot (not yet granted)."""
        waiting_room = {g.rank for g in self.awaiting_room}
        return [r for r, rs in self.ranks.items() if rs.state in (RankStatus.BLOCKED, RankStatus.QUEUED)
                and r != exclude and r not in waiting_room and self.slots.device_of(r) == device]

    def _completes_last(self, rank: int) -> float:
        """Eviction preference: ranks whose pending collectives miss the most members wait longest."""
        rs = self.ranks[rank]
        missing = 0
        for op_id in rs.blocked_on:
            rec = rs.pending.get(op_id)
            if rec is not None and rec.seq >= 0:
                missing += self.groups.by_id[rec.group].missing(rec.seq)
        return missing

    def note(self, rs: RankState, msg: dict) -> None:
        """A rank about to block reported its device footprint."""
        if self.memory is not None and "mem" in msg:
            self.memory[self.slots.device_of(rs.rank)].report(rs.rank, int(msg["mem"]))

    def check_footprints(self) -> None:
        """When a FootprintCheck sample is due, as a rank blocks: NVML's figure for every blocked,
        resident rank (its last report is current: it has not run since) replaces its report's."""
        held = self.footprint_check.sample() if self.footprint_check is not None else None
        if held is None:
            return
        for d, mem in enumerate(self.memory or []):
            for r in list(mem.resident):
                rs = self.ranks.get(r)
                if rs is not None and rs.state == RankStatus.BLOCKED and rs.pid in held:
                    pair = mem.cross_check(r, held[rs.pid])
                    if pair is not None:
                        self.footprint_check.record(r, *pair, self.device_names[d])

    def enforce(self, rank: int) -> None:
        """After a rank blocked: if its device's residents outgrew it, swap out the longest waiters."""
        if self.memory is None:
            return
        self.check_footprints()
        d = self.slots.device_of(rank)
        evictable = self._evictable(d)
        try:
            self.memory[d].enforce(evictable, {r: rs.pid for r, rs in self.ranks.items()}, self._completes_last)
        except Exception as e:
            self._fatal("swap", f"prism: swapping on {self.device_names[d]} failed: {e}")

    def forget(self, rank: int) -> bool:
        """An ended process holds no device memory; True when that may make room."""
        if self.memory is None:
            return False
        self.memory[self.slots.device_of(rank)].forget(rank)
        return True
