"""Two traces compared with their times left out: what a change that must not alter a run's content (a
faster path, a switch) is checked by. Ops and marks are compared per rank in issue order (ranks' rows
interleave, and group ids are numbered, as messages happened to arrive), each op's group by its name and ranks."""

from __future__ import annotations

import pyarrow as pa

from .reader import PrismTrace
from .schema import TIME_COLUMNS

__all__ = ["untimed_differences"]


def _groups(trace: PrismTrace) -> list:
    return sorted((g["name"], g["ranks"], g.get("backend")) for g in trace.manifest["groups"])


def _ops(trace: PrismTrace) -> pa.Table:
    cols = [c for c in trace.ops.column_names if c not in TIME_COLUMNS["ops"]]
    key = {g["id"]: f"{g['name']} {g['ranks']}" for g in trace.manifest["groups"]}
    table = trace.ops.select(cols).sort_by([("rank", "ascending"), ("index", "ascending")])
    named = pa.array([key[i] for i in table.column("group").to_pylist()], pa.string())
    return table.set_column(table.column_names.index("group"), "group", named)


def _marks(trace: PrismTrace) -> pa.Table:  # each rank's marks in order (a stable sort)
    return trace.marks.drop(list(TIME_COLUMNS["marks"])).sort_by([("rank", "ascending")])


def untimed_differences(a: PrismTrace, b: PrismTrace) -> list[str]:
    """The parts ('ops', 'marks', 'groups') in which ``a`` and ``b`` differ once times are left out."""
    out = []
    if a.ops.num_rows != b.ops.num_rows or not _ops(a).equals(_ops(b)):
        out.append("ops")
    if not _marks(a).equals(_marks(b)):
        out.append("marks")
    if _groups(a) != _groups(b):
        out.append("groups")
    return out
