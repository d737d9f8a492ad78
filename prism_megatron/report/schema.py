"""PrismReport (version 6): the one place that says what ``report.json`` contains.

A report is read later by people and programs that never saw the trace (dashboards, a comparison
of two runs), so like PrismTrace it is versioned and a reader refuses what it does not understand,
with an error naming the file and the field. Extra keys are allowed, so that a report may gain an
optional field without a version bump.

Sizes are bytes, times seconds. ``headroom`` is ``cap - max_reserved`` (negative: over the cap).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, NamedTuple

from prism_megatron.trace.writer import atomic_write_text

FORMAT = "prismreport"
VERSION = 7
#: Versions this code can read; a reader rejects anything else rather than guessing. Version 1 lacks
#: breakdown[].host_bound_s; reading it gives null there. Versions 1 and 2 lack ``fold``: null. Versions
#: 1 to 3 lack breakdown[].device_busy_s, prediction.host_bound and fold.classes[].host_bound_s and
#: .device_busy_s: null (not measured, as in a trace without GPU times). Versions 1 to 4 lack
#: memory.ranks[]/classes[].peak_iteration and .peak_rising: null. Versions 1 to 5 have no merged timeline
#: segments (each segment is one run); version 6's are read the same way (``runs.parts``). Versions 1 to 6 lack
#: job.machine: null (the emulating machine not recorded).
SUPPORTED_VERSIONS: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
REPORT_FILE = "report.json"
#: the first bytes of a gzip stream: how a compressed report is told from a plain one, whatever its name
GZIP_MAGIC = b"\x1f\x8b"


class ReportFormatError(ValueError):
    """A report does not match PrismReport; the message is ``report <file>: <field> <problem>``."""

    def __init__(self, path: str | Path, field: str, problem: str) -> None:
        self.path = str(path)
        self.field = field
        self.problem = problem
        super().__init__(f"report {self.path}: {field} {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.field, self.problem))


class Obj(NamedTuple):
    """A JSON object with these fields (name -> spec), or null when ``nullable``."""

    fields: dict[str, Any]
    nullable: bool = False


class ListOf(NamedTuple):
    """A JSON list whose items all match ``item`` (a spec), or null when ``nullable``."""

    item: Any
    nullable: bool = False


# A spec is a tuple of Python types (a leaf), an Obj or a ListOf.
NULL = type(None)
NUM = (int, float)
OPT_NUM = (int, float, NULL)
OPT_INT = (int, NULL)
OPT_STR = (str, NULL)
OPT_BOOL = (bool, NULL)

#: The machine the trace was measured on (manifest job 'machine'): a host-bound rank's time is its host's.
MACHINE = Obj({
    "gpus": ListOf((str,)),
    "cpu": OPT_STR,
    "cores": OPT_INT,
}, nullable=True)
JOB = Obj({
    "world_size": (int,),
    "argv": ListOf((str,), nullable=True),
    "script": OPT_STR,
    "devices": (list, str, NULL),
    "slots_per_device": OPT_INT,
    "machine": MACHINE,
})
#: The GPU the job is sized for (manifest job 'target_gpu'); every field null when unknown.
TARGET = Obj({
    "gpu": OPT_STR,
    "capacity_bytes": OPT_INT,
    "usable_bytes": OPT_INT,  # capacity - context: the per-rank cap
    "context_bytes": OPT_INT,
    "source": OPT_STR,
})
#: One rank over the median iteration's window; compute + exposed_comm + bubble add up to the window.
#: host_bound_s (v2): the part of compute in which the GPU waited for the host to issue work (a trace
#: measured on GPUs; null otherwise): launch-bound time that CUDA graphs or larger micro-batches cut.
#: device_busy_s (v4): the rest of compute, the GPU running it: what the device alone needs (a floor, not
#: a prediction); null where host_bound_s is.
BREAKDOWN = Obj({"rank": (int,), "class": (str,), "compute_s": NUM, "exposed_comm_s": NUM, "bubble_s": NUM,
                 "host_bound_s": OPT_NUM, "device_busy_s": OPT_NUM})
#: The headline's compute on two clocks (v4; null without GPU times): the breakdown figures of the critical
#: rank (the GPU-timed rank with the most compute on the critical path of the median iteration).
HOST_BOUND = Obj({"rank": (int,), "class": (str,), "compute_s": NUM, "host_bound_s": NUM, "device_busy_s": NUM},
                 nullable=True)
#: A step of the critical path inside the window; ``ranks`` as ranges, e.g. '0-7'.
PATH_STEP = Obj({"kind": (str,), "ranks": (str,), "start_s": NUM, "end_s": NUM, "label": (str,)})
CRITICAL_PATH = Obj({
    "steps": ListOf(PATH_STEP),  # the longest few, in time order
    "total_steps": (int,),
    "by_kind_s": (dict,),  # kind -> seconds on the path within the window
})
#: The median iteration's timeline for the HTML page: segments [kind, start, end], seconds from
#: the window start; kind is compute, exposed_comm or bubble. From v6, a run of segments narrower than the
#: timeline's resolution is one [kind, start, end, {"segments": n, "share_s": {kind: seconds}}] (``runs``).
TIMELINE_ROW = Obj({"rank": (int,), "class": (str,), "segments": ListOf((list,))})
#: A merged segment's fourth item (v6): how many runs it merged, and the seconds of each kind among them.
MERGED_RUNS = Obj({"segments": (int,), "share_s": (dict,)})
TIMELINE = Obj({
    "iteration": OPT_INT,
    "start_s": NUM,
    "end_s": NUM,
    "note": (str,),  # which ranks are shown when not all are
    "rows": ListOf(TIMELINE_ROW),
})
PREDICTION = Obj({
    "provenance": (str,),
    "cluster": OPT_STR,
    "iteration_times_s": ListOf(NUM),
    "iteration_time_s": OPT_NUM,  # median (on GPU-timed traces, of the iterations measured on two clocks)
    # optional extra key "iteration_bases": per iteration, what its prediction rests on (report.live.basis)
    # optional extra key "live_predictions": {"logged": n, "differ": [{"iteration", "logged_s", "report_s"}]}, the
    # predictions Megatron's log line gave set against these (report.build._live_check)
    "tokens_per_s": OPT_NUM,
    "tflops_per_gpu": OPT_NUM,  # model FLOPs
    "breakdown": ListOf(BREAKDOWN),
    "host_bound": HOST_BOUND,
    "critical_path": CRITICAL_PATH,
    "timeline": TIMELINE,
    "notes": ListOf((str,)),  # what building the graph left out or guessed
}, nullable=True)
MEMORY_RANK = Obj({
    "rank": (int,),
    "class": (str,),
    "max_allocated": (int,),
    "max_reserved": (int,),
    "cap": OPT_INT,
    "headroom": OPT_INT,
    "oom": (bool,),
    # v5: the iteration by whose end max_reserved was reached (null: no iteration marks); whether it still rose
    # in the last captured iteration (a longer run may peak higher)
    "peak_iteration": OPT_INT,
    "peak_rising": OPT_BOOL,
})
MEMORY_CLASS = Obj({
    "class": (str,),
    "ranks": ListOf((int,)),
    "max_allocated": (int,),
    "max_reserved": (int,),
    "headroom": OPT_INT,  # the smallest of its ranks
    "peak_iteration": OPT_INT,  # v5: the latest of its ranks'
    "peak_rising": OPT_BOOL,  # v5: any of its ranks'
})
#: Optional in a class row (no version bump): fits, OOM or "within the TE-substitution margin"
#: (report.margin), null where no cap was set.
MEMORY = Obj({"source": OPT_STR, "ranks": ListOf(MEMORY_RANK), "classes": ListOf(MEMORY_CLASS)})
OOM = Obj({
    "rank": (int,),
    "class": (str,),
    "requested": OPT_INT,
    "allocated": (int,),
    "reserved": (int,),
    "max_allocated": (int,),
    "max_reserved": (int,),
    "cap": OPT_INT,
    "message": (str,),
    "snapshot": OPT_STR,  # file name relative to the trace dir
})
#: Optional in an OOM entry (no version bump: older readers ignore it): the failing allocation's site, the
#: program's innermost frames "file:line (function)", outermost first (``memory.probe.allocation_site``);
#: empty where the trace did not record it.
OOM_WHERE = ListOf((str,))
#: A rank class of a folded job (v3): the ranks it stands for, its live (sandbox) ranks, its peak
#: memory and its mean time over its sandbox ranks in the median iteration (null: no figure); v4 adds
#: host_bound_s and device_busy_s as in BREAKDOWN (null unless every sandbox rank had GPU times).
FOLD_CLASS = Obj({
    "name": (str,),
    "role": (str,),
    "count": (int,),
    "sandbox": ListOf((int,)),
    "max_allocated": OPT_INT,
    "max_reserved": OPT_INT,
    "compute_s": OPT_NUM,
    "exposed_comm_s": OPT_NUM,
    "bubble_s": OPT_NUM,
    "host_bound_s": OPT_NUM,
    "device_busy_s": OPT_NUM,
})
#: A folded job (v3; null when every rank ran): which ranks were real and how the others were made.
FOLD = Obj({
    "world_size": (int,),
    "live": ListOf((int,)),
    "gpus_per_node": (int,),
    "contributions": (dict,),  # way (trace.fold.CONTRIBUTION_WAYS) -> virtual contributions made so
    "classes": ListOf(FOLD_CLASS),
}, nullable=True)
REPORT = Obj({
    "format": (str,),
    "version": (int,),
    "created": (str,),
    "trace": (str,),
    "job": JOB,
    "target": TARGET,
    "prediction": PREDICTION,
    "prediction_error": OPT_STR,  # why there is no prediction (the replay failed)
    "memory": MEMORY,
    "oom": ListOf(OOM),
    "swap": (dict, NULL),
    "verdict": (str,),
    "fold": FOLD,
})

#: Optional (no version bump: readers of v2 ignore it): settings of the target the emulation machine
#: could not run, each with what ran instead and which prediction it affects (from the recipe, through
#: the manifest's job.substitutions).
SUBSTITUTION = Obj({"setting": (str,), "published": (str,), "rendered": (str,), "affects": (str,)})

_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "list",
          NULL: "null"}


def _type_name(types: tuple[type, ...]) -> str:
    return " or ".join(dict.fromkeys(_NAMES.get(t, t.__name__) for t in types))


def _has_type(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool) and bool not in types:
        return False  # JSON true is not a byte count
    return isinstance(value, types)


def _check(value: Any, spec: Any, path: str | Path, field: str) -> None:
    if isinstance(spec, (Obj, ListOf)):
        if value is None and spec.nullable:
            return
        want = (dict,) if isinstance(spec, Obj) else (list,)
        if not isinstance(value, want):
            nul = " or null" if spec.nullable else ""
            raise ReportFormatError(path, f"field '{field}'", f"is {_type_name((type(value),))}, "
                                                             f"expected {_type_name(want)}{nul}")
        if isinstance(spec, ListOf):
            for i, item in enumerate(value):
                _check(item, spec.item, path, f"{field}[{i}]")
            return
        for key, sub in spec.fields.items():
            name = f"{field}.{key}" if field else key
            if key not in value:
                raise ReportFormatError(path, f"field '{name}'", "is missing")
            _check(value[key], sub, path, name)
    elif not _has_type(value, spec):
        raise ReportFormatError(path, f"field '{field}'",
                                f"is {_type_name((type(value),))}, expected {_type_name(spec)}")


def check_report(report: Any, path: str | Path) -> None:
    """Raise ReportFormatError unless ``report`` is a well-typed report of a supported version (older
    versions gain their missing fields as null).

    Format and version come first: a newer report should say so rather than complain about a
    field it may legitimately lack.
    """
    if not isinstance(report, dict):
        raise ReportFormatError(path, "top level", f"is {_type_name((type(report),))}, expected a JSON object")
    if report.get("format") != FORMAT:
        got = "is missing" if "format" not in report else f"is {report['format']!r}"
        raise ReportFormatError(path, "field 'format'", f"{got}, expected '{FORMAT}'")
    version = report.get("version")
    if not _has_type(version, (int,)) or version not in SUPPORTED_VERSIONS:
        got = "is missing" if "version" not in report else f"is {version!r}"
        supported = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
        raise ReportFormatError(path, "field 'version'", f"{got}; this reader supports PrismReport version(s) "
                                                         f"{supported}")
    if version < 3:
        report.setdefault("fold", None)
    if version < 7 and isinstance(report.get("job"), dict):
        report["job"].setdefault("machine", None)
    if version < 5:
        _null_missing(report, version)
    _check(report, REPORT, path, "")
    if report["prediction"] is not None:
        _check_segments(report["prediction"]["timeline"]["rows"], version, path)
    if "substitutions" in report:
        _check(report["substitutions"], ListOf(SUBSTITUTION), path, "substitutions")
    for i, e in enumerate(report["oom"]):
        if "where" in e:
            _check(e["where"], OOM_WHERE, path, f"oom[{i}].where")


def _check_segments(rows: list[dict[str, Any]], version: int, path: str | Path) -> None:
    """Each timeline segment is [kind, start, end], or from v6 that and {"segments": n, "share_s": {kind: s}}."""
    for i, row in enumerate(rows):
        for j, seg in enumerate(row["segments"]):
            field = f"prediction.timeline.rows[{i}].segments[{j}]"
            if len(seg) not in ((3, 4) if version >= 6 else (3,)):
                raise ReportFormatError(path, f"field '{field}'", f"has {len(seg)} items, expected [kind, start, end]"
                                        + (" and the merged runs' counts" if version >= 6 else ""))
            for k, spec in enumerate(((str,), NUM, NUM)):
                _check(seg[k], spec, path, f"{field}[{k}]")
            if len(seg) == 4:
                _check(seg[3], MERGED_RUNS, path, f"{field}[3]")


def _null_missing(report: dict[str, Any], version: int) -> None:
    """Give a report of a version before 5 the fields it lacks, as null (what was not measured then)."""
    memory = report.get("memory")
    if isinstance(memory, dict):
        for row in [*(memory.get("ranks") or []), *(memory.get("classes") or [])]:
            if isinstance(row, dict):
                row.setdefault("peak_iteration", None)
                row.setdefault("peak_rising", None)
    if version == 4:
        return
    pred = report.get("prediction")
    if isinstance(pred, dict):
        pred.setdefault("host_bound", None)
        for row in pred.get("breakdown") or []:
            if isinstance(row, dict):
                row.setdefault("device_busy_s", None)
                if version == 1:
                    row.setdefault("host_bound_s", None)
    fold = report.get("fold")
    for row in (fold.get("classes") or []) if isinstance(fold, dict) else []:
        if isinstance(row, dict):
            row.setdefault("host_bound_s", None)
            row.setdefault("device_busy_s", None)


def read_report(path: str | Path) -> dict[str, Any]:
    """Read and validate ``report.json`` (or the directory holding it); a gzip-compressed copy reads the same
    (results kept beside the code are compressed: a large job's report is mostly its timeline)."""
    path = Path(path)
    if path.is_dir():
        path = path / REPORT_FILE
    try:
        data = path.read_bytes()
        if data[:2] == GZIP_MAGIC:
            data = gzip.decompress(data)
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise ReportFormatError(path, "file", "is missing") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ReportFormatError(path, "file", f"cannot be read: {e}") from e
    try:
        report = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportFormatError(path, "JSON", f"is invalid at line {e.lineno} column {e.colno}: {e.msg}") from None
    check_report(report, path)
    return report


def write_report(report: dict[str, Any], path: str | Path) -> Path:
    """Validate ``report`` and write it atomically (a reader sees the old file or the new one)."""
    path = Path(path)
    try:
        text = json.dumps(report, indent=1, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise ReportFormatError(path, "report", f"is not JSON-serialisable: {e}") from e
    check_report(json.loads(text), path)  # what a reader will see (tuples become lists...)
    return atomic_write_text(path, text)
