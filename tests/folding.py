"""Fold a full trace the way the runtime folds a run: keep the live ranks' rows, record ``job.fold``.

A folded run writes only its live ranks' rows and the fold plan (the manifest's groups keep their
full rank lists); folding a full trace of a symmetric job gives the same file, which is how tests
check that synthesis rebuilds the full job.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from prism_megatron.trace import read_trace, write_trace
from prism_megatron.trace.fold import FoldClass, make_fold


def fold_trace(src: str | Path, dst: str | Path, rep: Sequence[int], gpus_per_node: int = 8,
               classes: Sequence[FoldClass] = (), class_of: Sequence[int] = (),
               contributions: dict[str, dict[str, int]] | None = None, **v2: Any) -> Path:
    """Write at ``dst`` the trace ``src`` folded to the ranks of ``rep`` (rep[r]: whom rank r mirrors);
    ``v2``: depth, axes, sizes, coords of a version-2 plan."""
    trace = read_trace(src)
    fold = make_fold(rep, gpus_per_node, classes, class_of, contributions, **v2)
    live = pa.array(fold.live, pa.int32())

    def keep(table: pa.Table) -> pa.Table:
        return table.filter(pc.is_in(table.column("rank"), value_set=live))

    manifest = {key: trace.manifest[key] for key in ("world_size", "groups", "created")}
    manifest["job"] = {**trace.manifest["job"], "fold": fold.to_json()}
    manifest["ranks"] = [e for e in trace.manifest["ranks"] if e["rank"] in set(fold.live)]
    return write_trace(dst, manifest, keep(trace.ops), keep(trace.marks), keep(trace.slots), keep(trace.gpu))
