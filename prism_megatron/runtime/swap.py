"""State preservation: move a blocked rank's GPU state to host memory and back.

A swapper acts on a whole process. `CudaCheckpointSwapper` uses the CUDA driver's process
checkpoint API (its speeds on a GPU: docs/measurements.md); it requires that the
process holds no live NCCL communicator and no CUDA IPC memory, which Phase 1 guarantees since all
communication goes through the coordinator. `BudgetSwapper` is a stand-in that enforces a memory
budget without a GPU, for tests of the scheduling logic.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from prism_megatron.runtime.fake_device import FakeDevice


class SwapNoRoom(RuntimeError):
    """A restore failed because the device lacks free memory (the process stays checkpointed)."""


class SwapUnavailable(RuntimeError):
    """The checkpoint API cannot be used here; the message says what to do."""


class Swapper(Protocol):
    name: str

    def checkpoint(self, rank: int, pid: int) -> None: ...

    def restore(self, rank: int, pid: int) -> None: ...


class BudgetSwapper:
    """Stand-in: a device of `capacity` bytes; ranks' footprints as the memory manager reports them.

    With a ``device`` (runtime.fake_device, shared with the ranks), what the ranks really hold there
    moves out and in too, and a restore that does not fit beside the residents fails as on a GPU.
    """

    name = "budget"

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


class CudaCheckpointSwapper:
    """`cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock}` through `cuda.bindings.driver`."""

    name = "checkpoint"

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


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0
