"""Turn the coordinator's records into a PrismTrace (the bare graph) on disk."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from pathlib import Path

from prism_megatron.runtime.governor import MemoryGovernor
from prism_megatron.runtime.groups import GroupTable
from prism_megatron.runtime.ranks import RankState
from prism_megatron.runtime.recorder import Recorder
from prism_megatron.trace import write_trace

_OP_COLUMNS = ("rank", "index", "kind", "group", "seq", "peer", "root", "bytes", "dtype", "shapes", "reduce_op",
               "async_op", "t_issue", "t_complete", "compute_before", "label", "splits", "payload",
               "t_wait", "wait_clock")


def _runtime(rs: RankState | None) -> dict:
    return {"runtime_s": rs.runtime_s} if rs is not None and rs.runtime_s else {}


def write_bare_trace(path: Path, job: dict, exit_codes: dict, *, world_size: int, recorder: Recorder,
                     groups: GroupTable, ranks: dict[int, RankState], governor: MemoryGovernor,
                     device_name: Callable[[int], str], live: list[int] | None = None,
                     incomplete: str | None = None, durable: bool = True) -> Path:
    """Write every op, marker and slot grant the coordinator saw; atomic (see trace.writer).
    ``device_name(rank)``: the device the rank ran on. ``live``: a folded job's live ranks (the only
    ranks with rows; its groups keep their full rank lists and ``job.fold`` says whom the others mirror).
    ``incomplete``: why the run did not end normally. ``durable``: as ``trace.write_trace``'s."""
    ops = []
    for rec in recorder.ops:
        # the fields read directly: ``dataclasses.asdict`` deep-copies each record, and the live prediction
        # writes every record so far at each logged iteration
        row = {k: getattr(rec, k) for k in _OP_COLUMNS}
        # encoded here, once, rather than per op in the coordinator's loop
        row["splits"] = json.dumps(list(rec.splits)) if rec.splits else ""
        row["payload"] = json.dumps([base64.b64encode(b).decode("ascii") for b in rec.payload]) if rec.payload else ""
        if math.isnan(row["t_complete"]):
            row["t_complete"] = row["t_issue"]  # never completed (fire-and-forget send at exit)
        ops.append(row)
    job = dict(job)  # the launcher's, with what only the coordinator knows
    if governor.memory is not None:
        job["swap"] = governor.swap_stats()
        swapper = governor.memory[0].swapper
        job["swapper"] = swapper.name  # who moved the state: runtime.swap
        if getattr(swapper, "copied", None):  # in-process swaps copy only the blocks in use
            job["swap_copied"] = {str(r): b for r, b in sorted(swapper.copied.items())}
            job["swap_split"] = {str(r): {"copy_s": c, "map_s": m, "pin_s": pin}
                                 for r, (c, m, pin) in sorted(swapper.split.items())}
            if swapper.pin_error is not None:
                job["swap_page_lock_error"] = swapper.pin_error
        if getattr(swapper, "compacted", None):  # the host region's extents slid together to fit one more
            job["swap_region_compacted"] = [{"bytes": b, "seconds": t} for b, t in swapper.compacted]
        job["admission"] = dict(governor.admissions)  # turns admitted by own peak, class peak, or the bound
        if any(governor.retried.values()):  # allocations that found the device full mid-turn
            job["full_device_allocations"] = {"retried": governor.retried[True], "failed": governor.retried[False]}
        if governor.host_need is not None:
            job["host_memory_need"] = governor.host_need
    if governor.timing_gated:
        job["gpu_timing_by_device"] = governor.timing_verdicts()
    if governor.footprint_check is not None:
        job["footprint_check"] = governor.footprint_check.summary()
    manifest = {
        "world_size": world_size,
        "job": job,
        "groups": [{"id": g.id, "name": g.name, "ranks": g.ranks, "backend": g.backend} for g in groups],
        "ranks": [{"rank": r, "exit_code": exit_codes.get(str(r), exit_codes.get(r)),
                   "device": device_name(r), **_runtime(ranks.get(r))}
                  for r in (range(world_size) if live is None else live)],
    }
    return write_trace(path, manifest, ops=ops, marks=recorder.marks, slots=recorder.slot_log, gpu=recorder.gpu_rows,
                       incomplete=incomplete, durable=durable)
