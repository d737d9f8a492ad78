"""The cluster profile a run costed communication with (the manifest's job key ``"cluster"``).

A run's report predicts with a cluster profile (a recipe's ``target.cluster`` or ``--prism-cluster``);
a report made later from the same trace must predict the same, so the run records the profile it
used: a shipped profile's name, or a profile file's absolute path (a report made from another
directory reads the same file), or null when it had none (communication free). Traces written
before the key existed lack it: their reports cost communication free, as they always did.

Placement needs no key of its own: a folded trace's ``job.fold.gpus_per_node`` and, otherwise, the
profile's node size are what the run's costing used, and both are read from the trace or profile.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .schema import MANIFEST_FILE, TraceFormatError

JOB_KEY = "cluster"


@dataclass(frozen=True)
class RecordedCluster:
    """What the run recorded: ``profile`` (a shipped name or a file's absolute path), or None when
    the run costed communication free."""

    profile: str | None


def read_recorded_cluster(manifest: dict[str, Any], trace_dir: str | Path = "<trace>") -> RecordedCluster | None:
    """The profile the run recorded; None when the trace records none (written before the key existed).
    Raises TraceFormatError naming the file and field for a value that is not a non-empty string or null."""
    job = manifest.get("job") or {}
    if not isinstance(job, dict) or JOB_KEY not in job:
        return None
    value = job[JOB_KEY]
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise TraceFormatError(Path(trace_dir) / MANIFEST_FILE, f"manifest field 'job.{JOB_KEY}'",
                               f"is {value!r}, expected a cluster profile's name or file (a non-empty string) "
                               "or null (communication free)")
    return RecordedCluster(value)
