"""The micro-batch fold of a trace: how many micro-batches ran per iteration, how many the target runs.

A target iteration runs M micro-batches per pipeline; under Megatron's non-interleaved schedules
(1F1B, and no pipelining at PP1) the micro-batches between the warm-up and the last one do the same
work on the same shapes. A micro-batch-folded run (``--prism-fold-microbatches``) captures only m_c
of them per iteration and replay gives every rank the target's M (replay.microbatch_fold): the units
(``forward``/``backward`` spans) of micro-batch i are the captured ones for i < m_c - 1, copies of the
steady micro-batch m_c - 2 for i in [m_c - 1, M - 1), and the captured last micro-batch's for i = M - 1
(it carries the data-parallel gradient reduction hooks; micro-batch 0 the parameter gathers).

Under Megatron's interleaved schedule (``forward_backward_pipelining_with_interleaving``: ``chunks``
model chunks per stage, micro-batches in groups of ``group``, Megatron's
``microbatch_group_size_per_vp_stage``, each group through every chunk in turn) a stage runs T = M·chunks
units per direction; its order of units and p2p calls is periodic in a group's U = chunks·group units
wherever the groups are full. The capture runs m_c = M - x·group micro-batches (the same last group,
so Megatron's rules on M hold for m_c as for M: group <= M, remainder of M by group 0 or >= PP) and
replay inserts x copies of one period of each stage's steady pairs (forward W + k, backward k, W its
warm-up): at pair ``interleaved_cut`` k0 the target repeats the captured pairs [k0 - U, k0) x times,
then continues as the capture did (rule "steady-group-copy"). The copied pairs avoid what is not alike:
the first steady pair (no earlier send to wait for), the last (no next input to receive), the forwards
of the first group (micro-batch 0's parameter syncs) and the backwards of the last group (micro-batch
M - 1's gradient syncs). Peak memory is the target's: a stage holds W + 1 units' activations at each
steady pair, and which chunks they belong to depends only on the pair's place in the period, so every
set of activations the target holds at once, the capture held too (the warm-up and cool-down are the
same programs).

The runtime records the fold in the manifest's job key ``"microbatches"``: ``version``, ``target``
(M), ``captured`` (m_c), ``rule`` (:data:`RULES`), ``schedule`` (:data:`SCHEDULES`) and ``warmup``
(Megatron's warm-up forwards per pipeline rank, before its cap at M, as the fold plan records them);
version 2 adds, for schedule "interleaved", ``chunks``, ``group``, ``overlap_p2p`` (``overlap_p2p_comm``)
and ``wait_sends`` (each steady forward's send waited at once, megatron-core 0.19), from which replay
computes the orders (replay.stage_schedule.interleaved_steps). A trace without the key ran every
micro-batch. :func:`read_microbatches` checks the record as strictly as the rest of the trace (errors
name the file and the field).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .schema import MANIFEST_FILE, TraceFormatError

#: Record versions this reader understands (2: schedule "interleaved" with its chunks and group).
MICROBATCH_FOLD_VERSIONS: tuple[int, ...] = (1, 2)
#: How the micro-batches that did not run are made, per schedule (see the module docstring).
RULES: dict[str, str] = {"no_pipelining": "steady-copy", "1f1b": "steady-copy", "interleaved": "steady-group-copy"}
#: The schedules a micro-batch fold applies to.
SCHEDULES: tuple[str, ...] = tuple(RULES)


def minimum_captured(warmup: tuple[int, ...] | list[int]) -> int:
    """The fewest micro-batches per iteration that keep every stage's schedule and peak memory under a
    non-interleaved schedule: each stage's full warm-up, one steady forward/backward pair, and the first
    and the last micro-batch as their own units: max(warm-up) + 2, and 3 without pipelining (first, one
    steady, last)."""
    return max(max(warmup, default=0) + 2, 3)


def interleaved_cut(warmup: int, chunks: int, group: int, microbatches: int) -> int | None:
    """The steady pair k0 of a stage (``warmup``: its warm-up before the cap) whose period [k0 - U, k0) of
    pairs stands for inserted groups when the interleaved program at ``microbatches`` is expanded (see
    the module docstring); None where the program has no such period."""
    u, t = chunks * group, microbatches * chunks
    groups = -(-microbatches // group)
    full = t if microbatches % group == 0 else (groups - 1) * u  # units in full groups
    w = min(warmup, t)
    k0 = max(u + 1, 2 * u - w)  # not the first pair; forwards past the first group
    if k0 + w > min(full, t - 1) or k0 > (groups - 1) * u:  # forwards in full groups, not the last pair;
        return None  # backwards before the last group
    return k0


def minimum_interleaved(warmup: tuple[int, ...] | list[int], chunks: int, group: int, target: int) -> int:
    """The fewest micro-batches per iteration, target - x·group, whose interleaved program every stage can
    expand to the target's (:func:`interleaved_cut`); ``target`` itself where none is fewer."""
    least = group + target % group
    for m in range(least, target, group):
        if all(interleaved_cut(w, chunks, group, m) is not None for w in warmup):
            return m
    return target


@dataclass(frozen=True)
class MicrobatchFold:
    """A micro-batch fold: ``captured`` of ``target`` micro-batches ran per iteration."""

    target: int
    captured: int
    schedule: str
    warmup: tuple[int, ...]
    rule: str = ""  # "": the schedule's (RULES)
    chunks: int = 1  # interleaved: model chunks per stage
    group: int = 1  # interleaved: microbatch_group_size_per_vp_stage
    overlap_p2p: bool = False  # interleaved: overlap_p2p_comm
    wait_sends: bool = False  # interleaved with overlap: each steady forward's send waited at once

    def __post_init__(self) -> None:
        if not self.rule:
            object.__setattr__(self, "rule", RULES.get(self.schedule, ""))

    @property
    def interleaved(self) -> bool:
        return self.schedule == "interleaved"

    @property
    def copied(self) -> int:
        """The captured micro-batch whose units stand for the ones that did not run (non-interleaved)."""
        return self.captured - 2

    def source(self, microbatch: int) -> int:
        """The captured micro-batch whose units target micro-batch ``microbatch`` replays (non-interleaved)."""
        if microbatch < self.captured - 1:
            return microbatch
        return self.captured - 1 if microbatch == self.target - 1 else self.copied

    def describe(self) -> str:
        """The provenance sentence."""
        extra = self.target - self.captured
        if self.interleaved:
            return (f"micro-batches: {self.captured} of {self.target} run per iteration (interleaved, {self.chunks} "
                    f"chunks, groups of {self.group}); {extra} replayed as {extra // self.group} copies of a steady "
                    "group's forward/backward units in every chunk")
        return (f"micro-batches: {self.captured} of {self.target} run per iteration; {extra} replayed as copies of "
                f"micro-batch {self.copied}'s forward/backward")

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``job.microbatches`` value."""
        doc = {"version": 2 if self.interleaved else 1, "target": self.target, "captured": self.captured,
               "rule": self.rule, "schedule": self.schedule, "warmup": list(self.warmup)}
        if self.interleaved:
            doc.update(chunks=self.chunks, group=self.group, overlap_p2p=self.overlap_p2p, wait_sends=self.wait_sends)
        return doc


def _error(path: str | Path, key: str, problem: str) -> TraceFormatError:
    return TraceFormatError(path, f"manifest field 'job.microbatches.{key}'", problem)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_microbatches(doc: Any, path: str | Path) -> MicrobatchFold:
    """Check a ``job.microbatches`` value; raise TraceFormatError naming the field."""
    if not isinstance(doc, dict):
        raise TraceFormatError(path, "manifest field 'job.microbatches'",
                               f"is {type(doc).__name__}, expected an object")
    version = doc.get("version")
    if isinstance(version, bool) or version not in MICROBATCH_FOLD_VERSIONS:
        raise _error(path, "version", f"is {version!r}; this reader supports version(s) "
                                      f"{', '.join(map(str, MICROBATCH_FOLD_VERSIONS))}")
    schedules = SCHEDULES if version >= 2 else tuple(s for s in SCHEDULES if s != "interleaved")
    schedule = doc.get("schedule")
    if schedule not in schedules:
        raise _error(path, "schedule", f"is {schedule!r}, expected one of {', '.join(schedules)} (version {version})")
    if doc.get("rule") != RULES[schedule]:
        raise _error(path, "rule", f"is {doc.get('rule')!r}, expected {RULES[schedule]!r} for schedule {schedule!r}")
    warmup = doc.get("warmup")
    if not isinstance(warmup, list) or not warmup or any(not _int(x) or x < 0 for x in warmup):
        raise _error(path, "warmup", f"is {warmup!r}, expected a non-empty list of integers >= 0 (one per pipeline "
                                     "rank)")
    captured, target = doc.get("captured"), doc.get("target")
    if schedule != "interleaved":
        least = minimum_captured(warmup)
        if not _int(captured) or captured < least:
            raise _error(path, "captured", f"is {captured!r}, expected an integer >= {least} (max warm-up + 2, at "
                                           "least 3)")
        if not _int(target) or target < captured:
            raise _error(path, "target", f"is {target!r}, expected an integer >= captured ({captured})")
        return MicrobatchFold(target, captured, schedule, tuple(warmup), doc["rule"])
    extra = {}
    for key, ok, want in (("chunks", lambda x: _int(x) and x >= 2, "an integer >= 2"),
                          ("group", lambda x: _int(x) and x >= len(warmup), f"an integer >= PP ({len(warmup)})"),
                          ("overlap_p2p", lambda x: isinstance(x, bool), "true or false"),
                          ("wait_sends", lambda x: isinstance(x, bool), "true or false")):
        if not ok(doc.get(key)):
            raise _error(path, key, f"is {doc.get(key)!r}, expected {want}")
        extra[key] = doc[key]
    group = extra["group"]
    if not _int(target) or target < group or 0 < target % group < len(warmup):
        raise _error(path, "target", f"is {target!r}, expected an integer >= group {group} whose remainder by it is "
                                     f"0 or >= PP {len(warmup)} (Megatron's interleaved schedule)")
    least = minimum_interleaved(warmup, extra["chunks"], group, target)
    if not _int(captured) or captured < least or captured > target or (target - captured) % group:
        raise _error(path, "captured", f"is {captured!r}, expected target {target} less a multiple of group {group}, "
                                       f"at least {least}")
    return MicrobatchFold(target, captured, schedule, tuple(warmup), doc["rule"], **extra)


def read_microbatches(manifest: dict[str, Any], trace_dir: str | Path = "<trace>") -> MicrobatchFold | None:
    """The micro-batch fold of a trace's manifest; None when every micro-batch ran."""
    job = manifest.get("job") or {}
    if not isinstance(job, dict) or job.get("microbatches") is None:
        return None
    return parse_microbatches(job["microbatches"], Path(trace_dir) / MANIFEST_FILE)
