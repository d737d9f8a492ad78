"""Host time and device busy time of each compute segment of a rank on a GPU.

Why: the data plane synchronises the GPU at every op (results travel through host memory), so a
segment's wall time includes the kernel-launch gaps of an empty queue; with NCCL the host runs
ahead and the queue stays full. A TP2 job's segments summed to +54% of the real iteration that way.
So the segment is measured twice over: the host's time to issue it (its waits for the device
removed) and the device's busy time for what it queued (the union of its kernels and copies, which
is the same whether the queue was full or not). The replay runs the two as clocks (replay.engine).

How: the CUDA profiler (CUPTI through kineto) records every kernel and copy with the correlation id
of the host call that queued it. The rank launches a tiny marker kernel when a segment begins and
one when it ends; the device work whose correlation id lies between a segment's two markers is the
segment's. Host calls that wait for the device (synchronize, blocking copies, cudaFree) inside a
segment are where the program waits (``.item()`` and the like); the replay makes the host wait there.
Work queued by the runtime's receiver thread (result copies) is left out by thread id.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prism_megatron.trace.schema import segment_pieces

#: Name fragment of the marker kernel (``torch.cuda._sleep``); programs do not launch it.
MARKER = "spin_kernel"
#: Kineto's switch: "1" detaches CUPTI when a profiler session ends (read at each end; unset keeps it attached). Left
#: attached, its callbacks stay on every later kernel launch, so the plain iterations whose host time the prediction
#: takes issue their work slower than the program does without a profiler: a host-bound job is predicted too slow
#: (docs/measurements.md, "CUPTI left attached").
CUPTI_TEARDOWN_ENV = "TEARDOWN_CUPTI"
#: Megatron flags that capture CUDA graphs: a graph and CUPTI's re-attachment after a teardown crash (torch's own
#: guard sets TEARDOWN_CUPTI=0 for inductor's graphs), so those jobs keep CUPTI attached.
CUDA_GRAPH_FLAGS = ("--enable-cuda-graph", "--external-cuda-graph", "--cuda-graph-impl")


def cupti_teardown_env(args: list[str], environ: dict[str, str]) -> dict[str, str]:
    """What a GPU-timed rank's environment gets so that CUPTI detaches after each profiled iteration: nothing where
    the environment already says (the user's word, or torch's for CUDA graphs) or the job captures CUDA graphs."""
    if CUPTI_TEARDOWN_ENV in environ:
        return {}
    for i, a in enumerate(args):
        flag, _, value = a.partition("=")
        if flag in CUDA_GRAPH_FLAGS:
            if flag == "--cuda-graph-impl":
                value = value or (args[i + 1] if i + 1 < len(args) else "")
                if value == "none":
                    continue
            return {}
    return {CUPTI_TEARDOWN_ENV: "1"}


#: Host calls that block until the device has finished work.
SYNC_CALLS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaFree",
    "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize", "cuMemFree_v2",
})


@dataclass(frozen=True)
class Activity:
    """What attribution needs of one profiler event: a host call or device work, in nanoseconds."""

    corr: int
    device: bool  # kernel / copy / memset on the GPU; False: a host runtime or driver call
    name: str
    tid: int
    start: int
    end: int


@dataclass
class SegmentTiming:
    """One closed segment: see the gpu table of PrismTrace (trace.schema.GPU_COLUMNS)."""

    clock_start: float
    clock_end: float
    cpu: float
    gpu: float
    syncs: list[tuple[float, float]] = field(default_factory=list)
    waited: float = 0.0  # host seconds spent in the waits (not stored: the replay models them)

    def row(self, rank: int) -> dict[str, Any]:
        return {"rank": rank, "clock_start": self.clock_start, "clock_end": self.clock_end, "cpu": self.cpu,
                "gpu": self.gpu, "syncs": [list(s) for s in self.syncs]}


@dataclass(frozen=True)
class Closed:
    """A segment as the client saw it: its end on the rank's compute clock, whether markers were
    launched around it (profiled, CUDA started), its length on that clock, and its host time (the
    length without the runtime's wait for the device at its end), in seconds; ``synced``: the runtime
    waited for the device at its end (an op on device tensors), so the next one starts on an empty queue
    (after a marker it starts with what the device still has to do)."""

    clock_end: float
    marked: bool
    duration: float
    host: float = 0.0
    synced: bool = True


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off for a block of the runtime's own, on a paused clock (left alone where the
    program turned it off: Megatron's ``--manual-gc``). A profiled iteration's attribution turns thousands of
    profiler events into Python objects that are garbage a moment later; collected mid-way, they would cost the
    rank collections the program does not have, and those that survive one would count toward a full collection
    of the program's whole heap later, wherever it lands (docs/measurements.md, "The collector: the rank's runtime,
    not its program")."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _union(intervals: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


class AttributionError(RuntimeError):
    """The profiler's events do not match the segments the rank closed (markers missing)."""


def attribute(acts: list[Activity], closed: list[Closed], exclude_tids: set[int]) -> list[SegmentTiming]:
    """Split profiler events into the closed segments' host and device times.

    Raises AttributionError when the marker kernels found are not two per marked segment.
    """
    host = {a.corr: a for a in acts if not a.device}
    device = sorted((a for a in acts if a.device), key=lambda a: a.corr)
    device_of = {a.corr: a for a in device}
    markers = [host[a.corr] for a in device if MARKER in a.name and a.corr in host]
    wanted = 2 * sum(c.marked for c in closed)
    if len(markers) != wanted:
        raise AttributionError(f"found {len(markers)} marker kernels, expected {wanted} (two per segment)")
    work = [a for a in device if MARKER not in a.name and host.get(a.corr, a).tid not in exclude_tids]
    waits = sorted((a for a in host.values() if a.tid not in exclude_tids and _waits(a, device_of)),
                   key=lambda a: a.corr)
    out, m, wi, di = [], 0, 0, 0
    for c in closed:
        if not c.marked:
            out.append(SegmentTiming(c.clock_end - c.duration, c.clock_end, c.duration, 0.0))
            continue
        begin, end = markers[m], markers[m + 1]
        m += 2
        while di < len(work) and work[di].corr < begin.corr:
            di += 1
        mine = []
        while di < len(work) and work[di].corr < end.corr:
            mine.append(work[di])
            di += 1
        while wi < len(waits) and waits[wi].corr < begin.corr:
            wi += 1
        syncs, waited, last = [], 0, None
        while wi < len(waits) and waits[wi].corr < end.corr:
            w = waits[wi]
            wi += 1
            # .item() is a blocking copy and then a stream sync: one wait unless work was queued between
            if last is None or any(last < a.corr < w.corr for a in mine):
                before = _union([(a.start, a.end) for a in mine if a.corr < w.corr])
                syncs.append((max(w.start - begin.end - waited, 0) / 1e9, before / 1e9))
            last = w.corr
            waited += w.end - w.start
        cpu = max(end.start - begin.end - waited, 0) / 1e9
        busy = _union([(a.start, a.end) for a in mine]) / 1e9
        out.append(SegmentTiming(c.clock_end - c.duration, c.clock_end, cpu, busy, syncs, waited / 1e9))
    return out


def _waits(call: Activity, device_of: dict[int, Activity]) -> bool:
    """Whether a host call waited for the device: a synchronising call, or a copy that returned only
    once its copy had run on the device (to or from pageable memory: ``.item()``, ``.cpu()``,
    ``.tolist()``), which waited for all work queued before it."""
    if call.name in SYNC_CALLS:
        return True
    copy = device_of.get(call.corr)
    return "emcpy" in call.name and copy is not None and call.end >= copy.end


def activities(events: Any) -> list[Activity]:
    """Kineto events (``profile.profiler.kineto_results.events()``) as Activities."""
    from torch.autograd import DeviceType

    out = []
    for e in events:
        corr = e.correlation_id()
        if not corr:
            continue
        is_device = e.device_type() == DeviceType.CUDA
        name = e.name()
        if not is_device and not name.startswith("cu"):
            continue
        start = e.start_ns()
        out.append(Activity(corr, is_device, name, e.start_thread_id(), start, start + e.duration_ns()))
    return out


def pair(profiled: list[SegmentTiming], plain: list[Closed]) -> tuple[list[SegmentTiming], list[SegmentTiming]] | None:
    """Host times from a plain iteration, device times from a profiled one: rows for both.

    The profiler slows the host markedly (docs/history.md), so host time is taken where it was off:
    segment k of the plain iteration gets the device time and waits of segment k of the profiled one
    (Megatron repeats an iteration's ops). Both iterations get those figures; the plain host time is
    the profiled one scaled so that the replay's model of the segment ends when the plain segment did
    (:func:`solve_scale`), the device still busy at its start with what the segments since the runtime's
    last wait for it left queued (a wait inside the segment waited for that too: Megatron's gradient
    check after the last backward). None when the iterations do not have the same number of segments.
    """
    if len(profiled) != len(plain) or not plain:
        return None
    out_p, out_u = [], []
    backlog = 0.0
    for p, u in zip(profiled, plain, strict=True):
        scale, left = solve_segment(p, u.host, backlog)
        backlog = 0.0 if u.synced else left
        host = p.cpu * scale
        syncs = [(off * scale, before) for off, before in p.syncs]
        out_p.append(SegmentTiming(p.clock_start, p.clock_end, host, p.gpu, syncs))
        out_u.append(SegmentTiming(u.clock_end - u.duration, u.clock_end, host, p.gpu, list(syncs)))
    return out_p, out_u


def run_segment(seg: SegmentTiming, scale: float, backlog: float = 0.0) -> tuple[float, float]:
    """When the host ends ``seg`` (its host time and wait offsets times ``scale``) and when the device
    has done its work, in the replay's model: the device busy with ``backlog`` seconds of earlier work
    at the segment's start, it runs the segment's work as it is issued, the host waits at each sync
    until the device has done the work queued before it (replay.engine: Compute and CpuSync)."""
    *waited, last = segment_pieces(seg.cpu, seg.gpu, seg.syncs)
    clock, stream = 0.0, backlog
    for c, g in waited:
        stream = max(stream + g, clock + c * scale)
        clock = max(clock + c * scale, stream)
    end = clock + last[0] * scale
    return end, max(stream + last[1], end)


def host_end(seg: SegmentTiming, scale: float, backlog: float = 0.0) -> float:
    """When the host ends ``seg`` in the model of :func:`run_segment`."""
    return run_segment(seg, scale, backlog)[0]


def solve_segment(seg: SegmentTiming, plain_host: float, backlog: float = 0.0) -> tuple[float, float]:
    """:func:`solve_scale`'s factor for ``seg``, and the device work the segment leaves queued when its host
    ends (the next segment's backlog where the runtime does not wait for the device between them)."""
    scale = solve_scale(seg, plain_host, backlog)
    end, device_end = run_segment(seg, scale, backlog)
    return scale, max(device_end - end, 0.0)


def solve_scale(seg: SegmentTiming, plain_host: float, backlog: float = 0.0) -> float:
    """The factor on ``seg``'s profiled host time that makes :func:`host_end` equal the host time the
    same segment took without the profiler, in which the host waited for the device a different while
    (it issues faster, so more work is queued at each sync; device-bound segments wait much longer).

    Subtracting the profiled waits instead left the plain iteration's extra waiting in the host time,
    and device-bound jobs were predicted far over their real time (docs/history.md).
    Where even no host time cannot end that early (the plain run's waits were shorter than the
    profiled device times allow), the plain time less the profiled waits stands.
    """
    if seg.cpu <= 0:
        return 0.0
    if host_end(seg, 0.0, backlog) >= plain_host:
        return max(plain_host - seg.waited, 0.0) / seg.cpu
    lo, hi = 0.0, 1.0
    while host_end(seg, hi, backlog) < plain_host:
        hi *= 2
    for _ in range(50):  # host_end is non-decreasing in the scale
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if host_end(seg, mid, backlog) < plain_host else (lo, mid)
    return hi


class GpuSegmentTimer:
    """Measures segments on a GPU: every other iteration under the CUDA profiler (device busy time, waits
    for the device), the ones between without it (host time); see :func:`pair`.

    Iterations end at ``flush()`` (the client calls it at each iteration's end marker and at exit).
    The set-up and iteration 1 run plain and get no rows (the replay gives them one clock); then
    iterations 2, 4, ... are profiled, each paired with the plain iteration before it, and 3, 5, ...
    with the profiled one before them (see :meth:`flush`). A program without iteration markers gets
    no rows.
    """

    def __init__(self) -> None:
        self._closed: list[Closed] = []
        self._open = False
        self._exclude: set[int] = set()
        self._profile: Any = None
        self._held: list[SegmentTiming] | None = None  # the last profiled iteration, for the plain one after it
        self._held_sent = False  # whether its rows went out already (paired with the plain one before it)
        self._flushed = False  # whether an iteration ended before (the first flush holds the set-up too)
        self._last_plain: list[Closed] | None = None
        self.failed = 0  # segments that could not be attributed (reported, left out of the trace)
        # what the attributions saw, printed at stop(): the numbers to check when a prediction looks off
        self.stats = {"segments": 0, "paired": 0, "device_work": 0, "syncs": 0}
        self.waits: dict[str, int] = {}
        self.off = ""  # why GPU timing stopped for this rank, if it did
        self.permitted = False  # the coordinator's word (at once, or under --swap auto its device's verdict)

    @property
    def profiling(self) -> bool:
        return self._profile is not None

    def exclude_current_thread(self) -> None:
        """Leave out device work this thread queues (the runtime's receiver; kineto may not report the
        thread ids this matches, in which case the receiver's result copies of async ops count)."""
        self._exclude.update({threading.get_native_id(), threading.get_ident()})

    def permit(self, on: bool, why: str) -> None:
        """The coordinator's word: the profiler may start at the next iteration's end (or never: ``why``)."""
        if why:
            print(f"prism: {why}", file=sys.stderr, flush=True)
        if on:
            self.permitted = True
        else:
            self.off = why

    def _start(self) -> None:
        if self.off or not self.permitted:
            return
        try:
            self._profile = self._open_profiler()
        except Exception as e:  # no CUPTI, a profiler already running...: say so; the trace gets no rows
            self._profile = None
            self.off = f"{type(e).__name__}: {e}"
            print(f"prism: GPU timing off for this rank: the CUDA profiler did not start ({self.off}); its "
                  "compute is replayed on one clock (host and device not separated)", file=sys.stderr, flush=True)

    @staticmethod
    def _open_profiler() -> Any:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if not hasattr(torch.cuda, "_sleep"):
            raise RuntimeError("torch.cuda._sleep (the marker kernel) is missing in this PyTorch")
        p = profile(activities=[ProfilerActivity.CUDA])
        p.start()
        return p

    def begin(self) -> None:
        """A segment begins (call before the rank's clock resumes)."""
        import torch

        self._open = self.profiling and torch.cuda.is_initialized()
        if self._open:
            torch.cuda._sleep(1)

    def end(self) -> None:
        """The program's part of the segment ends (before the runtime synchronises or stages)."""
        if self._open:
            import torch

            torch.cuda._sleep(1)

    def closed(self, clock_end: float, duration: float, host: float, synced: bool = True) -> None:
        self._closed.append(Closed(clock_end, self._open, duration, host, synced))
        self._open = False

    def flush(self, final: bool = False) -> list[SegmentTiming]:
        """End an iteration: the rows ready to send. Call while the rank's clock is paused (it may
        synchronise the device).

        Every iteration's rows go out at its own end, so the live prediction of an iteration stands on
        the same measured times as the report's: a profiled iteration takes the host times of the plain
        iteration before it, a plain one the device times of the profiled one before it. Only where no
        plain iteration of the same shape came before (the first profiled one, when iteration 1 differs)
        does a profiled iteration wait for the plain one after it, as the pairing did before.
        """
        closed, self._closed = self._closed, []
        if self.off:
            return []
        if self.profiling:
            timings = self._attribute(closed)
            if timings is None:
                return []
            both = pair(timings, self._last_plain) if self._last_plain else None
            if both is not None:
                self.stats["paired"] += len(both[0])
                self._held, self._held_sent = timings, True  # the next plain iteration's device times
                return both[0]
            if final:
                return timings  # profiled host times: ~30% high, said in the rank's log at stop()
            self._held, self._held_sent = timings, False  # the next iteration runs without the profiler
            return []
        held, self._held = self._held, None
        rows: list[SegmentTiming] = []
        if held is None:
            # the first flush holds the set-up too: no twin of an iteration even where the count matches
            self._last_plain = closed if self._flushed else None
        else:
            both = pair(held, closed)
            if both is None:  # the tail after the last iteration: host times of the iteration before
                rows = [] if self._held_sent else self._with_host(held, self._last_plain)
            else:
                rows = both[1] if self._held_sent else both[0] + both[1]
                self.stats["paired"] += len(rows)
                self._last_plain = closed
        self._flushed = True
        if not final:
            self._start()
        return rows

    def _with_host(self, timings: list[SegmentTiming], plain: list[Closed] | None) -> list[SegmentTiming]:
        both = pair(timings, plain) if plain else None
        if both is None:
            return timings  # profiled host times: ~30% high, said in the rank's log at stop()
        self.stats["paired"] += len(both[0])
        return both[0]

    @collector_paused()
    def _attribute(self, closed: list[Closed]) -> list[SegmentTiming] | None:
        import torch

        cuda = torch.cuda.is_initialized()
        if cuda:
            torch.cuda.synchronize()  # a kernel still running when the profiler stops is not recorded
        self._profile.stop()
        if cuda:
            # the first CUDA call after CUPTI's teardown is slow (bench/gpu/cupti_teardown_cost.py): made here, on
            # the paused clock, not in the plain iteration's first segment, whose host time both twins take
            torch.cuda._sleep(1)
            torch.cuda.synchronize()
        events = self._profile.profiler.kineto_results.events()
        self._profile = None
        if not closed:
            return []
        acts = activities(events)
        try:
            timings = attribute(acts, closed, self._exclude)
        except AttributionError as e:
            self.failed += len(closed)
            print(f"prism: GPU timing of {len(closed)} segment(s) lost: {e}; the replay uses their "
                  "wall time instead", file=sys.stderr, flush=True)
            return None
        self.stats["segments"] += len(timings)
        self.stats["device_work"] += sum(a.device and MARKER not in a.name for a in acts)
        self.stats["syncs"] += sum(len(t.syncs) for t in timings)
        for a in acts:
            if not a.device and a.name in SYNC_CALLS:
                self.waits[a.name] = self.waits.get(a.name, 0) + 1
        return timings

    def stop(self) -> None:
        if self._profile is not None:
            self._profile.stop()
            self._profile = None
        s = self.stats
        print(f"prism: GPU timing: {s['segments']} segments profiled, {s['paired']} rows with host time from "
              f"plain iterations, {s['device_work']} kernels/copies, {s['syncs']} waits for the device inside "
              f"segments, {self.failed} segments lost; host calls that wait: {self.waits}",
              file=sys.stderr, flush=True)
