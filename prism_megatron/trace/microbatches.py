"""The micro-batch fold of a trace: how many micro-batches ran per iteration, how many the target runs.

A target iteration runs M micro-batches per pipeline; under Megatron's non-interleaved schedules
(1F1B, and no pipelining at PP1) the micro-batches between the warm-up and the last one do the same
work on the same shapes. A micro-batch-folded run (``--prism-fold-microbatches``) captures only m_c
of them per iteration and replay gives every rank the target's M (replay.microbatch_fold): the units
(``forward``/``backward`` spans) of micro-batch i are the captured ones for i < m_c - 1, copies of the
steady micro-batch m_c - 2 for i in [m_c - 1, M - 1), and the captured last micro-batch's for i = M - 1
(it carries the data-parallel gradient reduction hooks; micro-batch 0 the parameter gathers).

The runtime records the fold in the manifest's job key ``"microbatches"``: ``version``, ``target``
(M), ``captured`` (m_c), ``rule`` (:data:`RULES`), ``schedule`` ("1f1b" or "no_pipelining") and
``warmup`` (Megatron's warm-up forwards per pipeline rank, before its cap at M, as the fold plan
records them). A trace without the key ran every micro-batch. :func:`read_microbatches` checks the
record as strictly as the rest of the trace (errors name the file and the field).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .schema import MANIFEST_FILE, TraceFormatError

#: Record versions this reader understands.
MICROBATCH_FOLD_VERSIONS: tuple[int, ...] = (1,)
#: How the micro-batches that did not run are made: "steady-copy" (see the module docstring).
RULES: tuple[str, ...] = ("steady-copy",)
#: The schedules a micro-batch fold applies to (Megatron's non-interleaved ones).
SCHEDULES: tuple[str, ...] = ("no_pipelining", "1f1b")


def minimum_captured(warmup: tuple[int, ...] | list[int]) -> int:
    """The fewest micro-batches per iteration that keep every stage's schedule and peak memory: each
    stage's full warm-up, one steady forward/backward pair, and the first and the last micro-batch as
    their own units: max(warm-up) + 2, and 3 without pipelining (first, one steady, last)."""
    return max(max(warmup, default=0) + 2, 3)


@dataclass(frozen=True)
class MicrobatchFold:
    """A micro-batch fold: ``captured`` of ``target`` micro-batches ran per iteration."""

    target: int
    captured: int
    schedule: str
    warmup: tuple[int, ...]
    rule: str = RULES[0]

    @property
    def copied(self) -> int:
        """The captured micro-batch whose units stand for the ones that did not run."""
        return self.captured - 2

    def source(self, microbatch: int) -> int:
        """The captured micro-batch whose units target micro-batch ``microbatch`` replays."""
        if microbatch < self.captured - 1:
            return microbatch
        return self.captured - 1 if microbatch == self.target - 1 else self.copied

    def describe(self) -> str:
        """The provenance sentence."""
        extra = self.target - self.captured
        return (f"micro-batches: {self.captured} of {self.target} run per iteration; {extra} replayed as copies of "
                f"micro-batch {self.copied}'s forward/backward")

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``job.microbatches`` value."""
        return {"version": 1, "target": self.target, "captured": self.captured, "rule": self.rule,
                "schedule": self.schedule, "warmup": list(self.warmup)}


def _error(path: str | Path, key: str, problem: str) -> TraceFormatError:
    return TraceFormatError(path, f"manifest field 'job.microbatches.{key}'", problem)


def parse_microbatches(doc: Any, path: str | Path) -> MicrobatchFold:
    """Check a ``job.microbatches`` value; raise TraceFormatError naming the field."""
    if not isinstance(doc, dict):
        raise TraceFormatError(path, "manifest field 'job.microbatches'",
                               f"is {type(doc).__name__}, expected an object")
    version = doc.get("version")
    if isinstance(version, bool) or version not in MICROBATCH_FOLD_VERSIONS:
        raise _error(path, "version", f"is {version!r}; this reader supports version(s) "
                                      f"{', '.join(map(str, MICROBATCH_FOLD_VERSIONS))}")
    if doc.get("rule") not in RULES:
        raise _error(path, "rule", f"is {doc.get('rule')!r}, expected one of {', '.join(RULES)}")
    if doc.get("schedule") not in SCHEDULES:
        raise _error(path, "schedule", f"is {doc.get('schedule')!r}, expected one of {', '.join(SCHEDULES)}")
    warmup = doc.get("warmup")
    if (not isinstance(warmup, list) or not warmup
            or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in warmup)):
        raise _error(path, "warmup", f"is {warmup!r}, expected a non-empty list of integers >= 0 (one per pipeline "
                                     "rank)")
    least = minimum_captured(warmup)
    captured, target = doc.get("captured"), doc.get("target")
    if isinstance(captured, bool) or not isinstance(captured, int) or captured < least:
        raise _error(path, "captured", f"is {captured!r}, expected an integer >= {least} (max warm-up + 2, at least 3)")
    if isinstance(target, bool) or not isinstance(target, int) or target < captured:
        raise _error(path, "target", f"is {target!r}, expected an integer >= captured ({captured})")
    return MicrobatchFold(target, captured, doc["schedule"], tuple(warmup), doc["rule"])


def read_microbatches(manifest: dict[str, Any], trace_dir: str | Path = "<trace>") -> MicrobatchFold | None:
    """The micro-batch fold of a trace's manifest; None when every micro-batch ran."""
    job = manifest.get("job") or {}
    if not isinstance(job, dict) or job.get("microbatches") is None:
        return None
    return parse_microbatches(job["microbatches"], Path(trace_dir) / MANIFEST_FILE)
