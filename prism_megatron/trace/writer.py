"""Write a PrismTrace directory atomically.

A trace is produced at the end of a long emulation run and consumed by calibration and reports;
a crash or a bad value must never leave something on disk that a reader mistakes for a finished
trace. So everything is validated first, written into a hidden sibling directory, fsynced, and
only then renamed into place; an existing trace is swapped out only after the new one is complete.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from .schema import (
    COLUMNS,
    DEFAULT_FILES,
    DEFAULTS,
    FORMAT,
    JSON_COLUMNS,
    MANIFEST_FILE,
    SCHEMAS,
    TABLE_NAMES,
    VERSION,
    TraceFormatError,
    check_manifest,
    check_references,
    check_table,
)

#: A table given as columns (name -> values), as rows (one mapping per row), or as an Arrow table.
TableData = Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Any]] | pa.Table | None

_ARROW_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, TypeError)


def fsync_dir(path: Path) -> None:
    """Make a rename durable; not every platform/filesystem allows opening a directory."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _to_disk(f: IO, durable: bool = True) -> None:
    """An open file's written bytes flushed and synced to the disk (nothing where ``durable`` is False)."""
    if durable:
        f.flush()
        os.fsync(f.fileno())


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Replace ``path`` with ``text`` so that readers see the old or the new file, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(6)}"
    try:
        with open(tmp, "w", encoding=encoding) as f:
            f.write(text)
            _to_disk(f)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def _json_text(value: Any) -> Any:
    """Let callers pass shapes/attrs as Python objects; store them as JSON text."""
    return value if isinstance(value, str) or value is None else json.dumps(value)


def _columns_from_rows(rows: Sequence[Any], name: str, where: Path) -> dict[str, list[Any]]:
    names = [c.name for c in COLUMNS[name]]
    known = set(names)
    if all(isinstance(row, Mapping) and row.keys() == known for row in rows):
        # every row names exactly the columns (the coordinator's, at every live snapshot): one pass per column
        return {n: [row[n] for row in rows] for n in names}
    columns: dict[str, list[Any]] = {n: [] for n in names}
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TraceFormatError(
                where, f"row {i}", f"is {type(row).__name__}, expected a mapping of column values"
            )
        defaults = DEFAULTS.get(name, {})
        for n in names:
            if n in row:
                columns[n].append(row[n])
            elif n in defaults:
                columns[n].append(defaults[n])
            else:
                raise TraceFormatError(where, f"column '{n}'", f"is missing in row {i}")
        extra = [k for k in row if k not in known]
        if extra:
            raise TraceFormatError(
                where, f"column '{extra[0]}'", f"(row {i}) is not a PrismTrace v{VERSION} {name} column"
            )
    return columns


def _to_table(data: TableData, name: str, where: Path) -> pa.Table:
    """Turn any accepted table form into an Arrow table with exactly the v1 schema."""
    schema = SCHEMAS[name]
    if data is None:
        return schema.empty_table()
    if isinstance(data, pa.Table):
        extra = [n for n in data.column_names if n not in schema.names]
        if extra:
            raise TraceFormatError(
                where, f"column '{extra[0]}'", f"is not a PrismTrace v{VERSION} {name} column"
            )
        columns = {n: data.column(n) for n in data.column_names}
    elif isinstance(data, Mapping):
        extra = [n for n in data if n not in schema.names]
        if extra:
            raise TraceFormatError(
                where, f"column '{extra[0]}'", f"is not a PrismTrace v{VERSION} {name} column"
            )
        columns = dict(data)
    elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        columns = _columns_from_rows(data, name, where)
    else:
        raise TraceFormatError(
            where, f"table '{name}'", f"is {type(data).__name__}, expected columns or rows"
        )

    arrays = []
    length = None
    for col in COLUMNS[name]:
        field = f"column '{col.name}'"
        if col.name not in columns and col.name in DEFAULTS.get(name, {}):
            rows = len(next(iter(columns.values()))) if columns else 0
            columns[col.name] = [DEFAULTS[name][col.name]] * rows
        if col.name not in columns:
            raise TraceFormatError(where, field, "is missing")
        values = columns[col.name]
        if not isinstance(values, (pa.Array, pa.ChunkedArray)):
            values = list(values)
        if length is None:
            length = len(values)
        elif len(values) != length:
            raise TraceFormatError(where, field, f"has {len(values)} values, other columns have {length}")
        try:
            if isinstance(values, (pa.Array, pa.ChunkedArray)):
                arrays.append(values.cast(col.type, safe=True))  # Arrow input: no round trip via Python
                continue
            if col.name in JSON_COLUMNS[name]:
                values = [_json_text(v) for v in values]
            arrays.append(pa.array(values, type=col.type))
        except (ValueError, *_ARROW_ERRORS) as e:
            raise TraceFormatError(where, field, f"cannot be stored as {col.type}: {e}") from e
    return check_table(pa.Table.from_arrays(arrays, schema=schema), name, where)


def _is_replaceable(path: Path) -> bool:
    """An existing path may be replaced only if it is an (old or broken) trace or an empty directory."""
    if path.is_symlink() or not path.is_dir():
        return False
    if not any(path.iterdir()):
        return True
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _check_destination(path: Path) -> None:
    if os.path.lexists(path) and not _is_replaceable(path):
        raise FileExistsError(
            f"trace {path}: exists and is not a PrismTrace directory; refusing to replace it"
        )


def _write_parquet(table: pa.Table, file: Path, durable: bool = True) -> None:
    with open(file, "wb") as f:
        pq.write_table(table, f)
        _to_disk(f, durable)


def swap_in_dir(tmp: Path, path: Path, durable: bool = True) -> None:
    """Rename the finished directory ``tmp`` to ``path``; an existing ``path`` is moved aside first and
    removed only after the rename succeeded (put back if it failed). Shared by every directory format.
    ``durable``: the renames reach the disk before it returns (False: atomic only, as ``write_directory``)."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
    else:
        aside = path.parent / f".{path.name}.old-{secrets.token_hex(6)}"
        os.rename(path, aside)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(aside, path)
            raise
        if durable:
            fsync_dir(path.parent)
        shutil.rmtree(aside, ignore_errors=True)
    if durable:
        fsync_dir(path.parent)


def write_directory(path: Path, tables: Mapping[str, pa.Table], manifest_name: str, manifest_text: str,
                    durable: bool = True) -> Path:
    """Write a table directory atomically: the tables, then the manifest (a manifest means complete),
    in a temp directory swapped in at ``path`` (``swap_in_dir``). Shared by PrismTrace and the
    calibrated graph; nothing is left behind on failure. ``durable`` (the default): every file and rename
    reaches the disk before it returns; False for a directory rewritten soon anyway (the coordinator's live
    snapshot, at every logged iteration), which readers still see whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{secrets.token_hex(6)}"
    tmp.mkdir()
    try:
        for name, table in tables.items():
            _write_parquet(table, tmp / name, durable)
        with open(tmp / manifest_name, "w", encoding="utf-8") as f:
            f.write(manifest_text)
            _to_disk(f, durable)
        if durable:
            fsync_dir(tmp)
        swap_in_dir(tmp, path, durable)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def write_trace(
    path: str | Path,
    manifest: Mapping[str, Any],
    ops: TableData,
    marks: TableData = None,
    slots: TableData = None,
    gpu: TableData = None,
    incomplete: str | None = None,
    durable: bool = True,
) -> Path:
    """Validate and atomically write a PrismTrace directory at ``path``; return ``path``.

    ``manifest`` needs ``world_size``, ``groups``, ``ranks`` (and optionally ``job`` and
    ``created``); ``format``, ``version``, ``complete`` and ``files`` are filled in here. Tables
    may be columns (dict of lists), rows (list of dicts) or Arrow tables; ``shapes``, ``attrs`` and
    ``syncs`` may be Python objects, stored as JSON. Raises TraceFormatError (naming file and field) before
    touching the disk if anything does not match the schema, and FileExistsError if ``path``
    exists but is not a trace. ``incomplete``: why the run this trace records did not end normally
    (the trace is then marked partial: ``complete`` false); None for a run that ended normally.
    ``durable``: as ``write_directory``'s (False: atomic, not flushed to the disk).
    """
    path = Path(path)
    if not path.name:
        raise ValueError(f"trace {path}: needs a directory name")
    manifest_path = path / MANIFEST_FILE
    if not isinstance(manifest, Mapping):
        raise TraceFormatError(
            manifest_path, "top level", f"is {type(manifest).__name__}, expected a mapping"
        )
    full = dict(manifest)
    if incomplete is not None and not (isinstance(incomplete, str) and incomplete):
        raise TraceFormatError(manifest_path, "manifest field 'incomplete'", f"is {incomplete!r}, expected a reason")
    full.update(format=FORMAT, version=VERSION, complete=incomplete is None, incomplete=incomplete,
                files=dict(DEFAULT_FILES))
    full.setdefault("created", datetime.now(timezone.utc).isoformat())
    full.setdefault("job", {})
    try:
        text = json.dumps(full, indent=2, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise TraceFormatError(manifest_path, "manifest", f"is not JSON-serialisable: {e}") from e
    # Validate what a reader will see (tuples become lists, and so on).
    full = json.loads(text)
    check_manifest(full, manifest_path)

    paths = {name: path / DEFAULT_FILES[name] for name in TABLE_NAMES}
    given = {"ops": ops, "marks": marks, "slots": slots, "gpu": gpu}
    tables = {name: _to_table(given[name], name, paths[name]) for name in TABLE_NAMES}
    check_references(full, tables, paths)
    _check_destination(path)

    return write_directory(path, {DEFAULT_FILES[name]: tables[name] for name in TABLE_NAMES}, MANIFEST_FILE, text,
                           durable)
