"""GPU segment timing: profiler events split into segments, and segments mapped onto the graph."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest

from prism_megatron.replay import Comm, Compute, CpuSync, Mark, Wait
from prism_megatron.replay.gpu_segments import with_gpu_times
from prism_megatron.runtime.gpu_timing import Activity, AttributionError, Closed, attribute

MS = 1_000_000  # ns


class _Events:
    """Build profiler events as kineto reports them: host calls and the device work they queued."""

    def __init__(self) -> None:
        self.acts: list[Activity] = []
        self.corr = 100

    def call(self, name: str, t0: float, t1: float, tid: int = 1,
             device: tuple[str, float, float] | None = None) -> int:
        self.corr += 1
        self.acts.append(Activity(self.corr, False, name, tid, int(t0 * MS), int(t1 * MS)))
        if device is not None:
            kname, d0, d1 = device
            self.acts.append(Activity(self.corr, True, kname, 0, int(d0 * MS), int(d1 * MS)))
        return self.corr

    def marker(self, t: float) -> None:
        self.call("cudaLaunchKernel", t, t + 0.01, device=("at::cuda::spin_kernel(long)", t + 0.02, t + 0.021))


def test_segment_gets_host_time_and_device_union_of_its_own_work():
    ev = _Events()
    ev.marker(0.0)  # begin: host call ends at 0.01 ms
    ev.call("cudaLaunchKernel", 0.1, 0.11, device=("gemm", 0.2, 1.2))
    ev.call("cudaLaunchKernel", 0.2, 0.21, device=("gelu", 1.0, 1.5))  # overlaps on another stream: union
    ev.call("cudaMemcpyAsync", 0.3, 0.31, tid=99, device=("Memcpy HtoD", 1.5, 1.9))  # receiver thread: not ours
    ev.marker(0.51)  # end: host call starts at 0.51 ms
    ev.call("cudaMemcpyAsync", 0.6, 0.7, device=("Memcpy DtoH", 1.9, 2.0))  # runtime staging after the end marker
    ev.call("cudaDeviceSynchronize", 0.7, 2.1)  # the runtime's own wait: outside the segment
    [seg] = attribute(ev.acts, [Closed(5.0, True, 0.004)], exclude_tids={99})
    assert seg.cpu == pytest.approx(0.5e-3)
    assert seg.gpu == pytest.approx(1.3e-3)  # [0.2, 1.5] ms
    assert seg.syncs == [] and (seg.clock_start, seg.clock_end) == (pytest.approx(4.996), 5.0)


def test_a_wait_inside_the_segment_is_a_sync_and_its_time_is_not_host_time():
    ev = _Events()
    ev.marker(0.0)
    ev.call("cudaLaunchKernel", 0.1, 0.11, device=("gemm", 0.2, 2.2))
    ev.call("cudaMemcpyAsync", 0.2, 0.21, device=("Memcpy DtoH", 2.2, 2.3))  # .item()
    ev.call("cudaStreamSynchronize", 0.21, 2.31)  # waits 2.1 ms
    ev.call("cudaLaunchKernel", 2.4, 2.41, device=("add", 2.5, 2.6))
    ev.marker(2.61)
    [seg] = attribute(ev.acts, [Closed(1.0, True, 0.0026)], exclude_tids=set())
    assert seg.cpu == pytest.approx((2.61 - 0.01 - 2.1) * 1e-3)
    assert seg.gpu == pytest.approx(2.2e-3)
    [(off, before)] = seg.syncs
    assert off == pytest.approx(0.2e-3) and before == pytest.approx(2.1e-3)


def test_a_copy_that_returns_after_its_device_copy_is_a_wait():
    """.item() to pageable memory: cudaMemcpyAsync itself blocks (the stream sync after it returns at
    once); a copy that returns before its device copy ran (pinned, async) is no wait."""
    ev = _Events()
    ev.marker(0.0)
    ev.call("cudaLaunchKernel", 0.1, 0.11, device=("gemm", 0.2, 2.2))
    ev.call("cudaMemcpyAsync", 0.2, 2.31, device=("Memcpy DtoH (Device -> Pageable)", 2.2, 2.3))
    ev.call("cudaStreamSynchronize", 2.31, 2.32)  # nothing queued since the copy: the same wait
    ev.call("cudaLaunchKernel", 2.4, 2.41, device=("add", 2.5, 2.6))
    ev.call("cudaMemcpyAsync", 2.45, 2.46, device=("Memcpy DtoH (Device -> Pinned)", 2.6, 2.7))  # async
    ev.marker(2.61)
    [seg] = attribute(ev.acts, [Closed(1.0, True, 0.0026)], exclude_tids=set())
    assert seg.cpu == pytest.approx((2.61 - 0.01 - 2.11 - 0.01) * 1e-3)
    [(off, before)] = seg.syncs
    assert off == pytest.approx(0.19e-3) and before == pytest.approx(2.0e-3)


def test_segments_before_cuda_started_are_host_only_and_missing_markers_are_an_error():
    ev = _Events()
    ev.marker(1.0)
    ev.call("cudaLaunchKernel", 1.1, 1.2, device=("k", 1.3, 1.4))
    ev.marker(1.5)
    first, second = attribute(ev.acts, [Closed(0.002, False, 0.002), Closed(0.003, True, 0.001)], set())
    assert (first.cpu, first.gpu) == (0.002, 0.0)
    assert second.gpu == pytest.approx(0.1e-3)
    with pytest.raises(AttributionError, match="found 2 marker kernels, expected 4"):
        attribute(ev.acts, [Closed(0.002, True, 0.002), Closed(0.003, True, 0.001)], set())


def test_graph_computes_take_the_measured_times_of_the_segments_they_span():
    events = [Compute(0.3), Comm("all_reduce", 0, 0, async_op=True), Compute(0.2), Mark("iteration", "E"),
              Compute(0.1), Wait((1,))]
    rows = [  # segments on the rank's clock: (0, .1], (.1, .3] | (.3, .5] | (.5, .6] lost
        {"clock_start": 0.0, "clock_end": 0.1, "cpu": 0.05, "gpu": 0.5, "syncs": "[]"},
        {"clock_start": 0.1, "clock_end": 0.3, "cpu": 0.1, "gpu": 0.25, "syncs": "[]"},
        {"clock_start": 0.3, "clock_end": 0.5, "cpu": 0.15, "gpu": 0.4, "syncs": [[0.05, 0.3]]},
    ]
    out = with_gpu_times(events, rows)
    assert out[0] == Compute(pytest.approx(0.15), "", pytest.approx(0.75))
    assert out[1] == events[1]
    assert out[2] == Compute(pytest.approx(0.05), "", pytest.approx(0.3))
    assert isinstance(out[3], CpuSync)
    assert out[4] == Compute(pytest.approx(0.1), "", pytest.approx(0.1))
    assert isinstance(out[5], CpuSync) and out[6] == events[3]  # an iteration ends when its device work has
    assert out[7] == Compute(pytest.approx(0.1), "", pytest.approx(0.1))  # no segment: one clock
    assert out[8] == Wait((1,))
    events.insert(1, Comm("barrier", 0, 0))
    events[-1] = Wait((2,))
    assert with_gpu_times(events, rows)[-1] == Wait((2,))
    moved = with_gpu_times([Compute(0.5), *events[1:]], rows)  # the sync's split shifts the ops after it
    assert [type(e).__name__ for e in moved[:5]] == ["Compute", "CpuSync", "Compute", "Comm", "Comm"]
    assert moved[-1] == Wait((4,)) and moved[4].kind == "all_reduce"
    assert with_gpu_times(events, []) is events


def test_host_times_are_the_median_over_iterations_of_the_same_shape():
    """Iterations 2-4 run the same two segments; iteration 3 ran slow (the VM): each segment takes its
    median over the iterations up to its own (the live prediction of an iteration cannot see later
    ones, and the report must agree with it); set-up/iteration 1, the first iteration of a shape and the
    tail keep their own; wait offsets scale with the host time."""
    from prism_megatron.replay.gpu_segments import typical_host_times

    def row(a, b, cpu, syncs=()):
        return {"clock_start": a, "clock_end": b, "cpu": cpu, "gpu": 0.01, "syncs": list(syncs)}

    rows = [row(0.0, 1.0, 0.9),  # set-up + iteration 1 (ends at clock 1)
            row(1.0, 1.1, 0.10), row(1.1, 1.3, 0.20, [[0.1, 0.005]]),  # iteration 2 (ends at 1.3)
            row(1.3, 1.6, 0.30), row(1.6, 1.9, 0.50, [[0.25, 0.005]]),  # iteration 3, slow
            row(1.9, 2.0, 0.12), row(2.0, 2.2, 0.22, [[0.11, 0.005]]),  # iteration 4 (ends at 2.2)
            row(2.2, 2.4, 0.7)]  # after the last iteration's end
    ends = [1.0, 1.3, 1.9, 2.2]
    out = typical_host_times(rows, ends)
    assert [r["cpu"] for r in out] == [0.9, 0.10, 0.20, pytest.approx(0.20), pytest.approx(0.35), 0.12, 0.22, 0.7]
    assert out[4]["syncs"] == [[pytest.approx(0.25 * 0.35 / 0.5), 0.005]]
    assert out[6]["syncs"] == [[pytest.approx(0.11), 0.005]] and rows[6]["cpu"] == 0.22  # a copy
    assert typical_host_times(rows[:5], ends[:3])[1:5] == out[1:5]  # cut after iteration 3: the same
    odd = [*rows[:5], row(1.9, 2.0, 0.5), row(2.0, 2.1, 0.5), row(2.1, 2.2, 0.5)]  # iteration 4: 3 segments
    assert [r["cpu"] for r in typical_host_times(odd, ends)][1:8] == [0.1, 0.2, 0.2, 0.35, 0.5, 0.5, 0.5]
    latest = typical_host_times(rows, ends, window=1)  # the pool cut to the latest: each keeps its own
    assert [r["cpu"] for r in latest] == [r["cpu"] for r in rows]


def test_host_times_are_pooled_over_ranks_that_issued_the_same_ops():
    """Three ranks end iterations 1-3 at clocks 1, 2, 3; in iteration 2 and 3 (windows 1 and 2) each issues
    one op between two stretches. Ranks 0 and 1 issue the same op (DP replicas) and rank 1 splits its first
    stretch in two (its iteration line): each stretch's host time becomes the median over 0, 1 and the
    other like rank 2, spread over its segments in proportion; rank 3 issued another op and keeps its own;
    set-up/iteration 1 are never pooled."""
    from prism_megatron.replay.gpu_segments import like_rank_host_times

    def row(a, b, cpu, syncs=()):
        return {"clock_start": a, "clock_end": b, "cpu": cpu, "gpu": 0.01, "syncs": list(syncs)}

    def rows(scale, split=False):
        out = [row(0.0, 1.0, 0.9 * scale)]
        for k in (1, 2):
            first = ([row(k, k + 0.25, 0.1 * scale), row(k + 0.25, k + 0.5, 0.3 * scale, [[0.2 * scale, 0.01]])]
                     if split else [row(k, k + 0.5, 0.4 * scale)])
            out += [*first, row(k + 0.5, k + 1.0, 0.5 * scale)]
        return out

    ends = [1.0, 2.0, 3.0]
    op = ("all_reduce", 1024, "torch.bfloat16", 2)
    ops = {r: {1: [(1.5, op)], 2: [(2.5, op)]} for r in (0, 1, 2)}
    ops[3] = {1: [(1.5, (*op[:3], 4))], 2: [(2.5, (*op[:3], 4))]}
    given = {0: rows(1.0), 1: rows(2.0, split=True), 2: rows(1.2), 3: rows(3.0)}
    out = like_rank_host_times(given, {r: ends for r in given}, ops)
    # medians of 0.4/0.8/0.48 and of 0.5/1.0/0.6, in both iterations
    assert [r["cpu"] for r in out[0]] == [0.9, *[pytest.approx(0.48), pytest.approx(0.6)] * 2]
    assert [r["cpu"] for r in out[1]][:4] == [1.8, pytest.approx(0.12), pytest.approx(0.36), pytest.approx(0.6)]
    assert out[1][2]["syncs"] == [[pytest.approx(0.24), 0.01]]  # the wait's offset scales with its segment
    assert [r["cpu"] for r in out[3]] == [r["cpu"] for r in given[3]]  # another op: not like the others
    assert given[1][2]["cpu"] == 0.6  # the input is left alone
    def upto(rows):
        return [x for x in rows if x["clock_end"] <= 2.0]

    cut = like_rank_host_times({r: upto(x) for r, x in given.items()}, {r: ends[:2] for r in given},
                               {r: {1: o[1]} for r, o in ops.items()})  # the live prediction of iteration 2
    assert all(cut[r] == upto(out[r]) for r in given)


def test_like_ranks_are_told_apart_by_their_ops_but_not_by_routed_token_counts():
    """Per whole iteration after the first, a rank's ops with their compute clocks; two MoE expert ranks
    that routed different token counts (all_to_all bytes) are alike, a different all_reduce size is not."""
    from prism_megatron.replay.graph import _iteration_ops

    def ops(a2a_bytes, ar_bytes):
        return [{"kind": kind, "bytes": b, "dtype": "torch.bfloat16", "group": g, "t_issue": t, "compute_before": c}
                for kind, b, g, t, c in (("all_reduce", 64, 0, 0.5, 0.5), ("all_to_all", a2a_bytes, 1, 1.5, 1.0),
                                         ("all_reduce", ar_bytes, 0, 1.7, 0.1), ("all_to_all", 8, 1, 2.5, 1.0))]

    marks = [{"name": "iteration", "phase": ph, "t": t} for ph, t in (("B", 0.0), ("E", 1.0), ("B", 1.0),
                                                                       ("E", 2.0), ("B", 2.0), ("E", 3.0))]
    sizes = {0: 2, 1: 4}
    a, b, c = (_iteration_ops(ops(x, y), marks, sizes) for x, y in ((100, 64), (300, 64), (100, 32)))
    assert list(a) == [1, 2] and [clock for clock, _ in a[1]] == [pytest.approx(1.5), pytest.approx(1.6)]
    assert a == b and a[1] != c[1] and a[2] == c[2]


def test_like_ranks_share_host_time_in_the_replay(tmp_path):
    """Two data-parallel replicas, the same work, but from iteration 2 the emulating machine ran rank 1's
    host code 50% slower than rank 0's: with like ranks pooled (the default) the prediction is what two
    replicas at the median speed give; each rank's own makes the slower one the critical path."""
    from prism_megatron.replay import graph_from_trace, replay
    from prism_megatron.trace import read_trace, write_trace

    def trace(hosts, name):
        manifest = {"world_size": 2, "groups": [{"id": 0, "name": "dp", "ranks": [0, 1], "backend": "nccl"}],
                    "ranks": [{"rank": r, "exit_code": 0, "device": "cuda:0"} for r in (0, 1)]}
        ops, marks, gpu = [], [], []
        for r, host in enumerate(hosts):
            for it in range(3):  # iterations 1-3 at t = 10 it .. 10 it + 5; compute clock 2 per iteration
                ops.append({"rank": r, "index": it, "kind": "all_reduce", "group": 0, "seq": it, "peer": -1,
                            "root": -1, "bytes": 1 << 20, "dtype": "torch.float32", "shapes": [[1 << 18]],
                            "reduce_op": "sum", "async_op": False, "t_issue": 10.0 * it + 1,
                            "t_complete": 10.0 * it + 2, "compute_before": 1.0 if it == 0 else 2.0, "label": ""})
                marks += [{"rank": r, "name": "iteration", "phase": ph, "t": 10.0 * it + dt, "compute_clock": c,
                           "attrs": {"iteration": it + 1} if ph == "B" else {}}
                          for ph, dt, c in (("B", 0.0, 2.0 * it), ("E", 5.0, 2.0 * it + 2))]
                gpu += [{"rank": r, "clock_start": 2.0 * it + a, "clock_end": 2.0 * it + a + 1,
                         "cpu": host if it else 0.25, "gpu": 0.1, "syncs": []} for a in (0, 1)]
        return read_trace(write_trace(tmp_path / name, manifest, ops, marks=marks, gpu=gpu))

    def times(t, **kw):
        return replay(graph_from_trace(t, **kw), lambda spec: 0.0).iteration_times()

    slow, even = trace([0.2, 0.3], "slow"), trace([0.25, 0.25], "even")  # iteration 1: 0.25 in both
    assert times(slow) == [pytest.approx(t) for t in times(even)]  # both at the median, 0.25
    own = times(slow, like_ranks=False)
    assert own[0] == times(slow)[0] and all(t > 0.5 + 0.05 for t in own[1:])  # the slower rank's host time
    assert times(even) == times(even, like_ranks=False)

    from prism_megatron.report.build import build_report
    from prism_megatron.report.live import predict_iteration

    report = build_report(slow.path)["prediction"]["iteration_times_s"]  # communication free, as the cost above
    assert [predict_iteration(slow.path, n)[0] for n in (1, 2, 3)] == [pytest.approx(t) for t in report]
    from pathlib import Path

    from prism_megatron.report import live

    assert live._REPLAYS[(str(Path(slow.path).resolve()), None, None)].resumed  # the third went on from the second


def test_a_trace_with_gpu_times_replays_with_the_host_running_ahead(tmp_path):
    """Two ranks, host-bound segments around a TP all_reduce: measured device time hides the op."""
    from prism_megatron.replay import graph_from_trace, replay
    from prism_megatron.trace import read_trace, write_trace

    manifest = {"world_size": 2, "groups": [{"id": 0, "name": "tp", "ranks": [0, 1], "backend": "nccl"}],
                "ranks": [{"rank": r, "exit_code": 0, "device": "cuda:0"} for r in (0, 1)]}
    ops = [{"rank": r, "index": 0, "kind": "all_reduce", "group": 0, "seq": 0, "peer": -1, "root": -1,
            "bytes": 1 << 20, "dtype": "torch.bfloat16", "shapes": [[512, 1024]], "reduce_op": "sum",
            "async_op": False, "t_issue": 1.0, "t_complete": 2.0, "compute_before": 1.0, "label": ""} for r in (0, 1)]
    marks = [{"rank": r, "name": "iteration", "phase": ph, "t": t, "compute_clock": c, "attrs": {}}
             for r in (0, 1) for ph, t, c in (("B", 0.0, 0.0), ("E", 3.0, 2.0))]
    # host 0.8 s + wait for the device (.item()) in the second segment; the device is busy 0.3 s per segment
    gpu = [{"rank": r, "clock_start": a, "clock_end": b, "cpu": 0.8, "gpu": 0.3, "syncs": s}
           for r in (0, 1) for a, b, s in ((0.0, 1.0, []), (1.0, 2.0, [[0.8, 0.3]]))]
    path = write_trace(tmp_path / "t", manifest, ops, marks=marks, gpu=gpu)
    trace = read_trace(path)
    cost = lambda spec: 0.5  # noqa: E731 - an all_reduce of 0.5 s
    two = replay(graph_from_trace(trace), cost).iteration_times()
    one = replay(graph_from_trace(trace, gpu_times=False), cost).iteration_times()
    assert one == [pytest.approx(2.5)]  # 1 + 0.5 + 1: the op blocks the one clock
    # host: 0.8, issue, 0.8, wait for the device (op ends 0.3 + 0.5 = 0.8 -> second segment 1.1), E at 1.6
    assert two == [pytest.approx(1.6)]

    from prism_megatron.report.build import build_report

    report = build_report(path, cluster=None)  # communication free: the GPU waits 0.5 s per segment
    rows = report["prediction"]["breakdown"]
    assert [b["host_bound_s"] for b in rows] == [pytest.approx(1.0), pytest.approx(1.0)]
    assert report["prediction"]["provenance"].startswith("host and GPU time per segment, measured")


def test_timer_takes_host_time_from_plain_iterations_and_device_time_from_profiled_ones(monkeypatch):
    """Set-up + iteration 1 plain (no rows); 2 profiled, but iteration 1 ran other segments: it waits for
    3 (plain) and both go out then; from there every iteration's rows go out at its own end: a profiled
    one with the host times of the plain one before it, a plain one with the device times of the
    profiled one before it (the live prediction of every iteration then has them); the tail after the
    last iteration gets none."""
    from prism_megatron.runtime import gpu_timing as gt

    class Timer(gt.GpuSegmentTimer):
        def _start(self) -> None:
            self._profile = object()

        def _attribute(self, closed):  # the profiler: host 30% slow, device 1 ms per segment, one wait in k=1
            self._profile = None
            return [gt.SegmentTiming(c.clock_end - c.duration, c.clock_end, c.host * 1.3, 1e-3,
                                     [(c.host * 0.65, 5e-4)] if k == 1 else [], 2e-4 if k == 1 else 0.0)
                    for k, c in enumerate(closed)]

    timer, clock, sent = Timer(), 0.0, {}
    for it, n in [(1, 5), (2, 3), (3, 3), (4, 3), (5, 3), (6, 3), ("tail", 1)]:
        profiled = timer.profiling
        for k in range(n):
            host = {3: 10, 5: 12}.get(it, 20) * 1e-3 * (k + 1)  # profiled iterations are slower still
            clock += host + 1e-3
            timer.closed(clock, host + 1e-3, host)
        rows = timer.flush(final=it == "tail")
        sent[it] = (profiled, rows)
    assert [sent[i][0] for i in (1, 2, 3, 4, 5, 6)] == [False, True, False, True, False, True]
    assert sent[1][1] == [] and sent[2][1] == [] and sent["tail"][1] == []
    pairs = sent[3][1]
    assert len(pairs) == 6  # iterations 2 and 3, three segments each
    assert all(r.gpu == 1e-3 for r in pairs)
    assert [round(r.clock_end - r.clock_start, 6) for r in pairs] == [0.021, 0.041, 0.061, 0.011, 0.021, 0.031]
    # host times are the plain iteration's (10, 20, 30 ms): the device (1 ms) never holds the host up
    assert [round(r.cpu * 1e3, 6) for r in pairs[:3]] == [10.0, 20.0, 30.0]
    assert [round(r.cpu * 1e3, 6) for r in pairs[3:]] == [10.0, 20.0, 30.0]
    assert pairs[1].syncs == [(pytest.approx(20e-3 * 0.65 / 1.3), 5e-4)]
    four, five, six = sent[4][1], sent[5][1], sent[6][1]  # each at its own end, on its own clock
    assert [round(r.clock_end - r.clock_start, 6) for r in four] == [0.021, 0.041, 0.061]
    assert [round(r.cpu * 1e3, 6) for r in four] == [10.0, 20.0, 30.0]  # iteration 3's host times
    assert [round(r.cpu * 1e3, 6) for r in five] == [12.0, 24.0, 36.0]  # its own, with 4's device times
    assert [round(r.clock_end - r.clock_start, 6) for r in five] == [0.013, 0.025, 0.037]
    assert [round(r.cpu * 1e3, 6) for r in six] == [12.0, 24.0, 36.0]  # iteration 5's
    assert timer.stats["paired"] == 15


def test_plain_host_time_is_solved_through_the_segment_model_not_by_subtracting_profiled_waits():
    """A device-bound segment: the profiled run reached its sync 5 ms in and waited 35 ms for 40 ms of
    device work; without the profiler the host issues 30% faster and waits longer. The plain segment's
    measured 43.5 ms are 7 ms of host time (scale 0.7), not 43.5 - 35 = 8.5."""
    from prism_megatron.runtime.gpu_timing import SegmentTiming, host_end, solve_scale

    seg = SegmentTiming(0.0, 0.1, cpu=10e-3, gpu=50e-3, syncs=[(5e-3, 40e-3)], waited=35e-3)
    assert host_end(seg, 1.0) == pytest.approx(45e-3)  # waits for the device at 40 ms, 5 ms more
    assert solve_scale(seg, 43.5e-3) == pytest.approx(0.7)
    # host-bound (device done before the host reaches the sync): the plain time is all host time
    quick = SegmentTiming(0.0, 0.1, cpu=10e-3, gpu=2e-3, syncs=[(5e-3, 1e-3)], waited=1e-4)
    assert quick.cpu * solve_scale(quick, 8e-3) == pytest.approx(8e-3)
    # shorter than the device work before the sync allows: the plain time less the profiled waits
    assert seg.cpu * solve_scale(seg, 39e-3) == pytest.approx(4e-3)
    assert solve_scale(SegmentTiming(0.0, 0.1, cpu=0.0, gpu=1e-3), 1e-3) == 0.0


def test_a_segment_after_a_marker_waits_for_the_device_work_the_one_before_left_and_that_is_not_host_time():
    """The H200's one-GPU truth (dense h4096, bench/gpu/results/*one-gpu-truth*run12*): the last backward is
    issued in 14 ms and queues 80 ms of device work; its end is a marker (no runtime wait), so the next
    segment, Megatron's gradient check, starts with ~66 ms of it still queued and its sync waits for that.
    Its plain time (~69 ms) is mostly that wait: solved as if the queue were empty it became 69 ms of host
    time and the replay idled the device 40 ms (+15 % on the iteration). After an op the runtime has
    waited for the device, so the next segment does start empty."""
    from prism_megatron.runtime.gpu_timing import Closed, SegmentTiming, pair

    backward = SegmentTiming(0.0, 0.014, cpu=14e-3, gpu=80e-3)
    check = SegmentTiming(0.014, 0.020, cpu=3e-3, gpu=1e-3, syncs=[(1e-3, 1e-3)], waited=60e-3)
    plain_check_ms = (66 + 1 + 2) * 1e-3  # waits for the backward's tail and its own kernel, then 2 ms
    after_marker = [Closed(0.1, False, 14e-3, 14e-3, synced=False), Closed(0.2, False, 70e-3, plain_check_ms)]
    _, rows = pair([backward, check], after_marker)
    assert rows[0].cpu == pytest.approx(14e-3)
    assert rows[1].cpu == pytest.approx(3e-3, rel=0.02)  # its own host time, not the wait
    after_op = [Closed(0.1, False, 95e-3, 14e-3, synced=True), Closed(0.2, False, 3e-3, 3e-3)]
    _, rows = pair([backward, check], after_op)
    assert rows[1].cpu == pytest.approx(3e-3, rel=0.02)
    # the same plain time after an op is the host's own: nothing queued before it to wait for
    _, rows = pair([backward, check], [after_op[0], Closed(0.2, False, 70e-3, plain_check_ms)])
    assert rows[1].cpu > 60e-3


def test_a_profiler_that_does_not_start_turns_timing_off_with_a_message(monkeypatch, capsys):
    import torch.profiler

    from prism_megatron.runtime import gpu_timing as gt

    def broken(*a, **k):
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(torch.profiler, "profile", broken)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None, raising=False)
    timer = gt.GpuSegmentTimer()
    timer.permit(True, "")
    timer.closed(0.1, 0.1, 0.1)
    assert timer.flush() == []  # the plain iteration 1; the profiler should start now, and cannot
    assert "CUPTI_ERROR_NOT_INITIALIZED" in timer.off and not timer.profiling
    timer.begin()
    timer.closed(0.2, 0.1, 0.1)
    assert timer.flush() == [] and timer.flush(final=True) == []
    assert "GPU timing off for this rank" in capsys.readouterr().err


def test_live_prediction_says_whether_the_iteration_had_measured_gpu_times(tmp_path):
    from prism_megatron.report.live import predict_iteration
    from prism_megatron.trace import write_trace

    manifest = {"world_size": 1, "groups": [{"id": 0, "name": "w", "ranks": [0], "backend": "nccl"}],
                "ranks": [{"rank": 0, "exit_code": 0, "device": "cuda:0"}]}
    ops = [{"rank": 0, "index": i, "kind": "all_reduce", "group": 0, "seq": i, "peer": -1, "root": -1, "bytes": 4,
            "dtype": "torch.float32", "shapes": [[1]], "reduce_op": "sum", "async_op": False, "t_issue": 1.0 + i,
            "t_complete": 1.0 + i, "compute_before": 0.5, "label": ""} for i in range(2)]
    marks = [{"rank": 0, "name": "iteration", "phase": ph, "t": t, "compute_clock": c, "attrs": a}
             for ph, t, c, a in (("B", 0.0, 0.0, {"iteration": 1}), ("E", 1.5, 0.5, {}),
                                 ("B", 1.6, 0.5, {"iteration": 2}), ("E", 2.5, 1.0, {}))]
    gpu = [{"rank": 0, "clock_start": 0.0, "clock_end": 0.5, "cpu": 0.2, "gpu": 0.4, "syncs": []}]
    path = write_trace(tmp_path / "t", manifest, ops, marks=marks, gpu=gpu)
    first, note1 = predict_iteration(path, 1)
    second, note2 = predict_iteration(path, 2)
    assert "host and GPU time measured" in note1 and first == pytest.approx(0.4)  # the device's 0.4 s
    assert "one clock" in note2 and second == pytest.approx(0.5)
    write_trace(tmp_path / "untimed", manifest, ops, marks=marks)  # GPU ranks, none timed (yet): one clock
    assert "one clock" in predict_iteration(tmp_path / "untimed", 1)[1]
    cpu = {**manifest, "ranks": [{"rank": 0, "exit_code": 0, "device": "cpu"}]}
    write_trace(tmp_path / "cpu", cpu, ops, marks=marks)
    assert predict_iteration(tmp_path / "cpu", 1)[1] == "uncalibrated, communication free"


# five iterations of three 10 ms busy loops, each followed by an all_reduce
FIVE_ITERATIONS = (
    "import time, torch, torch.distributed as dist\n"
    "from prism_megatron.trace import span\n"
    "dist.init_process_group('gloo')\n"
    "x = torch.ones(4)\n"
    "for it in range(1, 6):\n"
    "    with span('iteration', iteration=it):\n"
    "        for _ in range(3):\n"
    "            t = time.perf_counter()\n"
    "            while time.perf_counter() - t < 0.01:\n"
    "                pass\n"
    "            dist.all_reduce(x)\n"
    "dist.destroy_process_group()\n")


class _StandInProfile:
    """What the timer reads of torch.profiler.profile: no events (no GPU here)."""

    profiler = SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: []))

    def stop(self) -> None:
        pass


def _stand_in_profiler(monkeypatch) -> None:
    """Ranks (forked from this process) time GPU segments with the stand-in profiler."""
    from prism_megatron.runtime import gpu_timing as gt

    monkeypatch.setattr(gt.GpuSegmentTimer, "_open_profiler", staticmethod(_StandInProfile))
    monkeypatch.setenv("PRISM_GPU_TIMING", "1")  # the launcher sets it on GPUs only


def test_segment_rows_travel_from_ranks_to_the_trace_and_replay(tmp_path, monkeypatch):
    """The plumbing on CPU: ranks time segments (a stand-in profiler that sees no device work), pair
    plain and profiled iterations, send rows; the trace's gpu table holds iterations 2-5 of every rank
    (set-up and iteration 1 run plain and unpaired) and the replay runs on two clocks."""
    from conftest import launch_source
    from prism_megatron.replay import Compute, graph_from_trace, replay

    _stand_in_profiler(monkeypatch)
    tr = launch_source(tmp_path, FIVE_ITERATIONS)
    rows = tr.gpu.to_pylist()
    marks = [m for m in tr.marks.to_pylist() if m["name"] == "iteration"]
    for rank in (0, 1):
        clocks = [m["compute_clock"] for m in marks if m["rank"] == rank]
        start, end = clocks[1], clocks[-1]  # iteration 1's end .. iteration 5's end
        mine = [r for r in rows if r["rank"] == rank]
        assert mine and min(r["clock_start"] for r in mine) == pytest.approx(start, abs=1e-6)
        inside = [r for r in mine if r["clock_end"] <= end + 1e-9]  # the tail after iteration 5 has rows too
        assert sum(r["clock_end"] - r["clock_start"] for r in inside) == pytest.approx(end - start, abs=1e-6)
        # host times come from the plain iteration of each pair: ~10 ms of busy loop or a few us of marks;
        # the tail (process-group teardown, exit) is as long as the machine makes it, so only its sign
        assert all(r["gpu"] == 0.0 and r["cpu"] >= 0 for r in mine)
        assert all(r["cpu"] < 0.5 for r in inside)
        assert sum(r["cpu"] >= 0.009 for r in inside) == 12  # 3 loops x iterations 2-5
    graph = graph_from_trace(tr)
    assert any(isinstance(e, Compute) and e.gpu == 0.0 for e in graph.events[0])
    times = replay(graph).iteration_times()
    assert len(times) == 5 and all(0.03 <= t < 1.0 for t in times[1:])  # three 10 ms loops of host time


_BOUNDS = ((0.0, 2.0), (2.0, 2.5), (2.5, 3.0), (3.0, 3.5))  # compute clock of each iteration; an op in each


def _four_iterations(path, gpu: list[dict]):
    """A one-rank GPU trace of four iterations on the compute clocks ``_BOUNDS``, an all-reduce in each, with
    ``gpu`` rows."""
    from prism_megatron.trace import write_trace

    manifest = {"world_size": 1, "groups": [{"id": 0, "name": "w", "ranks": [0], "backend": "nccl"}],
                "ranks": [{"rank": 0, "exit_code": 0, "device": "cuda:0"}]}
    ops = [{"rank": 0, "index": i, "kind": "all_reduce", "group": 0, "seq": i, "peer": -1, "root": -1, "bytes": 4,
            "dtype": "torch.float32", "shapes": [[1]], "reduce_op": "sum", "async_op": False, "t_issue": t,
            "t_complete": t, "compute_before": c, "label": ""}
           for i, (t, c) in enumerate(((1.0, 1.0), (2.25, 1.25), (2.75, 0.5), (3.25, 0.5)))]
    marks = [{"rank": 0, "name": "iteration", "phase": ph, "t": c, "compute_clock": c,
              "attrs": {"iteration": k + 1} if ph == "B" else {}}
             for k, (b, e) in enumerate(_BOUNDS) for ph, c in (("B", b), ("E", e))]
    return write_trace(path, manifest, ops, marks=marks, gpu=gpu)


def test_report_headline_is_over_timed_iterations_and_says_per_iteration_what_it_rests_on(tmp_path):
    """Iteration 1 (set-up, allocator and autotuning warm-up) has no GPU rows: it is one-clock wall time,
    listed with its basis but left out of the headline median, which is of the iterations measured on
    two clocks; the live note of an iteration says the same basis as the report's entry for it."""
    from prism_megatron.report.build import build_report
    from prism_megatron.report.live import predict_iteration

    gpu = [{"rank": 0, "clock_start": a, "clock_end": z, "cpu": 0.05, "gpu": g / 2, "syncs": []}
           for (b, e), g in zip(_BOUNDS[1:], (0.3, 0.4, 0.2), strict=True) for a, z in ((b, b + 0.25), (b + 0.25, e))]
    path = _four_iterations(tmp_path / "t", gpu)
    pred = build_report(path)["prediction"]
    assert pred["iteration_times_s"] == [pytest.approx(2.0), pytest.approx(0.3), pytest.approx(0.4),
                                         pytest.approx(0.2)]
    assert pred["iteration_time_s"] == pytest.approx(0.3)  # of 0.3, 0.4, 0.2; with iteration 1 it was 0.35
    assert pred["iteration_bases"][0].startswith("one clock")
    assert all(b.startswith("host and GPU time measured") for b in pred["iteration_bases"][1:])
    for n in (1, 3):
        live, note = predict_iteration(path, n)
        assert live == pytest.approx(pred["iteration_times_s"][n - 1])
        assert pred["iteration_bases"][n - 1] in note


def test_an_iteration_whose_rows_cover_part_of_its_compute_is_not_timed(tmp_path):
    """Segments lost in an iteration leave that part on one clock in the replay, where the host waits for every
    op: mixing that into the headline moved a Qwen3-30B prediction (bench/targets/critical_path_by_iteration.py:
    one-clock iterations put 19 s of all-to-all on the path, timed ones 0.6-0.8 s). Such an iteration is listed
    with the one-clock basis and left out of the headline, like one without rows."""
    from prism_megatron.report.build import build_report
    from prism_megatron.report.live import timed_iterations
    from prism_megatron.trace import read_trace

    halves = [(2.0, 2.25), (2.25, 2.5), (2.5, 2.75), (3.0, 3.25), (3.25, 3.5)]  # iteration 3's second half lost
    gpu = [{"rank": 0, "clock_start": a, "clock_end": z, "cpu": 0.05, "gpu": 0.1, "syncs": []} for a, z in halves]
    path = _four_iterations(tmp_path / "t", gpu)
    assert timed_iterations(read_trace(path)) == {1: False, 2: True, 3: False, 4: True}
    pred = build_report(path)["prediction"]
    assert pred["iteration_bases"][2].startswith("one clock")
    assert pred["iteration_time_s"] == pytest.approx(statistics.median([pred["iteration_times_s"][i] for i in (1, 3)]))


def test_segments_end_at_every_wait_so_iterations_pair_whatever_the_ops_timing(tmp_path, monkeypatch):
    """Whether an async op has completed by the time the program waits for it varies run to run; the
    rank's segments must not (the timer pairs iterations segment by segment, else their rows are lost).
    Two slots, random compute before each wait: every iteration 2-5 has rows, the same number each."""
    from conftest import launch_source

    _stand_in_profiler(monkeypatch)
    tr = launch_source(tmp_path, (
        "import random, time, torch, torch.distributed as dist\n"
        "from prism_megatron.trace import span\n"
        "dist.init_process_group('gloo')\n"
        "rng = random.Random(dist.get_rank())\n"
        "x = torch.ones(1 << 15)\n"
        "for it in range(1, 6):\n"
        "    with span('iteration', iteration=it):\n"
        "        for _ in range(6):\n"
        "            w = dist.all_reduce(x, async_op=True)\n"
        "            t, busy = time.perf_counter(), rng.choice([0.0, 0.02])  # before or after it completes\n"
        "            while time.perf_counter() - t < busy:\n"
        "                pass\n"
        "            w.wait()\n"
        "dist.destroy_process_group()\n"), slots_per_device=2)
    rows = tr.gpu.to_pylist()
    marks = [m for m in tr.marks.to_pylist() if m["name"] == "iteration"]
    for rank in (0, 1):
        clocks = [m["compute_clock"] for m in marks if m["rank"] == rank]
        mine = [r for r in rows if r["rank"] == rank]
        counts = [sum(a - 1e-9 < r["clock_end"] <= b + 1e-9 for r in mine)
                  for a, b in zip(clocks[0::2], clocks[1::2], strict=True)][1:]
        assert len(set(counts)) == 1 and counts[0] > 0, counts


@pytest.mark.parametrize(("device_gib", "timed"), [(141, True), (61, False)])
def test_swap_auto_starts_gpu_timing_only_where_ranks_needed_no_swaps(tmp_path, monkeypatch, capsys, device_gib,
                                                                      timed):
    """--swap auto (the stand-in swapper): two ranks of 60 GiB fit a 141 GiB device, so once both ended
    iteration 1 the device is pinned and their timers start (rows from iteration 3: the verdict comes
    after the last rank's iteration-1 flush), whatever was swapped before (a rank not measured yet
    computes alone); on 61 GiB their peaks do not fit together, so they keep swapping and no rank is
    profiled (a profiled process cannot be checkpointed)."""
    from conftest import launch_source

    _stand_in_profiler(monkeypatch)
    monkeypatch.setenv("PRISM_FOOTPRINT_BYTES", str(60 * 2**30))
    tr = launch_source(tmp_path, FIVE_ITERATIONS, swap="budget-auto", device_memory_gib=device_gib)
    assert "--swap auto: blocked ranks are swapped to host memory if a device fills up" in capsys.readouterr().err
    job = tr.manifest["job"]
    verdict = job["gpu_timing_by_device"]["cpu"]
    swaps = sum(s["swaps_out"] for s in job["swap"].values())
    rows = tr.gpu.to_pylist()
    assert verdict["on"] is timed
    if timed:
        assert "peaks expected from iteration 1 add up to 120.0 of 141.0 GiB" in verdict["why"]
        swapped_after = [s for s in job["swap"].values() if s["swaps_out"]]  # all before the verdict
        assert "no swaps from here" in verdict["why"] and (not swapped_after or "swap(s) before" in verdict["why"])
        marks = [m for m in tr.marks.to_pylist() if m["name"] == "iteration" and m["phase"] == "E"]
        for rank in (0, 1):
            second_end = sorted(m["compute_clock"] for m in marks if m["rank"] == rank)[1]
            assert min(r["clock_start"] for r in rows if r["rank"] == rank) == pytest.approx(second_end, abs=1e-6)
    else:
        assert swaps > 0 and "add up to 120.0 of 61.0 GiB" in verdict["why"] and rows == []
    from prism_megatron.replay import graph_from_trace
    from prism_megatron.trace.summary import summarize

    assert f"cpu: {verdict['why']}" in summarize(tr.path)
    notes = graph_from_trace(tr).notes
    assert any(n.startswith("cpu: GPU timing stays off") for n in notes) is not timed


GROWS_AFTER_ITERATION_1 = (
    "import torch, torch.distributed as dist\n"
    "from prism_megatron.runtime import fake_device\n"
    "from prism_megatron.trace import span\n"
    "GIB = 2**30\n"
    "dist.init_process_group('gloo')\n"
    "x = torch.ones(4)\n"
    "fake_device.alloc(10 * GIB)  # weights\n"
    "dist.all_reduce(x)\n"
    "for it in range(1, 5):\n"
    "    with span('iteration', iteration=it):\n"
    "        fake_device.alloc(30 * GIB)  # activations, while the rank holds its slot\n"
    "        dist.all_reduce(x)\n"
    "        fake_device.free(30 * GIB)\n"
    "        if it == 1:\n"
    "            fake_device.alloc(15 * GIB)  # the optimizer's state, made at the first step and kept\n"
    "dist.all_reduce(x)\n"
    "dist.destroy_process_group()\n")


def test_swap_auto_pins_a_device_only_for_the_peaks_iteration_2_will_reach(tmp_path, monkeypatch):
    """Two ranks of 10 GiB that reach 40 GiB in iteration 1 and keep 15 GiB of optimizer state from its end:
    iteration 1's peaks (80 of 100 GiB) fit, iteration 2's (2 x 55) do not. The device must not be pinned
    on iteration 1's figures (admission stops swapping there, and the second rank's activations would
    overrun it): the verdict counts what each rank holds after iteration 1 plus what a turn of it rose, so
    GPU timing stays off, the ranks keep swapping, and the job ends."""
    from conftest import launch_source
    from prism_megatron.runtime.fake_device import FakeDevice

    _stand_in_profiler(monkeypatch)
    FakeDevice.create(tmp_path / "device", 100 * 2**30, 2)
    monkeypatch.setenv("PRISM_FAKE_DEVICE", str(tmp_path / "device"))
    monkeypatch.delenv("PRISM_FOOTPRINT_BYTES", raising=False)
    tr = launch_source(tmp_path, GROWS_AFTER_ITERATION_1, swap="budget-auto", device_memory_gib=100)
    verdict = tr.manifest["job"]["gpu_timing_by_device"]["cpu"]
    assert verdict["on"] is False and "GPU timing stays off" in verdict["why"], verdict
    assert "expected from iteration 1 add up to 140.0 of 100.0 GiB" in verdict["why"]  # 2 x (40 + 30)
    assert sum(s["swaps_out"] for s in tr.manifest["job"]["swap"].values()) > 0


def test_the_attribution_runs_with_the_collector_off_and_gives_it_back(monkeypatch):
    """A profiled iteration's events become thousands of short-lived Python objects: no collection of the program's
    heap may start among them (run 35: 26 collections an iteration in a timed rank); the collector is on again after,
    also when reading the events fails, and stays off where the program turned it off (--manual-gc)."""
    import gc

    import torch

    from prism_megatron.runtime import gpu_timing as gt

    seen = []

    def events():
        seen.append(gc.isenabled())
        return []

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    timer = gt.GpuSegmentTimer()
    timer._profile = SimpleNamespace(stop=lambda: None, profiler=SimpleNamespace(
        kineto_results=SimpleNamespace(events=events)))
    assert gc.isenabled()
    assert timer._attribute([gt.Closed(0.1, True, 0.1, 0.1)]) is None  # no marker kernels: lost, said
    assert seen == [False] and gc.isenabled()

    def broken():
        raise RuntimeError("kineto")

    timer._profile = SimpleNamespace(stop=lambda: None, profiler=SimpleNamespace(
        kineto_results=SimpleNamespace(events=broken)))
    with pytest.raises(RuntimeError, match="kineto"):
        timer._attribute([])
    assert gc.isenabled()

    gc.disable()
    try:
        timer._profile = SimpleNamespace(stop=lambda: None, profiler=SimpleNamespace(
            kineto_results=SimpleNamespace(events=events)))
        assert timer._attribute([]) == []
        assert seen == [False, False] and not gc.isenabled()  # the program's choice stands
    finally:
        gc.enable()

    # thousands of host-call events, each an Activity for a moment: not one collection among them
    from torch.autograd import DeviceType

    class Event:
        def __init__(self, i: int) -> None:
            self.i = i

        def correlation_id(self) -> int:
            return self.i + 1

        def device_type(self):
            return DeviceType.CPU

        def name(self) -> str:
            return "cudaLaunchKernel"

        def start_thread_id(self) -> int:
            return 1

        def start_ns(self) -> int:
            return self.i

        def duration_ns(self) -> int:
            return 1

    many = [Event(i) for i in range(30_000)]
    starts = []

    def census(phase, info):
        if phase == "start":
            starts.append(info["generation"])

    gc.callbacks.append(census)
    try:
        timer._profile = SimpleNamespace(stop=lambda: None, profiler=SimpleNamespace(
            kineto_results=SimpleNamespace(events=lambda: many)))
        assert timer._attribute([gt.Closed(0.1, True, 0.1, 0.1)]) is None
        assert starts == []
        assert len(gt.activities(many)) == 30_000 and starts  # the same work with the collector on collects
    finally:
        gc.callbacks.remove(census)


def test_the_first_cuda_call_after_the_profiler_stops_is_the_runtimes_on_the_paused_clock(monkeypatch):
    """With CUPTI torn down at each profiled iteration's end, the next CUDA call costs ~1.6 ms
    (bench/gpu/results/2026-12-07-cupti-teardown-cost-h100-run51.txt); made in the program's next segment, it was
    host time of the plain iteration, which both twins take (+2.4 ms an iteration, run 50). The attribution, which
    runs on the paused clock, makes a CUDA call after the stop and before it returns."""
    import torch

    from prism_megatron.runtime import gpu_timing as gt

    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: calls.append("launch"), raising=False)
    timer = gt.GpuSegmentTimer()
    timer._profile = SimpleNamespace(stop=lambda: calls.append("stop"), profiler=SimpleNamespace(
        kineto_results=SimpleNamespace(events=lambda: calls.append("events") or [])))
    assert timer._attribute([]) == []
    assert calls[calls.index("stop") + 1:calls.index("stop") + 2] == ["launch"], calls

    calls.clear()  # before CUDA started (a CPU-only program): no call that would start it
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    timer._profile = SimpleNamespace(stop=lambda: calls.append("stop"), profiler=SimpleNamespace(
        kineto_results=SimpleNamespace(events=lambda: [])))
    assert timer._attribute([]) == [] and calls == ["stop"]
