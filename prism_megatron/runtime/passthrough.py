"""The coordinator's side of p2p with a virtual pipeline neighbour: pass-through streams.

The rule (which live send answers which live receive) is ``nccl_prune.passthrough``'s; this module
keeps the messages in flight. A live rank's send to a virtual neighbour completes at once: the
sender may reuse its buffer then, so its data are copied — into the coordinator's host memory, where
the data plane (runtime.dataplane: the ranks' shared-memory segments, on a GPU too) holds every
payload — but only when a live rank downstream will receive them, and dropped when it has. A receive
posted first waits in its stream and takes the data straight from the send's segment. In a serial
capture a receive with no other live rank upstream is answered at once by a stand-in
(``nccl_prune.passthrough.STANDIN_RULE``) scaled to the norm an earlier capture recorded for that message;
every capture records the norms of the messages it sends to a virtual neighbour for the later ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from nccl_prune import Contributions, PruneError
from nccl_prune.contributions import STANDIN
from nccl_prune.passthrough import RULE_IN_SHORT, Route, recorded_stream, route_recv, route_send, standin_values
from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.dataplane import DataPlane
from prism_megatron.runtime.groups import Group, GroupTable
from prism_megatron.runtime.matching import Member

#: deliver(member, outputs, src group rank): write a member's outputs and complete its op
Deliver = Callable[..., None]
#: a recorded stream (STANDIN_RULE): (group key (name, ranks, incarnation), sender rank, receiver rank)
StreamKey = tuple[tuple, int, int]


@dataclass
class _Kept:
    data: torch.Tensor  # the coordinator's copy (flat, host)
    dtype: str
    shape: list[int]
    rank: int  # the sender


@dataclass
class _Stream:
    """Live U's sends to its virtual neighbour w, and the receives of the live rank that consumes them."""

    kept: deque[_Kept] = field(default_factory=deque)
    waiting: deque[Member] = field(default_factory=deque)
    sent: int = 0
    received: int = 0


class PassThrough:
    """Every pass-through stream of a folded job, and the count of receives it answered."""

    def __init__(self, contributions: Contributions, standin: bool = False,
                 elsewhere: frozenset[int] = frozenset(), sandbox: frozenset[int] = frozenset(),
                 norms: dict[StreamKey, list[tuple[int, float, bool]]] | None = None,
                 key: Callable[[Group], tuple] | None = None) -> None:
        self.contributions = contributions
        self.standin = standin  # a serial capture: STANDIN_RULE answers a receive with no other live rank upstream
        self.elsewhere = elsewhere  # a serial capture: the fold's live ranks captured in other captures
        self.sandbox = sandbox  # a serial capture: the fold's live ranks, whose captures record their sends
        # earlier captures' recordings: (numel, L2 norm, derived) per message, in send order; derived: sent after
        # its capture gave a stand-in of that direction without a recording (its scale may be the fallback's)
        self.norms = norms or {}
        self._key = key or (lambda g: (g.name, tuple(g.ranks), 0))
        self.sent: dict[StreamKey, list[tuple[int, float, bool]]] = {}  # this capture's recordings, for later ones
        self._taken: dict[StreamKey, int] = {}  # stand-ins answered per recorded stream
        self.unrecorded = 0  # stand-ins with neither a recording of their own nor this rank's own scale
        self._own: dict[tuple[bool, int], float] = {}  # (backward, numel) -> this rank's first such send's norm
        self._derived = {False: False, True: False}  # per direction (backward): a stand-in without a recording given
        self._standins: dict[tuple, torch.Tensor] = {}  # (dtype, numel, backward | None) -> its stand-in
        self.groups: dict[int, Group] = {}  # groups with streams (each in Group.passthrough, keyed (U, w))
        self._routes: dict[tuple[int, str, int, int], Route] = {}  # (group id, kind, me, peer): O(1) per op

    def handle(self, g: Group, m: Member, data: DataPlane, deliver: Deliver) -> str | None:
        """Answer live member ``m``'s send to / receive from a virtual group rank (``m.msg["peer"]``);
        None, or the fatal problem (naming ranks, shapes and the rule)."""
        peer = m.msg["peer"]
        key = (g.id, m.kind, m.grank, peer)
        route = self._routes.get(key)
        if route is None:
            try:
                elsewhere = g.ranks[peer] in self.elsewhere
                route = (route_send(g.fold, m.grank, peer, standin=self.standin, elsewhere=elsewhere)
                         if m.kind == "send" else
                         route_recv(g.fold, m.grank, peer, standin=self.standin, elsewhere=elsewhere))
            except PruneError as e:
                return str(e)
            self._routes[key] = route
        if route.standin:
            backward = _backward(m, route)
            if backward is None:
                return (f"rank {m.rank} receives from virtual rank {g.ranks[peer]} on group {g.name!r}, which is not "
                        f"its neighbour in the group's order, and the op's label ({m.msg.get('label') or 'none'!r}) "
                        "names no direction: its stand-in would not know whether it is an activation or a gradient "
                        "(STANDIN_RULE)")
            return self._stand_in(g, m, peer, route, backward, deliver)
        s = g.passthrough.get(route.stream)
        if s is None:
            s = g.passthrough[route.stream] = _Stream()
            self.groups[g.id] = g
        if m.kind == "send":
            GroupTable.p2p_seq(g, m.record, m.grank, peer)
            n, s.sent = s.sent, s.sent + 1
            if s.waiting:
                recv = s.waiting.popleft()
                problem = self._check(g, m, recv, route, n)
                if problem is not None:
                    return problem
                self._answer(recv, data.read(m.msg["ins"][0][0], m.msg["ins"][0][1]).reshape(-1), deliver)
            elif route.consumer is not None:  # the sender may reuse its buffer once this send completes
                desc, dt, shape = m.msg["ins"][0]
                s.kept.append(_Kept(data.read(desc, dt).reshape(-1).clone(), dt, list(shape), m.rank))
            elif self.standin:  # consumed by no one in this capture: its norm answers a later capture's stand-in
                self._record(g, m, peer, data)
            deliver(m, [])
            return None
        GroupTable.p2p_seq(g, m.record, peer, m.grank)
        n, s.received = s.received, s.received + 1
        if not s.kept:
            s.waiting.append(m)
            return None
        k = s.kept.popleft()
        problem = self._check_kept(g, k, m, route, n)
        if problem is not None:
            return problem
        self._answer(m, k.data, deliver)
        return None

    def _stand_in(self, g: Group, m: Member, peer: int, route: Route, backward: bool,
                  deliver: Deliver) -> str | None:
        """STANDIN_RULE: the receive gets the seeded stand-in of its posted dtype and shape at once, scaled to
        the recorded norm of the message a capture together would deliver, else the unit fallback."""
        GroupTable.p2p_seq(g, m.record, peer, m.grank)
        _, dt, shape = m.msg["outs"][0]
        numel = 1
        for n in shape:
            numel *= int(n)
        norm = None
        if self.sandbox:
            try:
                sender, to = recorded_stream(g.ranks, self.sandbox, m.grank, peer, route.step)
            except PruneError as e:
                return str(e)
            k = (self._key(g), sender, to)
            n = self._taken.get(k, 0)
            self._taken[k] = n + 1
            got = self.norms.get(k, ())
            recorded = got[n] if n < len(got) else None
            if recorded is not None and recorded[0] != numel:
                return (f"rank {m.rank}'s receive {n} from virtual rank {g.ranks[peer]} on group {g.name!r} "
                        f"posts {numel} elements, but message {n} that rank {sender} sent to rank {to} was "
                        f"{recorded[0]} elements when its capture recorded it (STANDIN_RULE): the captures do not "
                        "run the same program")
            own = self._own.get((backward, numel))
            if recorded is not None and not recorded[2]:
                norm = recorded[1]  # recorded
            elif own is not None:
                norm = own  # own scale
            else:  # a recording derived from stand-ins without one, or the unit fallback
                norm = recorded[1] if recorded is not None else None
                self.unrecorded += 1
                self._derived[backward] = True
        else:
            self.unrecorded += 1
        try:
            values = self._values(dt, numel, backward, norm)
        except PruneError as e:
            return str(e)
        deliver(m, [values], src=peer)
        self.contributions.add_passthrough("recv", how=STANDIN)
        return None

    def _values(self, dt: str, numel: int, backward: bool, norm: float | None) -> torch.Tensor:
        """The stand-in's values (the seeded direction kept once per dtype and size)."""
        if norm is None:
            key = (dt, numel, backward)
            if key not in self._standins:
                self._standins[key] = standin_values(P.dtype_from_name(dt), numel, backward)
            return self._standins[key]
        dtype = P.dtype_from_name(dt)
        key = (dt, numel, None)
        if key not in self._standins:
            work = torch.float64 if dtype.itemsize >= 8 else torch.float32
            if not (dtype.is_floating_point or dtype.is_complex):
                work = dtype  # standin_values refuses it by name
            self._standins[key] = standin_values(work, numel, norm=1.0)
        return self._standins[key].mul(norm).to(dtype)

    def _record(self, g: Group, m: Member, peer: int, data: DataPlane) -> None:
        """Keep the L2 norm of send ``m`` (floating point) for later captures' stand-ins (STANDIN_RULE)."""
        desc, dt, shape = m.msg["ins"][0]
        dtype = P.dtype_from_name(dt)
        if not (dtype.is_floating_point or dtype.is_complex):
            return
        t = data.read(desc, dt).reshape(-1)
        norm = float(torch.linalg.vector_norm(t if t.dtype in (torch.float32, torch.float64) else t.float()))
        backward = _send_backward(m, g, peer)
        derived = any(self._derived.values()) if backward is None else self._derived[backward]
        self.sent.setdefault((self._key(g), m.rank, g.ranks[peer]), []).append((t.numel(), norm, derived))
        if backward is not None and not derived:
            self._own.setdefault((backward, t.numel()), norm)

    @property
    def derived(self) -> bool:
        """Whether this capture gave a stand-in without a recording of its own (STANDIN_RULE (3), (4)) so far:
        what it computes from then on may carry the fallback's scale (a recording it makes is *derived*)."""
        return any(self._derived.values())

    def recordings(self) -> list[dict]:
        """This capture's recorded norms as JSON (``capture.part.p2p_norms``): one entry per stream."""
        return [{"group": [k[0][0], list(k[0][1]), k[0][2]], "src": k[1], "dst": k[2],
                 "norms": [[n, v, int(d)] for n, v, d in values]} for k, values in self.sent.items()]

    def _answer(self, recv: Member, data: torch.Tensor, deliver: Deliver) -> None:
        deliver(recv, [data], src=recv.msg["peer"])
        self.contributions.add_passthrough("recv")

    def held(self) -> tuple[int, int]:
        """(messages, bytes) kept and not yet received."""
        kept = [k for g in self.groups.values() for s in g.passthrough.values() for k in s.kept]
        return len(kept), sum(k.data.nbytes for k in kept)

    def leftovers(self) -> list[str]:
        """What the streams still hold: messages never received, then receives still waiting."""
        out = []
        for g in self.groups.values():
            for (u, w), s in sorted(g.passthrough.items()):
                if s.kept:
                    out.append(f"{len(s.kept)} message(s) rank {g.ranks[u]} sent to virtual rank {g.ranks[w]} on "
                               f"group {g.name!r} were never received by a live rank")
            out += waiting_receives(g)
        return out

    def _check(self, g: Group, send: Member, recv: Member, route: Route, n: int) -> str | None:
        _, dt, shape = send.msg["ins"][0]
        return self._check_kept(g, _Kept(torch.empty(0), dt, list(shape), send.rank), recv, route, n)

    def _check_kept(self, g: Group, k: _Kept, recv: Member, route: Route, n: int) -> str | None:
        _, rdt, rshape = recv.msg["outs"][0]
        if k.dtype == rdt and list(rshape) == k.shape:
            return None
        u, w = route.stream
        return (f"pass-through mismatch on group {g.name!r} (ranks {list(g.ranks)[:8]}): rank {recv.rank} receives "
                f"{rdt}{list(rshape)} from virtual rank {g.ranks[recv.msg['peer']]} ({route.direction}, receive "
                f"#{n}); its stand-in is message #{n} that rank {g.ranks[u]} sent to virtual rank {g.ranks[w]}: "
                f"{k.dtype}{k.shape}. Rule: {RULE_IN_SHORT}, so the stand-in must have the dtype and "
                f"shape the receiver posted")


def waiting_receives(g: Group) -> list[str]:
    """One line per receive from a virtual neighbour of ``g`` that waits for its stand-in (hang reports)."""
    return [f"recv rank {m.rank} <- virtual rank {g.ranks[m.msg['peer']]} on group {g.name!r}: waits for rank "
            f"{g.ranks[u]}'s next send to virtual rank {g.ranks[w]} (pass-through)"
            for (u, w), s in sorted(g.passthrough.items()) for m in s.waiting]


def _send_backward(m: Member, g: Group, peer: int) -> bool | None:
    """Whether a send carries a gradient: its op label's direction where the label names one send direction
    only, else its position when the peer is a neighbour on a ring of more than two; None otherwise."""
    label = m.msg.get("label") or ""
    fwd, bwd = "send_forward" in label, "send_backward" in label
    if fwd != bwd:
        return bwd
    n = len(g.ranks)
    if n > 2 and (peer - m.grank) % n in (1, n - 1):
        return (peer - m.grank) % n == n - 1
    return None


def _backward(m: Member, route: Route) -> bool | None:
    """Whether a stand-in receive carries a gradient: its op label's direction where the label names one
    receive direction only (a pipeline call such as recv_backward or send_forward_recv_backward), else its
    position (on a ring of two stages both neighbours are one rank: there the label decides); None where
    neither says (a peer that is not a neighbour in the group's order, ``route.step`` 0)."""
    label = m.msg.get("label") or ""
    fwd, bwd = "recv_forward" in label, "recv_backward" in label
    if fwd != bwd:
        return bwd
    return None if route.step == 0 else route.step == -1
