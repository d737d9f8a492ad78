"""The coordinator's side of a folded job: which ranks are live, each group's fold, and the count of
virtual contributions the trace records.

Only live ranks are processes. When a live rank registers a group, the group is folded once
(``nccl_prune.plan_group``: O(group size)); a group without virtual members keeps the runtime's own
path and numerics, a folded one completes when its live members have posted an op and is answered by
``nccl_prune.host`` (``ops.OpKind.run``); a p2p with a virtual neighbour is passed through
(runtime.passthrough). Knows ranks, not Megatron: the fold arrives as the plan's JSON (``trace.fold``
reads the same).

One capture of a serial run (``capture.part`` in the plan: one live rank L, every other rank's rep L)
answers a virtual member whose class has its live rank elsewhere by self mirror, and a receive with no
other live rank upstream by a stand-in, scaled to the norm an earlier capture recorded for that message
(``capture.part.p2p_answers`` in, this capture's ``capture.part.p2p_norms`` out); the counts say which
(``nccl_prune.SELF_MIRROR_RULE``, ``nccl_prune.STANDIN_RULE``). A broadcast is the exception
(``RECORDED_BROADCAST_RULE``): its root sends values the receivers branch on (Megatron's
do_train/do_valid/do_test flags from rank 0 reach a middle stage, which builds no data loader, only this
way), so L's own buffer is not an answer. Each capture records the broadcasts its class roots
(``capture.part.broadcasts``) and a later capture answers a root of that class from them
(``capture.part.answers``, counted ``recorded``); an integer broadcast with no
recording is refused by name. A small reduction over members of another class is answered likewise
(``nccl_prune.RECORDED_REDUCTION_RULE``): each capture records its live rank's inputs to them
(``capture.part.reductions``) and a later capture takes them for that class's members
(``capture.part.reduction_answers``), counting the ops that found none (``reductions_unrecorded``).
"""

from __future__ import annotations

import base64
import math
import sys
from collections.abc import Callable
from typing import Any

import torch

from nccl_prune import (
    RECORD_MAX_BYTES,
    Contributions,
    PruneError,
    other_classes,
    plan_group,
    recordable,
    recorded_inputs,
)
from nccl_prune.contributions import virtual_contributions
from prism_megatron.runtime.dataplane import DataPlane
from prism_megatron.runtime.groups import Group
from prism_megatron.runtime.matching import Member, desc_bytes
from prism_megatron.runtime.passthrough import PassThrough
from prism_megatron.runtime.protocol import dtype_from_name, dtype_name

__all__ = ["RECORDED_BROADCAST_RULE", "RECORDED_PART_KEYS", "RECORD_MAX_BYTES", "Folding", "untranslation"]

#: What a serial capture adds to its plan's ``capture.part`` in its trace (:meth:`Folding.to_json`): what it recorded
#: for later captures and what it lacked; the rest of ``job.fold`` is the plan it was given.
RECORDED_PART_KEYS: tuple[str, ...] = ("broadcasts", "p2p_norms", "standins_unrecorded", "reductions",
                                       "reductions_unrecorded")

RECORDED_BROADCAST_RULE = """\
In a serial capture of live rank L, a broadcast whose root's class has its live rank R elsewhere is not
answered by self mirror: the root sends what R sends, a value the receivers may branch on. Each capture
records the broadcasts (up to nccl_prune's RECORD_MAX_BYTES: values a program branches on are small) whose
root is its live rank or a member of its class, on a group with members of another class; a later capture
answers that broadcast (the same group, by name, members and incarnation, and the same sequence number) with
the recorded bytes. Captures run first stage first, so a broadcast from the first stage is answered in every
later capture. Without a recording an integer or bool broadcast is refused by name; a floating-point one is
answered by self mirror (data, not a decision)."""


class Folding:
    """A folded job's live ranks and representatives, with the groups' folds and contribution counts."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan_json = plan
        self.rep: list[int] = [int(x) for x in plan["rep"]]
        self.live: list[int] = [int(x) for x in plan["live"]]
        self.contributions = Contributions()
        part = (plan.get("capture") or {}).get("part")
        # a serial capture: every rank's class representative in the fold captured together (the plan's own
        # rep is the capture's one live rank for every rank)
        self.class_rep: list[int] | None = [int(x) for x in part["class_rep"]] if part else None
        self._key: dict[int, tuple] = {}  # group id -> (name, ranks, incarnation): the same in every capture
        sandbox = frozenset(int(x) for x in part["sandbox"]) if part else frozenset()
        self.passthrough = PassThrough(self.contributions, standin=part is not None,
                                       elsewhere=sandbox - {int(part["rank"])} if part else frozenset(),
                                       sandbox=sandbox,
                                       norms=_read_norms(part.get("p2p_answers", []) if part else [],
                                                         "capture.part.p2p_answers"),
                                       key=lambda g: self._key[g.id])
        self._self_mirror: dict[int, frozenset[int]] = {}  # group id -> positions answered by self mirror
        self._others: dict[int, dict[int, int]] = {}  # group id -> those positions' classes' live ranks
        self._planned: set[int] = set()  # group ids folded already
        self._incarnations: dict[tuple, int] = {}
        self.capture_rank: int | None = int(part["rank"]) if part else None
        # (group key, seq) -> (dtype, bytes): earlier captures' broadcasts; this capture's, for later ones
        self.answers = _read_broadcasts(part.get("answers", []) if part else [], "capture.part.answers")
        self.recorded: list[dict[str, Any]] = []
        # (group key, seq, rank) -> (kind, [(dtype, bytes)], derived): earlier captures' reductions
        # (RECORDED_REDUCTION_RULE)
        self.reduction_answers = _read_reductions(part.get("reduction_answers", []) if part else [],
                                                  "capture.part.reduction_answers")
        self.reductions: list[dict[str, Any]] = []  # this capture's, for later ones
        self.reductions_unrecorded = 0  # reductions with a member of another class that found no recording
        # per (group, kind, root, in place): the counts one op adds (an op's count is O(group), once)
        self._per_op: dict[tuple, dict[str, int]] = {}
        self.untranslate = untranslation(plan)


    def fold_group(self, g: Group) -> str | None:
        """Fold ``g`` at its first registration: None, or why it cannot be folded (a live rank made it,
        so it has live members; a virtual member whose representative is outside it cannot be mirrored)."""
        if g.id in self._planned:
            return None
        self._planned.add(g.id)
        base = (g.name, tuple(g.ranks))
        k = self._incarnations.get(base, 0)
        self._incarnations[base] = k + 1
        self._key[g.id] = (*base, k)
        try:
            p = plan_group(g.ranks, self.rep, self.untranslate)
        except PruneError as e:
            return f"process group {g.name!r}: {e}"
        if p is None:  # cannot happen for a group a live rank registered: the rank is a member
            return f"process group {g.name!r} (ranks {g.ranks[:8]}) has no live member but was registered"
        g.fold = p if p.num_virtual else None  # no virtual member: exactly the unfolded path
        if self.class_rep is not None and g.fold is not None:
            self._others[g.id] = other_classes(p, self.class_rep)
            self._self_mirror[g.id] = frozenset(self._others[g.id])
        return None

    def reduction(self, g: Group, seq: int, kind: str, ins: list[torch.Tensor]) -> tuple[dict[int, list], str | None]:
        """A serial capture's reduction ``seq`` on ``g`` whose one live member's inputs are ``ins`` (flat host
        tensors): record them for later captures and return (recorded inputs by virtual position, None) for the
        members of other classes that an earlier capture recorded (``nccl_prune.RECORDED_REDUCTION_RULE``);
        ({}, None) for an op outside the rule (another kind, larger than RECORD_MAX_BYTES, no member of another
        class: a size check); ({}, the problem) for a recording that does not fit."""
        others = self._others.get(g.id)
        if not others or not recordable(kind, sum(t.numel() * t.element_size() for t in ins)):
            return {}, None
        key = self._key[g.id]
        self.reductions.append({"group": [key[0], list(key[1]), key[2]], "seq": seq, "rank": self.capture_rank,
                                "kind": kind, "tensors": [[dtype_name(t.dtype), _b64(t)] for t in ins],
                                "derived": self.passthrough.derived})
        recordings = {}
        for r in set(others.values()):
            got = self.reduction_answers.get((key, seq, r))
            if got is None or got[2]:  # none, or derived: made after its capture's stand-ins fell back
                continue
            if got[0] != kind:
                return {}, (f"rank {r}'s capture recorded op #{seq} of this group as {got[0]}, this capture issues "
                            f"{kind}: the captures do not run the same program (RECORDED_REDUCTION_RULE)")
            recordings[r] = [torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype_from_name(dt)) if raw
                             else torch.empty(0, dtype=dtype_from_name(dt)) for dt, raw in got[1]]
        try:
            recorded = recorded_inputs(g.fold, others, recordings, ins)
        except PruneError as e:
            return {}, str(e)
        if len(recorded) < len(others):
            self.reductions_unrecorded += 1
        return recorded, None

    def broadcast_answer(self, g: Group, seq: int, root: int, out: tuple) -> tuple[torch.Tensor | None, str | None]:
        """A serial capture's answer to broadcast ``seq`` on ``g`` from group position ``root`` at the live
        receiver whose output is ``out`` (desc, dtype, shape): (the recorded data, None) where an earlier
        capture recorded it; (None, the problem) where it cannot be answered; (None, None): answer as usual
        (``RECORDED_BROADCAST_RULE``)."""
        if g.fold is None or root not in self._self_mirror.get(g.id, ()):
            return None, None
        dtype = dtype_from_name(out[1])
        nbytes = math.prod(out[2]) * dtype.itemsize
        got = self.answers.get((self._key[g.id], seq))
        if got is not None:
            if got[0] != out[1] or len(got[1]) != nbytes:
                return None, (f"the broadcast recorded for it by an earlier capture is {len(got[1])} bytes of "
                              f"{got[0]}, this capture's receive is {nbytes} bytes of {out[1]}: the "
                              "captures do not run the same program")
            return torch.frombuffer(bytearray(got[1]), dtype=torch.uint8).view(dtype), None
        if dtype.is_floating_point or dtype.is_complex:
            return None, None
        who = self.class_rep[g.ranks[root]]
        when = ("is captured after this one" if self._later(who) else
                f"recorded no such broadcast in its capture (over {RECORD_MAX_BYTES} bytes, or not issued there)")
        return None, (f"broadcast of {out[1]} from virtual rank {g.ranks[root]}, whose class's live rank {who} "
                      f"{when}: integer values steer the program, and self mirror would send this rank's own "
                      "(RECORDED_BROADCAST_RULE)")

    def _later(self, rank: int) -> bool:
        live = list((self.plan_json.get("capture") or {}).get("part", {}).get("sandbox", []))
        return rank in live and self.capture_rank in live and live.index(rank) > live.index(self.capture_rank)

    def record_broadcast(self, g: Group, seq: int, root: int, data: torch.Tensor, dtype: str) -> None:
        """Keep broadcast ``seq`` on ``g`` for later captures when its root is this capture's live rank or
        of its class (what a capture together sends) and another class has members in ``g``; larger than
        RECORD_MAX_BYTES: not kept."""
        if self.class_rep is None or g.fold is None or self.class_rep[g.ranks[root]] != self.capture_rank:
            return
        if not self._self_mirror.get(g.id):  # every member is of this capture's class: no other capture asks
            return
        raw = data.reshape(-1).contiguous().view(torch.uint8)
        if raw.numel() > RECORD_MAX_BYTES:
            return
        name, ranks, k = self._key[g.id]
        self.recorded.append({"group": [name, list(ranks), k], "seq": seq, "dtype": dtype,
                              "data": base64.b64encode(raw.numpy().tobytes()).decode("ascii")})

    def answered_in_rank(self, g: Group, msg: dict) -> str | None:
        """A collective on folded ``g`` that its only live member answered itself (runtime.local_fold):
        count it as the coordinator's answer would be counted; or say why it should not have been
        answered there (LOCAL_RULE)."""
        from prism_megatron.runtime.local_fold import KINDS, LOCAL_RULE

        kind, root = msg["kind"], msg.get("root")
        fold = g.fold
        if self._others.get(g.id) and recordable(kind, sum(desc_bytes(d[0]) for d in msg["ins"])):
            return ("a reduction answered in the rank, but it is small enough for a serial capture to record and "
                    "answer from other classes' recordings (RECORDED_REDUCTION_RULE): the coordinator must see it")
        if len(fold.live_positions) != 1 or kind not in KINDS:
            return (f"answered in the rank, but the group has live members "
                    f"{[g.ranks[p] for p in fold.live_positions][:8]} and {kind} is answered in the rank only "
                    f"by the group's one live member ({' '.join(LOCAL_RULE.split())})")
        if kind == "broadcast" and (root not in fold.live_positions or
                                    sum(desc_bytes(d[0]) for d in msg["ins"]) <= RECORD_MAX_BYTES):
            return ("a broadcast answered in the rank, but its root is virtual or its data small enough for a "
                    "serial capture to record (RECORDED_BROADCAST_RULE): the coordinator must see it")
        self.count(g, kind, root, bool(msg.get("in_place")))
        return None

    def virtual_peer(self, g: Group, msg: dict) -> bool:
        """Whether a send or receive names a virtual group rank (answered by ``pass_through``)."""
        peer = msg.get("peer")
        return g.fold is not None and peer is not None and msg["kind"] in ("send", "recv") and not g.fold.is_live(peer)

    def pass_through(self, g: Group, m: Member, data: DataPlane, deliver: Callable[..., None]) -> str | None:
        """Answer live ``m``'s send to / receive from a virtual neighbour: None, or the fatal problem."""
        return self.passthrough.handle(g, m, data, deliver)

    def finish(self) -> None:
        """At the end of the job: say what pass-through streams still hold (a live receiver never took
        what its virtual neighbour would have sent on: in the full job that send stays unmatched)."""
        for line in self.passthrough.leftovers():
            print(f"prism coordinator: pass-through: {line}", file=sys.stderr, flush=True)

    def count(self, g: Group, kind: str, root: int | None, in_place: bool, recorded: tuple[int, ...] = ()) -> None:
        """Add one op's virtual contributions (cached per group and op shape: O(1) per op after the first);
        ``recorded``: the positions whose contributions came from an earlier capture (a broadcast's root,
        ``broadcast_answer``; other classes' members of a reduction, ``reduction``)."""
        key = (g.id, kind, root, in_place, recorded)
        c = self._per_op.get(key)
        if c is None:
            c = self._per_op[key] = virtual_contributions(kind, g.fold, root=root, in_place=in_place,
                                                          recorded=recorded,
                                                          self_mirror=self._self_mirror.get(g.id, ()))
        self.contributions.add_counts(kind, c)

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``job.fold``: the plan plus the contributions counted so far."""
        out = {**self.plan_json, "contributions": self.contributions.to_json()}
        if self.class_rep is not None:  # a serial capture: what it recorded for later captures
            capture = out["capture"]
            pt = self.passthrough
            recorded = (list(self.recorded), pt.recordings(), pt.unrecorded, list(self.reductions),
                        self.reductions_unrecorded)
            out["capture"] = {**capture, "part": {**capture["part"], **dict(zip(RECORDED_PART_KEYS, recorded,
                                                                                strict=True))}}
        return out


def _read_entries(items: Any, field: str, what: str, entry: Callable[[dict], tuple[tuple, Any]]) -> dict[tuple, Any]:
    """A fold plan's list ``field`` of recorded entries, each ``entry(e)`` -> (key, value); a later entry for
    the same key replaces an earlier one. ValueError naming ``field`` (and the entry) when it is not one."""
    if not isinstance(items, list):
        raise ValueError(f"fold plan field {field!r} is {type(items).__name__}, expected a list")
    out = {}
    for i, e in enumerate(items):
        try:
            key, value = entry(e)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"fold plan field '{field}[{i}]' is not a {what}: {err}") from None
        out[key] = value
    return out


def _group_key(e: dict) -> tuple:
    name, ranks, k = e["group"]
    return str(name), tuple(int(r) for r in ranks), int(k)


def _read_broadcasts(items: Any, field: str) -> dict[tuple, tuple[str, bytes]]:
    """Recorded broadcasts (``Folding.record_broadcast``'s entries) by (group key, seq)."""
    def entry(e: dict) -> tuple[tuple, tuple[str, bytes]]:
        dtype_from_name(e["dtype"])
        return (_group_key(e), int(e["seq"])), (e["dtype"], base64.b64decode(e["data"], validate=True))

    return _read_entries(items, field, "recorded broadcast", entry)


def _read_reductions(items: Any, field: str) -> dict[tuple, tuple[str, list[tuple[str, bytes]], bool]]:
    """Recorded reductions (``Folding.reduction``'s entries) by (group key, seq, rank): (kind, [(dtype, bytes)],
    derived); a later entry replaces an earlier one (a capture taken again)."""
    def entry(e: dict) -> tuple[tuple, tuple[str, list[tuple[str, bytes]], bool]]:
        tensors = []
        for dt, data in e["tensors"]:
            dtype_from_name(dt)
            tensors.append((str(dt), base64.b64decode(data, validate=True)))
        return (_group_key(e), int(e["seq"]), int(e["rank"])), (str(e["kind"]), tensors, bool(e["derived"]))

    return _read_entries(items, field, "recorded reduction", entry)


def _b64(t: torch.Tensor) -> str:
    """A host tensor's bytes, base64 (a recording in the plan's JSON)."""
    return base64.b64encode(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).decode("ascii")


def _read_norms(items: Any, field: str) -> dict[tuple, list[tuple[int, float, bool]]]:
    """Recorded p2p norms (``PassThrough.recordings``' entries) by (group key, sender, receiver); a later
    entry for the same stream replaces an earlier one (a capture taken again: ``nccl_prune.SECOND_PASS_RULE``)."""
    def entry(e: dict) -> tuple[tuple, list[tuple[int, float, bool]]]:
        return (_group_key(e), int(e["src"]), int(e["dst"])), [(int(n), float(v), bool(d)) for n, v, d in e["norms"]]

    return _read_entries(items, field, "recorded p2p stream", entry)


def untranslation(plan: dict[str, Any] | None) -> Callable[[int, int], int] | None:
    """A version-2 plan's translation by coordinates, inverted (``nccl_prune.GroupPlan.untranslate``):
    the rank that v's representative plays where v plays y; None for a plan without coordinates (or no
    plan). The coordinator folds groups with it, and so does a rank that answers a group alone
    (runtime.local_fold): both choose the same all_to_all pieces."""
    if plan is None:
        return None
    coords, sizes = plan.get("coords"), plan.get("sizes")
    if not coords or not sizes:
        return None
    rep = [int(x) for x in plan["rep"]]
    at = {tuple(c): r for r, c in enumerate(coords)}

    def untranslate(v: int, y: int) -> int:
        cv, cm, cy = coords[v], coords[rep[v]], coords[y]
        return at[tuple((a - (b - c)) % n for a, b, c, n in zip(cy, cv, cm, sizes, strict=True))]

    return untranslate
