"""One trace from the captures of a serial run: what a capture of the fold's live ranks together records.

A serial run (``--prism-fold-capture serial``) captures each live rank of a fold alone; each capture's
trace holds that rank's rows, the groups it declared and a one-rank fold (``job.fold.capture.part``).
The merged trace holds every capture's rows, the union of their groups and the fold captured together
(its plan, contributions summed over the captures, and ``job.fold.capture``: mode serial, one entry per
capture saying where its trace is and whether it completed, and the rules that answered for the sandbox
members that were virtual). Replay and reports read it as a fold captured together.

Groups line up across captures by what they are, not by id: a group is (name, member ranks, k) where k
counts earlier groups of the same name and members in the capture (a re-made group's incarnations). A
rank declares every group it is a member of in every capture it runs in, so the k-th incarnation of a
group is the same group in each capture that has it, as in a capture together. Ops keep their sequence
numbers: a collective's is its member's count of earlier ops on the group and a p2p's the count per
(group, sender, receiver), which a rank reaches alone as it does beside the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .fold import CONTRIBUTION_WAYS, SERIAL_RULES
from .reader import PrismTrace, read_trace
from .schema import TraceFormatError
from .writer import write_trace

__all__ = ["merge_captures", "group_key"]


def group_key(trace: PrismTrace) -> dict[int, tuple]:
    """Group id -> (name, member ranks, incarnation): what a group is, the same in every capture."""
    seen: dict[tuple, int] = {}
    out = {}
    for g in sorted(trace.manifest["groups"], key=lambda g: g["id"]):
        base = (g["name"], tuple(g["ranks"]))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out[g["id"]] = (*base, k)
    return out


def merge_captures(out: str | Path, plan: Mapping[str, Any], captures: Sequence[Mapping[str, Any]],
                   relative_to: str | Path | None = None, second_pass: Mapping[str, Any] | None = None) -> Path:
    """Write the merged trace of a serial run at ``out``: ``plan`` the fold's JSON as captured together,
    ``captures`` one entry per live rank, in capture order: {"rank", "trace": its trace directory (None:
    it wrote none), "incomplete": None, or why it did not complete, and optionally "second_pass": "taken" or
    "skipped" and "reused": True (an earlier run's trace, ``--prism-fold-resume``)}; ``second_pass``: the run's
    decision on SECOND_PASS_RULE's second pass (``fold.SECOND_PASS_FIELDS``; each capture's
    ``standins_unrecorded`` and ``reductions_unrecorded`` come from its trace). Partial when a capture did not
    complete (``incomplete`` names it); TraceFormatError when a capture's trace does not belong to this fold
    (another world size, another live rank)."""
    out = Path(out)
    base = Path(relative_to) if relative_to is not None else out.parent
    traces: list[tuple[Mapping[str, Any], PrismTrace | None]] = []
    for c in captures:
        t = read_trace(c["trace"]) if c.get("trace") is not None else None
        if t is not None:
            _check_part(t, plan, int(c["rank"]))
        traces.append((c, t))
    ids: dict[tuple, int] = {}
    groups: list[dict[str, Any]] = []
    tables: dict[str, list[pa.Table]] = {"ops": [], "marks": [], "slots": [], "gpu": []}
    ranks: list[dict[str, Any]] = []
    contributions: dict[str, dict[str, int]] = {}
    jobs: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (the capture's record entry, its job)
    record = []
    for c, t in traces:
        reason = c.get("incomplete")
        record.append({"rank": int(c["rank"]),
                       "trace": "" if c.get("trace") is None else _relative(Path(c["trace"]), base),
                       "complete": reason is None, "incomplete": reason})
        if c.get("second_pass") is not None:
            record[-1]["second_pass"] = c["second_pass"]
        if c.get("reused"):
            record[-1]["reused"] = True
        if t is None:
            continue
        part = t.fold.capture.get("part") or {}
        for key in ("standins_unrecorded", "reductions_unrecorded"):
            if key in part:
                record[-1][key] = int(part[key])
        remap, keys = {}, group_key(t)
        for g in sorted(t.manifest["groups"], key=lambda g: g["id"]):
            key = keys[g["id"]]
            if key not in ids:
                ids[key] = len(groups)
                groups.append({**g, "id": ids[key]})
            remap[g["id"]] = ids[key]
        ops = t.ops
        if ops.num_rows:
            old = ops.column("group")
            new = pa.array([remap[x] for x in old.to_pylist()], pa.int32())
            at = ops.schema.get_field_index("group")  # its field kept (not null): a capture with no ops has it
            ops = ops.set_column(at, ops.schema.field(at), new)
        tables["ops"].append(ops)
        for name in ("marks", "slots", "gpu"):
            tables[name].append(getattr(t, name))
        ranks += t.manifest["ranks"]
        for kind, ways in t.fold.contributions.items():
            row = contributions.setdefault(kind, dict.fromkeys(CONTRIBUTION_WAYS[:4], 0))
            for way, n in ways.items():
                row[way] = row.get(way, 0) + n
        jobs.append((record[-1], dict(t.manifest.get("job") or {})))
    if not jobs:
        raise TraceFormatError(out, "captures", "wrote no trace: nothing to merge")
    job = _merged_job(jobs)
    job["fold"] = {**{k: v for k, v in plan.items() if k != "capture"}, "contributions": contributions,
                   "capture": {"mode": "serial", "rules": dict(SERIAL_RULES), "captures": record}}
    if second_pass is not None:
        job["fold"]["capture"]["second_pass"] = dict(second_pass)
    failed = [f"capture {i + 1} of {len(record)} (rank {r['rank']}): {r['incomplete']}"
              for i, r in enumerate(record) if not r["complete"]]
    manifest = {"world_size": int(plan["world_size"]), "job": job, "groups": groups,
                "ranks": sorted(ranks, key=lambda r: r["rank"])}
    merged = {name: pa.concat_tables(parts) if parts else None for name, parts in tables.items()}
    if merged["ops"] is not None and merged["ops"].num_rows:
        merged["ops"] = merged["ops"].sort_by([("rank", "ascending"), ("index", "ascending")])
    return write_trace(out, manifest, ops=merged["ops"], marks=merged["marks"], slots=merged["slots"],
                       gpu=merged["gpu"], incomplete="; ".join(failed) if failed else None)


def _check_part(t: PrismTrace, plan: Mapping[str, Any], rank: int) -> None:
    """A capture's trace is one capture of this fold: its world size, its one live rank ``rank``."""
    part = (t.fold.capture.get("part") if t.fold is not None else None) or {}
    if t.world_size != int(plan["world_size"]) or part.get("rank") != rank or part.get("sandbox") != list(plan["live"]):
        raise TraceFormatError(t.path, "manifest field 'job.fold.capture.part'",
                               f"is {part or None!r}: not the capture of rank {rank} of a fold of "
                               f"{plan['world_size']} ranks with live ranks {list(plan['live'])}")
    bad = pc.filter(t.ops.column("rank"), pc.not_equal(t.ops.column("rank"), rank)) if t.ops.num_rows else []
    if len(bad):
        raise TraceFormatError(t.path, "column 'rank'", f"contains {bad[0].as_py()}: a capture holds rank {rank}'s "
                                                        "rows only")


def _merged_job(jobs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """The captures' job keys they agree on; a key they record differently (their own swaps, admissions,
    checks) goes to each capture's record entry (its "job") instead."""
    keys = {k for _, j in jobs for k in j if k != "fold"}
    first = jobs[0][1]
    same = {k for k in keys if all(k in j and j[k] == first[k] for _, j in jobs)}
    for entry, j in jobs:
        own = {k: j[k] for k in sorted(keys - same) if k in j}
        if own:
            entry["job"] = own
    return {k: first[k] for k in sorted(same)}


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path)
