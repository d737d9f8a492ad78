"""State preservation: move a blocked rank's GPU state to host memory and back.

`InProcessSwapper` asks the rank itself (P.SWAP, answered by its receiver thread): the rank copies the
caching allocator's segments to its extent of the job's host region and releases their physical
memory (runtime.vmm, runtime.swap_space); its CUDA context stays, so the CUDA profiler may run in it.
`CudaCheckpointSwapper` acts on a whole process through the CUDA driver's process checkpoint API,
which needs nothing of the rank but copies at the host's first-touch speed and excludes the profiler
(speeds of both on a GPU: docs/measurements.md); it requires that the process holds no live NCCL
communicator and no CUDA IPC memory, which Phase 1 guarantees since all communication goes through
the coordinator. `BudgetSwapper` is a stand-in for the latter that enforces a memory budget without
a GPU, for tests of the scheduling logic (the former's stand-in is on the rank's side:
runtime.fake_device.StandInSegments).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prism_megatron.runtime.fake_device import FakeDevice
    from prism_megatron.runtime.swap_space import SwapSpace


class SwapNoRoom(RuntimeError):
    """A restore failed because the device lacks free memory (the process stays checkpointed)."""


class SwapUnavailable(RuntimeError):
    """The checkpoint API cannot be used here; the message says what to do."""


class Swapper(Protocol):
    name: str
    whole_state: bool  # a swap moves all the rank holds on the device, not only the blocks in use

    def checkpoint(self, rank: int, pid: int) -> None: ...

    def restore(self, rank: int, pid: int) -> None: ...

    def residual(self, rank: int, footprint: int) -> int:
        """Device bytes a swapped-out rank still holds, of its ``footprint``."""
        ...

    def host_bytes(self, rank: int, footprint: int) -> int:
        """Host bytes ``rank``'s state takes when out: what it holds there, or what a swap out would take
        now (of its ``footprint`` on the device)."""
        ...


class InProcessSwapper:
    """The rank moves its own state (runtime.vmm) to an extent of the job's host region.

    ``exchange(rank, message)`` sends a P.SWAP to the blocked rank and returns its P.SWAPPED answer
    (the coordinator's, which keeps the rank's other messages for later).
    """

    name = "inprocess"
    whole_state = False

    def __init__(self, space: SwapSpace, exchange: Callable[[int, dict], dict], context: int = 0) -> None:
        self.space = space
        self._exchange = exchange
        self.context = context  # what a rank is expected to keep on the device before its first swap
        self.extent: dict[int, tuple[int, int]] = {}  # swapped-out rank -> (offset, bytes) in the region
        self.moved: dict[int, int] = {}  # swapped-out rank -> bytes its swap moved
        self.kept: dict[int, int] = {}  # rank -> device bytes its last swap out left
        self.copied: dict[int, int] = {}  # rank -> bytes its swaps copied, out and in (blocks in use only)
        # rank -> seconds its swaps spent [copying, mapping and unmapping, page-locking the region]
        self.split: dict[int, list[float]] = {}
        self.pin_error: str | None = None  # why a rank could not page-lock the region (its copies pageable)
        self.compacted: list[tuple[int, float]] = []  # the region compacted: (bytes moved, seconds), each time

    def _ask(self, rank: int, op: str, offset: int = 0, nbytes: int = 0) -> dict:
        from prism_megatron.runtime import protocol as P

        reply = self._exchange(rank, {"t": P.SWAP, "op": op, "offset": offset, "nbytes": nbytes})
        if not reply.get("ok"):
            if reply.get("no_room"):
                raise SwapNoRoom(f"rank {rank}: {reply.get('error')}")
            raise RuntimeError(f"rank {rank}: in-process swap {op} failed: {reply.get('error')}")
        return reply

    def host_bytes(self, rank: int, footprint: int) -> int:
        """The rank's extent when out; else what its swap out would copy now, asked of the (blocked) rank:
        its allocator's blocks in use, often far below what it holds (free cached blocks are not copied)."""
        if rank in self.extent:
            return self.extent[rank][1]
        return int(self._ask(rank, "size")["bytes"])

    def checkpoint(self, rank: int, pid: int) -> None:
        nbytes = int(self._ask(rank, "size")["bytes"])  # asked again: a figure from an earlier turn may be stale
        offset = self.space.take(nbytes)
        if offset is None and self.space.free() >= nbytes:  # enough in all, no gap large enough
            t0 = time.perf_counter()
            moved = self.space.compact()
            self.extent = {r: (moved.get(o, o), n) for r, (o, n) in self.extent.items()}
            self.compacted.append((sum(self.space.taken[b] for b in moved.values()), time.perf_counter() - t0))
            offset = self.space.take(nbytes)
        if offset is None:
            raise RuntimeError(f"rank {rank}: no {nbytes} bytes free in the job's host region "
                               f"({self.space.free()} of {self.space.capacity} free)")
        try:
            reply = self._ask(rank, "out", offset, nbytes)
        except BaseException:
            self.space.give(offset)
            raise
        self.extent[rank] = (offset, nbytes)
        self.moved[rank] = int(reply["bytes"])
        self._count(rank, reply)

    def _count(self, rank: int, reply: dict) -> None:
        self.copied[rank] = self.copied.get(rank, 0) + int(reply.get("copied", 0))
        split = self.split.setdefault(rank, [0.0, 0.0, 0.0])
        split[0] += float(reply.get("copy_s", 0.0))
        split[1] += float(reply.get("map_s", 0.0))
        split[2] += float(reply.get("pin_s", 0.0))
        if reply.get("pin_error") and self.pin_error is None:
            self.pin_error = f"rank {rank}: {reply['pin_error']}"
            print(f"prism: the swap region is not page-locked ({self.pin_error}); in-process swaps copy through "
                  "pageable memory, slower", file=sys.stderr, flush=True)

    def restore(self, rank: int, pid: int) -> None:
        offset, nbytes = self.extent[rank]
        reply = self._ask(rank, "in", offset, nbytes)
        self._count(rank, reply)
        self.space.give(offset)
        del self.extent[rank]
        self.moved.pop(rank, None)

    def residual(self, rank: int, footprint: int) -> int:
        """The CUDA context and what the allocator took before its pool (runtime.vmm) stay: right after
        a swap out, what it did not move; before, what the rank's last one left (its context, first)."""
        if rank in self.moved:
            self.kept[rank] = max(footprint - self.moved[rank], 0)
        return self.kept.get(rank, min(self.context, footprint))

    def forget(self, rank: int) -> None:
        """The rank ended: its extent is free."""
        ext = self.extent.pop(rank, None)
        if ext is not None:
            self.space.give(ext[0])
        self.moved.pop(rank, None)
        self.kept.pop(rank, None)


class BudgetSwapper:
    """Stand-in: a device of `capacity` bytes; ranks' footprints as the memory manager reports them.

    With a ``device`` (runtime.fake_device, shared with the ranks), what the ranks really hold there
    moves out and in too, and a restore that does not fit beside the residents fails as on a GPU.
    """

    name = "budget"
    whole_state = True

    def __init__(self, capacity: int, device: FakeDevice | None = None) -> None:
        self.capacity = capacity
        self.device = device
        self.used: dict[int, int] = {}
        self.footprint: dict[int, int] = {}
        self.log: list[tuple[str, int]] = []

    def checkpoint(self, rank: int, pid: int) -> None:
        if not self.footprint.get(rank):  # the driver refuses a process without CUDA state
            raise RuntimeError(f"rank {rank}: cuCheckpointProcessLock failed: CUDA_ERROR_NOT_INITIALIZED")
        self.used.pop(rank, None)
        if self.device is not None:
            self.device.swap_out(rank)
        self.log.append(("out", rank))

    def restore(self, rank: int, pid: int) -> None:
        need = self.footprint.get(rank, 0)
        if sum(self.used.values()) + need > self.capacity:
            raise SwapNoRoom(f"rank {rank}: restore of {need} bytes does not fit")
        if self.device is not None and not self.device.swap_in(rank):
            raise SwapNoRoom(f"rank {rank}: restore of {self.device.held(rank)} bytes does not fit the stand-in "
                             f"device beside its residents ({self.device.used()} of {self.device.capacity} bytes)")
        self.used[rank] = need
        self.log.append(("in", rank))

    def residual(self, rank: int, footprint: int) -> int:
        return 0

    def host_bytes(self, rank: int, footprint: int) -> int:
        return footprint


class CudaCheckpointSwapper:
    """`cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock}` through `cuda.bindings.driver`."""

    name = "checkpoint"
    whole_state = True

    def __init__(self, lock_timeout_ms: int = 0) -> None:
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise SwapUnavailable("--swap checkpoint needs the cuda-bindings package (cuda.bindings.driver); "
                                  "install it or run with --swap none") from e
        if not hasattr(driver, "cuCheckpointProcessCheckpoint"):
            raise SwapUnavailable("this CUDA driver binding has no process checkpoint API; run with --swap none")
        self._d = driver
        self._check(driver.cuInit(0), "cuInit")
        self._timeout = lock_timeout_ms

    def _check(self, result: tuple, what: str, rank: int | None = None) -> None:
        err = result[0] if isinstance(result, tuple) else result
        if int(err) != 0:
            who = f"rank {rank}: " if rank is not None else ""
            name = getattr(err, "name", str(err))
            if "OUT_OF_MEMORY" in name:
                raise SwapNoRoom(f"{who}{what} failed: {name}")
            hint = (" (a process with a live NCCL communicator, CUDA IPC memory, or in which the CUDA profiler "
                    "ran cannot be checkpointed: run with --swap none, or without GPU timing)"
                    if "NOT_SUPPORTED" in name or what.endswith("Checkpoint") else "")
            raise RuntimeError(f"{who}{what} failed: {name}{hint}")

    def checkpoint(self, rank: int, pid: int) -> None:
        d = self._d
        args = d.CUcheckpointLockArgs() if hasattr(d, "CUcheckpointLockArgs") else None
        if args is not None:
            args.timeoutMs = self._timeout
        self._check(d.cuCheckpointProcessLock(pid, args), "cuCheckpointProcessLock", rank)
        self._check(d.cuCheckpointProcessCheckpoint(pid, None), "cuCheckpointProcessCheckpoint", rank)

    def restore(self, rank: int, pid: int) -> None:
        d = self._d
        self._check(d.cuCheckpointProcessRestore(pid, None), "cuCheckpointProcessRestore", rank)
        self._check(d.cuCheckpointProcessUnlock(pid, None), "cuCheckpointProcessUnlock", rank)

    def residual(self, rank: int, footprint: int) -> int:
        """The driver moves the whole process, its context too."""
        return 0

    def host_bytes(self, rank: int, footprint: int) -> int:
        return footprint


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0
