"""PrismTrace: round trips, Chrome export, rejection of bad traces, atomic writes, markers."""

from __future__ import annotations

import ast
import json
import math
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prism_megatron import trace as trace_pkg
from prism_megatron.trace import (
    VERSION,
    PrismTrace,
    TraceFormatError,
    mark,
    markers,
    read_trace,
    span,
    write_trace,
    writer,
)
from prism_megatron.trace.chrome import to_chrome, write_chrome
from prism_megatron.trace.schema import COLUMNS, MANIFEST_FIELDS, SCHEMAS
from prism_megatron.trace.writer import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
TRACE_DIR = REPO / "prism_megatron" / "trace"


# ----------------------------------------------------------------------------- sample data


def _manifest() -> dict:
    return {
        "world_size": 2,
        "job": {"argv": ["pretrain_gpt.py", "--tp", "1"], "devices": ["cuda:0"], "slots_per_device": 1},
        "groups": [
            {"id": 0, "name": "world", "ranks": [0, 1], "backend": "nccl"},
            {"id": 1, "name": "pp", "ranks": [0, 1], "backend": "nccl"},
        ],
        "ranks": [
            {"rank": 0, "exit_code": 0, "device": "cuda:0"},
            {"rank": 1, "exit_code": None, "device": "cuda:0"},
        ],
    }


def _op(rank, index, kind, group, seq, t_issue, t_complete, **kw) -> dict:
    row = {
        "rank": rank,
        "index": index,
        "kind": kind,
        "group": group,
        "seq": seq,
        "peer": -1,
        "root": -1,
        "bytes": 4096,
        "dtype": "torch.bfloat16",
        "shapes": "[[1024, 2]]",
        "reduce_op": "",
        "async_op": False,
        "t_issue": t_issue,
        "t_complete": t_complete,
        "compute_before": 0.1234567890123,
        "label": "",
        "splits": "",
        "payload": "",
        "t_wait": math.nan,  # never waited (a synchronous op)
        "wait_clock": math.nan,
    }
    row.update(kw)
    return row


def _nan_free(value):
    """Rows or columns with NaN replaced by a marker, so that == compares them (NaN != NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, dict):
        return {k: _nan_free(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_nan_free(v) for v in value]
    return value


def _ops() -> list[dict]:
    return [
        _op(0, 0, "all_reduce", 0, 0, 0.25, 0.5, reduce_op="sum", bytes=2**40 + 3),
        _op(0, 1, "send", 1, 0, 1.0, 1.25, peer=1, label="pp.send_forward", async_op=True, t_wait=1.2,
            wait_clock=0.5),
        _op(0, 2, "recv", 1, 0, 1.125, 1.5, peer=1, async_op=True, label="pp.recv_backward", t_wait=1.2,
            wait_clock=0.5),
        _op(0, 3, "broadcast", 0, 1, 2.0, 2.0, root=1, shapes="[[3], [4, 5]]"),
        _op(1, 0, "all_reduce", 0, 0, 0.3, 0.5, reduce_op="sum", compute_before=0.0),
        _op(1, 1, "recv", 1, 0, 0.6, 1.25, peer=0, label="pp.recv_forward"),
        _op(1, 2, "send", 1, 0, 1.4, 1.5, peer=0, dtype="torch.float32", label="pp.send_backward ✓"),
        _op(1, 3, "broadcast", 0, 1, 1.9, 2.0, root=1),
    ]


def _marks() -> list[dict]:
    def m(rank, name, phase, t, clock, **attrs):
        return {
            "rank": rank,
            "name": name,
            "phase": phase,
            "t": t,
            "compute_clock": clock,
            "attrs": json.dumps(attrs),
        }

    return [
        m(0, "iteration", "B", 0.05, 0.05, iteration=0),
        m(0, "forward", "B", 0.1, 0.1, microbatch=0, chunk=0),
        m(0, "forward", "E", 0.9, 0.4, microbatch=0, chunk=0),
        m(0, "checkpoint", "i", 0.95, 0.45),
        m(0, "backward", "B", 1.6, 0.6, microbatch=0),
        m(0, "backward", "E", 1.9, 0.9, microbatch=0),
        m(0, "iteration", "E", 2.1, 1.0, iteration=0),
        m(1, "iteration", "B", 0.0, 0.0, iteration=0),
        m(1, "forward", "B", 0.0, 0.0, microbatch=0),
        m(1, "forward", "E", 1.3, 0.35, microbatch=0),
        m(1, "iteration", "E", 2.0, 0.9, iteration=0),
    ]


def _slots() -> list[dict]:
    clocks: dict[int, float] = {}

    def g(rank, slot, a, b):
        clocks[rank] = clocks.get(rank, 0.0) + b - a  # the rank computed all its slot time here
        return {"rank": rank, "device": "cuda:0", "slot": slot, "t_grant": a, "t_release": b,
                "compute_clock": clocks[rank]}

    # Grants straddle span boundaries (forward begins/ends inside a grant) on purpose.
    return [
        g(0, 0, 0.0, 0.25),
        g(0, 0, 0.5, 1.0),
        g(0, 0, 1.5, 2.0),
        g(0, 0, 2.0, 2.2),
        g(1, 0, 0.0, 0.3),
        g(1, 0, 1.25, 1.4),
        g(1, 0, 1.5, 1.9),
    ]


def _columns(rows: list[dict], table: str) -> dict[str, list]:
    return {c.name: [r[c.name] for r in rows] for c in COLUMNS[table]}


@pytest.fixture
def trace_path(tmp_path: Path) -> Path:
    return write_trace(tmp_path / "run.prismtrace", _manifest(), _ops(), marks=_marks(), slots=_slots())


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ----------------------------------------------------------------------------- round trip


def test_round_trip_rows_preserves_every_value(trace_path: Path) -> None:
    tr = read_trace(trace_path)
    assert isinstance(tr, PrismTrace)
    assert tr.path == trace_path
    assert _nan_free(tr.ops.to_pylist()) == _nan_free(_ops())
    assert tr.marks.to_pylist() == _marks()
    assert tr.slots.to_pylist() == _slots()
    for name, table in (("ops", tr.ops), ("marks", tr.marks), ("slots", tr.slots)):
        assert table.schema.equals(SCHEMAS[name]), name
    m = tr.manifest
    for key, value in _manifest().items():
        assert m[key] == value
    assert (m["format"], m["version"], m["complete"]) == ("prismtrace", VERSION, True)
    assert m["files"] == {name: f"{name}.parquet" for name in ("ops", "marks", "slots", "gpu")}
    assert isinstance(m["created"], str) and m["created"][:2] == "20"


def test_rows_that_leave_a_defaulted_column_out_read_as_rows_that_give_it(tmp_path: Path) -> None:
    full = _ops()
    short = [dict(r) for r in full]
    del short[2]["payload"]  # one row without it: the row-by-row path, with the column's default
    a = read_trace(write_trace(tmp_path / "full", _manifest(), full))
    b = read_trace(write_trace(tmp_path / "short", _manifest(), short))
    assert _nan_free(a.ops.to_pylist()) == _nan_free(b.ops.to_pylist()) == _nan_free(full)
    extra = [dict(r) for r in full]
    extra[5]["colour"] = "red"
    with pytest.raises(TraceFormatError, match="colour"):
        write_trace(tmp_path / "extra", _manifest(), extra)


def test_a_trace_written_not_durable_is_the_same_trace_without_a_flush_to_the_disk(tmp_path: Path, monkeypatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    fast = read_trace(write_trace(tmp_path / "live", _manifest(), _ops(), marks=_marks(), durable=False))
    assert synced == []
    write_trace(tmp_path / "live", _manifest(), _ops()[:2], durable=False)  # swapped in whole over the last
    assert read_trace(tmp_path / "live").ops.num_rows == 2 and _leftovers(tmp_path) == []
    kept = read_trace(write_trace(tmp_path / "kept", _manifest(), _ops(), marks=_marks()))
    assert synced  # the default reaches the disk
    assert _nan_free(fast.ops.to_pylist()) == _nan_free(kept.ops.to_pylist()) and fast.marks.equals(kept.marks)


def test_round_trip_columns(tmp_path: Path) -> None:
    ops, marks, slots = _columns(_ops(), "ops"), _columns(_marks(), "marks"), _columns(_slots(), "slots")
    tr = read_trace(write_trace(tmp_path / "t", _manifest(), ops, marks=marks, slots=slots))
    assert _nan_free(tr.ops.to_pydict()) == _nan_free(ops)
    assert tr.marks.to_pydict() == marks
    assert tr.slots.to_pydict() == slots


def test_arrow_tables_and_empty_tables(tmp_path: Path) -> None:
    ops = pa.Table.from_pylist(_ops())  # inferred int64 where the schema says int32: cast safely
    tr = read_trace(write_trace(tmp_path / "t", _manifest(), ops))
    assert _nan_free(tr.ops.to_pylist()) == _nan_free(_ops())
    assert tr.marks.num_rows == 0 and tr.slots.num_rows == 0
    assert tr.marks.schema.equals(SCHEMAS["marks"])


def test_json_columns_accept_python_objects(tmp_path: Path) -> None:
    ops = _ops()
    ops[0]["shapes"] = [[1024, 2], [7]]
    marks = _marks()
    marks[0]["attrs"] = {"iteration": 3, "tags": ["a"]}
    tr = read_trace(write_trace(tmp_path / "t", _manifest(), ops, marks=marks))
    assert json.loads(tr.ops.column("shapes")[0].as_py()) == [[1024, 2], [7]]
    assert json.loads(tr.marks.column("attrs")[0].as_py()) == {"iteration": 3, "tags": ["a"]}


def test_convenience_accessors(tmp_path: Path) -> None:
    shuffled = list(reversed(_ops()))
    tr = read_trace(write_trace(tmp_path / "t", _manifest(), shuffled))
    assert tr.world_size == 2
    assert set(tr.groups()) == {0, 1}
    assert tr.groups()[1]["name"] == "pp"
    for rank in (0, 1):
        got = tr.ops_for_rank(rank)
        assert [o["index"] for o in got] == [0, 1, 2, 3]
        assert _nan_free(got) == _nan_free([o for o in _ops() if o["rank"] == rank])
    assert tr.ops_for_rank(5) == []


# ----------------------------------------------------------------------------- chrome


def _check_nesting(events: list[dict]) -> None:
    """Fail unless slices on every (pid, tid) are time-ordered and properly nested."""
    eps = 1e-6
    threads: dict[tuple[int, int], list[dict]] = {}
    for ev in events:
        if ev["ph"] != "M":
            threads.setdefault((ev["pid"], ev["tid"]), []).append(ev)
    for key, evs in threads.items():
        stack: list[tuple[str, str, float]] = []  # (phase, name, end); B has end inf until its E
        last_ts = -math.inf
        for ev in evs:
            ts = ev["ts"]
            assert ts >= last_ts - eps, f"{key}: events not sorted by time at {ev}"
            last_ts = ts
            while stack and stack[-1][0] == "X" and stack[-1][2] <= ts + eps:
                stack.pop()
            if ev["ph"] == "X":
                assert ev["dur"] >= 0
                end = ts + ev["dur"]
                assert not stack or end <= stack[-1][2] + eps, f"{key}: {ev} overlaps {stack[-1]}"
                stack.append(("X", ev["name"], end))
            elif ev["ph"] == "B":
                assert not stack or stack[-1][0] == "B", f"{key}: B inside a slice: {ev}"
                stack.append(("B", ev["name"], math.inf))
            elif ev["ph"] == "E":
                assert stack and stack[-1][:2] == ("B", ev["name"]), f"{key}: unmatched E {ev}, stack {stack}"
                stack.pop()
        assert not [s for s in stack if s[0] == "B"], f"{key}: spans never ended: {stack}"


def test_chrome_structure(trace_path: Path) -> None:
    tr = read_trace(trace_path)
    doc = to_chrome(tr)
    assert doc["displayTimeUnit"] == "ms"
    json.loads(json.dumps(doc, allow_nan=False))
    events = doc["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    threads = {(e["pid"], e["tid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(0, 0, "compute"), (0, 1, "comm"), (1, 0, "compute"), (1, 1, "comm")} <= threads
    _check_nesting(events)

    comm = [e for e in events if e.get("cat") == "comm"]
    assert len(comm) == len(_ops())
    by_key = {(e["pid"], e["args"]["index"]): e for e in comm}
    for op in _ops():
        ev = by_key[(op["rank"], op["index"])]
        assert ev["ph"] == "X" and ev["tid"] >= 1
        assert ev["name"] == (op["label"] or op["kind"])
        assert ev["ts"] == pytest.approx(op["t_issue"] * 1e6, abs=1e-3)
        assert ev["dur"] == pytest.approx((op["t_complete"] - op["t_issue"]) * 1e6, abs=1e-3)
        args = ev["args"]
        assert (args["group"], args["seq"], args["peer"], args["bytes"], args["dtype"]) == (
            op["group"],
            op["seq"],
            op["peer"],
            op["bytes"],
            op["dtype"],
        )
        assert args["shapes"] == json.loads(op["shapes"])
    # rank 0's send (1.0-1.25) and recv (1.125-1.5) overlap without nesting: not on one thread
    assert by_key[(0, 1)]["tid"] != by_key[(0, 2)]["tid"]
    assert by_key[(0, 0)]["tid"] == 1

    for rank in (0, 1):
        grants = [s for s in _slots() if s["rank"] == rank]
        compute = [e for e in events if e["pid"] == rank and e.get("cat") == "slot"]
        assert all(e["ph"] == "X" and e["tid"] == 0 and e["name"] == "compute" for e in compute)
        total = sum(e["dur"] for e in compute)
        assert total == pytest.approx(sum(g["t_release"] - g["t_grant"] for g in grants) * 1e6, abs=1e-2)
        marks = [e for e in events if e["pid"] == rank and e.get("cat") == "mark"]
        assert all(e["tid"] == 0 for e in marks)
        expected = [(m["name"], m["phase"]) for m in _marks() if m["rank"] == rank]
        assert sorted((e["name"], e["ph"]) for e in marks) == sorted(expected)
    fwd = next(e for e in events if e["name"] == "forward" and e["ph"] == "B" and e["pid"] == 0)
    assert fwd["ts"] == pytest.approx(0.1e6) and fwd["args"]["microbatch"] == 0


def test_chrome_repairs_unbalanced_marks(tmp_path: Path) -> None:
    marks = _marks()
    marks.append(
        {"rank": 1, "name": "optimizer", "phase": "B", "t": 1.95, "compute_clock": 0.9, "attrs": "{}"}
    )
    marks.append({"rank": 0, "name": "stray", "phase": "E", "t": 2.15, "compute_clock": 1.0, "attrs": "{}"})
    tr = read_trace(write_trace(tmp_path / "t", _manifest(), _ops(), marks=marks, slots=_slots()))
    events = to_chrome(tr)["traceEvents"]
    _check_nesting(events)
    assert any(e["name"] == "stray" and e["ph"] == "i" for e in events)


def test_write_chrome(trace_path: Path, tmp_path: Path) -> None:
    out = write_chrome(trace_path, tmp_path / "out" / "trace.json")
    doc = json.loads(out.read_text())
    assert doc == json.loads(json.dumps(to_chrome(read_trace(trace_path))))
    assert _leftovers(out.parent) == []


# ----------------------------------------------------------------------------- reader rejections


def _edit_manifest(path: Path, fn) -> None:
    mpath = path / "manifest.json"
    m = json.loads(mpath.read_text())
    fn(m)
    mpath.write_text(json.dumps(m))


def _rewrite_table(path: Path, file: str, fn) -> None:
    pq.write_table(fn(pq.read_table(path / file)), path / file)


def _drop_key(key):
    return lambda m: m.pop(key)


def _set(key, value):
    return lambda m: m.__setitem__(key, value)


MANIFEST_CASES = {
    "wrong format": (_set("format", "chrome"), ["'format'", "chrome"]),
    "no format": (_drop_key("format"), ["'format'", "missing"]),
    "future version": (_set("version", 7), ["'version'", "is 7", "supports", "1, 2, 3, 4, 5, 6"]),
    "version string": (_set("version", "1"), ["'version'", "string"]),
    "no version": (_drop_key("version"), ["'version'", "missing"]),
    "incomplete without why": (_set("complete", False), ["'incomplete'", "must say why"]),
    "complete with a why": (_set("incomplete", "interrupted"), ["'incomplete'", "'complete' is true"]),
    "no incomplete": (_drop_key("incomplete"), ["'incomplete'", "missing"]),
    "v3 incomplete": (lambda m: m.update(version=3, complete=False), ["'complete'", "not finished"]),
    "no complete": (_drop_key("complete"), ["'complete'", "missing"]),
    "world_size string": (_set("world_size", "2"), ["'world_size'", "string", "integer"]),
    "world_size bool": (_set("world_size", True), ["'world_size'", "boolean"]),
    "world_size zero": (_set("world_size", 0), ["'world_size'", ">= 1"]),
    "job list": (_set("job", []), ["'job'", "list", "object"]),
    "group ranks": (lambda m: m["groups"][1].__setitem__("ranks", "01"), ["'groups[1].ranks'"]),
    "group rank range": (lambda m: m["groups"][0]["ranks"].append(7), ["'groups[0].ranks'", "7"]),
    "group no backend": (lambda m: m["groups"][0].pop("backend"), ["'groups[0].backend'", "missing"]),
    "duplicate group": (lambda m: m["groups"][1].__setitem__("id", 0), ["'groups[1].id'"]),
    "exit_code string": (lambda m: m["ranks"][1].__setitem__("exit_code", "0"), ["'ranks[1].exit_code'"]),
    "rank entry": (lambda m: m["ranks"].__setitem__(0, 3), ["'ranks[0]'"]),
    "files.ops int": (lambda m: m["files"].__setitem__("ops", 3), ["'files.ops'", "integer"]),
    "files.ops escapes": (
        lambda m: m["files"].__setitem__("ops", "../ops.parquet"),
        ["'files.ops'", "plain"],
    ),
    "no files.slots": (lambda m: m["files"].pop("slots"), ["'files.slots'", "missing"]),
    **{
        f"no {key}": (_drop_key(key), [f"'{key}'", "missing"])
        for key in MANIFEST_FIELDS
        if key not in ("format", "version", "complete")
    },
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_reader_rejects_bad_manifest(trace_path: Path, case: str) -> None:
    edit, expected = MANIFEST_CASES[case]
    _edit_manifest(trace_path, edit)
    with pytest.raises(TraceFormatError) as err:
        read_trace(trace_path)
    msg = str(err.value)
    assert str(trace_path / "manifest.json") in msg
    for part in expected:
        assert part in msg, (part, msg)


def test_reader_rejects_missing_or_unparsable_manifest(tmp_path: Path, trace_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r"nothing-here.*directory.*does not exist"):
        read_trace(tmp_path / "nothing-here")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(TraceFormatError, match=r"afile.*not a directory"):
        read_trace(tmp_path / "afile")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFormatError, match=r"empty/manifest\.json.*file.*missing"):
        read_trace(tmp_path / "empty")
    (trace_path / "manifest.json").write_text('{"format": "prismtrace", "version": 1,')
    with pytest.raises(TraceFormatError, match=r"run\.prismtrace/manifest\.json: JSON is invalid at line 1"):
        read_trace(trace_path)
    (trace_path / "manifest.json").write_text("[1, 2]")
    with pytest.raises(TraceFormatError, match=r"manifest\.json: top level is list"):
        read_trace(trace_path)


def test_reader_rejects_missing_and_corrupt_parquet(trace_path: Path) -> None:
    (trace_path / "slots.parquet").unlink()
    with pytest.raises(TraceFormatError, match=r"slots\.parquet: file is missing .*'files\.slots'"):
        read_trace(trace_path)
    (trace_path / "slots.parquet").write_bytes(b"this is not parquet at all")
    with pytest.raises(TraceFormatError, match=r"slots\.parquet: file is not a readable Parquet file"):
        read_trace(trace_path)
    good = (trace_path / "marks.parquet").read_bytes()
    (trace_path / "marks.parquet").write_bytes(good[: len(good) // 2])
    (trace_path / "slots.parquet").unlink()
    write_trace(trace_path.parent / "other", _manifest(), _ops(), slots=_slots())
    (trace_path / "slots.parquet").write_bytes((trace_path.parent / "other" / "slots.parquet").read_bytes())
    with pytest.raises(TraceFormatError, match=r"marks\.parquet: file is not a readable Parquet file"):
        read_trace(trace_path)


def _set_column(name, array_fn):
    def fn(t: pa.Table) -> pa.Table:
        i = t.column_names.index(name)
        return t.set_column(i, name, array_fn(t.column(name)))

    return fn


TABLE_CASES = {
    "ops missing seq": ("ops.parquet", lambda t: t.drop_columns(["seq"]), "column 'seq' is missing"),
    "ops seq string": (
        "ops.parquet",
        _set_column("seq", lambda c: c.cast(pa.string())),
        "column 'seq' has type string, expected int64",
    ),
    "ops rank int64": (
        "ops.parquet",
        _set_column("rank", lambda c: c.cast(pa.int64())),
        "column 'rank' has type int64, expected int32",
    ),
    "marks t null": (
        "marks.parquet",
        _set_column("t", lambda c: pa.array([None] * len(c), pa.float64())),
        "column 't' has 11 null value(s)",
    ),
    "slots missing t_release": (
        "slots.parquet",
        lambda t: t.drop_columns(["t_release"]),
        "column 't_release' is missing",
    ),
    "ops rank out of range": (
        "ops.parquet",
        _set_column("rank", lambda c: pa.array([9] * len(c), pa.int32())),
        "column 'rank' contains 9",
    ),
    "ops unknown group": (
        "ops.parquet",
        _set_column("group", lambda c: pa.array([5] * len(c), pa.int32())),
        "column 'group' contains 5",
    ),
    "ops duplicate index": (
        "ops.parquet",
        _set_column("index", lambda c: pa.array([0] * len(c), pa.int64())),
        "column 'index' repeats index 0",
    ),
    "marks bad phase": (
        "marks.parquet",
        _set_column("phase", lambda c: pa.array(["X"] * len(c))),
        "column 'phase' contains 'X'",
    ),
}


@pytest.mark.parametrize("case", sorted(TABLE_CASES))
def test_reader_rejects_bad_tables(trace_path: Path, case: str) -> None:
    file, fn, expected = TABLE_CASES[case]
    _rewrite_table(trace_path, file, fn)
    with pytest.raises(TraceFormatError) as err:
        read_trace(trace_path)
    assert f"trace {trace_path / file}: {expected}" in str(err.value)
    assert err.value.path == str(trace_path / file)


def test_reader_ignores_extra_columns(trace_path: Path) -> None:
    _rewrite_table(trace_path, "ops.parquet", lambda t: t.append_column("future", pa.array([1] * t.num_rows)))
    assert read_trace(trace_path).ops.column_names == [c.name for c in COLUMNS["ops"]]


def test_error_is_picklable() -> None:
    err = TraceFormatError("/x/ops.parquet", "column 'seq'", "has type string, expected int64")
    assert str(err) == "trace /x/ops.parquet: column 'seq' has type string, expected int64"
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.path, back.field) == (str(err), err.path, err.field)
    assert isinstance(err, ValueError)


# ----------------------------------------------------------------------------- writer rejections


def _without(rows: list[dict], key: str, i: int = 0) -> list[dict]:
    rows = [dict(r) for r in rows]
    del rows[i][key]
    return rows


WRITER_CASES = {
    "row missing column": (
        lambda: {"ops": _without(_ops(), "seq", 2)},
        "ops.parquet",
        "column 'seq' is missing in row 2",
    ),
    "columns missing column": (
        lambda: {"slots": {k: v for k, v in _columns(_slots(), "slots").items() if k != "slot"}},
        "slots.parquet",
        "column 'slot' is missing",
    ),
    "unknown column": (
        lambda: {"marks": [{**_marks()[0], "colour": "red"}]},
        "marks.parquet",
        "column 'colour'",
    ),
    "wrong value type": (
        lambda: {"ops": [{**_ops()[0], "bytes": "many"}]},
        "ops.parquet",
        "column 'bytes' cannot be stored as int64",
    ),
    "ragged columns": (
        lambda: {"ops": {**_columns(_ops(), "ops"), "label": [""]}},
        "ops.parquet",
        "column 'label' has 1 values",
    ),
    "null value": (
        lambda: {"ops": [{**_ops()[0], "kind": None}]},
        "ops.parquet",
        "column 'kind' has 1 null",
    ),
    "rank out of range": (
        lambda: {"slots": [{**_slots()[0], "rank": 2}]},
        "slots.parquet",
        "column 'rank' contains 2",
    ),
    "manifest missing world_size": (
        lambda: {"manifest": {k: v for k, v in _manifest().items() if k != "world_size"}},
        "manifest.json",
        "'world_size' is missing",
    ),
    "manifest not JSON": (
        lambda: {"manifest": {**_manifest(), "job": {"when": object()}}},
        "manifest.json",
        "not JSON-serialisable",
    ),
}


@pytest.mark.parametrize("case", sorted(WRITER_CASES))
def test_writer_rejects_before_touching_disk(tmp_path: Path, case: str) -> None:
    make, file, expected = WRITER_CASES[case]
    args = {"manifest": _manifest(), "ops": _ops(), "marks": _marks(), "slots": _slots(), **make()}
    dest = tmp_path / "t"
    with pytest.raises(TraceFormatError) as err:
        write_trace(dest, args.pop("manifest"), args.pop("ops"), **args)
    assert f"trace {dest / file}: " in str(err.value) and expected in str(err.value), str(err.value)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- atomicity


def test_existing_trace_is_replaced(trace_path: Path) -> None:
    m = _manifest()
    m["job"] = {"run": "second"}
    write_trace(trace_path, m, _ops()[:2])
    tr = read_trace(trace_path)
    assert tr.manifest["job"] == {"run": "second"}
    assert tr.ops.num_rows == 2 and tr.marks.num_rows == 0
    assert _leftovers(trace_path.parent) == []


def test_failed_write_leaves_old_trace_intact(trace_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.read_bytes() for p in trace_path.iterdir()}
    bad = _ops()
    bad[3]["seq"] = "three"
    with pytest.raises(TraceFormatError, match="column 'seq'"):
        write_trace(trace_path, _manifest(), bad)
    assert {p.name: p.read_bytes() for p in trace_path.iterdir()} == before
    assert _leftovers(trace_path.parent) == []

    # A failure half-way through writing files (disk full, killed...) also leaves nothing behind.
    real = writer._write_parquet
    calls = []

    def failing(table, file, durable=True):
        calls.append(file.name)
        if file.name == "marks.parquet":
            raise OSError("disk full")
        real(table, file, durable)

    monkeypatch.setattr(writer, "_write_parquet", failing)
    with pytest.raises(OSError, match="disk full"):
        write_trace(trace_path, _manifest(), _ops()[:1])
    assert calls == ["ops.parquet", "marks.parquet"]
    assert {p.name: p.read_bytes() for p in trace_path.iterdir()} == before
    assert _leftovers(trace_path.parent) == []
    assert read_trace(trace_path).ops.num_rows == len(_ops())


def test_failed_rename_restores_old_trace(trace_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_rename = os.rename

    def rename(src, dst):
        if ".tmp-" in str(src):
            raise OSError("rename failed")
        real_rename(src, dst)

    monkeypatch.setattr(writer.os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        write_trace(trace_path, _manifest(), _ops()[:1])
    monkeypatch.undo()
    assert read_trace(trace_path).ops.num_rows == len(_ops())
    assert _leftovers(trace_path.parent) == []


def test_writer_refuses_to_clobber_non_trace(tmp_path: Path) -> None:
    dest = tmp_path / "results"
    dest.mkdir()
    (dest / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a PrismTrace"):
        write_trace(dest, _manifest(), _ops())
    assert (dest / "notes.txt").read_text() == "keep me"
    assert _leftovers(tmp_path) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    assert read_trace(write_trace(empty, _manifest(), _ops())).ops.num_rows == len(_ops())


def test_atomic_write_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "sub" / "report.json"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"

    def broken_replace(src, dst):
        raise OSError("replace failed")

    monkeypatch.setattr(writer.os, "replace", broken_replace)
    with pytest.raises(OSError, match="replace failed"):
        atomic_write_text(target, "three")
    assert target.read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["report.json"]


# ----------------------------------------------------------------------------- markers


class RecordingSink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, dict]] = []

    def record_mark(self, name: str, phase: str, attrs: dict) -> None:
        self.calls.append((name, phase, attrs))


@pytest.fixture
def sink():
    s = RecordingSink()
    previous = markers.set_sink(s)
    yield s
    markers.set_sink(previous)


def test_markers_are_noops_without_sink() -> None:
    assert markers.get_sink() is None
    mark("anything", x=1)
    with span("forward", microbatch=0) as s:
        pass
    assert span("a") is span("b")  # one shared object: no allocation per call
    assert s is not None


def test_markers_call_sink(sink: RecordingSink) -> None:
    assert markers.get_sink() is sink
    mark("checkpoint", step=3)
    with span("iteration", iteration=1):
        with span("forward", microbatch=0, chunk=1):
            mark("inside")
    assert sink.calls == [
        ("checkpoint", "i", {"step": 3}),
        ("iteration", "B", {"iteration": 1}),
        ("forward", "B", {"microbatch": 0, "chunk": 1}),
        ("inside", "i", {}),
        ("forward", "E", {}),
        ("iteration", "E", {}),
    ]


def test_span_ends_when_body_raises(sink: RecordingSink) -> None:
    with pytest.raises(KeyError):
        with span("backward", microbatch=2):
            raise KeyError("boom")
    assert sink.calls == [("backward", "B", {"microbatch": 2}), ("backward", "E", {"error": "KeyError"})]


def test_set_sink_validates_and_returns_previous(sink: RecordingSink) -> None:
    with pytest.raises(TypeError, match="record_mark"):
        markers.set_sink(object())
    assert markers.get_sink() is sink
    other = RecordingSink()
    assert markers.set_sink(other) is sink
    assert markers.set_sink(sink) is other


# ----------------------------------------------------------------------------- independence


def test_package_imports_no_torch_megatron_or_runtime() -> None:
    forbidden = ("torch", "megatron", "prism_megatron.runtime")
    for file in sorted(TRACE_DIR.glob("*.py")):
        tree = ast.parse(file.read_text(), filename=str(file))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [("." * node.level) + (node.module or "")]
                if node.level:  # relative: only siblings inside the trace package
                    assert node.level == 1, f"{file.name} imports {mods}"
            else:
                continue
            for mod in mods:
                assert not any(mod == f or mod.startswith(f + ".") for f in forbidden), f"{file.name}: {mod}"
    assert set(trace_pkg.__all__) >= {"mark", "span", "read_trace", "write_trace", "PrismTrace"}
    assert {"TraceFormatError", "VERSION"} <= set(trace_pkg.__all__)


def test_markers_do_not_load_pyarrow() -> None:
    code = (
        "import sys\n"
        "from prism_megatron.trace import mark, span\n"
        "mark('x')\n"
        "with span('y'):\n    pass\n"
        "assert 'pyarrow' not in sys.modules, 'markers pulled in pyarrow'\n"
        "import prism_megatron.trace as t\n"
        "t.read_trace, t.write_trace, t.to_chrome, t.VERSION\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron') "
        "or m.startswith('prism_megatron.runtime')]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_version_1_traces_still_read_with_slot_holding_as_the_clock(tmp_path):
    """v1 had no slots.compute_clock: the reader fills it from slot-holding time, v1's compute clock."""
    import json

    import pyarrow.parquet as pq

    path = write_trace(tmp_path / "t", _manifest(), _ops(), marks=_marks(), slots=_slots())
    table = pq.read_table(path / "slots.parquet").drop_columns(["compute_clock"])
    pq.write_table(table, path / "slots.parquet")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["version"] = 1
    (path / "manifest.json").write_text(json.dumps(manifest))
    slots = read_trace(path).slots.to_pylist()
    for rank in {s["rank"] for s in slots}:
        mine = sorted((s for s in slots if s["rank"] == rank), key=lambda s: s["t_grant"])
        held = 0.0
        for s in mine:
            held += s["t_release"] - s["t_grant"]
            assert s["compute_clock"] == pytest.approx(held)
    manifest["version"] = 2  # a v2 trace without the column is rejected, naming it
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceFormatError, match="column 'compute_clock' is missing"):
        read_trace(path)


def _gpu_rows() -> list[dict]:
    return [
        {"rank": 0, "clock_start": 0.0, "clock_end": 0.5, "cpu": 0.4, "gpu": 0.9, "syncs": []},
        {"rank": 1, "clock_start": 0.0, "clock_end": 0.25, "cpu": 0.2, "gpu": 0.1, "syncs": [[0.05, 0.02]]},
    ]


def test_gpu_table_round_trips_and_older_versions_read_without_it(tmp_path):
    """v3 adds the gpu table (per-segment host/device times); a v2 trace has none and reads as empty."""
    import json

    path = write_trace(tmp_path / "t", _manifest(), _ops(), marks=_marks(), slots=_slots(), gpu=_gpu_rows())
    rows = read_trace(path).gpu.to_pylist()
    assert [(r["rank"], r["clock_end"], r["cpu"], r["gpu"], json.loads(r["syncs"])) for r in rows] == [
        (0, 0.5, 0.4, 0.9, []), (1, 0.25, 0.2, 0.1, [[0.05, 0.02]])]
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["files"]["gpu"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceFormatError, match="'files.gpu' is missing"):
        read_trace(path)  # v3 must name its gpu table
    manifest["version"] = 2
    (path / "gpu.parquet").unlink()
    (path / "manifest.json").write_text(json.dumps(manifest))
    old = read_trace(path)
    assert old.gpu.num_rows == 0 and old.gpu.column_names == ["rank", "clock_start", "clock_end", "cpu", "gpu", "syncs"]


def test_gpu_table_rejects_bad_values_naming_the_field(tmp_path):
    bad = [dict(_gpu_rows()[0], rank=7)]
    with pytest.raises(TraceFormatError, match=r"gpu.parquet: column 'rank' contains 7"):
        write_trace(tmp_path / "t", _manifest(), _ops(), gpu=bad)
    with pytest.raises(TraceFormatError, match=r"gpu.parquet: column 'cpu' cannot be stored"):
        write_trace(tmp_path / "t", _manifest(), _ops(), gpu=[dict(_gpu_rows()[0], cpu="soon")])


def test_all_to_all_split_sizes_round_trip_and_older_traces_read_without_them(tmp_path):
    import json

    ops = _ops()
    ops[0] = dict(ops[0], splits=[[0, 512], [256, 256]])
    for op in ops[1:]:
        del op["splits"], op["payload"]  # optional: '' when left out
    path = write_trace(tmp_path / "t", _manifest(), ops)
    assert {op["splits"] for op in read_trace(path).ops.to_pylist()[1:]} == {""}
    assert json.loads(read_trace(path).ops.to_pylist()[0]["splits"]) == [[0, 512], [256, 256]]
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(path / "ops.parquet").drop_columns(["splits", "payload"]), path / "ops.parquet")
    manifest = json.loads((path / "manifest.json").read_text())
    assert {op["splits"] for op in read_trace(path).ops.to_pylist()} == {""}  # optional: an older writer
    manifest["version"] = 2
    del manifest["files"]["gpu"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert {(op["splits"], op["payload"]) for op in read_trace(path).ops.to_pylist()} == {("", "")}


def test_summary_reports_the_ranks_compute_clock_and_gpu_times(tmp_path):
    from prism_megatron.trace.summary import summarize

    slots = [dict(s, compute_clock=s["compute_clock"] / 2) for s in _slots()]  # computed half of its slot time
    path = write_trace(tmp_path / "t", _manifest(), _ops(), marks=_marks(), slots=slots, gpu=_gpu_rows())
    text = summarize(path)
    clocks = {r: max(s["compute_clock"] for s in slots if s["rank"] == r) for r in (0, 1)}
    assert f"max {max(clocks.values()):.3f} s" in text and f"min {min(clocks.values()):.3f} s" in text
    assert "measured on GPUs (2 segments)" in text
    assert "host time per rank: min 0.200 s, median 0.300 s, max 0.400 s (rank 0)" in text
    assert "device busy time per rank: min 0.100 s, median 0.500 s, max 0.900 s (rank 0)" in text
    assert "measured on GPUs" not in summarize(write_trace(tmp_path / "u", _manifest(), _ops(), slots=slots))


def test_summary_says_how_staging_memory_was_held_and_how_far_nvml_was_from_the_reports(tmp_path):
    from prism_megatron.runtime.nvml import FootprintCheck
    from prism_megatron.trace.summary import summarize

    check = FootprintCheck(lambda: {}, samples=4, pairs={0: (10 * 2**30, 11 * 2**30), 1: (10 * 2**30, 7 * 2**30)})
    manifest = _manifest()
    manifest["job"] |= {"staging_by_device": {"cuda:0": "page-locked"},
                        "footprint_check": check.summary()}
    text = summarize(write_trace(tmp_path / "t", manifest, _ops()))
    assert "staging memory: cuda:0 page-locked" in text
    assert ("cross-checked with NVML (4 samples, 2 ranks): NVML minus report median +1.00 GiB, "
            "worst -3.00 GiB (rank 1)") in text
    assert "NVML" not in summarize(write_trace(tmp_path / "u", _manifest(), _ops()))
    manifest["job"]["footprint_check"] = FootprintCheck(lambda: {}, samples=3).summary()
    text = summarize(write_trace(tmp_path / "v", manifest, _ops()))
    assert "NVML listed none of the ranks' PIDs in 3 samples" in text


def test_capture_efficiency_is_wall_against_summed_compute_over_the_machine(tmp_path):
    """Iteration 2 ends at 3.0 s (last rank) after iteration 1 ended at 2.1 s: 0.9 s of wall for
    0.5 + 0.3 s of compute on one GPU; 2 CPU slots halve the limit."""
    from prism_megatron.trace.summary import capture_efficiency, summarize

    def end(rank, t, clock):
        return {"rank": rank, "name": "iteration", "phase": "E", "t": t, "compute_clock": clock, "attrs": "{}"}

    marks = [end(0, 2.1, 1.0), end(0, 2.8, 1.5), end(1, 2.0, 0.9), end(1, 3.0, 1.2), end(1, 3.5, 1.4)]
    tr = read_trace(write_trace(tmp_path / "gpu", _manifest(), _ops(), marks=marks))
    [(it, wall, limit)] = capture_efficiency(tr)  # rank 0 ended two iterations only
    assert it == 2 and wall == pytest.approx(0.9) and limit == pytest.approx(0.8)
    assert "wall 0.900 s, physical limit 0.800 s (compute of all ranks / 1), ratio 1.12" in summarize(tmp_path / "gpu")
    cpu = _manifest()
    cpu["job"].update(devices=["cpu"], slots_per_device=2)
    assert capture_efficiency(read_trace(write_trace(tmp_path / "cpu", cpu, _ops(), marks=marks)))[0][2] == \
        pytest.approx(0.4)


def test_slot_time_splits_a_capture_into_computing_runtime_work_and_idle(tmp_path):
    """Iteration 2's window is 2.1-3.0 s on one GPU slot: ranks held it for 0.4 + 0.45 s (a turn that
    began before the window counts from 2.1) and computed 0.5 + 0.3 s, so 0.8 of 0.9 s computing,
    0.05 s runtime work, 0.05 s idle; the ranks' runtime counters are printed beside."""
    from prism_megatron.trace.summary import slot_time, summarize

    def end(rank, t, clock):
        return {"rank": rank, "name": "iteration", "phase": "E", "t": t, "compute_clock": clock, "attrs": "{}"}

    def turn(rank, a, b, clock):
        return {"rank": rank, "device": "cuda:0", "slot": 0, "t_grant": a, "t_release": b, "compute_clock": clock}

    marks = [end(0, 2.1, 1.0), end(0, 2.8, 1.5), end(1, 2.0, 0.9), end(1, 3.0, 1.2)]
    slots = [turn(0, 2.0, 2.5, 1.5), turn(1, 2.55, 3.0, 1.2)]
    manifest = _manifest()
    manifest["ranks"][0]["runtime_s"] = {"stage": 1.5, "results": 0.25, "gpu_timer": 0.125}
    path = write_trace(tmp_path / "t", manifest, _ops(), marks=marks, slots=slots)
    [(it, computing, work, idle)] = slot_time(read_trace(path))
    assert it == 2 and (computing, work, idle) == pytest.approx((0.8 / 0.9, 0.05 / 0.9, 0.05 / 0.9))
    text = summarize(path)
    assert "slot time per iteration (median): 89% computing, 6% runtime in turns" in text and "6% idle" in text
    assert "stage: min 0.000 s, median 0.750 s, max 1.500 s (rank 0)" in text
    assert "runtime work per rank" not in summarize(write_trace(tmp_path / "u", _manifest(), _ops(), marks=marks))
    manifest["ranks"][0]["runtime_s"]["gpu_timer"] = 0.0  # no GPU timing: no GPU-timer line
    text = summarize(write_trace(tmp_path / "w", manifest, _ops(), marks=marks, slots=slots))
    assert "stage: min" in text and "gpu_timer" not in text


def test_partial_trace_says_why_and_reads(tmp_path: Path) -> None:
    """A job that did not end normally keeps its trace so far, marked partial (v4), and says why."""
    from prism_megatron.trace.summary import summarize

    path = write_trace(tmp_path / "t", _manifest(), _ops(), marks=_marks(), slots=_slots(),
                       incomplete="interrupted by SIGTERM")
    m = json.loads((path / "manifest.json").read_text())
    assert (m["complete"], m["incomplete"]) == (False, "interrupted by SIGTERM")
    assert read_trace(path).incomplete == "interrupted by SIGTERM"
    assert "incomplete: interrupted by SIGTERM" in summarize(path)
    assert read_trace(write_trace(tmp_path / "ok", _manifest(), _ops())).incomplete is None


def test_wait_columns_round_trip_and_older_traces_read_them_as_nan(tmp_path):
    import pyarrow.parquet as pq

    path = write_trace(tmp_path / "t", _manifest(), _ops())
    rows = read_trace(path).ops.to_pylist()
    assert [(r["t_wait"], r["wait_clock"]) for r in rows if r["async_op"]] == [(1.2, 0.5), (1.2, 0.5)]
    assert all(math.isnan(r["t_wait"]) and math.isnan(r["wait_clock"]) for r in rows if not r["async_op"])
    pq.write_table(pq.read_table(path / "ops.parquet").drop_columns(["t_wait", "wait_clock"]), path / "ops.parquet")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["version"] = 4  # written before the program's waits were recorded
    (path / "manifest.json").write_text(json.dumps(manifest))
    rows = read_trace(path).ops.to_pylist()
    assert len(rows) == len(_ops()) and all(math.isnan(r["t_wait"]) and math.isnan(r["wait_clock"]) for r in rows)
