"""The calibrated graph and its file (format ``prismcalibrated``, version 2).

The calibrated graph is what Phase 2's virtual ranks walk and what predictions replay: each rank's
events with compute durations measured in its slice, and one duration per communication op with
where that number came from (``measured`` in a slice, or ``model``). Absolute times are not stored:
they follow from these durations through the dependency edges (:meth:`CalibratedGraph.replay`).

A file is a directory, like a PrismTrace::

    manifest.json   format, version, provenance (trace, slices and their devices, cost model), groups
    events.parquet  one row per event per rank (columns in EVENT_COLUMNS)

It is written into a hidden sibling directory and renamed into place, so a reader never sees a
half-written one; the reader rejects an unknown format or version and names the file and the field
of anything missing or mistyped, since the file is read far from the run that produced it.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict, deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from ..replay.engine import CommSpec, CostFn, ReplayResult, replay
from ..replay.graph import P2P_KINDS, Comm, Compute, CpuSync, Event, Graph, GraphError, Group, Mark, Wait
from ..trace.writer import write_directory

FORMAT = "prismcalibrated"
VERSION = 2
#: Version 1 lacks the gpu column and cpu_sync events (one clock per rank); it reads as such.
SUPPORTED_VERSIONS: tuple[int, ...] = (1, 2)
MANIFEST_FILE = "manifest.json"
EVENTS_FILE = "events.parquet"
COST_SOURCES = ("measured", "model")

#: name, type, meaning
EVENT_COLUMNS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("rank", pa.int32(), "global rank"),
    ("index", pa.int64(), "position in the rank's event list, 0, 1, 2..."),
    ("type", pa.string(), "compute, comm, wait, mark or cpu_sync (v2: the host waits for the device)"),
    ("duration", pa.float64(), "compute: seconds (host seconds when gpu is set); comm: the op's calibrated "
                               "duration (same for every member)"),
    ("gpu", pa.float64(), "compute: device busy seconds measured on a GPU, NaN for one clock (v2)"),
    ("cost_source", pa.string(), "comm: 'measured' or 'model'; '' otherwise"),
    ("cost_slice", pa.int32(), "comm: the slice whose measurement gave the duration, -1 if none"),
    ("kind", pa.string(), "comm: op kind"),
    ("group", pa.int32(), "comm: process-group id"),
    ("seq", pa.int64(), "comm: per-group (p2p: per group, src, dst) sequence number"),
    ("peer", pa.int32(), "comm: p2p peer, -1 if none"),
    ("root", pa.int32(), "comm: root of a rooted collective, -1 if none"),
    ("bytes", pa.int64(), "comm: bytes, trace convention"),
    ("dtype", pa.string(), "comm: element type"),
    ("async_op", pa.bool_(), "comm: issued asynchronously"),
    ("label", pa.string(), "compute/comm label, or the mark's name"),
    ("refs", pa.string(), "wait: JSON list of the awaited event indices"),
    ("phase", pa.string(), "mark: B, E or i"),
    ("attrs", pa.string(), "mark: JSON object of attributes"),
)
EVENTS_SCHEMA = pa.schema([pa.field(n, t, nullable=False) for n, t, _ in EVENT_COLUMNS],
                          metadata={"format": FORMAT, "version": str(VERSION)})

#: required manifest keys and their JSON types
MANIFEST_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (str,), "version": (int,), "complete": (bool,), "created": (str,), "world_size": (int,),
    "trace": (str,), "cost": (str,), "serialize_group_collectives": (bool,), "groups": (list,),
    "slices": (list,), "notes": (list,), "files": (dict,),
}
GROUP_FIELDS: dict[str, tuple[type, ...]] = {"id": (int,), "name": (str,), "ranks": (list,)}
SLICE_FIELDS: dict[str, tuple[type, ...]] = {"index": (int,), "ranks": (list,), "device": (str,), "source": (str,)}


class CalibratedFormatError(ValueError):
    """A calibrated-graph file does not match the format; the message names the file and the field."""

    def __init__(self, path: str | Path, field: str, problem: str) -> None:
        self.path, self.field, self.problem = str(path), field, problem
        super().__init__(f"calibrated graph {self.path}: {field} {problem}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.field, self.problem))


@dataclass(frozen=True)
class OpCost:
    """The calibrated duration of one matched op and where it came from."""

    kind: str  # the engine's op kind: the collective's kind, or 'send/recv'
    nbytes: int
    duration: float
    source: str  # 'measured' or 'model'
    slice: int = -1  # the slice that measured it, -1 for the model


@dataclass(frozen=True)
class SliceProvenance:
    """Which ranks a slice ran for real, on what, and from which trace."""

    index: int
    ranks: tuple[int, ...]
    device: str = ""
    source: str = ""


def op_key(rank: int, ev: Comm) -> tuple:
    """The engine's identity of an op: ('coll', group, seq) or ('p2p', group, src, dst, seq)."""
    if ev.is_p2p:
        src, dst = (rank, ev.peer) if ev.kind == "send" else (ev.peer, rank)
        return ("p2p", ev.group, src, dst, ev.seq)
    return ("coll", ev.group, ev.seq)


@dataclass
class CalibratedGraph:
    """A graph with calibrated compute durations plus one calibrated duration per op."""

    graph: Graph
    costs: dict[tuple, OpCost]
    slices: list[SliceProvenance] = field(default_factory=list)
    trace: str = ""
    cost: str = ""  # what costed the ops no slice measured
    serialize_group_collectives: bool = True
    created: str = ""

    def cost_fn(self) -> CostFn:
        """A fresh cost function for ``replay`` that returns each op's calibrated duration.

        The engine's CommSpec does not carry the sequence number, so ops are recognised by order:
        the engine costs an op once, when its last member issues it, and on one stream (a group's
        collectives, or one (group, src, dst) p2p channel) that happens in sequence order because
        every rank issues a stream's ops in that order. Kind and size are checked on every call.
        """
        streams: dict[tuple, deque[tuple]] = defaultdict(deque)
        for key in sorted(self.costs):
            streams[key[:-1]].append(key)

        def cost(spec: CommSpec) -> float:
            p2p = spec.kind in P2P_KINDS
            stream = ("p2p", spec.group, spec.src, spec.dst) if p2p else ("coll", spec.group)
            queue = streams.get(stream)
            if not queue:
                raise GraphError(f"{self.graph.source}: no calibrated duration left for {spec}")
            key = queue.popleft()
            c = self.costs[key]
            if c.nbytes != spec.nbytes or (not p2p and c.kind != spec.kind):
                raise GraphError(f"{self.graph.source}: op {key} is a {c.kind} of {c.nbytes} B, but the replay "
                                 f"costs a {spec.kind} of {spec.nbytes} B there (ops issued out of sequence order?)")
            return c.duration

        return cost

    def replay(self) -> ReplayResult:
        """The globally consistent timeline: replay with every op at its calibrated duration."""
        return replay(self.graph, self.cost_fn(), serialize_group_collectives=self.serialize_group_collectives)


# --- writer ----------------------------------------------------------------------------------------
def _rows(cg: CalibratedGraph) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {n: [] for n, _, _ in EVENT_COLUMNS}
    blank = {"duration": 0.0, "gpu": math.nan, "cost_source": "", "cost_slice": -1, "kind": "", "group": -1,
             "seq": -1, "peer": -1, "root": -1, "bytes": 0, "dtype": "", "async_op": False, "label": "", "refs": "",
             "phase": "", "attrs": ""}
    for rank in cg.graph.ranks:
        for i, ev in enumerate(cg.graph.events[rank]):
            row = dict(blank, rank=rank, index=i)
            if isinstance(ev, Compute):
                row.update(type="compute", duration=ev.duration, label=ev.label,
                           gpu=math.nan if ev.gpu is None else ev.gpu)
            elif isinstance(ev, CpuSync):
                row.update(type="cpu_sync")
            elif isinstance(ev, Comm):
                c = cg.costs[op_key(rank, ev)]
                row.update(type="comm", duration=c.duration, cost_source=c.source, cost_slice=c.slice, kind=ev.kind,
                           group=ev.group, seq=ev.seq, peer=ev.peer, root=ev.root, bytes=ev.nbytes, dtype=ev.dtype,
                           async_op=ev.async_op, label=ev.label)
            elif isinstance(ev, Wait):
                row.update(type="wait", refs=json.dumps(list(ev.refs)))
            else:
                row.update(type="mark", label=ev.name, phase=ev.phase, attrs=json.dumps(ev.attrs, sort_keys=True))
            for k, v in row.items():
                cols[k].append(v)
    return cols


def write_calibrated(path: str | Path, cg: CalibratedGraph) -> Path:
    """Write ``cg`` as a calibrated-graph directory at ``path`` (replacing one there); return the path."""
    path = Path(path)
    if path.exists() and not (path / MANIFEST_FILE).is_file():
        raise FileExistsError(f"calibrated graph {path}: exists and is not a calibrated graph; not replacing it")
    missing = [(r, i) for r in cg.graph.ranks for i, ev in enumerate(cg.graph.events[r])
               if isinstance(ev, Comm) and op_key(r, ev) not in cg.costs]
    if missing:
        raise ValueError(f"calibrated graph {path}: no calibrated duration for rank {missing[0][0]} "
                         f"event {missing[0][1]} ({len(missing)} op event(s) in all)")
    manifest = {
        "format": FORMAT, "version": VERSION, "complete": True,
        "created": cg.created or datetime.now(timezone.utc).isoformat(),
        "world_size": max([*cg.graph.ranks, *(r for g in cg.graph.groups.values() for r in g.ranks)], default=-1) + 1,
        "trace": cg.trace, "cost": cg.cost, "serialize_group_collectives": cg.serialize_group_collectives,
        "groups": [{"id": g.id, "name": g.name, "ranks": list(g.ranks)} for g in cg.graph.groups.values()],
        "slices": [{"index": s.index, "ranks": list(s.ranks), "device": s.device, "source": s.source}
                   for s in cg.slices],
        "notes": list(cg.graph.notes), "files": {"events": EVENTS_FILE},
    }
    text = json.dumps(manifest, indent=1, allow_nan=False) + "\n"
    table = pa.table(_rows(cg), schema=EVENTS_SCHEMA)
    return write_directory(path, {EVENTS_FILE: table}, MANIFEST_FILE, text)


# --- reader ----------------------------------------------------------------------------------------
def _type_name(types: tuple[type, ...]) -> str:
    names = {str: "string", int: "integer", bool: "boolean", dict: "object", list: "list", float: "number"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _check(obj: Any, spec: dict[str, tuple[type, ...]], path: Path, prefix: str) -> None:
    if not isinstance(obj, dict):
        raise CalibratedFormatError(path, f"manifest field '{prefix.rstrip('.')}'", "is not an object")
    for key, types in spec.items():
        name = f"manifest field '{prefix}{key}'"
        if key not in obj:
            raise CalibratedFormatError(path, name, "is missing")
        value = obj[key]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            raise CalibratedFormatError(path, name, f"is {_type_name((type(value),))}, expected {_type_name(types)}")


def _int_list(value: list, path: Path, name: str) -> tuple[int, ...]:
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in value):
        raise CalibratedFormatError(path, f"manifest field '{name}'", "must be a list of ranks (integers >= 0)")
    return tuple(value)


def _read_manifest(path: Path) -> dict[str, Any]:
    mpath = path / MANIFEST_FILE
    try:
        manifest = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CalibratedFormatError(mpath, "manifest", "is missing: not a calibrated graph") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CalibratedFormatError(mpath, "manifest", f"is not JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise CalibratedFormatError(mpath, "top level", "is not a JSON object")
    if manifest.get("format") != FORMAT:
        raise CalibratedFormatError(mpath, "manifest field 'format'",
                                    f"is {manifest.get('format')!r}, expected '{FORMAT}'")
    version = manifest.get("version")
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise CalibratedFormatError(mpath, "manifest field 'version'", f"is {version!r}; this reader supports "
                                    f"version(s) {', '.join(map(str, SUPPORTED_VERSIONS))}")
    if manifest.get("complete") is not True:
        raise CalibratedFormatError(mpath, "manifest field 'complete'", "is not true: the file was not finished")
    _check(manifest, MANIFEST_FIELDS, mpath, "")
    for i, g in enumerate(manifest["groups"]):
        _check(g, GROUP_FIELDS, mpath, f"groups[{i}].")
        _int_list(g["ranks"], mpath, f"groups[{i}].ranks")
    for i, s in enumerate(manifest["slices"]):
        _check(s, SLICE_FIELDS, mpath, f"slices[{i}].")
        _int_list(s["ranks"], mpath, f"slices[{i}].ranks")
    if not isinstance(manifest["files"].get("events"), str) or Path(manifest["files"]["events"]).name != \
            manifest["files"]["events"]:
        raise CalibratedFormatError(mpath, "manifest field 'files.events'", "must be a plain file name")
    return manifest


def _read_events(file: Path, version: int = VERSION) -> pa.Table:
    try:
        table = pq.read_table(file)
    except FileNotFoundError:
        raise CalibratedFormatError(file, "file", "is missing") from None
    except (pa.ArrowException, OSError) as e:
        raise CalibratedFormatError(file, "file", f"is not a readable parquet file: {e}") from None
    if version == 1 and "gpu" not in table.column_names:  # one clock: no device times
        table = table.append_column("gpu", pa.array([math.nan] * table.num_rows, pa.float64()))
    for name, typ, _ in EVENT_COLUMNS:
        if name not in table.column_names:
            raise CalibratedFormatError(file, f"column '{name}'", "is missing")
        if table.schema.field(name).type != typ:
            raise CalibratedFormatError(file, f"column '{name}'",
                                        f"has type {table.schema.field(name).type}, expected {typ}")
        if table.column(name).null_count:
            raise CalibratedFormatError(file, f"column '{name}'", "has null values")
    return table.select([n for n, _, _ in EVENT_COLUMNS]).sort_by([("rank", "ascending"), ("index", "ascending")])


def _json(text: str, typ: type) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, typ) else None


def _event(row: dict[str, Any], file: Path) -> Event:
    where = f"(rank {row['rank']} event {row['index']})"
    t = row["type"]
    if t == "compute":
        gpu = row.get("gpu", math.nan)
        return Compute(row["duration"], row["label"], None if math.isnan(gpu) else gpu)
    if t == "cpu_sync":
        return CpuSync()
    if t == "comm":
        return Comm(row["kind"], row["group"], row["seq"], row["peer"], row["root"], row["bytes"], row["dtype"],
                    row["async_op"], row["label"])
    if t == "wait":
        refs = _json(row["refs"], list)
        if refs is None or not all(type(r) is int for r in refs):
            raise CalibratedFormatError(file, "column 'refs'", f"is {row['refs']!r} {where}, expected a JSON "
                                        "list of event indices")
        return Wait(tuple(refs))
    if t == "mark":
        if row["phase"] not in ("B", "E", "i"):
            raise CalibratedFormatError(file, "column 'phase'", f"is {row['phase']!r} {where}, expected B, E or i")
        attrs = _json(row["attrs"] or "{}", dict)
        if attrs is None:
            raise CalibratedFormatError(file, "column 'attrs'", f"is {row['attrs']!r} {where}, expected a JSON "
                                        "object")
        return Mark(row["label"], row["phase"], attrs)
    raise CalibratedFormatError(file, "column 'type'", f"is {t!r} {where}, expected compute, comm, wait, mark or "
                                "cpu_sync")


def read_calibrated(path: str | Path) -> CalibratedGraph:
    """Read and validate a calibrated-graph directory; raise CalibratedFormatError naming file and field."""
    path = Path(path)
    manifest = _read_manifest(path)
    file = path / manifest["files"]["events"]
    events: dict[int, list[Event]] = defaultdict(list)
    costs: dict[tuple, OpCost] = {}
    for row in _read_events(file, manifest["version"]).to_pylist():
        rank, evs = row["rank"], events[row["rank"]]
        if row["index"] != len(evs):
            raise CalibratedFormatError(file, "column 'index'", f"of rank {rank} jumps to {row['index']} where "
                                        f"{len(evs)} was expected (indices run 0, 1, 2... per rank)")
        ev = _event(row, file)
        if isinstance(ev, Compute) and not (math.isfinite(ev.duration) and ev.duration >= 0):
            raise CalibratedFormatError(file, "column 'duration'", f"is {ev.duration} (rank {rank} event "
                                        f"{row['index']}), expected a finite number >= 0")
        if isinstance(ev, Compute) and ev.gpu is not None and not (math.isfinite(ev.gpu) and ev.gpu >= 0):
            raise CalibratedFormatError(file, "column 'gpu'", f"is {ev.gpu} (rank {rank} event {row['index']}), "
                                        "expected NaN or a finite number >= 0")
        if isinstance(ev, Comm):
            d, src, where = row["duration"], row["cost_source"], f"(rank {rank} event {row['index']})"
            if src not in COST_SOURCES:
                raise CalibratedFormatError(file, "column 'cost_source'", f"is {src!r} {where}, expected one of "
                                            f"{', '.join(COST_SOURCES)}")
            if not (math.isfinite(d) and d >= 0):
                raise CalibratedFormatError(file, "column 'duration'", f"is {d} {where}, expected a finite number >= 0")
            key = op_key(rank, ev)
            new = OpCost("send/recv" if ev.is_p2p else ev.kind, ev.nbytes, d, src, row["cost_slice"])
            old = costs.setdefault(key, new)
            if (old.duration, old.source, old.slice) != (new.duration, new.source, new.slice):
                raise CalibratedFormatError(file, "column 'duration'", f"of op {key} differs between its members "
                                            f"({old} vs {new} at rank {rank})")
            costs[key] = OpCost(old.kind, max(old.nbytes, new.nbytes), d, src, old.slice)
        evs.append(ev)
    groups = {g["id"]: Group(g["id"], tuple(g["ranks"]), g["name"]) for g in manifest["groups"]}
    graph = Graph(groups, dict(events), str(path), [str(n) for n in manifest["notes"]])
    try:
        graph.validate()
    except GraphError as e:
        raise CalibratedFormatError(file, "events", f"do not form a valid graph: {e}") from None
    slices = [SliceProvenance(s["index"], tuple(s["ranks"]), s["device"], s["source"]) for s in manifest["slices"]]
    return CalibratedGraph(graph, costs, slices, manifest["trace"], manifest["cost"],
                           manifest["serialize_group_collectives"], manifest["created"])
