"""bench/gpu/fold_consistency.py's readings of a trace: measured times moved between class members,
the rows a rank received in its MoE token dispatches, the running peak per iteration."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from prism_megatron.trace.reader import PrismTrace
from prism_megatron.trace.schema import SCHEMAS
from tests.bench_scripts import load_bench


def _bench():
    return load_bench('gpu/fold_consistency.py')


def _mark(rank: int, name: str, phase: str, clock: float, **attrs) -> dict:
    return {"rank": rank, "name": name, "phase": phase, "t": clock, "compute_clock": clock, "attrs": json.dumps(attrs)}


def _seg(rank: int, start: float, end: float, cpu: float, gpu: float) -> dict:
    return {"rank": rank, "clock_start": start, "clock_end": end, "cpu": cpu, "gpu": gpu,
            "syncs": json.dumps([[cpu / 2, gpu]])}


def _op(rank: int, index: int, kind: str, before: float, shapes: list) -> dict:
    return {"rank": rank, "index": index, "kind": kind, "group": 0, "seq": index, "peer": -1, "root": -1,
            "bytes": 8, "dtype": "bfloat16", "shapes": json.dumps(shapes), "reduce_op": "", "async_op": False,
            "t_issue": 0.0, "t_complete": 0.0, "compute_before": before, "label": "", "splits": "",
            "t_wait": float("nan"), "wait_clock": float("nan"), "payload": ""}


def _trace(ops: list[dict], marks: list[dict], gpu: list[dict]) -> PrismTrace:
    table = {name: pa.Table.from_pylist(rows, schema=SCHEMAS[name])
             for name, rows in (("ops", ops), ("marks", marks), ("gpu", gpu), ("slots", []))}
    return PrismTrace(Path("t"), {"world_size": 2, "groups": []}, table["ops"], table["marks"], table["slots"],
                      table["gpu"])


def _two_ranks(rank1_segments: int = 2) -> PrismTrace:
    """Ranks 0 and 1: a set-up segment, then iterations 1 (clock 1-3) and 2 (3-5)."""
    marks, gpu = [], []
    for r in (0, 1):
        gpu.append(_seg(r, 0.0, 1.0, 10.0 + r, 0.0))  # set-up
        for k, (b, e) in enumerate(((1.0, 3.0), (3.0, 5.0)), start=1):
            marks += [_mark(r, "iteration", "B", b, iteration=k), _mark(r, "iteration", "E", e, iteration=k)]
            n = 2 if r == 0 else rank1_segments
            for j in range(n):
                s = b + j * (e - b) / n
                gpu.append(_seg(r, s, s + (e - b) / n, 100 * r + 10 * k + j, 1000 * r + 10 * k + j))
    return _trace([], marks, gpu)


def test_measured_by_moves_a_members_times_segment_by_segment_and_keeps_clocks():
    fc = _bench()
    t = _two_ranks()
    out = fc._measured_by(t, t, {0: 1})
    rows = [r for r in out.gpu.to_pylist() if r["rank"] == 0]
    mine = [r for r in t.gpu.to_pylist() if r["rank"] == 0]
    theirs = [r for r in t.gpu.to_pylist() if r["rank"] == 1]
    assert rows[0] == mine[0]  # the set-up stays rank 0's
    for got, own, other in zip(rows[1:], mine[1:], theirs[1:], strict=True):
        assert (got["clock_start"], got["clock_end"]) == (own["clock_start"], own["clock_end"])
        assert (got["cpu"], got["gpu"], got["syncs"]) == (other["cpu"], other["gpu"], other["syncs"])
    assert [r for r in out.gpu.to_pylist() if r["rank"] == 1] == theirs
    host_only = fc._measured_by(t, t, {0: 1}, ("cpu",))
    got = [r for r in host_only.gpu.to_pylist() if r["rank"] == 0][1:]
    assert [r["cpu"] for r in got] == [r["cpu"] for r in theirs[1:]]
    assert [r["gpu"] for r in got] == [r["gpu"] for r in mine[1:]]


def test_measured_by_refuses_members_that_ran_other_programs():
    t = _two_ranks(rank1_segments=3)
    with pytest.raises(ValueError, match="iteration 1: rank 1 has 3 GPU-timed segments, rank 0 2"):
        _bench()._measured_by(t, t, {0: 1})


def test_expert_rows_are_the_dispatches_of_forward_passes():
    ops = []  # an op's clock at issue: the sum of compute_before up to it
    marks = [_mark(0, "forward", "B", 0.4, iteration=1, microbatch=0, chunk=0)]
    # inside the forward: per MoE layer a 1-D all-to-all (probs), the dispatch and the combine
    for layer, got in enumerate((70, 90)):
        ops.append(_op(0, len(ops), "all_to_all", 0.5 if layer == 0 else 0.1, [[128], [got]]))
        ops.append(_op(0, len(ops), "all_to_all", 0.1, [[128, 16], [got, 16]]))
        ops.append(_op(0, len(ops), "all_to_all", 0.1, [[got, 16], [128, 16]]))
        ops.append(_op(0, len(ops), "all_reduce", 0.1, [[4]]))
    marks.append(_mark(0, "forward", "E", sum(o["compute_before"] for o in ops) + 0.1, iteration=1, microbatch=0,
                       chunk=0))
    ops.append(_op(0, len(ops), "all_to_all", 0.5, [[128, 16], [55, 16]]))  # a backward one: not a dispatch
    rows = _bench().expert_rows(_trace(ops, marks, []))
    assert rows == {0: {1: [70, 90]}}


def test_memory_by_iteration_is_the_running_peak_of_each_iteration_mark():
    marks = [_mark(0, "memory", "i", 1.0, iteration=1, allocated=5, reserved=9, max_allocated=7, max_reserved=9),
             _mark(0, "memory", "i", 2.0, iteration=2, allocated=5, reserved=9, max_allocated=8, max_reserved=9),
             _mark(0, "memory", "i", 3.0, iteration=None, allocated=4, reserved=9, max_allocated=8, max_reserved=9)]
    assert _bench().memory_by_iteration(_trace([], marks, [])) == {0: {1: 7, 2: 8}}
