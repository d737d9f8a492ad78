"""The memory governor: which ranks' GPU state is resident on each device (admission at a grant by
the rank's expected peak, swaps of blocked ranks when residents outgrow the device, NVML's view of
their footprints), the verdict on a physical out-of-memory, and under --swap auto with GPU timing,
each device's verdict on whether its ranks may time GPU segments.

Admission reserves a rank's expected peak for its turn (runtime.peaks). Where nothing is measured of
the rank or its class yet, the bound is prism's estimate of the rank's class (memory.estimate) with
``ESTIMATE_HEADROOM`` and the context, where the launcher has one; otherwise the whole device (it
computes alone: every blocked rank is evicted first); and never more than the target GPU's usable
memory plus the context where the rank's allocator is capped there: the allocator cannot go beyond it.
A physical out-of-memory cannot be retried in place (PyTorch's allocator calls its out-of-memory
observers only after it has emptied the rank's cache, and raises after them), so admission is what
prevents it; one that happens anyway ends the job with a report of what each rank held and what would
cure it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import StrEnum

from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.groups import GroupTable
from prism_megatron.runtime.hostplan import HOST_LIMIT_HINT, swap_host_need, swapped_out_bounds
from prism_megatron.runtime.memory import DeviceMemory, HostBudget
from prism_megatron.runtime.nvml import FootprintCheck
from prism_megatron.runtime.peaks import PeakTracker
from prism_megatron.runtime.ranks import RankState, RankStatus
from prism_megatron.runtime.slots import Grant, ResidentFirstPolicy, SlotScheduler
from prism_megatron.runtime.swap import InProcessSwapper, Swapper

# Added to a GPU rank's measured peak when admitting it: what neither its allocator report nor the last NVML
# cross-check saw yet (kernels loaded lazily on first use grow the context). A judgement, not measured.
ADMISSION_MARGIN = 512 << 20
# Room for a rank nothing is measured of yet, per byte of prism's estimate of its class's peak: the estimate
# misses measured max allocated by a few percent either way (docs/measurements.md, bench/memory_estimate.py), and
# the caching allocator reserves a few percent over what it allocates; this covers both with room to spare. A
# rank that outgrew it while the other residents filled the rest of the device would end the job in the
# physical out-of-memory report (which names this reservation), not crash it.
ESTIMATE_HEADROOM = 1.25


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
        self.peaks = PeakTracker()  # its class_of: set by the coordinator (default: each rank its own class)
        self.margin = 0  # bytes added to every known expected peak (what the reports cannot see)
        self.rank_cap: int | None = None  # each rank's allocator cap (the target GPU's usable bytes), if any
        # how each turn's need was known: own or class peak, prism's estimate, or the bound (device or cap)
        self.admissions: dict[str, int] = {"own": 0, "class": 0, "estimate": 0, "bound": 0}
        # allocations that found the device full mid-turn: retried after swaps (True), or failed (False)
        self.retried: dict[bool, int] = {True: 0, False: 0}
        self.estimates: dict[int, int] = {}  # rank -> prism's estimate of its class's peak (bytes), where known
        self._host_said = False
        self._ended_one: set[int] = set()  # ranks that ended an iteration
        self.host_need: str | None = None  # after iteration 1: whether swapped-out state fits the host budget

    def enable_swap(self, swapper: Swapper, capacities: list[int], policy: str = SwapPolicy.RESIDENT_FIRST,
                    host_capacity: int | None = None, gate_timing: bool = False, margin: int = 0) -> None:
        """Keep at most each device's capacity of ranks' state resident, swapping blocked ranks out.

        With `resident-first`, the slot goes preferably to a queued rank whose state is on the device,
        which cuts swaps (bench: `python bench/swap_policy.py`); `fifo` keeps plain arrival order.
        ``host_capacity``: bytes of host memory the checkpointed state of all devices may take.
        ``gate_timing`` (--swap auto with GPU timing): ranks time their GPU segments only once their
        device's verdict allows it (see runtime.memory.DeviceMemory.timing_verdict).
        """
        policy = SwapPolicy(policy)
        self.margin = margin
        self.timing_gated = gate_timing
        if gate_timing:
            for r in self._running():
                self._timing_waits.setdefault(self.slots.device_of(r), set()).add(r)
        host = HostBudget(host_capacity) if host_capacity is not None else None
        self.memory = [DeviceMemory(c, swapper, host=host) for c in capacities]
        if policy == SwapPolicy.RESIDENT_FIRST:
            mem = self.memory
            self.slots.policy = ResidentFirstPolicy(lambda r: r in mem[self.slots.device_of(r)].resident)

    def configure_admission(self, classes: dict, rank_cap: int | None, estimates: dict | None = None) -> None:
        """``classes``: rank -> class label (ranks not named are each their own class): a rank not yet
        through an iteration is admitted by its class's peak. ``rank_cap``: each rank's allocator cap.
        ``estimates``: rank -> prism's estimate of its class's peak in bytes, the room for a rank before
        anything of it or its class is measured (ranks not named: the device)."""
        labels = {int(r): c for r, c in classes.items()}
        self.peaks.class_of = lambda r: labels.get(r, f"rank {r} alone")
        self.rank_cap = int(rank_cap) if rank_cap else None
        self.estimates = {int(r): int(b) for r, b in (estimates or {}).items() if b}

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
        peaks = {r: self._expected_next_iteration(r) for r in self.ranks if self.slots.device_of(r) == device}
        on, why = self.memory[device].timing_verdict(peaks)
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

    def unmarked_swaps_note(self) -> str | None:
        """What to do, said at the job's end, where ranks were swapped but no turn was admitted by a measured
        peak: the program marks no iterations, so admission never learns a peak and every turn reserves
        the bound (the device, or the target's cap plus context), swapping the other ranks out for it."""
        if self.memory is None or self.admissions["own"] or self.admissions["class"]:
            return None
        swaps = sum(s.swaps_out for m in self.memory for s in m.stats.values())
        if not swaps:
            return None
        return (f"{swaps} swap(s) out: no rank marked a training iteration, so each of the "
                f"{self.admissions['bound']} turns was admitted with room for the most a rank may need (the "
                "device, or the target GPU's cap) and the blocked ranks were swapped out for it. Mark each "
                "iteration (prism_megatron.trace.span('iteration'), as Megatron runs under prism do) to be "
                "admitted by measured peaks, or run with --swap none where the ranks fit the device together")

    def admit(self, g: Grant) -> bool:
        """Make the granted rank's state resident (swapping others out); False: it waits for room."""
        if self.memory is None:
            return True
        ok = self._room(g.rank, g.device)
        if not ok:
            self.awaiting_room.append(g)  # holds the slot; retried when memory frees up
        return ok

    def keep(self, rank: int) -> bool:
        """A rank whose awaited ops were complete when it blocked keeps its slot, if its next turn's
        expected peak has room (evicting blocked ranks); False: it must wait for room like any other."""
        if self.memory is None:
            return True
        return self._room(rank, self.slots.device_of(rank))

    def released(self, rank: int) -> None:
        """``rank`` gave its slot back: the room held for its turn is free."""
        if self.memory is not None:
            self.memory[self.slots.device_of(rank)].released(rank)

    def _room(self, rank: int, device: int) -> bool:
        mem = self.memory[device]
        need, source = self.need(rank)
        evictable = self._evictable(device, exclude=rank)
        pids = {r: rs.pid for r, rs in self.ranks.items()}
        try:
            ok = mem.make_resident(rank, need, evictable, pids, self._completes_last)
        except Exception as e:  # a failing checkpoint API is the job's end, with what to do
            self._fatal("swap", f"prism: swapping on {self.device_names[device]} failed: {e}")
            return False
        if ok:
            self.peaks.turn_began(rank, mem.reported.get(rank, 0) if rank not in mem.no_context else 0)
            self.admissions[source or "bound"] += 1
        return ok

    def make_room(self, rank: int, nbytes: int) -> bool:
        """A computing rank's allocation found its device physically full, ``nbytes`` short (it grew past
        what admission expected, or the figures were short): swap blocked ranks out for it, as on its own
        GPU it would have had the room. False: no blocked rank could go; the allocation fails, and the
        rank's physical out-of-memory report says why."""
        if self.memory is None or self.ranks[rank].state != RankStatus.RUNNING:
            return False  # only a rank in its turn has room reserved to widen (another thread's, blocked: none)
        d = self.slots.device_of(rank)
        pids = {r: rs.pid for r, rs in self.ranks.items()}
        try:
            made = self.memory[d].make_room(rank, nbytes, self._evictable(d, exclude=rank), pids,
                                            self._completes_last)
        except Exception as e:  # a failing swap is the job's end, with what to do
            self._fatal("swap", f"prism: swapping on {self.device_names[d]} failed: {e}")
            return False
        self.retried[made] += 1
        return made

    def need(self, rank: int) -> tuple[int, str]:
        """Device bytes to hold for ``rank``'s next turn, and where the figure comes from ('own', 'class'
        or '' for the bound: the device, or the allocator cap plus context). Never more than the device can
        give the rank with the others out (DeviceMemory.most_for: an in-process swap leaves each its
        context), or the rank would wait for room forever; a rank at the device's edge that reaches past
        its reservation waits mid-turn while the others go out (make_room), or ends in the physical
        out-of-memory report."""
        mem = self.memory[self.slots.device_of(rank)]
        expected, source = self.peaks.expected(rank, mem.reported.get(rank, 0) if rank not in mem.no_context else 0)
        if expected is None:
            room, source = self._bound(mem.capacity, rank)
        else:
            room = expected + mem.offset.get(rank, 0) + self.margin
        return min(room, mem.capacity, mem.most_for(rank)), source

    def unknown_bound(self, capacity: int, rank: int | None = None) -> int:
        """Room for a rank whose peak nothing measured tells yet: prism's estimate of its class with
        ``ESTIMATE_HEADROOM`` plus the context, where there is one; else the device; and with the allocator
        capped at the target's usable bytes, never more than that cap plus the context (what the caching
        allocator cannot pass)."""
        return self._bound(capacity, rank)[0]

    def _bound(self, capacity: int, rank: int | None) -> tuple[int, str]:
        """``unknown_bound`` and where it comes from: 'estimate' where the estimate is what bounds it, ''
        where the device or the cap does."""
        cap = self._cap_room()
        bound = capacity if cap is None else min(capacity, cap + self.margin)
        if rank in self.estimates:
            from prism_megatron.runtime.staging import CONTEXT_BYTES

            room = int(self.estimates[rank] * ESTIMATE_HEADROOM) + CONTEXT_BYTES + self.margin
            if room < bound:
                return room, "estimate"
        return bound, ""

    def _cap_room(self) -> int | None:
        """The most a rank's process can hold on its device with its allocator capped (the cap plus the
        context), or None where it is not capped."""
        if self.rank_cap is None:
            return None
        from prism_megatron.runtime.staging import CONTEXT_BYTES

        return self.rank_cap + CONTEXT_BYTES

    def _expected_next_iteration(self, rank: int) -> int:
        """Device bytes ``rank`` may reach in its next iteration (runtime.peaks: its latest iteration's peak,
        or what it holds now plus the most a turn of it rose), within its allocator's cap: what a device
        pinned for GPU timing, where admission no longer swaps, must hold for it."""
        mem = self.memory[self.slots.device_of(rank)]
        held = mem.reported.get(rank, 0) if rank not in mem.no_context else 0
        peak = max(self.peaks.next_iteration_peak(rank, held), self.peaks.peak_so_far(rank))
        cap = self._cap_room()
        return (peak if cap is None else min(peak, cap)) + mem.offset.get(rank, 0)

    def _peak_so_far(self, rank: int) -> int:
        mem = self.memory[self.slots.device_of(rank)]
        return self.peaks.peak_so_far(rank) + mem.offset.get(rank, 0)

    def take_awaiting(self) -> list[Grant]:
        """The grants waiting for room, to try again."""
        waiting, self.awaiting_room = self.awaiting_room, []
        return waiting

    def _evictable(self, device: int, exclude: int = -1) -> list[int]:
        """Ranks on `device` not computing: blocked in an op, idle, or queued for a slot (not yet granted)."""
        waiting_room = {g.rank for g in self.awaiting_room}
        still = (RankStatus.BLOCKED, RankStatus.QUEUED, RankStatus.IDLE)
        return [r for r, rs in self.ranks.items() if rs.state in still
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
        """A rank about to block reported its device footprint and the peak of the turn it ends."""
        if "mem" not in msg:
            return
        self.peaks.turn_ended(rs.rank, int(msg.get("peak", msg["mem"])))
        if self.memory is not None:
            self.memory[self.slots.device_of(rs.rank)].report(rs.rank, int(msg["mem"]))

    def mark(self, rank: int, msg: dict) -> None:
        """The program's markers: an iteration's begin starts the rank's next row of turn peaks; the end
        of iteration 1 is when the host budget is judged on measured peaks (said once)."""
        if msg["name"] != "iteration":
            return
        if msg["phase"] == "B":
            self.peaks.iteration_began(rank)
        elif msg["phase"] == "E" and self.memory is not None and not self._host_said:
            self._ended_one.add(rank)
            if len(self._ended_one) == self.world_size:  # every rank's peaks of iteration 1 are in
                self._host_said = True
                self.say_host_need(measured=True)
                self._trim_host_region()

    def _running(self):
        """The ranks that run: the live ones of a folded job (their rank numbers), else 0 .. world_size - 1."""
        return self.slots._device_of or range(self.world_size)

    def swap_out_bound(self) -> int:
        """The most bytes of the ranks' state out at once, by the bounds for ranks not yet measured (prism's
        estimate with its headroom, each rank's cap, or the device): 0 means no swap is expected."""
        if self.memory is None:
            return 0
        sizes = [[self.unknown_bound(mem.capacity, r) for r in self._running() if self.slots.device_of(r) == d]
                 or [0] for d, mem in enumerate(self.memory)]
        return swapped_out_bounds(sizes, [m.capacity for m in self.memory])[1]

    def say_host_need(self, measured: bool = False) -> list[str]:
        """Whether the job's swapped-out state fits the host budget (lines to say): at start from
        bounds (each rank up to the bound for a rank not measured), after iteration 1 from the ranks'
        peaks so far (then also printed, and kept for the trace)."""
        if self.memory is None:
            return []
        host = self.memory[0].host
        budget = host.capacity if host is not None else None
        sizes = self._measured_peaks() if measured else [
            [self.unknown_bound(mem.capacity, r) for r in self._running() if self.slots.device_of(r) == d]
            for d, mem in enumerate(self.memory)]
        caps, whole = [m.capacity for m in self.memory], self.memory[0].swapper.whole_state
        fits, message = swap_host_need(sizes, caps, budget, measured=measured, whole_state=whole)
        lines = [message] + ([] if fits or not measured else [HOST_LIMIT_HINT])
        if not measured and (expected := self._estimated_peaks()) is not None:  # a prediction, before any bound
            fits, message = swap_host_need(expected, caps, budget, whole_state=whole, basis="prism's memory estimates")
            if swapped_out_bounds(expected, caps)[1] == 0 < swapped_out_bounds(sizes, caps)[1]:
                message += (f" once peaks are measured; until then each rank is admitted with room for its estimate "
                            f"x {ESTIMATE_HEADROOM}, more than its device holds for all, so the first turns may swap")
            lines += [message] + ([] if fits else [HOST_LIMIT_HINT])
        if measured:
            self.host_need = message
            for line in lines:
                print(f"prism: {line}", file=sys.stderr, flush=True)
        return lines

    def _measured_peaks(self) -> list[list[int]]:
        """Per device, the peak so far of each running rank that has one."""
        return [[self._peak_so_far(r) for r in self._running() if self.slots.device_of(r) == d and r in self.ranks]
                or [0] for d in range(len(self.memory))]

    def _trim_host_region(self) -> None:
        """With iteration 1's peaks measured, the host region's readied pages beyond the most state those peaks
        swap out at once go back to the host (runtime.swap_space.SwapSpace.trim): readied for the bounds of
        ranks not yet measured, they would otherwise crowd the ranks' own host memory for the whole run."""
        from prism_megatron.runtime.swap_space import SwapSpaceError

        space = getattr(self.memory[0].swapper, "space", None)
        if space is None:
            return
        most = swapped_out_bounds(self._measured_peaks(), [m.capacity for m in self.memory])[1]
        try:
            freed = space.trim(most)
        except SwapSpaceError as e:
            print(f"prism: {e}", file=sys.stderr, flush=True)
            return
        if freed:
            print(f"prism: host region for swaps: {freed / 2**20:,.0f} MiB of readied pages given back (the peaks "
                  f"measured by iteration 1 swap out at most {most / 2**20:,.0f} MiB at once)", file=sys.stderr,
                  flush=True)

    def _estimated_peaks(self) -> list[list[int]] | None:
        """Per device, each running rank's peak by prism's estimate of its class plus the context, or None
        where some rank has no estimate."""
        from prism_megatron.runtime.staging import CONTEXT_BYTES

        if any(r not in self.estimates for r in self._running()):
            return None
        return [[self.estimates[r] + CONTEXT_BYTES for r in self._running() if self.slots.device_of(r) == d] or [0]
                for d in range(len(self.memory))]

    def physical_oom(self, rank: int, msg: dict) -> str:
        """A rank found its device full while under its own cap: the report that ends the job, saying
        whether evicting other ranks could have made room and what to do."""
        d = self.slots.device_of(rank)
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        held, requested = int(msg.get("held", 0)), int(msg.get("requested", 0) or 0)
        capacity = self.memory[d].capacity if self.memory is not None else int(msg.get("total", 0))
        cls = self.peaks.class_of(rank)
        lines = [f"prism: rank {rank} (class {cls}) ran out of memory on the physical device {self.device_names[d]} "
                 f"(not the target's: it was under its own cap): it held {gib(held)} and asked for "
                 f"{gib(requested)} more; the device has {gib(capacity)}"
                 + (f", of which the driver had {gib(int(msg['free']))} free" if msg.get("free") is not None else "")]
        others = [(r, rs) for r, rs in sorted(self.ranks.items()) if r != rank and self.slots.device_of(r) == d]
        if self.memory is not None:
            mem = self.memory[d]
            resident = [(r, mem.footprint.get(r, 0)) for r, _ in others if r in mem.resident]
            lines.append("ranks resident on it then: " + (", ".join(f"{r} ({gib(b)}, {self.ranks[r].state})"
                                                                    for r, b in resident) or "none"))
            need, source = self.need(rank)
            expected = {"own": "its own peak at this point of the last iteration",
                        "class": f"its class's ({cls}) peak",
                        "estimate": f"prism's estimate of its class x {ESTIMATE_HEADROOM} plus the context: "
                                    "nothing of it was measured yet"}.get(source,
                                                                          "the bound for a rank not yet measured")
            lines.append(f"admission had reserved {gib(mem.reserve.get(rank, need))} for this turn ({expected})")
        else:
            resident = [(r, 0) for r, _ in others]
        if held + requested > capacity:
            lines.append("no eviction can cure this: the rank alone needs more than the device. What to do: "
                         "declare a larger device only if it has the memory (--prism-device-memory), emulate this "
                         "rank's class on a larger GPU, or shrink what one rank holds (a smaller micro-batch, more "
                         "model parallelism)")
        elif self.memory is None:
            lines.append("the other ranks on this device hold the rest (no swapping: --swap none). What to do: "
                         "--prism-swap checkpoint (or auto), fewer slots per device, or more devices")
        elif isinstance(self.memory[d].swapper, InProcessSwapper):
            lines.append("the allocation waited for room, but no blocked rank could be swapped out for it: the "
                         "others were computing, or their state would not fit the host budget. What to do: fewer "
                         "slots per device (--prism-slots-per-device 1), or more host memory for swaps "
                         "(--prism-host-memory)")
        else:
            lines.append("evicting the other ranks would have made room, but an allocation cannot be retried in "
                         "place with this swapper: the rank grew past what admission reserved for it. What to do: "
                         "--prism-swap inprocess (the allocation waits while blocked ranks are swapped out), run "
                         "again (the peaks are measured the same way), fewer slots per device "
                         "(--prism-slots-per-device 1), or declare the device smaller (--prism-device-memory) to "
                         "leave more headroom")
        return "\n".join(lines)

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
        self.peaks.forget(rank)
        return True
