"""Read and validate a PrismTrace directory.

Calibration, replay and reports work only from trace files, often written by another version of
this code; so a reader refuses anything it does not fully understand, with an error naming the
file and the field, instead of computing from a misread column.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .costing import RecordedCluster, read_recorded_cluster
from .fold import Fold, read_fold
from .microbatches import MicrobatchFold, read_microbatches
from .schema import (
    COLUMNS,
    DEFAULTS,
    MANIFEST_FILE,
    SCHEMAS,
    VERSION,
    TraceFormatError,
    check_manifest,
    check_references,
    check_table,
    incomplete_reason,
    tables_of,
)


@dataclass
class PrismTrace:
    """A validated trace: its manifest and its tables (columns exactly as in ``schema``; the gpu
    table of a v1/v2 trace is empty)."""

    path: Path
    manifest: dict[str, Any]
    ops: pa.Table
    marks: pa.Table
    slots: pa.Table
    gpu: pa.Table = field(default_factory=SCHEMAS["gpu"].empty_table)
    #: the fold (job key "fold"): which ranks ran for real and whom the others mirror; None: all ran
    fold: Fold | None = None
    #: the micro-batch fold (job key "microbatches"): m_c of the target's M ran per iteration; None: all ran
    microbatches: MicrobatchFold | None = None
    #: the cluster profile the run costed communication with (job key "cluster"); None: not recorded
    cluster: RecordedCluster | None = None
    # ops sorted by (rank, index) and each rank's [start, stop) rows in it, built on first use so
    # that walking all ranks is O(rows) rather than O(ranks * rows).
    _ops_by_rank: tuple[pa.Table, dict[int, tuple[int, int]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def incomplete(self) -> str | None:
        """Why the run this trace records did not end normally (a partial record), or None."""
        return incomplete_reason(self.manifest)

    @property
    def real_ranks(self) -> list[int]:
        """The ranks that ran (and have rows): the fold's live ranks, or every rank."""
        return list(self.fold.live) if self.fold is not None else list(range(self.world_size))

    def groups(self) -> dict[int, dict[str, Any]]:
        """Process groups by id."""
        return {g["id"]: g for g in self.manifest["groups"]}

    def ops_for_rank(self, rank: int) -> list[dict[str, Any]]:
        """Rank ``rank``'s ops as dicts, in order of issue (by ``index``)."""
        if self._ops_by_rank is None:
            ordered = self.ops.sort_by([("rank", "ascending"), ("index", "ascending")])
            spans: dict[int, tuple[int, int]] = {}
            start = 0
            for item in pc.value_counts(ordered.column("rank")).to_pylist():
                spans[item["values"]] = (start, start + item["counts"])
                start += item["counts"]
            self._ops_by_rank = (ordered, spans)
        ordered, spans = self._ops_by_rank
        start, stop = spans.get(rank, (0, 0))
        return ordered.slice(start, stop - start).to_pylist()


def _v1_slots(table: pa.Table) -> pa.Table:
    """A v1 slots table with v2's compute_clock: v1's clock was cumulative slot-holding time."""
    if "compute_clock" in table.column_names or not {"rank", "t_grant", "t_release"} <= set(table.column_names):
        return table  # check_table names what is missing
    rows = table.to_pylist()
    clock: dict[int, float] = {}
    values = [0.0] * len(rows)
    for i in sorted(range(len(rows)), key=lambda i: (rows[i]["rank"], rows[i]["t_grant"])):
        r = rows[i]
        clock[r["rank"]] = clock.get(r["rank"], 0.0) + max(r["t_release"] - r["t_grant"], 0.0)
        values[i] = clock[r["rank"]]
    return table.append_column("compute_clock", pa.array(values, pa.float64()))


def _with_defaults(table: pa.Table, name: str) -> pa.Table:
    """Optional columns (schema.DEFAULTS) a table lacks, filled with their default: older writers
    (and v1/v2 traces) did not record them."""
    for column, value in DEFAULTS.get(name, {}).items():
        if column not in table.column_names:
            kind = next(c.type for c in COLUMNS[name] if c.name == column)
            table = table.append_column(column, pa.array([value] * table.num_rows, kind))
    return table


def _read_table(file: Path, name: str, manifest_path: Path, version: int = VERSION) -> pa.Table:
    if not file.is_file():
        raise TraceFormatError(
            file, "file", f"is missing (named by manifest field 'files.{name}' in {manifest_path})"
        )
    try:
        with pq.ParquetFile(file) as pf:  # one file, no dataset discovery or partition guessing
            table = pf.read()
    except (pa.ArrowException, OSError) as e:
        raise TraceFormatError(file, "file", f"is not a readable Parquet file ({name} table): {e}") from e
    if name == "slots" and version == 1:
        table = _v1_slots(table)
    table = _with_defaults(table, name)
    return check_table(table, name, file)


def read_trace(path: str | Path) -> PrismTrace:
    """Open the trace directory at ``path``; raise TraceFormatError if it is not a complete v1/v2/v3 trace."""
    path = Path(path)
    if not path.exists():
        raise TraceFormatError(path, "directory", "does not exist")
    if not path.is_dir():
        raise TraceFormatError(path, "directory", "is not a directory (a PrismTrace is a directory)")
    manifest_path = path / MANIFEST_FILE
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TraceFormatError(manifest_path, "file", "is missing: not a PrismTrace directory") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFormatError(manifest_path, "file", f"cannot be read: {e}") from e
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceFormatError(
            manifest_path, "JSON", f"is invalid at line {e.lineno} column {e.colno}: {e.msg}"
        ) from None
    check_manifest(manifest, manifest_path)

    names = tables_of(manifest["version"])
    paths = {name: path / manifest["files"][name] for name in names}
    tables = {name: _read_table(paths[name], name, manifest_path, manifest["version"]) for name in names}
    check_references(manifest, tables, paths)
    fold = read_fold(manifest, path)
    if fold is not None:
        _check_live_rows(fold, tables, paths)
    microbatches = read_microbatches(manifest, path)
    return PrismTrace(path=path, manifest=manifest, fold=fold, microbatches=microbatches,
                      cluster=read_recorded_cluster(manifest, path), **tables)


def _check_live_rows(fold: Fold, tables: dict[str, pa.Table], paths: dict[str, Path]) -> None:
    """A folded trace's tables hold live ranks' rows only (a virtual rank has no process)."""
    live = pa.array(fold.live, pa.int32())
    for name, table in tables.items():
        bad = pc.filter(table.column("rank"), pc.invert(pc.is_in(table.column("rank"), value_set=live)))
        if len(bad):
            raise TraceFormatError(paths[name], "column 'rank'",
                                   f"contains {bad[0].as_py()}, a virtual rank of the fold (live: job.fold.live)")
