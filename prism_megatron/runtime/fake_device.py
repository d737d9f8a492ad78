"""A stand-in for one GPU's memory, for CPU tests of admission and swapping.

A table in a file, shared by the ranks of a job and the coordinator: each rank's bytes on the
"device", whether its state is resident, and its peak since its last report. A test program
allocates and frees through it (``alloc``/``free``: the counter a rank's footprint is read from,
``staging.footprint_and_peak``); the stand-in swapper (``swap.BudgetSwapper``) marks ranks out and
in. An allocation that would take the resident ranks past the capacity raises ``DeviceFull``, a
``torch.OutOfMemoryError`` as the CUDA allocator raises when the physical GPU is full: so a test
sees an overrun of the device as the GPU would, not as a bookkeeping assertion.

``PRISM_FAKE_DEVICE`` names the file (made by ``FakeDevice.create``); ranks know themselves by RANK.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from pathlib import Path

import torch

ENV = "PRISM_FAKE_DEVICE"
_HEAD = struct.Struct("<qq")  # capacity, ranks
_ROW = struct.Struct("<qqq")  # bytes held, peak since the last report, resident (1) or swapped out (0)


class DeviceFull(torch.OutOfMemoryError):
    """The stand-in device is full: what a physical GPU's out-of-memory is in CPU tests. ``figures``:
    what a GPU rank reports of one (memory.probe.MemoryProbe.physical)."""

    def __init__(self, message: str, figures: dict) -> None:
        super().__init__(message)
        self.figures = figures


class FakeDevice:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._f = open(self.path, "r+b")  # noqa: SIM115 - lives as long as the device
        self._m = mmap.mmap(self._f.fileno(), 0)
        self.capacity, self.ranks = _HEAD.unpack_from(self._m, 0)

    @classmethod
    def create(cls, path: Path, capacity: int, ranks: int) -> FakeDevice:
        data = bytearray(_HEAD.size + _ROW.size * ranks)
        _HEAD.pack_into(data, 0, capacity, ranks)
        for r in range(ranks):
            _ROW.pack_into(data, _HEAD.size + _ROW.size * r, 0, 0, 1)
        Path(path).write_bytes(bytes(data))
        return cls(path)

    @classmethod
    def from_env(cls) -> FakeDevice | None:
        path = os.environ.get(ENV)
        return cls(Path(path)) if path else None

    def _row(self, rank: int) -> tuple[int, int, int]:
        if not 0 <= rank < self.ranks:
            raise ValueError(f"fake device {self.path}: rank {rank} is outside 0..{self.ranks - 1}")
        return _ROW.unpack_from(self._m, _HEAD.size + _ROW.size * rank)

    def _set(self, rank: int, held: int, peak: int, resident: int) -> None:
        _ROW.pack_into(self._m, _HEAD.size + _ROW.size * rank, held, peak, resident)

    def _locked(self):
        return _Lock(self._f)

    def used(self) -> int:
        """Bytes the resident ranks hold."""
        with self._locked():
            return self._used()

    def _used(self) -> int:
        rows = (self._row(r) for r in range(self.ranks))
        return sum(held for held, _, resident in rows if resident)

    def alloc(self, rank: int, nbytes: int) -> None:
        with self._locked():
            held, peak, resident = self._row(rank)
            if not resident:
                raise RuntimeError(f"fake device: rank {rank} allocates while swapped out (it computes without "
                                   "its state: a scheduling bug)")
            used = self._used()
            if used + nbytes > self.capacity:
                raise DeviceFull(f"CUDA out of memory (prism stand-in device). Tried to allocate {nbytes} bytes; "
                                 f"rank {rank} holds {held} bytes; the device's resident ranks hold {used} of "
                                 f"{self.capacity} bytes",
                                 {"held": held, "requested": nbytes, "free": self.capacity - used,
                                  "total": self.capacity})
            self._set(rank, held + nbytes, max(peak, held + nbytes), resident)

    def free(self, rank: int, nbytes: int) -> None:
        with self._locked():
            held, peak, resident = self._row(rank)
            self._set(rank, max(held - nbytes, 0), peak, resident)

    def take_peak(self, rank: int) -> tuple[int, int]:
        """(bytes held now, peak since the last call): the rank's report as it blocks."""
        with self._locked():
            held, peak, resident = self._row(rank)
            self._set(rank, held, held, resident)
            return held, max(peak, held)

    def held(self, rank: int) -> int:
        return self._row(rank)[0]

    def release(self, rank: int) -> None:
        """The rank's process ended: nothing of it stays on the device."""
        with self._locked():
            self._set(rank, 0, 0, 1)

    def swap_out(self, rank: int) -> None:
        with self._locked():
            held, peak, _ = self._row(rank)
            self._set(rank, held, peak, 0)

    def swap_in(self, rank: int) -> bool:
        """Make the rank's state resident again; False when it does not fit beside the residents."""
        with self._locked():
            held, peak, resident = self._row(rank)
            if not resident and self._used() + held > self.capacity:
                return False
            self._set(rank, held, peak, 1)
            return True


class _Lock:
    def __init__(self, f) -> None:
        self._f = f

    def __enter__(self) -> None:
        fcntl.flock(self._f.fileno(), fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._f.fileno(), fcntl.LOCK_UN)


def alloc(nbytes: int) -> None:
    """For test programs: this rank (RANK) allocates ``nbytes`` on the stand-in device. Where the device is
    full and the rank's swaps are in process (`StandInSegments`), other ranks are swapped out for it and the
    allocation tried again, as runtime.vmm does on a GPU."""
    while True:
        try:
            shared().alloc(int(os.environ["RANK"]), nbytes)
            return
        except DeviceFull as e:
            hook = _IN_PROCESS.on_no_room if _IN_PROCESS is not None else None
            if hook is None or not hook(nbytes, e.figures["free"]):
                raise


def free(nbytes: int) -> None:
    shared().free(int(os.environ["RANK"]), nbytes)


_DEVICE: FakeDevice | None = None
_IN_PROCESS: StandInSegments | None = None  # this rank's, where its swaps are in process


def shared() -> FakeDevice:
    """This process's handle on the stand-in device named by PRISM_FAKE_DEVICE (opened once). What this rank
    holds there is freed when its process exits, as a GPU frees an exited process's memory."""
    global _DEVICE
    if _DEVICE is None:
        _DEVICE = FakeDevice.from_env()
        if _DEVICE is None:
            raise RuntimeError(f"{ENV} is not set: no stand-in device to allocate from")
        if "RANK" in os.environ:
            import atexit

            atexit.register(_DEVICE.release, int(os.environ["RANK"]))
    return _DEVICE


_MARK = struct.Struct("<qq")  # rank, bytes: what a stand-in swap writes at the start of its host extent


class StandInSegments:
    """In-process swaps on the stand-in device (runtime.vmm's interface, for CPU tests): the rank's bytes
    there move out and back in, and a marker in its host extent checks that nobody wrote over it."""

    def __init__(self, rank: int) -> None:
        global _IN_PROCESS
        self.rank = rank
        self.swapped = False
        self.on_no_room = None  # as runtime.vmm.VmmSegments.on_no_room: used by alloc()
        self.grains: list[tuple[int, int] | None] = []  # each swap's page-locking grain, as the rank gave it
        _IN_PROCESS = self

    def host_bytes(self) -> int:
        return 0 if self.swapped else shared().held(self.rank)

    def swap_out(self, host_address: int, nbytes: int, grain: tuple[int, int] | None = None):
        import ctypes

        from prism_megatron.runtime.vmm import SwapTimes, VmmError

        self.grains.append(grain)
        t0 = time.perf_counter()
        held = shared().held(self.rank)
        if held > nbytes:
            raise VmmError(f"the rank's segments take {held} bytes; the host extent has {nbytes}")
        if nbytes >= _MARK.size:
            ctypes.memmove(host_address, _MARK.pack(self.rank, held), _MARK.size)
        t1 = time.perf_counter()
        shared().swap_out(self.rank)
        self.swapped = True
        return SwapTimes(nbytes=held, copied=held, copy_s=t1 - t0, map_s=time.perf_counter() - t1)

    def swap_in(self, host_address: int, grain: tuple[int, int] | None = None):
        import ctypes

        from prism_megatron.runtime.vmm import SwapTimes, VmmError, VmmNoRoom

        self.grains.append(grain)
        t0 = time.perf_counter()
        held = shared().held(self.rank)
        if held >= _MARK.size and _MARK.unpack(ctypes.string_at(host_address, _MARK.size)) != (self.rank, held):
            raise VmmError(f"rank {self.rank}: its host extent was written over while it was swapped out")
        t1 = time.perf_counter()
        if not shared().swap_in(self.rank):
            raise VmmNoRoom(f"rank {self.rank}: {held} bytes do not fit the stand-in device beside its residents")
        self.swapped = False
        return SwapTimes(nbytes=held, copied=held, copy_s=t1 - t0, map_s=time.perf_counter() - t1)
