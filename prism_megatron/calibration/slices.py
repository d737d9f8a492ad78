"""The slice planner: which logical ranks run together, for real, in one calibration slice.

A slice is a set of at most ``devices * ranks_per_device`` ranks that runs concurrently on the
physical GPUs while every other rank is replayed. Only communication whose members all ran in
one slice is measured for real; everything else is costed by the collective model. So the groups
that carry the most traffic must land whole in one slice: a group is *coupled* when its
collective bytes per member rank reach ``couple`` times those of the heaviest group (in a Megatron
graph that selects the tensor-parallel groups, and expert/context groups when they are as busy;
the planner decides from the graph's bytes, not from Megatron's layout). Overlapping coupled
groups must share a slice, so they are merged; a merged unit that does not fit is an error naming
its groups and sizes. Point-to-point traffic never couples: a send and its recv are aligned
through their dependency edge whichever slices they ran in.

Units are then packed in order of their lowest rank, which keeps contiguous ranks (whole
pipeline stages, in Megatron's rank order) together; next-fit is used unless first-fit needs
fewer slices. The plan is a pure function of the graph and the arguments.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from ..replay.graph import P2P_KINDS, Comm, Graph


class SliceError(ValueError):
    """No valid slice plan: a coupled group (or a union of overlapping ones) exceeds a slice."""


@dataclass(frozen=True)
class GroupTraffic:
    """What one process group carries over the whole graph, summed over its members' events."""

    group: int
    name: str
    ranks: tuple[int, ...]
    collective_bytes: int
    collective_ops: int
    p2p_bytes: int

    @property
    def bytes_per_rank(self) -> float:
        """Collective bytes per member: the coupling weight (independent of the group's size)."""
        return self.collective_bytes / max(len(self.ranks), 1)

    def describe(self) -> str:
        name = f" '{self.name}'" if self.name else ""
        return (f"group {self.group}{name} ({len(self.ranks)} ranks, "
                f"{self.bytes_per_rank / 2**20:.3g} MiB of collectives per rank)")


@dataclass(frozen=True)
class Slice:
    """One slice: its ranks (ascending) and the coupled groups it holds whole."""

    index: int
    ranks: tuple[int, ...]
    groups: tuple[int, ...] = ()


def group_traffic(graph: Graph) -> list[GroupTraffic]:
    """Per-group traffic of ``graph``, heaviest collective bytes per rank first (ties: group id)."""
    coll: dict[int, int] = dict.fromkeys(graph.groups, 0)
    ops: dict[int, int] = dict.fromkeys(graph.groups, 0)
    p2p: dict[int, int] = dict.fromkeys(graph.groups, 0)
    for evs in graph.events.values():
        for ev in evs:
            if isinstance(ev, Comm) and ev.group in coll:
                if ev.kind in P2P_KINDS:
                    p2p[ev.group] += ev.nbytes
                else:
                    coll[ev.group] += ev.nbytes
                    ops[ev.group] += 1
    out = [GroupTraffic(g.id, g.name, tuple(g.ranks), coll[g.id], ops[g.id], p2p[g.id])
           for g in graph.groups.values()]
    return sorted(out, key=lambda t: (-t.bytes_per_rank, t.group))


def coupled_groups(traffic: list[GroupTraffic], couple: float | Collection[int]) -> list[GroupTraffic]:
    """The groups to keep whole: those at ``couple`` x the heaviest bytes per rank, or the ids given."""
    if isinstance(couple, (int, float)) and not isinstance(couple, bool):
        if not 0 < couple <= 1:
            raise ValueError(f"couple={couple}: expected a fraction in (0, 1] or a collection of group ids")
        multi = [t for t in traffic if len(set(t.ranks)) > 1 and t.collective_bytes > 0]
        if not multi:
            return []
        bar = couple * max(t.bytes_per_rank for t in multi)
        return [t for t in multi if t.bytes_per_rank >= bar]
    wanted = set(couple)
    unknown = sorted(wanted - {t.group for t in traffic})
    if unknown:
        raise ValueError(f"couple names unknown group id(s) {unknown}")
    return [t for t in traffic if t.group in wanted]


def _units(world: list[int], coupled: list[GroupTraffic], capacity: int, why: str) -> list[tuple[list[int], list[int]]]:
    """Union-find over coupled groups: (ranks, group ids) per unit, by lowest rank."""
    parent = {r: r for r in world}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    hint = "use more devices or ranks per device, or choose the groups to keep whole with 'couple'"
    for t in coupled:
        if len(set(t.ranks)) > capacity:
            raise SliceError(f"{t.describe()} is tightly coupled and must run in one slice, but a slice holds at "
                             f"most {capacity} ranks ({why}); {hint}")
        for r in t.ranks[1:]:
            a, b = find(t.ranks[0]), find(r)
            if a != b:
                parent[max(a, b)] = min(a, b)
    ranks: dict[int, list[int]] = {}
    for r in world:
        ranks.setdefault(find(r), []).append(r)
    groups: dict[int, list[int]] = {}
    for t in coupled:
        groups.setdefault(find(t.ranks[0]), []).append(t.group)
    for root, members in ranks.items():
        if len(members) > capacity:
            names = ", ".join(t.describe() for t in coupled if find(t.ranks[0]) == root)
            raise SliceError(f"overlapping coupled groups must share a slice, but together they span "
                             f"{len(members)} ranks and a slice holds at most {capacity} ({why}): {names}; {hint}")
    return [(ranks[root], sorted(groups.get(root, []))) for root in sorted(ranks)]


def _pack(sizes: list[int], capacity: int, first_fit: bool) -> list[list[int]]:
    bins: list[list[int]] = []
    room: list[int] = []
    for i, n in enumerate(sizes):
        candidates = range(len(bins)) if first_fit else range(max(len(bins) - 1, 0), len(bins))
        target = next((b for b in candidates if room[b] >= n), None)
        if target is None:
            bins.append([])
            room.append(capacity)
            target = len(bins) - 1
        bins[target].append(i)
        room[target] -= n
    return bins


def plan_slices(graph: Graph, devices: int, ranks_per_device: int = 1, *,
                couple: float | Collection[int] = 0.5) -> list[Slice]:
    """Split the ranks of ``graph`` into slices that each fit ``devices * ranks_per_device`` ranks.

    ``couple`` is a fraction in (0, 1] (keep whole every group whose collective bytes per rank are
    at least that fraction of the heaviest group's) or an explicit collection of group ids. Every
    rank (of the events or of any group) lands in exactly one slice. Raises SliceError when a
    coupled group, or a union of overlapping coupled groups, cannot fit in one slice.
    """
    if devices < 1 or ranks_per_device < 1:
        raise ValueError(f"devices={devices}, ranks_per_device={ranks_per_device}: both must be >= 1")
    capacity = devices * ranks_per_device
    why = f"{devices} device(s) x {ranks_per_device} rank(s) per device"
    world = sorted(set(graph.events) | {r for g in graph.groups.values() for r in g.ranks})
    units = _units(world, coupled_groups(group_traffic(graph), couple), capacity, why)
    sizes = [len(ranks) for ranks, _ in units]
    bins = _pack(sizes, capacity, first_fit=False)
    tighter = _pack(sizes, capacity, first_fit=True)
    if len(tighter) < len(bins):
        bins = tighter
    return [Slice(i, tuple(sorted(r for u in b for r in units[u][0])), tuple(sorted(g for u in b for g in units[u][1])))
            for i, b in enumerate(bins)]
