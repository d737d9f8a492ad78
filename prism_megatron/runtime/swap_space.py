"""Host memory for in-process swaps: one region per job that every rank's swapped state goes to.

The coordinator creates the region (an anonymous shared-memory file, `memfd_create`: not bounded by
/dev/shm's size, and freed when the coordinator ends, however it ends) and hands out extents of it;
a rank maps it through ``/proc/<coordinator>/fd/<fd>`` and copies its GPU segments into the extent it
was given. Pages touched once stay, so a later swap into them runs at the link's speed rather than at
the host's first-touch speed (docs/measurements.md, "In-process swaps"), and the region never holds
more than the host budget allows. The pages are readied for the bound of ranks not yet measured; what
the measured peaks do not need goes back to the host (``trim``): held, it crowds the ranks' own memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_MADV_POPULATE_WRITE = 23  # linux/mman.h
#: Share of the host's RAM the prefault leaves available (SwapSpace.prefault)
PREFAULT_KEEPS_FREE = 0.10


class SwapSpaceError(RuntimeError):
    """The region cannot be made or mapped; the message says what to do."""


@dataclass
class SwapSpace:
    """The coordinator's side: the region and which of its extents are taken (first fit)."""

    capacity: int
    fd: int = -1
    taken: dict[int, int] = field(default_factory=dict)  # base -> size
    given: set[int] = field(default_factory=set)  # PIN_CHUNK granules an extent ever covered (ranks may lock them)
    _prefault_end: int = field(default=0, init=False)  # how far the prefault thread goes (trim lowers it)
    _prefault_lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        if self.fd < 0:
            try:
                self.fd = os.memfd_create("prism-swap", 0)
                os.ftruncate(self.fd, self.capacity)
            except (AttributeError, OSError) as e:
                raise SwapSpaceError(f"no host region for in-process swaps ({e}); run with --swap checkpoint "
                                     "or --swap none") from None

    @property
    def path_for_ranks(self) -> str:
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def free(self) -> int:
        return self.capacity - sum(self.taken.values())

    def take(self, nbytes: int) -> int | None:
        """An extent of ``nbytes`` (its base offset), or None when no gap is that large."""
        at = 0
        for base in sorted(self.taken):
            if base - at >= nbytes:
                break
            at = max(at, base + self.taken[base])
        else:
            if self.capacity - at < nbytes:
                return None
        self.taken[at] = nbytes
        self._give(at, nbytes)
        return at

    def _give(self, base: int, nbytes: int) -> None:
        self.given.update(granules(base, max(nbytes, 1)))

    def give(self, base: int) -> None:
        self.taken.pop(base, None)

    def compact(self) -> dict[int, int]:
        """Slide every taken extent down to the lowest offsets, in order, with its bytes: the gaps first fit
        leaves may add up to an extent without one being large enough. Only while no rank copies (the
        coordinator's own thread, between swaps). Returns old base -> new base of the extents that moved."""
        mm = mmap.mmap(self.fd, self.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            at, moved = 0, {}
            for old in sorted(self.taken):
                n = self.taken[old]
                if old != at:
                    # downwards, what holds data only (a stand-in rank writes a marker into a sparse extent):
                    # what it overwrites has moved already
                    for start, end in _data_ranges(self.fd, old, old + n):
                        ctypes.memmove(base + start - (old - at), base + start, end - start)
                    moved[old] = at
                at += n
            self.taken = {moved.get(b, b): n for b, n in self.taken.items()}
            for b, n in self.taken.items():
                self._give(b, n)
            del base
        finally:
            try:
                mm.close()
            except BufferError:  # a ctypes view still alive: the mapping goes with the object
                pass
        return moved

    def prefault(self, nbytes: int, chunk: int = 256 << 20, keep_free: int | None = None) -> threading.Thread:
        """Give the region's first ``nbytes`` their pages now, in a background thread, without writing them
        (``MADV_POPULATE_WRITE``, Linux 5.14+): the first swaps then copy at the link's speed, not at the
        host's first-touch speed. Safe beside swaps under way (a present page is left as it is). It stops
        where the host would have less than ``keep_free`` bytes available (default ``PREFAULT_KEEPS_FREE`` of
        its RAM): the ranks' own memory grows after the budget was taken, and a host short of memory slows
        every rank; a swap past that point still finds its pages, at first-touch speed. The thread's
        ``result`` is (bytes readied, why it stopped early: madvise's error or the host's memory, or None)."""
        from prism_megatron.runtime.hostplan import available_host_memory

        mm = mmap.mmap(self.fd, self.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        libc = ctypes.CDLL(None, use_errno=True)
        self._prefault_end = min(nbytes, self.capacity)
        if keep_free is None:
            keep_free = int(PREFAULT_KEEPS_FREE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

        def run() -> None:
            t0, done, why, said = time.perf_counter(), 0, None, None
            while True:
                with self._prefault_lock:  # trim waits for this chunk, then the thread sees its new end
                    if done >= self._prefault_end:
                        break
                    n = min(chunk, self._prefault_end - done)
                    if (available := available_host_memory()) - n < keep_free:
                        why = said = (f"the host had {available / 2**20:,.0f} MiB available, and the readying "
                                      f"leaves {keep_free / 2**20:,.0f} MiB to the ranks")
                        break
                    if libc.madvise(ctypes.c_void_p(base + done), ctypes.c_size_t(n), _MADV_POPULATE_WRITE) != 0:
                        why = os.strerror(ctypes.get_errno())
                        said = f"madvise: {why}"
                        break
                    done += n
            t.result = (done, why)
            print(f"prism coordinator: host region for swaps: {done / 2**30:.1f} GiB of pages ready in "
                  f"{time.perf_counter() - t0:.1f} s" + (f"; stopped there: {said}" if said else ""),
                  file=sys.stderr, flush=True)

        t = threading.Thread(target=run, name="prism-swap-prefault", daemon=True)
        t.result = None
        t.mapping = mm  # kept as long as the thread object
        t.start()
        return t

    def resident(self) -> int:
        """Bytes of the region that have pages (host RAM it holds)."""
        return os.fstat(self.fd).st_blocks * 512

    def trim(self, nbytes: int) -> int:
        """Ready no pages past the first ``nbytes`` and give back those already there, for when measured peaks
        need less host room than the bound the region was readied for: the pages held beyond the need are
        the ranks' and the page cache's, and a full host slows every rank. Only whole granules no extent ever
        covered go (a rank page-locks the granules its swaps reach: a locked page must stay where it is).
        Returns the bytes given back."""
        with self._prefault_lock:
            self._prefault_end = min(self._prefault_end, max(nbytes, 0))
            before = self.resident()
            for g in range(-(-max(nbytes, 0) // PIN_CHUNK), -(-self.capacity // PIN_CHUNK)):
                if g not in self.given:
                    start = g * PIN_CHUNK
                    _punch_hole(self.fd, start, min(PIN_CHUNK, self.capacity - start))
            return max(before - self.resident(), 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2  # linux/falloc.h


def _punch_hole(fd: int, start: int, nbytes: int) -> None:
    """Free the pages of [start, start + nbytes) of a file (they read as zeros after), its size kept."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, _FALLOC_FL_KEEP_SIZE | _FALLOC_FL_PUNCH_HOLE, start, nbytes) != 0:
        raise SwapSpaceError(f"cannot give back host pages of the swap region: fallocate: "
                             f"{os.strerror(ctypes.get_errno())}")


def _data_ranges(fd: int, start: int, end: int):
    """The ranges of [start, end) of a file that hold data, not holes (SEEK_DATA / SEEK_HOLE)."""
    at = start
    while at < end:
        try:
            data = os.lseek(fd, at, os.SEEK_DATA)
        except OSError:  # ENXIO: no data from here on
            return
        if data >= end:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        yield data, hole
        at = hole


#: Granule of a rank's page-locking of the region: registered once per process as its swaps first reach
#: it (one range may be registered only once in a process; every rank's fall on the same granules).
PIN_CHUNK = 1 << 30


def granules(offset: int, nbytes: int) -> range:
    """The PIN_CHUNK granules [offset, offset + nbytes) reaches: those a rank's swap into it page-locks."""
    return range(offset // PIN_CHUNK, (offset + nbytes - 1) // PIN_CHUNK + 1)


class HostRegion:
    """A rank's mapping of the job's region."""

    def __init__(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise SwapSpaceError(f"the job's swap region {path}: {e.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.size = size
        self.base_address = ctypes.addressof(ctypes.c_char.from_buffer(self._mm))
        self.pinned: set[int] = set()  # PIN_CHUNK granules this process page-locked
        self.pin_error: str | None = None  # why page-locking failed here (it is not tried again)

    def pin(self, offset: int, nbytes: int, register: Callable[[int, int], object]) -> float:
        """Page-lock the granules of [offset, offset + nbytes) not locked yet by this process, through
        ``register(address, bytes)`` (cudaHostRegister): copies from and to locked pages run at the copy
        engine's speed, pageable ones at the CPU's (docs/measurements.md, "In-process swaps"). Returns the
        seconds it took. A failure is kept in ``pin_error`` and ends the locking: copies stay correct,
        only slower, and the caller says so."""
        t0 = time.perf_counter()
        if self.pin_error is not None or nbytes <= 0:
            return 0.0
        mapped = -(-self.size // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages: the region's last one too
        for g in granules(offset, nbytes):
            if g in self.pinned:
                continue
            start = g * PIN_CHUNK
            try:
                register(self.base_address + start, min(PIN_CHUNK, mapped - start))
            except RuntimeError as e:
                self.pin_error = str(e)
                break
            self.pinned.add(g)
        return time.perf_counter() - t0

    @property
    def grain(self) -> tuple[int, int] | None:
        """(base address, bytes) of the separate registrations this process page-locked the region in, or None
        where it locked none: no copy may span two (the driver refuses it; runtime.vmm.pieces cuts them)."""
        return (self.base_address, PIN_CHUNK) if self.pinned else None

    def address(self, offset: int, nbytes: int) -> int:
        if offset < 0 or offset + nbytes > self.size:
            raise SwapSpaceError(f"extent [{offset}, {offset + nbytes}) is outside the swap region "
                                 f"({self.size} bytes)")
        return self.base_address + offset
