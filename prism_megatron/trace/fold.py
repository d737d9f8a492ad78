"""The fold of a trace: which ranks ran for real and whom every other rank mirrors.

A folded job runs only its *live* ranks; every virtual rank r mirrors its representative
``rep[r]`` (a live rank of the same class), *translated* to r: a rank x that rep[r] deals with (a
p2p peer, a group member) is, for r, :meth:`Fold.translate` ``(r, x)``. A version-2 plan gives
every rank's coordinates on the job's parallel axes (``axes``, ``sizes``, ``coords``: Megatron's
rank order, e.g. tp-cp-dp-pp) and the translation is by coordinates on the torus, so that TP/CP
peers and middle pipeline stages can be folded too (``depth`` "class"); a version-1 plan (data
parallelism folded only) has no coordinates and the translation is the shift ``x + r - rep[r]``
into r's replica. The
runtime records the fold plan in the manifest's job key ``"fold"`` (the plan's JSON plus
``"contributions"``: per op kind, how many virtual contributions were mirrored, recorded, kept or
passed through);
the ops/marks/slots/gpu tables then hold live ranks' rows only, while the manifest's groups keep
their full rank lists. Replay and reports read the fold through :func:`read_fold`, which checks it
as strictly as the rest of the trace (errors name the file and the field).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, NamedTuple

from .schema import MANIFEST_FILE, VERSION, TraceFormatError

#: Fold plan versions this reader understands.
FOLD_VERSIONS: tuple[int, ...] = (1, 2)
#: How deep a version-2 plan folds: "replica" (data parallelism only), "class" (TP/CP peers and
#: middle pipeline stages too: one live rank per class).
FOLD_DEPTHS: tuple[str, ...] = ("replica", "class")
#: How a virtual member's input to an op was made: nccl_prune.contributions.HOWS (a test keeps them
#: equal; the trace format imports no executor).
CONTRIBUTION_WAYS: tuple[str, ...] = ("mirror", "recorded", "keep", "passthrough", "self_mirror", "standin")
#: How a folded trace's live ranks were captured (v6 ``job.fold.capture.mode``): "together" (every live
#: rank a process of one run; what a trace without the field records), "serial" (one capture per live
#: rank, only that rank a process; ``--prism-fold-capture serial``). A serial run's merged trace lists
#: its ``captures`` (per live rank: its own trace directory, relative to the merged trace's parent, and
#: whether it completed); the trace of one capture has ``part`` instead (its live rank, index, the
#: fold's sandbox and every rank's class representative ``class_rep``). ``rules`` names how the sandbox
#: members that were virtual in a capture were answered: collectives by "self_mirror", receives from a
#: virtual pipeline neighbour by "standin" (nccl_prune.SELF_MIRROR_RULE, nccl_prune.STANDIN_RULE).
CAPTURE_MODES: tuple[str, ...] = ("together", "serial")
SERIAL_RULES: dict[str, str] = {"collectives": "self_mirror", "p2p": "standin"}
#: A serial run's merged trace may say what its stand-ins lacked (traces before these fields say nothing; read
#: as unknown): per capture, ``standins_unrecorded`` (its receives whose stand-in had no recorded norm: a derived
#: recording's or the unit fallback, nccl_prune.STANDIN_RULE (3), (4)), ``reductions_unrecorded`` (its small
#: reductions over another class's members answered by self mirror for want of a usable recording of that
#: class's inputs, nccl_prune.RECORDED_REDUCTION_RULE) and ``second_pass`` ("taken": captured again, its latest
#: trace merged; "skipped": it needed one and ``--prism-fold-second-pass`` took none), and
#: ``capture.second_pass``: the option's decision, {"option", "on": taken where needed, "why", "moe": whether
#: the fold has MoE layers, null where the plan did not say}, and where auto stopped it, ``unchanged``: the capture
#: (from 1) whose take again routed every token as the take before it (launcher.serial). ``reused`` (optional,
#: true) marks a capture whose trace an earlier run of the same job left (``--prism-fold-resume``; its record's
#: ``job`` says which run: launcher.serial.RESUME_RULE).
SECOND_PASS_STATES: tuple[str, ...] = ("taken", "skipped")
SECOND_PASS_FIELDS: tuple[str, ...] = ("option", "on", "why", "moe")
SECOND_PASS_OPTIONAL: tuple[str, ...] = ("unchanged",)
#: The pipeline schedules a version-2 plan's optional ``schedule.name`` can name: Megatron's
#: ``forward_backward_no_pipelining``, non-interleaved 1F1B and interleaved 1F1B. For "1f1b" the plan
#: gives ``schedule.warmup``: per pipeline rank (pp coordinate), Megatron's count of warm-up forwards
#: before Megatron caps it at the iteration's microbatch count (its schedule takes ``min(warmup, M)``);
#: replay.stage_schedule then gives each folded pipeline stage its own order of units. For
#: "interleaved" ``warmup`` is per pipeline rank too (warm-up virtual microbatches before the cap at
#: M·chunks) and the plan adds ``schedule.chunks`` (model chunks per rank, VPP) and ``schedule.group``
#: (Megatron's ``microbatch_group_size_per_vp_stage``), ``schedule.overlap_p2p`` (``overlap_p2p_comm``)
#: and ``schedule.wait_sends`` (the installed release waits each steady forward's send at once): the
#: order of (microbatch, chunk) units and p2p calls follows from these and M
#: (replay.stage_schedule.interleaved_steps). An interleaved schedule without them (a
#: plan written before plans recorded them) is read, but a stage cannot be given its own order.
SCHEDULES: tuple[str, ...] = ("no_pipelining", "1f1b", "interleaved")

Coord = tuple[int, ...]


def second_pass_skipped(decision: dict[str, Any]) -> str:
    """What skipping the second pass (``capture.second_pass`` with "on" false) leaves in a capture's stand-ins,
    in the words the launcher's line and the report say it: the stand-ins' norms steer values (grad norm,
    clipping, losses) and, through MoE routing only, tokens per expert, hence time and memory; where a capture
    taken again routed every token alike (``unchanged``), they steered none."""
    consequence = {False: "; time and memory do not depend on them",
                   True: "; nor, through MoE routing, are their tokens per expert, hence time and memory"}
    said = consequence[False] if decision.get("unchanged") else consequence.get(decision.get("moe"), "")
    return f"second pass off {decision['why']}: the grad norms and losses they log are not the job's{said}"


class IncompleteCapture(NamedTuple):
    """A capture of a serial run that did not complete: the ``number``-th of ``of``, of live ``rank`` (class
    ``cls``); ``written``: it wrote a trace (cut short), else none; ``reason``: why (the merge's record)."""

    number: int
    of: int
    rank: int
    cls: str
    written: bool
    reason: str

    @property
    def status(self) -> str:
        """"incomplete" (cut short), "not run" (an earlier capture failed) or "wrote no trace"."""
        return "incomplete" if self.written else "not run" if self.reason.startswith("not run") else \
            "wrote no trace"

    @property
    def sentence(self) -> str:
        """"capture 2 of 3 (rank 16, class middle) incomplete: ended by SIGTERM", or for one that was not run
        "capture 3 of 3 (rank 48, class last) not run: capture 2 failed first"."""
        head = f"capture {self.number} of {self.of} (rank {self.rank}, class {self.cls})"
        return f"{head} {self.reason}" if self.status == "not run" else f"{head} {self.status}: {self.reason}"


@dataclass(frozen=True)
class FoldClass:
    """Ranks that do the same work on the same shapes; ``sandbox``: its live ranks."""

    name: str
    role: str
    count: int
    sandbox: tuple[int, ...]
    coords: Any = None


@dataclass(frozen=True)
class Fold:
    """A fold plan as replay and reports need it (see the module docstring).

    ``axes``/``sizes``/``coords`` (version 2): the parallel axes in rank order, their sizes and every
    rank's coordinates on them; empty for a version-1 plan.
    """

    world_size: int
    live: tuple[int, ...]
    rep: tuple[int, ...]
    gpus_per_node: int
    classes: tuple[FoldClass, ...] = ()
    class_of: tuple[int, ...] = ()
    contributions: dict[str, dict[str, int]] = field(default_factory=dict, hash=False, compare=False)
    depth: str = "replica"
    axes: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    coords: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    schedule: str = ""  # one of SCHEDULES; "": the plan does not say (a stage cannot be given its own order)
    warmup: tuple[int, ...] = ()  # "1f1b"/"interleaved": per pipeline rank, Megatron's warm-up before its cap
    chunks: int = 1  # "interleaved": model chunks per pipeline rank (0: the plan does not say)
    group: int = 0  # "interleaved": Megatron's microbatch_group_size_per_vp_stage (0: the plan does not say)
    overlap_p2p: bool = False  # "interleaved": Megatron's overlap_p2p_comm (p2p calls split and awaited later)
    wait_sends: bool = False  # "interleaved" with overlap: each steady forward's send waited at once
    capture: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)  # v6: CAPTURE_MODES

    @property
    def capture_mode(self) -> str:
        """How the live ranks were captured: "together" (also every trace before v6) or "serial"."""
        return self.capture.get("mode", "together")
    # how folded expert-parallel peers' tokens were made ("translated mirror"); "": no expert peer is virtual
    expert_tokens: str = ""

    @property
    def version(self) -> int:
        return 2 if self.coords else 1

    def shift(self, rank: int) -> int:
        """How far rank ``rank``'s replica is from its representative's: ``rank - rep[rank]`` (version 1)."""
        return rank - self.rep[rank]

    # --- translation --------------------------------------------------------------------------
    @cached_property
    def _rank_at(self) -> list[int]:
        """The O(W) index: rank by mixed-radix code of its coordinates (first axis fastest)."""
        at = [-1] * self.world_size
        for r, c in enumerate(self.coords):
            at[self._code(c)] = r
        return at

    @cached_property
    def _strides(self) -> tuple[int, ...]:
        out, k = [], 1
        for n in self.sizes:
            out.append(k)
            k *= n
        return tuple(out)

    def _code(self, c: Sequence[int]) -> int:
        return sum(x * k for x, k in zip(c, self._strides, strict=True))

    def offset(self, rank: int) -> tuple[int, ...]:
        """The translation from ``rep[rank]`` to ``rank``: per axis, coordinate difference mod size
        (version 2), or ``(rank - rep[rank],)`` (version 1)."""
        if not self.coords:
            return (rank - self.rep[rank],)
        a, b = self.coords[rank], self.coords[self.rep[rank]]
        return tuple((x - y) % n for x, y, n in zip(a, b, self.sizes, strict=True))

    def translate_by(self, offset: Sequence[int], x: int) -> int:
        """Rank ``x`` translated by ``offset`` (from :meth:`offset`). Version 1: ``x + offset[0]``,
        which may fall outside [0, W) (the caller says why that is an error)."""
        if not self.coords:
            return x + offset[0]
        c = self.coords[x]
        return self._rank_at[sum(((a + d) % n) * k for a, d, n, k in zip(c, offset, self.sizes, self._strides,
                                                                          strict=True))]

    def translate(self, rank: int, x: int) -> int:
        """The rank that is, for virtual rank ``rank``, what ``x`` is for ``rep[rank]``: the rank whose
        coordinates are ``coords[x] + coords[rank] - coords[rep[rank]]`` (mod sizes, axis by axis);
        ``x + rank - rep[rank]`` for a version-1 plan. O(1) after an O(W) index built once."""
        return self.translate_by(self.offset(rank), x)

    def unit(self, axis: int, step: int = 1) -> tuple[int, ...]:
        """The offset of ``step`` along axis number ``axis`` (version 2)."""
        return tuple(step if a == axis else 0 for a in range(len(self.axes)))

    def invariant_axes(self, ranks: Sequence[int]) -> tuple[bool, ...]:
        """Per axis: whether the set ``ranks`` maps onto itself when moved one step along it (a DP group
        along dp, a TP group along tp; an axis of size 1 always). O(len(ranks) * axes); version 2."""
        members = frozenset(ranks)
        return tuple(n == 1 or all(self.translate_by(self.unit(a), x) in members for x in members)
                     for a, n in enumerate(self.sizes))

    def lockstep_steps(self) -> tuple[int, ...]:
        """Per axis, the smallest step along it that keeps every rank's representative (a divisor of the
        axis size; the size itself when no smaller one does): ranks that differ by multiples of these
        steps run the same program translated, in lockstep (TP/CP/DP peers under a class fold: step 1;
        DP under a replica fold that keeps k DP indices: step k). Folded pipeline stages are not
        lockstep peers (along pp the step is the size). () for version 1."""
        out = []
        for a, n in enumerate(self.sizes):
            step = n
            for s in range(1, n):
                if n % s == 0:
                    move = self.unit(a, s)
                    if all(self.rep[self.translate_by(move, x)] == self.rep[x] for x in range(self.world_size)):
                        step = s
                        break
            out.append(step)
        return tuple(out)

    # --- reports ------------------------------------------------------------------------------
    def class_name(self, rank: int) -> str:
        return self.classes[self.class_of[rank]].name if self.classes else f"like rank {self.rep[rank]}"

    def incomplete_captures(self) -> list[IncompleteCapture]:
        """A serial run's merged trace: its captures that did not complete, in capture order; [] where every
        capture completed, and for any other trace."""
        captures = self.capture.get("captures") or []
        return [IncompleteCapture(i + 1, len(captures), c["rank"], self.class_name(c["rank"]), bool(c["trace"]),
                                  c["incomplete"]) for i, c in enumerate(captures) if not c["complete"]]

    def unrecorded_standins(self) -> str:
        """A serial run's merged trace: which captures kept stand-ins without a recorded norm and why, as the
        report says it (e.g. "captures 1, 2 kept stand-ins without a recorded norm (second pass off for a dense
        fold: ...)"); "" where none did, or the trace does not say (SECOND_PASS_FIELDS)."""
        captures = self.capture.get("captures") or []
        decision = self.capture.get("second_pass")
        kept = [(i + 1, c.get("second_pass") == "skipped" and decision is not None and not decision["on"])
                for i, c in enumerate(captures) if c.get("standins_unrecorded")]
        out = []
        for skipped, why in ((True, second_pass_skipped(decision) if decision else ""),
                             (False, "no capture recorded their senders' norms: the grad norms and losses they log "
                                     "are not the job's")):
            which = [n for n, s in kept if s == skipped]
            if which:
                out.append(f"capture{'s' if len(which) > 1 else ''} {', '.join(map(str, which))} kept stand-ins "
                           f"without a recorded norm ({why})")
        return "; ".join(out)

    def reused_captures(self) -> str:
        """A serial run's merged trace: which captures an earlier run of the same job made (``--prism-fold-resume``),
        as the report says it; "" where none."""
        which = [str(i + 1) for i, c in enumerate(self.capture.get("captures") or []) if c.get("reused")]
        if not which:
            return ""
        return (f"capture{'s' if len(which) > 1 else ''} {', '.join(which)} reused from an earlier run of the same "
                "job on the same machine and software (--prism-fold-resume)")

    def unrecorded_reductions(self) -> str:
        """A serial run's merged trace: which captures answered small reductions over another class's members by
        self mirror for want of a recording (``nccl_prune.RECORDED_REDUCTION_RULE``), as the report says it; ""
        where none did, or the trace does not say."""
        captures = self.capture.get("captures") or []
        which = [(i + 1, c["reductions_unrecorded"]) for i, c in enumerate(captures) if c.get("reductions_unrecorded")]
        if not which:
            return ""
        said = ", ".join(f"{i} ({n})" for i, n in which)
        return (f"capture{'s' if len(which) > 1 else ''} {said} answered reductions over another class's members by "
                "self mirror, that class's inputs unrecorded (captured later, or recorded after stand-ins without a "
                "norm): the grad norms they log count their own stage for it")

    def contribution_counts(self) -> dict[str, int]:
        """Virtual contributions by way, summed over op kinds: the first four CONTRIBUTION_WAYS always, a serial
        capture's (self_mirror, standin) where it made any."""
        out = dict.fromkeys(CONTRIBUTION_WAYS[:4], 0)
        for ways in self.contributions.values():
            for way, n in ways.items():
                out[way] = out.get(way, 0) + n
        return out

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``job.fold`` value for this fold (what the runtime writes)."""
        doc = {"version": self.version, "world_size": self.world_size, "live": list(self.live),
               "rep": list(self.rep), "gpus_per_node": self.gpus_per_node,
               "classes": [{"name": c.name, "role": c.role, "count": c.count, "sandbox": list(c.sandbox),
                            "coords": c.coords} for c in self.classes],
               "class_of": list(self.class_of), "contributions": self.contributions}
        if self.coords:
            doc.update(depth=self.depth, axes=list(self.axes), sizes=list(self.sizes),
                       coords=[list(c) for c in self.coords])
            if self.schedule:
                doc["schedule"] = {"name": self.schedule, "warmup": list(self.warmup)}
                if self.schedule == "interleaved" and self.chunks > 1:
                    doc["schedule"].update(chunks=self.chunks, group=self.group, overlap_p2p=self.overlap_p2p,
                                           wait_sends=self.wait_sends)
        if self.expert_tokens:
            doc["expert_tokens"] = self.expert_tokens
        if self.capture:
            doc["capture"] = self.capture
        return doc


def make_fold(rep: Sequence[int], gpus_per_node: int, classes: Sequence[FoldClass] = (),
              class_of: Sequence[int] = (), contributions: dict[str, dict[str, int]] | None = None, *,
              depth: str = "replica", axes: Sequence[str] = (), sizes: Sequence[int] = (),
              coords: Sequence[Sequence[int]] = (), schedule: str = "", warmup: Sequence[int] = (),
              chunks: int = 1, group: int = 0, overlap_p2p: bool = False, wait_sends: bool = False) -> Fold:
    """A checked Fold from a rep list; without ``classes``, one class per live rank (the ranks it stands
    for); with ``coords`` (and ``axes``, ``sizes``; optionally ``schedule``, ``warmup``, and for an
    interleaved schedule ``chunks``, ``group``) a version-2 fold."""
    rep = tuple(int(x) for x in rep)
    live = tuple(sorted(set(rep)))
    if not classes:
        index = {x: i for i, x in enumerate(live)}
        counts = [0] * len(live)
        for x in rep:
            counts[index[x]] += 1
        classes = tuple(FoldClass(f"like rank {x}", "", counts[i], (x,)) for i, x in enumerate(live))
        class_of = tuple(index[x] for x in rep)
    fold = Fold(len(rep), live, rep, int(gpus_per_node), tuple(classes), tuple(class_of), dict(contributions or {}),
                depth, tuple(axes), tuple(int(n) for n in sizes), tuple(tuple(int(x) for x in c) for c in coords),
                schedule, tuple(int(x) for x in warmup), int(chunks), int(group), bool(overlap_p2p),
                bool(wait_sends))
    return parse_fold(fold.to_json(), len(rep), "<fold>")


def _error(path: str | Path, key: str, problem: str) -> TraceFormatError:
    return TraceFormatError(path, f"manifest field 'job.fold.{key}'", problem)


def _int_list(doc: dict, key: str, path: str | Path) -> list[int]:
    value = doc.get(key)
    if not isinstance(value, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in value):
        raise _error(path, key, "is missing or not a list of integers")
    return value


def _int(doc: dict, key: str, path: str | Path, minimum: int = 1) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _error(path, key, f"is {value!r}, expected an integer >= {minimum}")
    return value


def parse_fold(doc: Any, world_size: int, path: str | Path, trace_version: int = VERSION) -> Fold:
    """Check a ``job.fold`` value against the trace's ``world_size`` (and its version: ``capture`` and the
    ways self_mirror/standin came with v6); raise TraceFormatError naming the field."""
    if not isinstance(doc, dict):
        raise TraceFormatError(path, "manifest field 'job.fold'", f"is {type(doc).__name__}, expected an object")
    version = doc.get("version")
    if version not in FOLD_VERSIONS or isinstance(version, bool):
        raise _error(path, "version", f"is {version!r}; this reader supports fold plan version(s) "
                                      f"{', '.join(map(str, FOLD_VERSIONS))}")
    w = _int(doc, "world_size", path)
    if w != world_size:
        raise _error(path, "world_size", f"is {w}, but the trace's world_size is {world_size}")
    live, rep = _int_list(doc, "live", path), _int_list(doc, "rep", path)
    if not live or live != sorted(set(live)) or live[0] < 0 or live[-1] >= w:
        raise _error(path, "live", f"is {live[:8]}{'...' if len(live) > 8 else ''}: expected sorted distinct "
                                   f"ranks in [0, {w})")
    if len(rep) != w:
        raise _error(path, "rep", f"has {len(rep)} entries, expected one per rank ({w})")
    live_set = set(live)
    for r, x in enumerate(rep):
        if x not in live_set:
            raise _error(path, "rep", f"maps rank {r} to {x}, which is not a live rank")
        if r in live_set and x != r:
            raise _error(path, "rep", f"maps live rank {r} to {x}; a live rank represents itself")
    gpus = _int(doc, "gpus_per_node", path)
    raw_classes = doc.get("classes", [])
    if not isinstance(raw_classes, list):
        raise _error(path, "classes", "is not a list")
    classes = []
    for i, c in enumerate(raw_classes):
        key = f"classes[{i}]"
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not isinstance(c.get("role", ""), str):
            raise _error(path, key, "is not an object with a string 'name' (and 'role')")
        count = _int(c, "count", path)
        sandbox = _int_list(c, "sandbox", path)
        if not sandbox or not set(sandbox) <= live_set:
            raise _error(path, f"{key}.sandbox", f"is {sandbox}: expected live ranks")
        classes.append(FoldClass(c["name"], c.get("role", ""), count, tuple(sandbox), c.get("coords")))
    class_of: list[int] = []
    if classes:
        class_of = _int_list(doc, "class_of", path)
        if len(class_of) != w or any(not 0 <= k < len(classes) for k in class_of):
            raise _error(path, "class_of", f"must hold {w} indices into classes (0..{len(classes) - 1})")
        counts = [0] * len(classes)
        for k in class_of:
            counts[k] += 1
        for i, (c, n) in enumerate(zip(classes, counts, strict=True)):
            if c.count != n:
                raise _error(path, f"classes[{i}].count", f"is {c.count}, but class_of gives class {c.name!r} "
                                                          f"{n} rank(s)")
    contributions = doc.get("contributions", {})
    if not isinstance(contributions, dict) or any(
            not isinstance(v, dict) or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in v.values())
            for v in contributions.values()):
        raise _error(path, "contributions", "is not an object of {op kind: {mirror|recorded|keep|passthrough: count}}")
    ways = CONTRIBUTION_WAYS if trace_version >= 6 else CONTRIBUTION_WAYS[:4]
    for kind, v in contributions.items():
        bad = sorted(set(v) - set(ways))
        if bad:
            raise _error(path, f"contributions.{kind}", f"names way(s) {bad}; a v{trace_version} trace knows "
                                                        f"{', '.join(ways)}")
    capture = _capture(doc, live, w, path, trace_version)
    depth, axes, sizes, coords = ("replica", (), (), ()) if version == 1 else _axes(doc, w, path)
    schedule, warmup, chunks, group, overlap, wait_sends = ("", (), 1, 0, False, False) if version == 1 else \
        _schedule(doc, axes, sizes, path)
    expert_tokens = doc.get("expert_tokens", "")
    if not isinstance(expert_tokens, str):
        raise _error(path, "expert_tokens", f"is {expert_tokens!r}, expected a string (the rule's name)")
    return Fold(w, tuple(live), tuple(rep), gpus, tuple(classes), tuple(class_of), contributions, depth, axes,
                sizes, coords, schedule, warmup, chunks, group, overlap, wait_sends, capture,
                expert_tokens)


def _capture(doc: dict, live: list[int], w: int, path: str | Path, trace_version: int) -> dict[str, Any]:
    """The v6 ``capture`` record (CAPTURE_MODES), checked; {} when absent."""
    if "capture" not in doc:
        return {}
    value = doc["capture"]
    if trace_version < 6:
        raise _error(path, "capture", f"is present in a v{trace_version} trace (it came with v6)")
    if not isinstance(value, dict) or value.get("mode") not in CAPTURE_MODES:
        got = value.get("mode") if isinstance(value, dict) else value
        raise _error(path, "capture.mode", f"is {got!r}, expected one of {', '.join(CAPTURE_MODES)}")
    if value["mode"] == "together":
        return dict(value)
    if value.get("rules") != SERIAL_RULES:
        raise _error(path, "capture.rules", f"is {value.get('rules')!r}, expected {SERIAL_RULES}")
    if ("captures" in value) == ("part" in value):
        raise _error(path, "capture", "of a serial run needs either 'captures' (the merged trace) or 'part' (one "
                                      "capture's trace)")
    if "part" in value:
        part = value["part"]
        if not isinstance(part, dict):
            raise _error(path, "capture.part", "is not an object")
        rank, sandbox, class_rep = part.get("rank"), part.get("sandbox"), part.get("class_rep")
        if live != [rank]:
            raise _error(path, "capture.part.rank", f"is {rank!r}; one capture's live ranks are [rank], got {live}")
        if not isinstance(sandbox, list) or rank not in sandbox or any(
                isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < w for x in sandbox):
            raise _error(path, "capture.part.sandbox", f"is {sandbox!r}: expected the fold's live ranks, {rank} "
                                                       "among them")
        if not isinstance(class_rep, list) or len(class_rep) != w or not set(class_rep) <= set(sandbox):
            raise _error(path, "capture.part.class_rep", f"must hold one rank of capture.part.sandbox per rank ({w})")
        for key in ("index", "of"):
            x = part.get(key)
            if isinstance(x, bool) or not isinstance(x, int) or x < 0:
                raise _error(path, f"capture.part.{key}", f"is {x!r}, expected an integer >= 0")
        if part["index"] >= part["of"] or part["of"] != len(sandbox):
            raise _error(path, "capture.part.of", f"is {part['of']}: capture {part['index']} of one capture per "
                                                  f"sandbox rank ({len(sandbox)})")
        return dict(value)
    captures = value["captures"]
    if not isinstance(captures, list) or not captures:
        raise _error(path, "capture.captures", "is not a non-empty list")
    seen = []
    for i, c in enumerate(captures):
        key = f"capture.captures[{i}]"
        if (not isinstance(c, dict) or isinstance(c.get("rank"), bool) or not isinstance(c.get("rank"), int)
                or not isinstance(c.get("trace"), str) or not isinstance(c.get("complete"), bool)):
            raise _error(path, key, "is not an object with an integer 'rank', a string 'trace' and a boolean "
                                    "'complete'")
        reason = c.get("incomplete")
        if c["complete"] == (reason is not None) or (reason is not None and not (isinstance(reason, str) and reason)):
            raise _error(path, f"{key}.incomplete", f"is {reason!r}: null for a complete capture, else why not")
        for count in ("standins_unrecorded", "reductions_unrecorded"):
            n = c.get(count, 0)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise _error(path, f"{key}.{count}", f"is {n!r}, expected an integer >= 0")
        if c.get("reused", True) is not True:
            raise _error(path, f"{key}.reused", f"is {c['reused']!r}, expected true (absent: captured by this run)")
        if c.get("second_pass", "taken") not in SECOND_PASS_STATES:
            raise _error(path, f"{key}.second_pass", f"is {c['second_pass']!r}, expected one of "
                                                     f"{', '.join(SECOND_PASS_STATES)}")
        seen.append(c["rank"])
    decision = value.get("second_pass")
    if decision is not None and (not isinstance(decision, dict) or not set(SECOND_PASS_FIELDS) <= set(decision)
                                 or not set(decision) <= set(SECOND_PASS_FIELDS + SECOND_PASS_OPTIONAL)
                                 or not _unchanged_ok(decision.get("unchanged", 1), len(live))
                                 or not isinstance(decision["on"], bool) or not isinstance(decision["why"], str)
                                 or not isinstance(decision["option"], str)
                                 or not (decision["moe"] is None or isinstance(decision["moe"], bool))):
        raise _error(path, "capture.second_pass", f"is {decision!r}: expected {{{', '.join(SECOND_PASS_FIELDS)}}} "
                                                  "with a boolean 'on', a string 'why' and 'moe' true, false or null, "
                                                  "and optionally 'unchanged': a capture number")
    if sorted(seen) != live:
        raise _error(path, "capture.captures", f"lists ranks {seen}; a serial run captures each live rank once "
                                               f"({live})")
    return dict(value)


def _unchanged_ok(n: Any, captures: int) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= captures


def _schedule(doc: dict, axes: tuple[str, ...], sizes: tuple[int, ...],
              path: str | Path) -> tuple[str, tuple[int, ...], int, int, bool, bool]:
    """A version-2 plan's optional ``schedule`` (SCHEDULES): name, warmup, chunks, group, overlap_p2p,
    wait_sends; ("", (), 1, 0, False, False) when absent; checked when present."""
    if "schedule" not in doc:
        return "", (), 1, 0, False, False
    value = doc["schedule"]
    if not isinstance(value, dict) or value.get("name") not in SCHEDULES:
        got = value.get("name") if isinstance(value, dict) else value
        raise _error(path, "schedule.name", f"is {got!r}, expected one of {', '.join(SCHEDULES)}")
    warmup = value.get("warmup", [])
    stages = sizes[axes.index("pp")] if "pp" in axes else 1
    if not isinstance(warmup, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in warmup):
        raise _error(path, "schedule.warmup", f"is {warmup!r}, expected a list of integers >= 0")
    if value["name"] == "1f1b" and len(warmup) != stages:
        raise _error(path, "schedule.warmup", f"has {len(warmup)} entries; a 1f1b schedule needs one per pipeline "
                                              f"rank ({stages})")
    if value["name"] != "interleaved" or ("chunks" not in value and not warmup):
        return value["name"], tuple(warmup), 1 if value["name"] != "interleaved" else 0, 0, False, False
    for key, least in (("chunks", 2), ("group", stages)):
        x = value.get(key)
        if isinstance(x, bool) or not isinstance(x, int) or x < least:
            raise _error(path, f"schedule.{key}", f"is {x!r}, expected an integer >= {least} for an interleaved "
                                                  f"schedule over {stages} pipeline ranks")
    if len(warmup) != stages:
        raise _error(path, "schedule.warmup", f"has {len(warmup)} entries; an interleaved schedule needs one per "
                                              f"pipeline rank ({stages})")
    flags = []
    for key in ("overlap_p2p", "wait_sends"):
        flags.append(value.get(key, False))
        if not isinstance(flags[-1], bool):
            raise _error(path, f"schedule.{key}", f"is {flags[-1]!r}, expected true or false")
    return value["name"], tuple(warmup), value["chunks"], value["group"], flags[0], flags[1]


def _axes(doc: dict, w: int, path: str | Path) -> tuple[str, tuple[str, ...], tuple[int, ...], tuple[Coord, ...]]:
    """A version-2 plan's depth, axes, sizes and coords, checked: every rank has one distinct point of
    the grid (the translation needs a bijection between ranks and coordinates)."""
    depth = doc.get("depth")
    if depth not in FOLD_DEPTHS:
        raise _error(path, "depth", f"is {depth!r}, expected one of {', '.join(FOLD_DEPTHS)}")
    axes = doc.get("axes")
    if not isinstance(axes, list) or not axes or any(not isinstance(a, str) or not a for a in axes) \
            or len(set(axes)) != len(axes):
        raise _error(path, "axes", f"is {axes!r}, expected a list of distinct axis names (e.g. tp, cp, dp, pp)")
    sizes = _int_list(doc, "sizes", path)
    if len(sizes) != len(axes) or any(n < 1 for n in sizes):
        raise _error(path, "sizes", f"is {sizes}, expected one size >= 1 per axis ({len(axes)} axes)")
    if math.prod(sizes) != w:
        raise _error(path, "sizes", f"is {sizes}, whose product {math.prod(sizes)} is not the world size {w}")
    raw = doc.get("coords")
    if not isinstance(raw, list) or len(raw) != w:
        raise _error(path, "coords", f"{'has ' + str(len(raw)) + ' entries' if isinstance(raw, list) else 'is missing'}"
                                     f", expected one list of {len(axes)} coordinates per rank ({w})")
    coords, seen = [], {}
    for r, c in enumerate(raw):
        if not isinstance(c, list) or len(c) != len(axes) or any(
                isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n for x, n in zip(c, sizes, strict=True)):
            raise _error(path, f"coords[{r}]", f"is {c!r}, expected {len(axes)} integers within sizes {sizes}")
        t = tuple(c)
        if t in seen:
            raise _error(path, f"coords[{r}]", f"is {c}, the same as rank {seen[t]}'s: coordinates must be distinct")
        seen[t] = r
        coords.append(t)
    return depth, tuple(axes), tuple(sizes), tuple(coords)


def read_fold(manifest: dict[str, Any], trace_dir: str | Path = "<trace>") -> Fold | None:
    """The fold of a trace's manifest, None when the trace is not folded (every rank ran)."""
    job = manifest.get("job") or {}
    if not isinstance(job, dict) or job.get("fold") is None:
        return None
    return parse_fold(job["fold"], int(manifest["world_size"]), Path(trace_dir) / MANIFEST_FILE,
                      int(manifest.get("version", VERSION)))
