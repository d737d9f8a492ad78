"""The shared-memory data plane: growable per-rank segments, mapped by the coordinator by name.

A rank stages each op's input bytes and reserves its output bytes in its own segment; the
coordinator reads inputs and writes outputs in place, so tensor bytes cross no socket. Segments are
files in /dev/shm (tmpfs); the launcher removes every segment of a job when it ends.

On a GPU, copies between the device and these pageable pages are slow (the driver copies pageable
memory through a staging buffer of its own); `Arena.pin_with` registers every segment with the CUDA
driver (page-locked: the copy engine reads and writes them directly), which halves a turn's runtime
work (docs/measurements.md, capture cost). GPU ranks do it under --staging auto, the default: the
driver checkpoints and restores a process that registered host memory, and the registration works
after the restore (swap_bench.py's lock probes).
"""

from __future__ import annotations

import mmap
import os
import re
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

ALIGN = 64


SHM_DIR_ENV = "PRISM_SHM_DIR"


def shm_dir() -> Path:
    """Where segments live: $PRISM_SHM_DIR where set (a container whose /dev/shm is small, as Docker's
    64 MB default is; one job's segments kept apart from other jobs'), else /dev/shm when present
    (tmpfs), else the temp dir."""
    if os.environ.get(SHM_DIR_ENV):
        return Path(os.environ[SHM_DIR_ENV])
    d = Path("/dev/shm")
    return d if d.is_dir() and os.access(d, os.W_OK) else Path(tempfile.gettempdir())


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Segment:
    def __init__(self, path: Path, size: int, create: bool) -> None:
        self.path = path
        self.name = path.name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.view = torch.frombuffer(self.map, dtype=torch.uint8)
        self.top = 0  # bump pointer
        self.live = 0  # allocations not yet freed
        self.unpin: Callable[[], None] | None = None  # set while registered with CUDA (Arena.pin_with)

    def close(self) -> None:
        if self.unpin is not None:  # before the pages go: a registration must not outlive its mapping
            self.unpin()
            self.unpin = None
        del self.view
        try:
            self.map.close()
        except BufferError:  # a tensor still views it; the mapping goes when that tensor does
            pass


class Arena:
    """A rank's staging memory: bump allocation, reset when nothing is live, grown by doubling.

    Async ops can be outstanding in any number, so a region lives until its op completed and the
    rank copied the result out. Thread-safe: the rank's receiver thread frees.
    """

    def __init__(self, prefix: str, initial: int = 1 << 20) -> None:
        self._prefix = prefix
        self._count = 0
        self._lock = threading.Lock()
        self._segments: dict[str, _Segment] = {}
        self._pin: Callable[[int, int], Callable[[], None]] | None = None
        self._active = self._new_segment(initial)
        self.dropped: list[str] = []  # names unlinked since the caller last looked

    def pin_with(self, pin: Callable[[int, int], Callable[[], None]]) -> None:
        """Register every segment, present and future: ``pin(address, nbytes)`` returns its undo."""
        with self._lock:
            self._pin = pin
            for seg in self._segments.values():
                if seg.unpin is None:
                    seg.unpin = pin(seg.view.data_ptr(), seg.size)

    def _new_segment(self, size: int) -> _Segment:
        path = shm_dir() / f"{self._prefix}-{self._count}"
        self._count += 1
        seg = _Segment(path, size, create=True)
        if self._pin is not None:
            seg.unpin = self._pin(seg.view.data_ptr(), seg.size)
        self._segments[seg.name] = seg
        return seg

    def alloc(self, nbytes: int) -> tuple[str, int, torch.Tensor]:
        """Reserve `nbytes`; returns (segment name, offset, uint8 view)."""
        with self._lock:
            seg = self._active
            if seg.top + nbytes > seg.size:
                if seg.live == 0 and nbytes <= seg.size:
                    seg.top = 0
                else:
                    size = max(2 * seg.size, 1 << max(nbytes - 1, 1).bit_length())
                    old = seg
                    seg = self._active = self._new_segment(size)
                    if old.live == 0:
                        self._drop(old)
            off = seg.top
            seg.top = _align(off + nbytes)
            seg.live += 1
            return seg.name, off, seg.view[off : off + nbytes]

    def free(self, name: str) -> None:
        with self._lock:
            seg = self._segments.get(name)
            if seg is None:
                return
            seg.live -= 1
            if seg.live == 0:
                if seg is self._active:
                    seg.top = 0
                else:
                    self._drop(seg)

    def _drop(self, seg: _Segment) -> None:
        del self._segments[seg.name]
        seg.close()
        seg.path.unlink(missing_ok=True)
        self.dropped.append(seg.name)

    def take_dropped(self) -> list[str]:
        with self._lock:
            out, self.dropped = self.dropped, []
            return out

    def close(self) -> None:
        with self._lock:
            for seg in list(self._segments.values()):
                seg.close()
                seg.path.unlink(missing_ok=True)
            self._segments.clear()


class SegmentGone(RuntimeError):
    """A rank's segment file is not there: removed by something outside the job (its rank unlinks a
    segment only after the coordinator is done with it)."""


class SegmentMap:
    """The coordinator's view of every rank's segments, mapped by name when an op first names them.

    A mapping outlives the file: once mapped, a segment that something outside the job unlinks (a
    cleanup of /dev/shm) still serves every op that named it before.
    """

    def __init__(self) -> None:
        self._segs: dict[str, _Segment] = {}
        self._dir = shm_dir()

    def attach(self, name: str) -> _Segment:
        seg = self._segs.get(name)
        if seg is None:
            try:
                seg = self._segs[name] = _Segment(self._dir / name, 0, create=False)
            except FileNotFoundError:
                raise SegmentGone(f"staging segment {self._dir / name} is gone: something outside this job "
                                  "removed it (a cleanup of shared memory while the job ran?)") from None
        return seg

    def view(self, name: str, offset: int, nbytes: int) -> torch.Tensor:
        return self.attach(name).view[offset : offset + nbytes]

    def drop(self, name: str) -> None:
        seg = self._segs.pop(name, None)
        if seg is not None:
            seg.close()

    def close(self) -> None:
        for seg in self._segs.values():
            seg.close()
        self._segs.clear()


def job_prefix(launcher_pid: int, job_id: str) -> str:
    """Segment names of a job start with this: the launcher's pid lets a later job tell a dead job's
    segments (swept) from a live one's (``sweep_stale_segments``)."""
    return f"prism-{launcher_pid}-{job_id}"


_JOB_SEGMENT = re.compile(r"prism-(\d+)-[0-9a-f]+-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def sweep_stale_segments() -> tuple[int, int]:
    """Remove the segments of jobs whose launcher is gone (killed before it could clean up, e.g. by the
    kernel's OOM killer); returns (segments, bytes) removed. Segments of live jobs are kept."""
    n = size = 0
    for p in shm_dir().glob("prism-*"):
        m = _JOB_SEGMENT.match(p.name)
        if m is None or _alive(int(m.group(1))):
            continue
        try:
            nbytes = p.stat().st_size
            p.unlink()
        except OSError:  # another user's, or gone meanwhile
            continue
        n, size = n + 1, size + nbytes
    return n, size


def remove_job_segments(prefix: str) -> int:
    """Remove every segment whose name starts with `prefix` (end of job, any outcome)."""
    n = 0
    for p in shm_dir().glob(f"{prefix}*"):
        p.unlink(missing_ok=True)
        n += 1
    return n
