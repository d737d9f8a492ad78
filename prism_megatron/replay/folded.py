"""Replay of a folded graph by a method that is exact for it, and the sentence that says which.

A folded graph holds its live ranks' events; the job is every rank, each virtual rank doing what its
representative does, translated (replay.synthesize). Three ways to replay it:

- ``symmetric``: replay the live ranks only (engine, ``Graph.fold``); a collective over a group with
  virtual members starts when its live members issue it and is costed for the whole group. Exact
  when every virtual rank runs in lockstep with a live rank: ranks that differ by the fold's
  *lockstep steps* (``Fold.lockstep_steps``: TP/CP/DP peers) run the same program translated, so each
  issues every op when its live peer does.
- ``pipeline``: folded middle pipeline stages are not in lockstep with their representative (a
  stage's timeline is offset from its neighbours', each runs its own stage's order of units
  (replay.stage_schedule), and a live stage receives from a virtual one). Synthesise the ranks that
  are not lockstep peers of one another (one pipeline: every stage at the live ranks' TP/CP/DP
  position) and replay those symmetrically, the rest of the job being their lockstep peers.
- ``full``: synthesise every rank and replay all of them (exact, slow at thousands of ranks).

``auto`` takes the first of symmetric/pipeline that applies and checks what makes it exact: every
p2p partner of a replayed rank is replayed; every member of a group the replayed ranks use is a
lockstep peer of a replayed member of that group, and the group is the same set for both; and the
cost function gives a group the same cost as its lockstep translates (the placement on nodes is as
symmetric as the fold: checked op by op after the replay). Otherwise it falls back to ``full`` and the
graph's notes say why. A version-1 fold (no coordinates) cannot check the last two and is replayed
symmetrically when its p2p partners are live, as before.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import TYPE_CHECKING

from .graph import Comm, Graph, GraphError

if TYPE_CHECKING:
    from ..trace.fold import Fold
    from .engine import CommSpec, CostFn, ReplayResult

#: The ways a folded graph can be replayed (``auto``: the fastest exact one).
FOLD_METHODS: tuple[str, ...] = ("auto", "symmetric", "pipeline", "full")


class _NotExact(Exception):
    """Why a faster method is not exact for this graph (auto then falls back to full)."""


def describe(method: str, replayed: int, world: int) -> str:
    """The sentence reports and the CLI print for the method used."""
    if method == "symmetric":
        return f"symmetric replay of the live ranks ({replayed}; the others are their lockstep peers)"
    if method == "pipeline":
        return (f"replay of {replayed} synthesised ranks (one pipeline: the folded stages included), symmetric "
                "over their lockstep (TP/CP/DP) peers")
    return f"replay of the synthesised graph of every rank ({world})"


def lockstep(fold: Fold) -> tuple[tuple[int, ...], list[int], list[int]]:
    """(the lockstep steps, the ranks to replay, for every rank the replayed rank it runs in lockstep with).

    A rank's lockstep partner is the rank translated from it by the multiples of the lockstep steps
    in its offset from its representative (so it has the same representative); the replayed ranks
    are those partners (the live ranks among them). Version 1: ((), live, rep).
    """
    if not fold.coords:
        return (), list(fold.live), list(fold.rep)
    steps = fold.lockstep_steps()
    partner = []
    for y in range(fold.world_size):
        off = fold.offset(y)
        back = tuple((-(d - d % k)) % n for d, k, n in zip(off, steps, fold.sizes, strict=True))
        partner.append(fold.translate_by(back, y))
    return steps, sorted(set(partner)), partner


def replay_folded(graph: Graph, cost: CostFn, method: str = "auto", serialize: bool = True) -> ReplayResult:
    """Replay the folded ``graph`` by ``method`` (see the module docstring); the result's ``method``
    says which was used. The result's graph is the one replayed: the live ranks, one synthesised
    pipeline (its fold then names the replayed ranks live and each rank's lockstep partner as its
    rep), or every rank (not folded)."""
    from .engine import _Replay

    fold = graph.fold
    if fold is None:
        raise GraphError(f"{graph.source}: not a folded graph")
    if method not in FOLD_METHODS:
        raise ValueError(f"fold replay method {method!r}: expected one of {', '.join(FOLD_METHODS)}")
    why = ""
    if method != "full":
        steps, ranks, partner = lockstep(fold)
        fast = "symmetric" if ranks == list(fold.live) else "pipeline"
        if method not in ("auto", fast):
            raise GraphError(f"{graph.source}: the {method} replay does not apply to this fold; "
                             f"{describe(fast, len(ranks), fold.world_size)} does")
        try:
            sub = graph if fast == "symmetric" else _pipeline_graph(graph, ranks)
            sub = Graph(sub.groups, sub.events, sub.source, sub.notes,
                        replace(fold, live=tuple(ranks), rep=tuple(partner)))
            _check_partners(sub)
            recorded = _Recording(cost)
            result = _Replay(sub, recorded, serialize).run()
            _check_costs(sub.fold, steps, recorded)
            result.method = describe(fast, len(ranks), fold.world_size)
            return result
        except _NotExact as e:
            if method != "auto":
                raise GraphError(f"{graph.source}: the {fast} replay would not be exact: {e}") from None
            why = f"replayed every rank: the {fast} replay would not be exact ({e})"
    from .synthesize import synthesize

    full = synthesize(graph)
    if why:
        full.notes.append(why)
    result = _Replay(full, cost, serialize).run()
    result.method = describe("full", fold.world_size, fold.world_size)
    return result


def _pipeline_graph(graph: Graph, ranks: list[int]) -> Graph:
    from .synthesize import synthesize

    return synthesize(graph, ranks)


def _check_partners(graph: Graph) -> None:
    """The replayed ranks' p2p partners are replayed; every member of a group they use is the lockstep
    peer of a member, and (with coordinates) the translation between them keeps the group."""
    fold = graph.fold
    replayed = frozenset(fold.live)
    seen: set[int] = set()
    for r, evs in graph.events.items():
        for i, ev in enumerate(evs):
            if type(ev) is not Comm:
                continue
            if ev.is_p2p and ev.peer not in replayed:
                raise _NotExact(f"rank {r} event {i} ({ev.kind}) has p2p partner {ev.peer}, which is not replayed")
            if ev.group in seen:
                continue
            seen.add(ev.group)
            group = graph.groups[ev.group]
            members = frozenset(group.ranks)
            free = fold.invariant_axes(group.ranks) if fold.coords else ()
            for y in group.ranks:
                p = fold.rep[y]
                if p not in members:
                    raise _NotExact(f"group {ev.group} ({group.name or 'unnamed'}) has member {y} whose lockstep "
                                    f"peer {p} is not in it")
                if fold.coords and p != y and any(d and not f for d, f in zip(fold.offset(y), free, strict=True)):
                    raise _NotExact(f"group {ev.group} ({group.name or 'unnamed'}) is not the same set for member "
                                    f"{y} as for its lockstep peer {p}")


class _Recording:
    """A cost function that remembers every distinct op it costed (to check their translates)."""

    def __init__(self, cost: CostFn) -> None:
        self.cost = cost
        self.seen: dict[tuple, tuple[CommSpec, float]] = {}

    def __call__(self, spec: CommSpec) -> float:
        key = (spec.kind, spec.nbytes, spec.group, spec.src, spec.dst, spec.root, spec.dtype)
        hit = self.seen.get(key)
        if hit is None:
            hit = self.seen[key] = (spec, float(self.cost(spec)))
        return hit[1]


def _check_costs(fold: Fold, steps: tuple[int, ...], recorded: _Recording) -> None:
    """Every costed op costs the same on each translate of its group by lockstep steps (where its
    lockstep peers run it): the symmetric replay charged them all the cost of the replayed one."""
    from .engine import CommSpec

    if not fold.coords:
        return
    new = object.__new__
    for spec, c in recorded.seen.values():
        free = fold.invariant_axes(spec.ranks)
        moving = [a for a, (k, n) in enumerate(zip(steps, fold.sizes, strict=True)) if k < n and not free[a]]
        for moves in itertools.product(*(range(0, fold.sizes[a], steps[a]) for a in moving)):
            if not any(moves):
                continue
            off = [0] * len(fold.sizes)
            for a, k in zip(moving, moves, strict=True):
                off[a] = k

            def move(x: int, off: list[int] = off) -> int:
                return fold.translate_by(off, x) if x >= 0 else x

            other = new(CommSpec)
            other.__dict__.update(spec.__dict__, ranks=tuple(move(x) for x in spec.ranks), src=move(spec.src),
                                  dst=move(spec.dst), root=move(spec.root))
            c2 = float(recorded.cost(other))
            if not math.isclose(c2, c, rel_tol=1e-9, abs_tol=1e-15):
                raise _NotExact(f"{spec.kind} of {spec.nbytes} B on ranks {_short(spec.ranks)} costs {c:.6g} s, but "
                                f"{c2:.6g} s on its translate {_short(other.ranks)} (the placement on nodes is not "
                                "symmetric under the fold)")


def _short(ranks: tuple[int, ...]) -> str:
    return str(list(ranks)) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:4]))}, ..., {ranks[-1]}]"
