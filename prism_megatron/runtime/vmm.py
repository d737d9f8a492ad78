"""A rank's GPU state made movable from inside its own process: CUDA virtual memory under the allocator.

PyTorch's caching allocator gets its segments from `VmmSegments` (a custom allocator of a `MemPool` that
every stream of the process allocates to), which reserves an address range per segment and maps
physical memory at it (`cuMemCreate`/`cuMemMap`). To swap the rank out, each segment's bytes are copied
to host memory and its physical memory is released; the address range stays reserved, so a swap in maps
new physical memory at the same addresses and copies the bytes back. Every tensor, the allocator's own
free lists and cached blocks stay valid: the caching allocator sees nothing, and decides exactly what it
decides without prism (same requests, same segment sizes). Unlike the driver's process checkpoint, the
process keeps its CUDA context (and the profiler may run in it), and the copies run at the link's speed
into host memory that is reused from one swap to the next (runtime.swap_space).

Where routing every stream to a pool makes the caching allocator differ from its default pool:
while a pool takes allocations the allocator counts a capture as under way, so (1) a block freed
with uses on other streams (``record_stream``) is not reused until the routing ends, and (2) an
allocation that fails frees only the pool's cached blocks that size-match before it raises, not
every cached block. Neither happens in a job whose work runs on one stream and whose ranks stay
clear of the device's limit; `bench/gpu/vmm_swap_probe.py` compares both allocators' figures.

Only the rank's own process may call `swap_out`/`swap_in`, with no GPU work of its own in flight (the
rank is blocked in the coordinator).
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_ALLOC_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
_FREE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)


class VmmError(RuntimeError):
    """A CUDA virtual-memory call failed; the message names the call and the driver's error."""


class VmmNoRoom(VmmError):
    """Physical memory for a swap in is not there (the rank stays swapped out, nothing is lost)."""


@dataclass
class _Segment:
    size: int  # bytes the caching allocator asked for (the mapping may be rounded up to the granularity)
    mapped: int  # bytes reserved and mapped
    handle: Any = None  # physical allocation, None while swapped out
    live: list[tuple[int, int]] = field(default_factory=list)  # (offset, bytes) copied out: its blocks in use


@dataclass
class SwapTimes:
    """One swap's figures (bytes, seconds) for the report."""

    nbytes: int = 0  # device bytes released (out) or mapped again (in)
    copied: int = 0  # bytes copied: the blocks in use; the allocator's free cached blocks are not
    copy_s: float = 0.0
    map_s: float = 0.0


@dataclass
class VmmSegments:
    """The segment source of one device's caching allocator, in one process."""

    device: int
    segments: dict[int, _Segment] = field(default_factory=dict)  # address -> segment
    swapped: bool = False
    pool: Any = None  # the MemPool install() made (kept alive with the segments)
    # asked when the device is full for a new segment (its bytes, the driver's free bytes): True once other
    # ranks' state made room (runtime.client.RankClient.ask_room), so the allocation is tried again, as a
    # GPU of the rank's own would have had the room
    on_no_room: Callable[[int, int], bool] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        import torch
        from cuda.bindings import driver

        # torch's CUDA first: in a rank forked from a launcher that imported torch, torch's lazy init
        # after cuda-bindings' cuInit crashed (SIGSEGV in torch.cuda._lazy_init)
        torch.cuda.init()

        self._d = driver
        self._check(driver.cuInit(0), "cuInit")
        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        self._prop = prop
        access = driver.CUmemAccessDesc()
        access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = access
        self.granularity = int(self._check(driver.cuMemGetAllocationGranularity(
            prop, driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity"))
        # the callbacks must outlive every segment: the allocator calls them until the process ends
        self._c_alloc = _ALLOC_FN(self._alloc)
        self._c_free = _FREE_FN(self._free)

    # ---- the caching allocator's side ------------------------------------------------------------
    def _check(self, result: Any, what: str) -> Any:
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            name = getattr(err, "name", str(err))
            cls = VmmNoRoom if "OUT_OF_MEMORY" in name else VmmError
            raise cls(f"{what} failed: {name}")
        if isinstance(result, tuple):
            return result[1] if len(result) == 2 else result[1:]
        return None

    def _map(self, addr: int, mapped: int) -> Any:
        d = self._d
        handle = self._check(d.cuMemCreate(mapped, self._prop, 0), f"cuMemCreate({mapped})")
        try:
            self._check(d.cuMemMap(addr, mapped, 0, handle, 0), "cuMemMap")
        except VmmError:
            d.cuMemRelease(handle)
            raise
        try:
            self._check(d.cuMemSetAccess(addr, mapped, [self._access], 1), "cuMemSetAccess")
        except VmmError:
            d.cuMemUnmap(addr, mapped)
            d.cuMemRelease(handle)
            raise
        return handle

    def _unmap(self, addr: int, seg: _Segment) -> None:
        self._check(self._d.cuMemUnmap(addr, seg.mapped), "cuMemUnmap")
        self._check(self._d.cuMemRelease(seg.handle), "cuMemRelease")
        seg.handle = None

    def _alloc(self, size: int, device: int, stream: int) -> int:
        """cudaMalloc's place. Where the device is full, the rank's own GPU would not be: ``on_no_room`` has
        other ranks swapped out and the segment is tried again, the caching allocator seeing nothing of it.
        0 tells the allocator the device is out of memory (it frees what it may, see the module, and
        retries, or raises its OutOfMemoryError, as after cudaMalloc). A failure other than the driver's
        out-of-memory goes to the rank's log first: the OutOfMemoryError that follows would not name it."""
        mapped = -(-size // self.granularity) * self.granularity
        try:
            while True:
                try:
                    return self._new_segment(size, mapped)
                except VmmNoRoom:
                    if self.on_no_room is None or not self.on_no_room(mapped, self._device_free()):
                        return 0
        except Exception as e:  # noqa: BLE001 - a callback from C must not raise
            print(f"prism: allocating a {size}-byte segment failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            return 0

    def _device_free(self) -> int:
        free, _total = self._check(self._d.cuMemGetInfo(), "cuMemGetInfo")
        return int(free)

    def _new_segment(self, size: int, mapped: int) -> int:
        d = self._d
        with self._lock:
            if self.swapped:
                raise VmmError("an allocation while the rank's state is swapped out")
            addr = int(self._check(d.cuMemAddressReserve(mapped, 0, 0, 0), "cuMemAddressReserve"))
            try:
                handle = self._map(addr, mapped)
            except VmmError:
                d.cuMemAddressFree(addr, mapped)
                raise
            self.segments[addr] = _Segment(size, mapped, handle)
        return addr

    def _free(self, ptr: int, size: int, device: int, stream: int) -> None:
        try:
            with self._lock:
                seg = self.segments.pop(int(ptr), None)
                if seg is None:
                    return
                if seg.handle is not None:
                    self._unmap(int(ptr), seg)
                self._d.cuMemAddressFree(int(ptr), seg.mapped)
        except Exception:  # noqa: BLE001 - a callback from C must not raise (interpreter shutdown)
            pass

    def install(self) -> Any:
        """Route every allocation of this process on ``device`` (every stream, every thread) to a pool
        whose segments come from here. Call before the program allocates on the device. Returns the
        pool (keep it alive)."""
        import torch

        allocator = torch._C._cuda_customAllocator(ctypes.cast(self._c_alloc, ctypes.c_void_p).value,
                                                   ctypes.cast(self._c_free, ctypes.c_void_p).value)
        pool = torch.cuda.MemPool(allocator=allocator)
        torch._C._cuda_beginAllocateToPool(self.device, pool.id)
        return pool

    # ---- swaps -----------------------------------------------------------------------------------
    def mapped_bytes(self) -> int:
        """Bytes the segments take on the device when resident (what a swap releases)."""
        return sum(s.mapped for s in self.segments.values())

    def _live(self) -> dict[int, list[tuple[int, int]]]:
        import torch

        live = in_use(torch.cuda.memory_snapshot())
        return {addr: live.get(addr, [(0, seg.mapped)]) for addr, seg in self.segments.items()}

    def host_bytes(self) -> int:
        """Host bytes a swap out copies now: the blocks in use, packed end to end (the caller blocks, so
        the figure holds for its swap out)."""
        import torch

        torch.cuda.synchronize()
        with self._lock:
            return 0 if self.swapped else sum(n for ranges in self._live().values() for _, n in ranges)

    def swap_out(self, host_address: int, nbytes: int, grain: tuple[int, int] | None = None) -> SwapTimes:
        """Copy every segment's blocks in use (the allocator's snapshot; its free cached blocks hold
        nothing a program may read) to host memory at ``host_address``, packed end to end in segment
        order (``nbytes`` there), and release the segments' physical memory. ``grain`` (base, bytes): the
        host memory is page-locked in separate registrations of that size from base, and no copy may span
        two (the driver refuses it: CUDA_ERROR_INVALID_VALUE)."""
        import torch

        t = SwapTimes()
        torch.cuda.synchronize()
        with self._lock:
            if self.swapped:
                return t
            live = self._live()
            need = sum(n for ranges in live.values() for _, n in ranges)
            if need > nbytes:
                raise VmmError(f"the rank's blocks in use take {need} bytes; the host extent has {nbytes}")
            at = host_address
            for addr, seg in self.segments.items():
                t0 = time.perf_counter()
                seg.live = live[addr]
                for off, n in seg.live:
                    for skip, part in pieces(at, n, grain):
                        self._check(self._d.cuMemcpyDtoH(at + skip, addr + off + skip, part), "cuMemcpyDtoH")
                    at += n
                    t.copied += n
                t1 = time.perf_counter()
                self._unmap(addr, seg)
                t.copy_s += t1 - t0
                t.map_s += time.perf_counter() - t1
                t.nbytes += seg.mapped
            self.swapped = True
        return t

    def swap_in(self, host_address: int, grain: tuple[int, int] | None = None) -> SwapTimes:
        """Map physical memory at every segment's addresses again and copy its blocks back from
        ``host_address`` (as ``swap_out`` packed them, ``grain`` as there). Raises `VmmNoRoom`, with every
        segment left out, when the device lacks room."""
        t = SwapTimes()
        with self._lock:
            if not self.swapped:
                return t
            done = []
            t0 = time.perf_counter()
            try:
                for addr, seg in self.segments.items():
                    seg.handle = self._map(addr, seg.mapped)
                    done.append((addr, seg))
            except VmmError:
                for addr, seg in done:
                    self._unmap(addr, seg)
                raise
            t.map_s = time.perf_counter() - t0
            at = host_address
            for addr, seg in self.segments.items():
                t0 = time.perf_counter()
                for off, n in seg.live:
                    for skip, part in pieces(at, n, grain):
                        self._check(self._d.cuMemcpyHtoD(addr + off + skip, at + skip, part), "cuMemcpyHtoD")
                    at += n
                    t.copied += n
                t.copy_s += time.perf_counter() - t0
                t.nbytes += seg.mapped
            self.swapped = False
        return t


def pieces(host_address: int, nbytes: int, grain: tuple[int, int] | None) -> list[tuple[int, int]]:
    """(offset, bytes) parts of a copy of ``nbytes`` at ``host_address`` that each stay inside one grain
    (base + k * size, of ``grain`` = (base, size)); the whole copy where there is no grain."""
    if grain is None or nbytes <= 0:
        return [(0, nbytes)]
    base, size = grain
    out, done = [], 0
    while done < nbytes:
        room = size - (host_address + done - base) % size
        part = min(room, nbytes - done)
        out.append((done, part))
        done += part
    return out


def in_use(snapshot: list[dict]) -> dict[int, list[tuple[int, int]]]:
    """Per segment address, the (offset, bytes) ranges of its blocks that are not free (allocated, or
    freed but awaiting another stream's use), adjacent ones merged: what a swap must keep. From
    ``torch.cuda.memory_snapshot()``'s segments."""
    out: dict[int, list[tuple[int, int]]] = {}
    for seg in snapshot:
        base, ranges = int(seg["address"]), []
        for b in sorted(seg.get("blocks", []), key=lambda b: int(b["address"])):
            if b.get("state") == "inactive":
                continue
            off, n = int(b["address"]) - base, int(b["size"])
            if ranges and ranges[-1][0] + ranges[-1][1] == off:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + n)
            else:
                ranges.append((off, n))
        out[base] = ranges
    return out
