"""Turn the coordinator's records into a PrismTrace (the bare graph) on disk."""

from __future__ import annotations

import base64
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prism_megatron.trace import write_trace

_OP_COLUMNS = ("rank", "index", "kind", "group", "seq", "peer", "root", "bytes", "dtype", "shapes", "reduce_op",
               "async_op", "t_issue", "t_complete", "compute_before", "label", "splits", "payload")


def _runtime(coord: Any, rank: int) -> dict:
    rs = coord.ranks.get(rank)
    return {"runtime_s": rs.runtime_s} if rs is not None and rs.runtime_s else {}


def write_bare_trace(coord: Any, path: Path, job: dict, exit_codes: dict) -> Path:
    """Write every op, marker and slot grant the coordinator saw; atomic (see trace.writer)."""
    ops = []
    for rec in coord.ops:
        row = {k: v for k, v in asdict(rec).items() if k in _OP_COLUMNS}
        # encoded here, once, rather than per op in the coordinator's loop
        row["splits"] = json.dumps(list(rec.splits)) if rec.splits else ""
        row["payload"] = json.dumps([base64.b64encode(b).decode("ascii") for b in rec.payload]) if rec.payload else ""
        if math.isnan(row["t_complete"]):
            row["t_complete"] = row["t_issue"]  # never completed (fire-and-forget send at exit)
        ops.append(row)
    job = dict(job)  # the launcher's, with what only the coordinator knows
    if coord.memory is not None:
        job["swap"] = coord.swap_stats()
    if coord.timing_gated:
        job["gpu_timing_by_device"] = coord.timing_verdicts()
    if coord.footprint_check is not None:
        job["footprint_check"] = coord.footprint_check.summary()
    manifest = {
        "world_size": coord.world_size,
        "job": job,
        "groups": [{"id": g.id, "name": g.name, "ranks": g.ranks, "backend": g.backend}
                   for g in sorted(coord.groups_by_id.values(), key=lambda g: g.id)],
        "ranks": [{"rank": r, "exit_code": exit_codes.get(str(r), exit_codes.get(r)),
                   "device": coord.device_names[coord.slots.device_of(r)], **_runtime(coord, r)}
                  for r in range(coord.world_size)],
    }
    return write_trace(path, manifest, ops=ops, marks=coord.marks, slots=coord.slot_log, gpu=coord.gpu_rows)
