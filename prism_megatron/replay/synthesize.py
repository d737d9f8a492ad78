"""The full-scale graph of a folded job: every rank of the target, from its live ranks' events.

A virtual rank r does what its representative ``rep[r]`` did, in its own replica (``shift(r) =
r - rep[r]``): it takes rep[r]'s events (compute with host and device times, marks, waits); a
point-to-point peer x becomes x + shift(r); a collective on group R stays on R when r is a member
of R (a group across replicas, e.g. data-parallel), else moves to R + shift(r), a group of r's
replica that the folded run never created (it gets a new id here, one per original group and
shift, so each keeps its own sequence numbers as a communicator would).

Synthesis is only sound when the shifted groups are consistent: every member of R + s must be a
virtual rank that mirrors its own rank - s and is not itself in R (so it, too, moves its R events
to R + s), and every virtual member of a group R the live ranks use must have its representative
in R. Anything else is an error naming the rank and the group: a fold plan that does not describe
the job's symmetry must not give a silently wrong graph.

:func:`fold_graph` goes the other way (keep the live ranks of a full graph): it is how tests and
benchmarks make folded graphs, and with it synthesis can be checked against the original.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..trace.fold import Fold, FoldClass, make_fold
from .graph import Comm, Event, Graph, GraphError, Group


class SynthesisError(GraphError):
    """The fold cannot be unfolded: a shifted peer or group falls outside the job or is inconsistent."""


def fold_graph(graph: Graph, rep: Sequence[int], gpus_per_node: int, classes: Sequence[FoldClass] = (),
               class_of: Sequence[int] = ()) -> Graph:
    """``graph`` (every rank of the job) folded to the ranks ``rep`` names: their events, all groups."""
    fold = make_fold(rep, gpus_per_node, classes, class_of)
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
        self.shifted: dict[tuple[int, int], int] = {}
        self.next_id = max(self.groups, default=-1) + 1
        self.checked: set[int] = set()

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

    def group_for(self, gid: int, rank: int, shift: int) -> int:
        """The group virtual rank ``rank`` joins for its representative's op on ``gid``."""
        if rank in self._members(gid):
            self.check_virtual_members(gid)
            return gid
        key = (gid, shift)
        new = self.shifted.get(key)
        if new is not None:
            return new
        w, rep = self.fold.world_size, self.fold.rep
        source = self.groups[gid]
        ranks = tuple(x + shift for x in source.ranks)
        for y in ranks:
            if not 0 <= y < w:
                raise SynthesisError(
                    f"{self.g.source}: rank {rank} (mirroring rank {rep[rank]}, shift {shift}) would join group "
                    f"{gid} {self._name(gid)}shifted to ranks {list(ranks)}, and rank {y} is outside [0, {w})")
            if rep[y] != y - shift or y in self._members(gid):
                raise SynthesisError(
                    f"{self.g.source}: rank {rank} (mirroring rank {rep[rank]}, shift {shift}) would join group "
                    f"{gid} {self._name(gid)}shifted to ranks {list(ranks)}, but member {y} mirrors rank {rep[y]} "
                    f"(shift {y - rep[y]}){' and is in the original group' if y in self._members(gid) else ''}: "
                    "the shifted group does not exist consistently")
        new = self.shifted[key] = self.next_id
        self.next_id += 1
        name = f"{source.name}+{shift}" if source.name else f"group {gid}+{shift}"
        self.groups[new] = Group(new, ranks, name)
        return new

    def rank_events(self, rank: int) -> list[Event]:
        rep = self.fold.rep[rank]
        shift = rank - rep
        src = self.g.events[rep]
        if shift == 0:
            return src
        w = self.fold.world_size
        out: list[Event] = []
        cache: dict[int, int] = {}
        for i, ev in enumerate(src):
            if type(ev) is not Comm:
                out.append(ev)  # frozen: shared with the representative
                continue
            gid = cache.get(ev.group)
            if gid is None:
                gid = cache[ev.group] = self.group_for(ev.group, rank, shift)
            moved = gid != ev.group
            peer, root = ev.peer, ev.root
            if ev.is_p2p:
                peer = ev.peer + shift
                if not 0 <= peer < w or peer not in self._members(gid):
                    raise SynthesisError(
                        f"{self.g.source}: rank {rank} event {i} ({ev.kind} with peer {ev.peer} of rank {rep}) "
                        f"has shifted peer {peer}, " + (f"outside [0, {w})" if not 0 <= peer < w else
                                                         f"not in group {gid} {self._name(gid)}"))
            elif moved and root >= 0:
                root += shift
            out.append(Comm(ev.kind, gid, ev.seq, peer, root, ev.nbytes, ev.dtype, ev.async_op, ev.label))
        return out


def synthesize(graph: Graph) -> Graph:
    """The graph of every rank of ``graph``'s fold (see the module docstring); not validated here
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
    events = {r: s.rank_events(r) for r in range(fold.world_size)}
    return Graph(s.groups, events, f"{graph.source} (synthesised: {fold.world_size} ranks)", list(graph.notes))
