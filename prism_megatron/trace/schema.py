"""PrismTrace (version 6): the one place that says what a trace directory contains.

Writer, reader and exporters all validate against the definitions here, so a file the writer
accepts is exactly a file the reader accepts. Every error names the file and the field, because a
trace is read long after (and far from) the run that wrote it.

A trace is a directory::

    manifest.json   job metadata, process groups, per-rank exit codes, names of the tables
    ops.parquet     one row per communication op per rank
    marks.parquet   scheduling-unit markers (iteration, microbatch, forward/backward...)
    slots.parquet   slot grants: when each rank held a compute slot on which device
    gpu.parquet     (v3) per compute segment of a rank on a GPU: host time, device busy time, and
                    where the program waited for the device; empty when not measured

Times are float seconds since job start on the coordinator's wall clock.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc

FORMAT = "prismtrace"
VERSION = 6
#: Versions this code can read; a reader rejects anything else rather than guessing. Version 1 lacks
#: slots.compute_clock; reading it fills the column from slot-holding time (what v1 recorded as compute).
#: Versions 1 and 2 lack the gpu table; reading them gives an empty one. Versions 1 to 3 have no
#: 'incomplete' field: every trace they could write recorded a run that ended normally. Versions 1 to 4
#: lack ops.t_wait/wait_clock (NaN when read: waits on async ops are then inferred, see replay.graph).
#: Version 6 adds a folded trace's 'job.fold.capture' (how its live ranks were captured: together, or
#: serially one capture per live rank and merged) and the contribution ways self_mirror and standin;
#: versions 1 to 5 have neither (every folded trace they could write was captured together).
SUPPORTED_VERSIONS: tuple[int, ...] = (1, 2, 3, 4, 5, 6)

#: the columns that hold times (wall or compute clock): two runs of one program differ only there
TIME_COLUMNS: dict[str, tuple[str, ...]] = {
    "ops": ("t_issue", "t_complete", "compute_before", "t_wait", "wait_clock"),
    "marks": ("t", "compute_clock"),
}

MANIFEST_FILE = "manifest.json"
TABLE_NAMES: tuple[str, ...] = ("ops", "marks", "slots", "gpu")
DEFAULT_FILES: dict[str, str] = {name: f"{name}.parquet" for name in TABLE_NAMES}


def tables_of(version: int) -> tuple[str, ...]:
    """The tables a trace of ``version`` has (the gpu table came with v3)."""
    return TABLE_NAMES if version >= 3 else TABLE_NAMES[:3]


class TraceFormatError(ValueError):
    """A trace (or a table handed to the writer) does not match PrismTrace.

    The message is ``trace <file>: <field> <problem>`` so that it always names both the file and
    the field; ``path``, ``field`` and ``problem`` are kept as attributes for programs.
    """

    def __init__(self, path: str | Path, field: str, problem: str) -> None:
        self.path = str(path)
        self.field = field
        self.problem = problem
        super().__init__(f"trace {self.path}: {field} {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the exception picklable (it may cross process boundaries in the launcher).
        return (type(self), (self.path, self.field, self.problem))


class Column(NamedTuple):
    """One table column: its name, Arrow type and what it means."""

    name: str
    type: pa.DataType
    doc: str


OPS_COLUMNS: tuple[Column, ...] = (
    Column("rank", pa.int32(), "global rank that issued the op"),
    Column("index", pa.int64(), "0, 1, 2... order of issue on that rank; unique per rank"),
    Column("kind", pa.string(), "op kind: all_reduce, send, recv, all_to_all_single, barrier..."),
    Column("group", pa.int32(), "process-group id, one of manifest 'groups'[].id"),
    Column("seq", pa.int64(), "per-group collective sequence number; for p2p the per (group, src, dst) one"),
    Column("peer", pa.int32(), "global rank of the p2p peer, -1 if none"),
    Column("root", pa.int32(), "global rank of the root of a rooted collective, -1 if none"),
    Column("bytes", pa.int64(), "bytes this rank contributes/sends or receives, whichever is larger"),
    Column("dtype", pa.string(), "element type of the tensors, e.g. 'torch.bfloat16'"),
    Column("shapes", pa.string(), "JSON list of lists: the shape of each tensor of the op"),
    Column("reduce_op", pa.string(), "reduction ('sum', 'max'...), '' if none"),
    Column("async_op", pa.bool_(), "issued with async_op=True (the rank did not block at issue)"),
    Column("t_issue", pa.float64(), "seconds since job start when the rank issued the op"),
    Column("t_complete", pa.float64(), "seconds since job start when the op completed for this rank"),
    Column(
        "compute_before",
        pa.float64(),
        "seconds this rank held a compute slot since its previous op was issued "
        "(the compute segment preceding the op; excludes waiting, swapped-out time and, from v2, the "
        "runtime's own staging and messaging)",
    ),
    Column("label", pa.string(), "hook-assigned tag such as 'pp.send_forward', '' if none"),
    Column(
        "splits",
        pa.string(),
        "all_to_all_single: JSON [input bytes to each group rank, output bytes from each group rank] "
        "(uneven MoE dispatch); '' for other ops (v3; older traces read as '')",
    ),
    Column(
        "t_wait",
        pa.float64(),
        "an async op: seconds since job start when the program first waited for it, whether or not it "
        "had completed (Work.wait and the like); NaN if never waited or not async (v5; older traces: NaN)",
    ),
    Column("wait_clock", pa.float64(), "the rank's compute clock at t_wait; NaN with it (v5)"),
    Column(
        "payload",
        pa.string(),
        "JSON list of the inputs' bytes (base64) for ops whose inputs are small enough to steer control "
        "flow (integer/byte tensors up to 64 KiB: object collectives; floats up to 64 bytes), else '' (v3)",
    ),
)

MARKS_COLUMNS: tuple[Column, ...] = (
    Column("rank", pa.int32(), "global rank that recorded the marker"),
    Column("name", pa.string(), "scheduling unit, e.g. 'iteration', 'forward'"),
    Column("phase", pa.string(), "'B' begin, 'E' end, 'i' instant"),
    Column("t", pa.float64(), "seconds since job start"),
    Column(
        "compute_clock",
        pa.float64(),
        "the rank's compute clock at that moment: seconds in its program while holding a slot, the "
        "runtime's own work (staging, messages, waiting for a grant) excluded (v1: slot-holding seconds)",
    ),
    Column("attrs", pa.string(), "JSON object of marker attributes (microbatch, chunk...)"),
)

SLOTS_COLUMNS: tuple[Column, ...] = (
    Column("rank", pa.int32(), "global rank that held the slot"),
    Column("device", pa.string(), "physical device of the slot, e.g. 'cuda:0'"),
    Column("slot", pa.int32(), "slot number on that device"),
    Column("t_grant", pa.float64(), "seconds since job start when the slot was granted"),
    Column("t_release", pa.float64(), "seconds since job start when the rank gave the slot back"),
    Column(
        "compute_clock",
        pa.float64(),
        "the rank's compute clock when it gave the slot back (same clock as marks.compute_clock and the "
        "sum of ops.compute_before; v2)",
    ),
)

GPU_COLUMNS: tuple[Column, ...] = (
    Column("rank", pa.int32(), "global rank whose compute segment this is"),
    Column("clock_start", pa.float64(), "the rank's compute clock when the segment began"),
    Column(
        "clock_end",
        pa.float64(),
        "the rank's compute clock when the segment ended (the value marks.compute_clock, "
        "slots.compute_clock or the running sum of ops.compute_before has at the same point)",
    ),
    Column("cpu", pa.float64(), "host seconds of the segment, waits for the device excluded"),
    Column(
        "gpu",
        pa.float64(),
        "device busy seconds of the work the segment queued (union of its kernels and copies, "
        "measured with the queue full, as when a real host runs ahead)",
    ),
    Column(
        "syncs",
        pa.string(),
        "JSON list of [host seconds into the segment, device busy seconds queued before]: where the "
        "program waited for the device inside the segment (.item(), synchronize, copies to host)",
    ),
)


def segment_pieces(cpu: float, gpu: float, syncs: list) -> list[tuple[float, float]]:
    """A gpu row's (host, device) stretches between its waits for the device: one more than the
    waits (``syncs``: host offset, device time queued before), the program waiting after each but the last.
    The runtime's host-time solve and the replay read rows through it."""
    out, cpu_at, gpu_at = [], 0.0, 0.0
    for off, before in syncs:
        out.append((max(off - cpu_at, 0.0), max(before - gpu_at, 0.0)))
        cpu_at, gpu_at = max(off, cpu_at), max(before, gpu_at)
    out.append((max(cpu - cpu_at, 0.0), max(gpu - gpu_at, 0.0)))
    return out


COLUMNS: dict[str, tuple[Column, ...]] = {
    "ops": OPS_COLUMNS, "marks": MARKS_COLUMNS, "slots": SLOTS_COLUMNS, "gpu": GPU_COLUMNS,
}

#: Columns a writer may leave out (their value then is this): added by a later version, meaningful for
#: few rows.
DEFAULTS: dict[str, dict[str, Any]] = {
    "ops": {"splits": "", "payload": "", "t_wait": float("nan"), "wait_clock": float("nan")},
}

#: Columns the writer accepts as Python objects and stores as JSON text.
JSON_COLUMNS: dict[str, tuple[str, ...]] = {
    "ops": ("shapes", "splits"), "marks": ("attrs",), "slots": (), "gpu": ("syncs",),
}

MARK_PHASES: tuple[str, ...] = ("B", "E", "i")


def _schema(table: str, columns: tuple[Column, ...]) -> pa.Schema:
    fields = [pa.field(c.name, c.type, nullable=False, metadata={"doc": c.doc}) for c in columns]
    return pa.schema(fields, metadata={"format": FORMAT, "version": str(VERSION), "table": table})


OPS_SCHEMA = _schema("ops", OPS_COLUMNS)
MARKS_SCHEMA = _schema("marks", MARKS_COLUMNS)
SLOTS_SCHEMA = _schema("slots", SLOTS_COLUMNS)
GPU_SCHEMA = _schema("gpu", GPU_COLUMNS)
SCHEMAS: dict[str, pa.Schema] = {"ops": OPS_SCHEMA, "marks": MARKS_SCHEMA, "slots": SLOTS_SCHEMA, "gpu": GPU_SCHEMA}

_NONE = type(None)

#: Required manifest keys and the Python types their values may have (bool is never an int here).
MANIFEST_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (str,),
    "version": (int,),
    "complete": (bool,),
    "created": (str,),
    "world_size": (int,),
    "job": (dict,),
    "groups": (list,),
    "ranks": (list,),
    "files": (dict,),
}
#: Keys of each entry of manifest 'groups'.
GROUP_FIELDS: dict[str, tuple[type, ...]] = {
    "id": (int,),
    "name": (str,),
    "ranks": (list,),
    "backend": (str,),
}
#: Keys of each entry of manifest 'ranks'.
RANK_FIELDS: dict[str, tuple[type, ...]] = {"rank": (int,), "exit_code": (int, _NONE), "device": (str,)}

MANIFEST_DOCS: dict[str, str] = {
    "format": f"always '{FORMAT}'",
    "version": f"format version; this code writes {VERSION} and reads {', '.join(map(str, SUPPORTED_VERSIONS))}",
    "complete": "true when the trace records a run that ended normally; from v4 false for a partial record "
                "(a failed, interrupted or still running job; 'incomplete' says why); up to v3 always true",
    "incomplete": "(v4) null, or why the record is partial: 'rank 2 exited with code 1', 'interrupted by "
                  "SIGTERM', 'live snapshot of a running job'...; its files are whole either way",
    "created": "ISO-8601 time the trace was written",
    "world_size": "number of logical ranks of the target job",
    "job": "free-form job description: argv, script, devices, slots_per_device...; a folded run's 'fold' "
           "(trace.fold: the plan, its contributions and, from v6, 'capture'); optionally 'cluster', the "
           "cluster profile the run costed communication with: a shipped name, a file's absolute path, or null "
           "for none (trace.costing; absent in older traces: communication free); optionally 'memory_estimates', "
           "rank -> prism's estimate of its class's peak in bytes (memory.estimate; report.margin weighs a class "
           "that ran out of memory by it); optionally 'live_predictions', iteration (as text) -> the seconds "
           "Megatron's log line gave as the live prediction, or null where there was none (report.build checks "
           "its own figures by them)",
    "groups": "process groups: id, name, global ranks, requested backend (e.g. 'nccl')",
    "ranks": "per rank: global rank, exit code (null if unknown), device it ran on; optionally runtime_s, "
             "seconds of the runtime's own work in the rank's slot turns (stage: inputs into shared memory, "
             "results: outputs written back, gpu_timer: the GPU timer's iteration-end work)",
    "files": "file name of each table: ops, marks, slots (and gpu from v3)",
}


def _type_name(types: tuple[type, ...]) -> str:
    names = {str: "string", int: "integer", bool: "boolean", dict: "object", list: "list", _NONE: "null"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _value_type(value: Any) -> str:
    return _type_name((type(value),))


def _has_type(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is not a rank number
    return isinstance(value, types)


def _check_fields(obj: dict, spec: dict[str, tuple[type, ...]], path: str | Path, prefix: str) -> None:
    for key, types in spec.items():
        field = f"manifest field '{prefix}{key}'"
        if key not in obj:
            raise TraceFormatError(path, field, "is missing")
        if not _has_type(obj[key], types):
            raise TraceFormatError(path, field, f"is {_value_type(obj[key])}, expected {_type_name(types)}")


def check_manifest(manifest: Any, path: str | Path) -> None:
    """Raise TraceFormatError unless ``manifest`` is a complete, well-typed v1 manifest.

    Format, version and completeness are checked first: a newer or unfinished trace should say
    so rather than complain about a field it may legitimately lack.
    """
    if not isinstance(manifest, dict):
        raise TraceFormatError(path, "top level", f"is {_value_type(manifest)}, expected a JSON object")
    fmt = manifest.get("format")
    if "format" not in manifest:
        raise TraceFormatError(path, "manifest field 'format'", f"is missing (expected '{FORMAT}')")
    if fmt != FORMAT:
        raise TraceFormatError(path, "manifest field 'format'", f"is {fmt!r}, expected '{FORMAT}'")
    supported = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
    if "version" not in manifest:
        raise TraceFormatError(path, "manifest field 'version'", "is missing")
    version = manifest["version"]
    if not _has_type(version, (int,)):
        raise TraceFormatError(
            path, "manifest field 'version'", f"is {_value_type(version)}, expected integer"
        )
    if version not in SUPPORTED_VERSIONS:
        raise TraceFormatError(
            path,
            "manifest field 'version'",
            f"is {version}; this reader supports PrismTrace version(s) {supported}",
        )
    _check_completeness(manifest, version, path)
    _check_fields(manifest, MANIFEST_FIELDS, path, "")

    world_size = manifest["world_size"]
    if world_size < 1:
        raise TraceFormatError(path, "manifest field 'world_size'", f"is {world_size}, expected >= 1")

    seen_ids: set[int] = set()
    for i, group in enumerate(manifest["groups"]):
        prefix = f"groups[{i}]."
        if not isinstance(group, dict):
            raise TraceFormatError(
                path, f"manifest field 'groups[{i}]'", f"is {_value_type(group)}, expected object"
            )
        _check_fields(group, GROUP_FIELDS, path, prefix)
        if group["id"] in seen_ids:
            raise TraceFormatError(path, f"manifest field '{prefix}id'", f"repeats group id {group['id']}")
        seen_ids.add(group["id"])
        for r in group["ranks"]:
            if not _has_type(r, (int,)) or not 0 <= r < world_size:
                raise TraceFormatError(
                    path,
                    f"manifest field '{prefix}ranks'",
                    f"contains {r!r}, not a rank in [0, {world_size})",
                )

    seen_ranks: set[int] = set()
    for i, entry in enumerate(manifest["ranks"]):
        prefix = f"ranks[{i}]."
        if not isinstance(entry, dict):
            raise TraceFormatError(
                path, f"manifest field 'ranks[{i}]'", f"is {_value_type(entry)}, expected object"
            )
        _check_fields(entry, RANK_FIELDS, path, prefix)
        r = entry["rank"]
        if not 0 <= r < world_size or r in seen_ranks:
            raise TraceFormatError(
                path, f"manifest field '{prefix}rank'", f"is {r}: duplicate or not in [0, {world_size})"
            )
        seen_ranks.add(r)

    files = manifest["files"]
    for name in tables_of(version):
        field = f"manifest field 'files.{name}'"
        if name not in files:
            raise TraceFormatError(path, field, "is missing")
        fname = files[name]
        if not isinstance(fname, str):
            raise TraceFormatError(path, field, f"is {_value_type(fname)}, expected string")
        # Tables live inside the trace directory; refuse names that would escape it.
        if not fname or fname != Path(fname).name or fname in (".", ".."):
            raise TraceFormatError(path, field, f"is {fname!r}, expected a plain file name inside the trace")


#: Signals that stop a job from outside: a user's Ctrl-C, a scheduler's or a time limit's SIGTERM, a hangup.
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


def stopped_reason(signal_name: str) -> str:
    """The 'incomplete' reason of a job a signal stopped (the launcher and the coordinator write it so)."""
    return f"ended by {signal_name}"


def stopped_by_signal(reason: str | None) -> bool:
    """Whether an 'incomplete' reason is a stop from outside (``STOP_SIGNALS``), not a failure of the job."""
    return reason is not None and any(reason.startswith(stopped_reason(s)) for s in STOP_SIGNALS)


def incomplete_reason(manifest: dict) -> str | None:
    """Why the trace's record of its run is partial (v4 'incomplete'), or None for a run that ended normally."""
    return manifest.get("incomplete") if manifest.get("complete") is False else None


def _check_completeness(manifest: dict, version: int, path: str | Path) -> None:
    """Up to v3 a trace is always complete; from v4 a partial record says why ('incomplete')."""
    complete = manifest.get("complete")
    if version >= 4 and "incomplete" not in manifest:
        raise TraceFormatError(path, "manifest field 'incomplete'", "is missing (a v4 trace has it: null or why)")
    reason = manifest.get("incomplete")
    if version >= 4 and complete is False:
        if not isinstance(reason, str) or not reason:
            raise TraceFormatError(path, "manifest field 'incomplete'",
                                   f"is {reason!r}: a partial trace (complete false) must say why")
        return
    if complete is not True:
        state = "is missing" if "complete" not in manifest else f"is {complete!r}"
        raise TraceFormatError(
            path,
            "manifest field 'complete'",
            f"{state}: the trace was not finished (its writer failed or is still running)",
        )
    if version >= 4 and reason is not None:
        raise TraceFormatError(path, "manifest field 'incomplete'",
                               f"is {reason!r} but 'complete' is true: a complete trace has null here")


def check_table(table: pa.Table, name: str, path: str | Path) -> pa.Table:
    """Check a table's columns against the schema; return it reduced to the schema's columns.

    Extra columns are dropped, not rejected, so that a reader can open a trace that gained an
    optional column without a version bump.
    """
    for col in COLUMNS[name]:
        field = f"column '{col.name}'"
        if col.name not in table.column_names:
            raise TraceFormatError(path, field, "is missing")
        actual = table.schema.field(col.name).type
        if actual != col.type:
            raise TraceFormatError(path, field, f"has type {actual}, expected {col.type}")
        nulls = table.column(col.name).null_count
        if nulls:
            raise TraceFormatError(
                path, field, f"has {nulls} null value(s); PrismTrace columns are never null"
            )
    return table.select([c.name for c in COLUMNS[name]])


def check_references(manifest: dict, tables: dict[str, pa.Table], paths: dict[str, str | Path]) -> None:
    """Cross-checks that are cheap in Arrow: ranks in range, known groups, unique (rank, index)."""
    world_size = manifest["world_size"]
    for name, table in tables.items():
        if table.num_rows == 0:
            continue
        ranks = table.column("rank")
        lo, hi = pc.min(ranks).as_py(), pc.max(ranks).as_py()
        if lo < 0 or hi >= world_size:
            bad = lo if lo < 0 else hi
            raise TraceFormatError(
                paths[name], "column 'rank'", f"contains {bad}, not a rank in [0, {world_size})"
            )
    ops = tables["ops"]
    if ops.num_rows:
        ids = pa.array(sorted(g["id"] for g in manifest["groups"]), pa.int32())
        unknown = pc.filter(ops.column("group"), pc.invert(pc.is_in(ops.column("group"), value_set=ids)))
        if len(unknown):
            raise TraceFormatError(
                paths["ops"],
                "column 'group'",
                f"contains {unknown[0].as_py()}, not an id in manifest 'groups'",
            )
        counts = ops.group_by(["rank", "index"]).aggregate([([], "count_all")])
        dup = counts.filter(pc.greater(counts.column("count_all"), 1))
        if dup.num_rows:
            row = dup.slice(0, 1).to_pylist()[0]
            raise TraceFormatError(
                paths["ops"], "column 'index'", f"repeats index {row['index']} on rank {row['rank']}"
            )
    marks = tables["marks"]
    if marks.num_rows:
        bad = pc.filter(
            marks.column("phase"), pc.invert(pc.is_in(marks.column("phase"), pa.array(MARK_PHASES)))
        )
        if len(bad):
            raise TraceFormatError(
                paths["marks"], "column 'phase'", f"contains {bad[0].as_py()!r}, expected one of B, E, i"
            )
