"""The full-scale graph of a folded job: every rank of the target, from its live ranks' events.

A virtual rank r does what its representative ``rep[r]`` did, translated to r (``Fold.translate``:
by coordinates on the job's parallel axes for a version-2 plan, by ``r - rep[r]`` for a version-1
one): it takes rep[r]'s events (compute with host and device times, marks, waits); a point-to-point
peer x becomes translate(r, x); a collective on group R stays on R when the translation maps R onto
itself (r's own TP, DP or pipeline group when rep[r] is in it too; for a version-1 plan, any group
r is a member of), else moves to the translated group {translate(r, x) for x in R}, a group that the
folded run never created (it gets a new id here, one per original group and translation, so each
keeps its own sequence numbers as a communicator would). A virtual rank on another pipeline stage than
its representative (a middle stage folded at class depth) runs its own stage's schedule: its units
(the same compute as rep[r]'s units of the same microbatch) are put in its stage's order by
replay.stage_schedule before the translation.

Synthesis is only sound when the translated groups are consistent: every member y of a translated
group must be a virtual rank that mirrors a member of R and translates R to the same group (so it,
too, moves its R events there), and is not itself in R; a rank in R whose translation moves R would
have to play two parts. Every virtual member of a group R the live ranks use must have its
representative in R. Anything else is an error naming the rank and the group: a fold plan that does
not describe the job's symmetry must not give a silently wrong graph.

:func:`fold_graph` goes the other way (keep the live ranks of a full graph): it is how tests and
benchmarks make folded graphs, and with it synthesis can be checked against the original.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..trace.fold import Fold, FoldClass, make_fold
from .graph import Comm, Event, Graph, GraphError, Group
from .stage_schedule import ScheduleError, restage


class SynthesisError(GraphError):
    """The fold cannot be unfolded: a translated peer or group falls outside the job or is inconsistent."""


def fold_graph(graph: Graph, rep: Sequence[int], gpus_per_node: int, classes: Sequence[FoldClass] = (),
               class_of: Sequence[int] = (), *, depth: str = "replica", axes: Sequence[str] = (),
               sizes: Sequence[int] = (), coords: Sequence[Sequence[int]] = (), schedule: str = "",
               warmup: Sequence[int] = (), chunks: int = 1, group: int = 0, overlap_p2p: bool = False,
               wait_sends: bool = False) -> Graph:
    """``graph`` (every rank of the job) folded to the ranks ``rep`` names: their events, all groups.
    ``coords`` (with ``axes``, ``sizes``, ``depth``; ``schedule``, ``warmup``, ``chunks``, ``group``,
    ``overlap_p2p``, ``wait_sends``): a version-2 fold (see trace.fold)."""
    fold = make_fold(rep, gpus_per_node, classes, class_of, depth=depth, axes=axes, sizes=sizes, coords=coords,
                     schedule=schedule, warmup=warmup, chunks=chunks, group=group, overlap_p2p=overlap_p2p,
                     wait_sends=wait_sends)
    if sorted(graph.events) != list(range(fold.world_size)):
        raise GraphError(f"{graph.source}: fold_graph needs every rank 0..{fold.world_size - 1}; "
                         f"the graph has {len(graph.events)}")
    return Graph(dict(graph.groups), {r: graph.events[r] for r in fold.live}, f"{graph.source} (folded)",
                 list(graph.notes), fold)


class _Synthesis:
    def __init__(self, graph: Graph, fold: Fold) -> None:
        self.g, self.fold = graph, fold
        self.groups: dict[int, Group] = dict(graph.groups)
        self.members: dict[int, frozenset[int]] = {}
        self.moved: dict[tuple[int, tuple[int, ...]], int] = {}  # (group, its translation) -> group it lands on
        self.free: dict[int, tuple[bool, ...]] = {}
        self.next_id = max(self.groups, default=-1) + 1
        self.checked: set[int] = set()
        self.staged: dict[tuple[int, int], list[Event]] = {}  # (rep, stage) -> rep's units in that stage's order
        self.pp_axis = fold.axes.index("pp") if "pp" in fold.axes else -1

    def _members(self, gid: int) -> frozenset[int]:
        m = self.members.get(gid)
        if m is None:
            m = self.members[gid] = frozenset(self.groups[gid].ranks)
        return m

    def check_virtual_members(self, gid: int) -> None:
        """Every virtual member of a group the live ranks use mirrors a member of that group."""
        if gid in self.checked:
            return
        self.checked.add(gid)
        rep, members = self.fold.rep, self._members(gid)
        for y in self.groups[gid].ranks:
            if rep[y] not in members:
                raise SynthesisError(
                    f"{self.g.source}: group {gid} {self._name(gid)}has virtual member {y} whose representative "
                    f"{rep[y]} is not in the group: its part in the group's ops is not a mirror of a member")

    def _name(self, gid: int) -> str:
        g = self.groups[gid]
        ranks = list(g.ranks)
        shown = ranks if len(ranks) <= 8 else [*ranks[:4], "...", *ranks[-2:]]
        return f"({g.name + ', ' if g.name else ''}ranks {shown}) "

    def _key(self, gid: int, offset: tuple[int, ...]) -> tuple[int, ...]:
        """The part of ``offset`` that moves group ``gid``: version 2 drops the axes along which the group
        is invariant (a DP group moved along dp is itself), so that a translated group is made once."""
        fold = self.fold
        if not fold.coords:
            return offset
        free = self.free.get(gid)
        if free is None:
            free = self.free[gid] = fold.invariant_axes(self.groups[gid].ranks)
        return tuple(0 if f else d for f, d in zip(free, offset, strict=True))

    def _how(self, offset: tuple[int, ...]) -> str:
        if not self.fold.coords:
            return f"shift {offset[0]}"
        return "offset " + (", ".join(f"{a}+{d}" for a, d in zip(self.fold.axes, offset, strict=True) if d) or "0")

    def _where(self, rank: int, offset: tuple[int, ...]) -> str:
        return f"rank {rank} (mirroring rank {self.fold.rep[rank]}, {self._how(offset)})"

    def group_for(self, gid: int, rank: int, offset: tuple[int, ...]) -> int:
        """The group virtual rank ``rank`` joins for its representative's op on ``gid``."""
        members = self._members(gid)
        v2 = bool(self.fold.coords)
        key = self._key(gid, offset)
        if rank in members and (not v2 or not any(key)):
            self.check_virtual_members(gid)
            return gid
        found = self.moved.get((gid, key))
        if found is not None:
            return found
        w, rep, fold = self.fold.world_size, self.fold.rep, self.fold
        source = self.groups[gid]
        ranks = tuple(fold.translate_by(key, x) for x in source.ranks)
        if v2 and frozenset(ranks) == members:  # a group the translation maps onto itself
            self.check_virtual_members(gid)
            self.moved[(gid, key)] = gid
            return gid
        if rank in members:
            raise SynthesisError(
                f"{self.g.source}: {self._where(rank, offset)} is a member of group {gid} {self._name(gid)}but "
                f"its representative's group translates to other ranks {_short(ranks)}: rank {rank} would have "
                "to play a part in both")
        for y in ranks:
            if not 0 <= y < w:
                raise SynthesisError(
                    f"{self.g.source}: {self._where(rank, offset)} would join group {gid} {self._name(gid)}"
                    f"translated to ranks {_short(ranks)}, and rank {y} is outside [0, {w})")
            if y in members or rep[y] not in members or self._key(gid, fold.offset(y)) != key:
                raise SynthesisError(
                    f"{self.g.source}: {self._where(rank, offset)} would join group {gid} {self._name(gid)}"
                    f"translated to ranks {_short(ranks)}, but member {y} mirrors rank {rep[y]} "
                    f"({self._how(fold.offset(y))})"
                    f"{' and is in the original group' if y in members else ''}: "
                    "the translated group does not exist consistently")
        new = self.moved[(gid, key)] = self.next_id
        self.next_id += 1
        tag = ",".join(str(d) for d in key)
        name = f"{source.name}+({tag})" if source.name else f"group {gid}+({tag})"
        self.groups[new] = Group(new, ranks, name)
        return new

    def program(self, rank: int, rep: int) -> list[Event]:
        """rep's events, or for a rank on another pipeline stage, rep's units in that stage's order."""
        src = self.g.events[rep]
        if self.pp_axis < 0:
            return src
        stage = self.fold.coords[rank][self.pp_axis]
        if stage == self.fold.coords[rep][self.pp_axis]:
            return src
        key = (rep, stage)
        if key not in self.staged:
            members = {gid: g.ranks for gid, g in self.groups.items()}
            try:
                self.staged[key] = restage(src, self.fold, rep, stage, members, self.g.source)
            except ScheduleError as e:
                raise SynthesisError(f"{e} (needed for rank {rank}, a folded pipeline stage)") from None
        return self.staged[key]

    def rank_events(self, rank: int) -> list[Event]:
        rep = self.fold.rep[rank]
        if rank == rep:
            return self.g.events[rep]
        src = self.program(rank, rep)
        offset = self.fold.offset(rank)
        translate = self.fold.translate_by
        w = self.fold.world_size
        out: list[Event] = []
        cache: dict[int, int] = {}
        for i, ev in enumerate(src):
            if type(ev) is not Comm:
                out.append(ev)  # frozen: shared with the representative
                continue
            gid = cache.get(ev.group)
            if gid is None:
                gid = cache[ev.group] = self.group_for(ev.group, rank, offset)
            moved = gid != ev.group
            peer, root = ev.peer, ev.root
            if ev.is_p2p:
                peer = translate(offset, ev.peer)
                if not 0 <= peer < w or peer not in self._members(gid):
                    raise SynthesisError(
                        f"{self.g.source}: rank {rank} event {i} ({ev.kind} with peer {ev.peer} of rank {rep}) "
                        f"has translated peer {peer}, " + (f"outside [0, {w})" if not 0 <= peer < w else
                                                            f"not in group {gid} {self._name(gid)}"))
            elif moved and root >= 0:
                root = translate(offset, root)
            same = gid == ev.group and peer == ev.peer and root == ev.root  # then shared, as frozen
            out.append(ev if same else ev.but(group=gid, peer=peer, root=root))
        return out


def _short(ranks: Sequence[int]) -> str:
    return str(list(ranks)) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:4]))}, ..., {ranks[-1]}]"


def synthesize(graph: Graph, ranks: Iterable[int] | None = None) -> Graph:
    """The graph of every rank of ``graph``'s fold (see the module docstring), or of ``ranks`` only
    (with every group: the pipeline replay of replay.folded); unfolded and not validated here
    (``replay`` validates its input)."""
    fold = graph.fold
    if fold is None:
        raise GraphError(f"{graph.source}: not a folded graph; nothing to synthesise")
    missing = [r for r in fold.live if r not in graph.events]
    if missing:
        raise GraphError(f"{graph.source}: folded graph lacks live rank(s) {missing[:8]}")
    s = _Synthesis(graph, fold)
    for gid in sorted({ev.group for evs in graph.events.values() for ev in evs if type(ev) is Comm}):
        s.check_virtual_members(gid)
    which = range(fold.world_size) if ranks is None else sorted(ranks)
    events = {r: s.rank_events(r) for r in which}
    what = f"{fold.world_size} ranks" if ranks is None else f"{len(events)} of {fold.world_size} ranks"
    return Graph(s.groups, events, f"{graph.source} (synthesised: {what})", list(graph.notes))
