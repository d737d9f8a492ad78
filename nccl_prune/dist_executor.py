"""Execute folded ops over a real torch.distributed process group of the live members.

When sandbox ranks sit on different devices (NCCL) or hosts (gloo), the same plan runs over their own
communicator: a process group whose members are the group's live members in group-position order
(its rank i is ``plan.live_positions[i]``). Each live member calls the same method with its own
buffers and gets the result ``host.execute`` defines for it: reductions all-reduce each member's
multiplicity-weighted term (sum: m·x, product: x**m, ...), gathers all-gather the live inputs and fill
virtual chunks from their mirror (or keep them), and all_to_all sends each live peer the pieces its
virtual peers would have sent (the A2A rule) in one uneven exchange after a small exchange of sizes.

Float reductions add in the backend's order, not in group-position order: results agree with the host
executor within rounding, not bitwise. Methods take torch's argument order; positions are group
positions of the full group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from nccl_prune.contributions import RECORDED, check_p2p, how
from nccl_prune.host import is_in_place_all_gather
from nccl_prune.plan import GroupPlan, PruneError
from nccl_prune.reduction import effective_op, finish_avg, reduce_terms, term

_NATIVE = {"sum": "SUM", "avg": "SUM", "premul_sum": "SUM", "min": "MIN", "max": "MAX", "product": "PRODUCT",
           "band": "BAND", "bor": "BOR", "bxor": "BXOR"}


class PrunedGroup:
    """A folded group as seen by one live member: ``plan``, the live members' process ``group``, and
    this member's group position ``me``."""

    def __init__(self, plan: GroupPlan, group: Any, me: int) -> None:
        if not plan.is_live(me):
            raise PruneError(f"rank {plan.ranks[me]} is virtual in group {list(plan.ranks)[:8]}: it has no process")
        if dist.get_world_size(group) != len(plan.live_positions):
            raise PruneError(f"the process group has {dist.get_world_size(group)} members; the group "
                             f"{list(plan.ranks)[:8]} has {len(plan.live_positions)} live members")
        if dist.get_rank(group) != plan.live_index(me):
            raise PruneError(f"group position {me} should be rank {plan.live_index(me)} of the live members' "
                             f"process group, is {dist.get_rank(group)}")
        self.plan, self.group, self.me = plan, group, me
        self._global = [dist.get_global_rank(group, i) for i in range(len(plan.live_positions))]

    # ---- reductions ----------------------------------------------------------------------------
    def all_reduce(self, tensors: torch.Tensor | Sequence[torch.Tensor], op: str, factor: float | None = None,
                   recorded: Mapping[int, Sequence[torch.Tensor]] | None = None) -> None:
        """In place, every (coalesced) tensor; ``recorded[v]``: virtual position v's inputs instead of
        its mirror's (added once, by the first live member)."""
        ts = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        recorded = self._recorded(recorded)
        for j, t in enumerate(ts):
            extra = [r[j] for r in recorded.values()] if self.plan.live_index(self.me) == 0 else []
            t.copy_(self._reduce(t, op, factor, set(recorded), extra, None).view_as(t))

    def reduce(self, tensor: torch.Tensor, root: int, op: str, factor: float | None = None) -> None:
        """Into ``tensor`` at a live root; a virtual root's result reaches no live member (no traffic)."""
        if self.plan.is_live(root):
            r = self._reduce(tensor, op, factor, set(), [], root)
            if self.me == root:
                tensor.copy_(r.view_as(tensor))

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: str,
                              factor: float | None = None) -> None:
        n = self.plan.size
        flat = input.reshape(-1)
        if flat.numel() != n * output.numel():
            raise PruneError(f"reduce_scatter of {flat.numel()} elements into {output.numel()} over {n} members")
        c = output.numel()
        self._scatter_reduced(output, [flat[p * c:(p + 1) * c] for p in range(n)], op, factor)

    def reduce_scatter(self, output: torch.Tensor, input_list: Sequence[torch.Tensor], op: str,
                       factor: float | None = None) -> None:
        self._scatter_reduced(output, [t.reshape(-1) for t in input_list], op, factor)

    # ---- gathers -------------------------------------------------------------------------------
    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor,
                               recorded: Mapping[int, torch.Tensor] | None = None) -> None:
        """Chunk q of ``output``: live q's input, a virtual q's mirror's input (or recorded), or — when
        ``input`` is this member's own chunk of ``output`` (in place) — what the chunk holds (keep)."""
        n = self.plan.size
        keep = is_in_place_all_gather(output, input, self.me)
        got = self._gather_live(input)
        out = _bytes(output)
        c = out.numel() // n
        for q, data in enumerate(self._chunks(got, keep, recorded)):
            if data is not None:
                out[q * c:(q + 1) * c].copy_(data)

    def all_gather(self, tensor_list: Sequence[torch.Tensor], tensor: torch.Tensor,
                   recorded: Mapping[int, torch.Tensor] | None = None) -> None:
        keep = is_in_place_all_gather(tensor_list, tensor, self.me)
        got = self._gather_live(tensor)
        for q, data in enumerate(self._chunks(got, keep, recorded)):
            if data is not None:
                _bytes(tensor_list[q]).copy_(data)

    def gather(self, tensor: torch.Tensor, gather_list: Sequence[torch.Tensor] | None, root: int) -> None:
        """At a live root, ``gather_list[q]``: member q's tensor (a virtual q's mirror's); a virtual root:
        nothing reaches a live member (no traffic)."""
        if not self.plan.is_live(root):
            return
        live = self.plan.live_positions
        bufs = [torch.empty_like(_bytes(tensor)) for _ in live] if self.me == root else None
        dist.gather(_bytes(tensor), bufs, dst=self._global[self.plan.live_index(root)], group=self.group)
        if bufs is not None:
            for q in range(self.plan.size):
                _bytes(gather_list[q]).copy_(bufs[self.plan.live_index(self.plan.mirror[q])])  # type: ignore[index]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's object (a virtual member's is its mirror's): an all_gather of pickles."""
        got: list[Any] = [None] * len(self.plan.live_positions)
        dist.all_gather_object(got, obj, group=self.group)
        return [got[self.plan.live_index(self.plan.mirror[q])] for q in range(self.plan.size)]

    # ---- from a root ---------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        """From ``root``; a virtual root sends its mirror's buffer as it stands."""
        src = self.plan.mirror[root]
        dist.broadcast(_bytes(tensor), src=self._global[self.plan.live_index(src)], group=self.group)

    def broadcast_object_list(self, objects: list[Any], root: int) -> None:
        src = self.plan.mirror[root]
        dist.broadcast_object_list(objects, src=self._global[self.plan.live_index(src)], group=self.group)

    def scatter(self, tensor: torch.Tensor, scatter_list: Sequence[torch.Tensor] | None, root: int,
                recorded: Mapping[int, Sequence[torch.Tensor]] | None = None) -> None:
        """From a live root; a virtual root only with its recorded pieces (its mirror holds no list)."""
        if not self.plan.is_live(root):
            if not recorded or root not in recorded:
                raise PruneError(f"scatter from virtual rank {self.plan.ranks[root]}: its mirror, rank "
                                 f"{self.plan.ranks[self.plan.mirror[root]]}, holds no scatter list (a "
                                 f"receiver); record the root's pieces")
            tensor.copy_(recorded[root][self.me].view_as(tensor))
            return
        pieces = [_bytes(scatter_list[p]) for p in self.plan.live_positions] if self.me == root else None  # type: ignore[index]
        dist.scatter(_bytes(tensor), pieces, src=self._global[self.plan.live_index(root)], group=self.group)

    # ---- exchanges -----------------------------------------------------------------------------
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None) -> None:
        """Splits along dim 0 as torch's (None: even); a virtual peer's piece follows the A2A rule."""
        n = self.plan.size
        pieces = list(_bytes(input).split(_row_bytes(input, input_split_sizes, n, "input")))
        want = _row_bytes(output, output_split_sizes, n, "output")
        got = self._exchange(pieces, want)
        _bytes(output).copy_(torch.cat(got))

    def all_to_all(self, output_list: Sequence[torch.Tensor], input_list: Sequence[torch.Tensor]) -> None:
        got = self._exchange([_bytes(t) for t in input_list], [t.nbytes for t in output_list])
        for o, g in zip(output_list, got, strict=True):
            _bytes(o).copy_(g)

    # ---- no data -------------------------------------------------------------------------------
    def barrier(self) -> None:
        """Live members only: a virtual member arrives when its mirror does."""
        dist.barrier(group=self.group)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        check_p2p(self.plan, self.me, dst)
        dist.send(_bytes(tensor), dst=self._global[self.plan.live_index(dst)], group=self.group, tag=tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        check_p2p(self.plan, src, self.me)
        dist.recv(_bytes(tensor), src=self._global[self.plan.live_index(src)], group=self.group, tag=tag)

    # ---- internals -----------------------------------------------------------------------------
    def _recorded(self, recorded: Mapping[int, Any] | None) -> Mapping[int, Any]:
        for v in recorded or {}:
            if self.plan.is_live(v):
                raise PruneError(f"recorded inputs for group position {v}, which is live")
        return recorded or {}

    def _weight(self, recorded: set[int]) -> int:
        return self.plan.multiplicity[self.me] - sum(1 for v in recorded if self.plan.mirror[v] == self.me)

    def _local_term(self, x: torch.Tensor, op: str, factor: float | None, recorded: set[int],
                    extra: Sequence[torch.Tensor]) -> torch.Tensor:
        """This member's weighted term, with recorded inputs folded in (their own terms, weight 1)."""
        t = term(x.reshape(-1), self._weight(recorded), op, factor)
        if extra:
            combine = "sum" if effective_op(op, x.dtype) == "avg" else op
            t = reduce_terms([t, *(term(e.reshape(-1), 1, op, factor) for e in extra)], combine, 1)
        return t

    def _reduce(self, x: torch.Tensor, op: str, factor: float | None, recorded: set[int],
                extra: Sequence[torch.Tensor], root: int | None) -> torch.Tensor:
        t = self._local_term(x, op, factor, recorded, extra)
        t = t.clone() if t.data_ptr() == x.data_ptr() else t
        return self._native(t, op, root)

    def _native(self, t: torch.Tensor, op: str, root: int | None) -> torch.Tensor:
        """Reduce the terms of the live members with the backend's op; finish an average over all members."""
        eop = effective_op(op, t.dtype)
        wire = t.view(torch.uint8) if t.dtype == torch.bool else t  # bool travels as bytes: OR/AND/XOR
        native = getattr(dist.ReduceOp, "BOR" if t.dtype == torch.bool and eop == "avg" else _NATIVE[eop])
        if root is None:
            dist.all_reduce(wire, op=native, group=self.group)
        else:
            dist.reduce(wire, dst=self._global[self.plan.live_index(root)], op=native, group=self.group)
        return finish_avg(t, self.plan.size) if eop == "avg" else t

    def _scatter_reduced(self, output: torch.Tensor, chunks: Sequence[torch.Tensor], op: str,
                         factor: float | None) -> None:
        live = self.plan.live_positions
        terms = [term(chunks[p], self.plan.multiplicity[self.me], op, factor) for p in live]
        buf = torch.cat(terms)  # a copy: the live members' chunks only
        r = self._native(buf, op, None)
        k = self.plan.live_index(self.me)
        c = chunks[self.me].numel()
        output.copy_(r[k * c:(k + 1) * c].view_as(output))

    def _gather_live(self, x: torch.Tensor) -> list[torch.Tensor]:
        got = [torch.empty_like(_bytes(x)) for _ in self.plan.live_positions]
        dist.all_gather(got, _bytes(x).contiguous(), group=self.group)
        return got

    def _chunks(self, got: list[torch.Tensor], keep: bool,
                recorded: Mapping[int, torch.Tensor] | None) -> list[torch.Tensor | None]:
        """Chunk of each member: live or mirrored data, recorded bytes, or None (kept as it is)."""
        out: list[torch.Tensor | None] = []
        rec = recorded or {}
        for q in range(self.plan.size):
            h = how(self.plan, q, recorded=rec, keep=keep)
            if h == RECORDED:
                out.append(_bytes(rec[q]))
            elif h == "keep":
                out.append(None)
            else:
                out.append(got[self.plan.live_index(self.plan.mirror[q])])
        return out

    def _exchange(self, pieces: list[torch.Tensor], want: Sequence[int]) -> list[torch.Tensor]:
        """One personalised exchange: returns, per source position, the bytes this member receives.

        Each live member sends each live peer d, in source-position order, its own piece for d and, for
        every virtual member q it mirrors, its piece for d's counterpart (the A2A rule). Sizes travel
        first (one small exchange), so uneven splits need no agreement beforehand; a size that differs
        from what this member expects is an error after the exchange (no peer is left waiting).
        """
        plan, me = self.plan, self.me
        n, live = plan.size, plan.live_positions
        if len(pieces) != n or len(want) != n:
            raise PruneError(f"all_to_all over {n} members with {len(pieces)} input and {len(want)} output pieces")
        sources = plan.members_of  # the members each live member sends for
        mine = sources[me]
        send = [[pieces[d if q == me else plan.counterpart(d, q)] for q in mine] for d in live]
        sizes = torch.tensor([p.numel() for row in send for p in row], dtype=torch.int64)
        got_sizes = torch.empty(sum(len(sources[s]) for s in live), dtype=torch.int64)
        dist.all_to_all_single(got_sizes, sizes, [len(sources[s]) for s in live], [len(mine)] * len(live),
                               group=self.group)
        flat_send = torch.cat([p for row in send for p in row]) if sizes.numel() else torch.empty(0, dtype=torch.uint8)
        per_src = got_sizes.split([len(sources[s]) for s in live])
        recv = torch.empty(int(got_sizes.sum()), dtype=torch.uint8)
        dist.all_to_all_single(recv, flat_send, [int(x.sum()) for x in per_src],
                               [sum(p.numel() for p in row) for row in send], group=self.group)
        by_pos: list[torch.Tensor] = [recv[:0]] * n
        parts = iter(recv.split(got_sizes.tolist()))
        for s in live:
            for q in sources[s]:
                by_pos[q] = next(parts)
        bad = [(q, by_pos[q].numel(), want[q]) for q in range(n) if by_pos[q].numel() != want[q]]
        if bad:
            q, got, exp = bad[0]
            whence = "live" if plan.is_live(q) else f"mirrored from rank {plan.ranks[plan.mirror[q]]}"
            raise PruneError(f"all_to_all on group {list(plan.ranks)[:8]}: rank {plan.ranks[me]} expects "
                             f"{exp} bytes from rank {plan.ranks[q]} and receives {got} ({whence})")
        return by_pos


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise PruneError(f"a non-contiguous tensor of shape {list(t.shape)} cannot be a collective buffer")
    return t.reshape(-1).view(torch.uint8)


def _row_bytes(t: torch.Tensor, splits: Sequence[int] | None, n: int, what: str) -> list[int]:
    """Bytes per member of an all_to_all_single buffer (splits along dim 0; None or empty: even)."""
    row = t.element_size()
    for d in t.shape[1:]:
        row *= d
    splits = [int(s) for s in (splits or [])]
    if not splits:
        if t.dim() == 0 or t.shape[0] % n:
            raise PruneError(f"all_to_all_single {what} of shape {list(t.shape)} does not split evenly over {n}")
        return [t.shape[0] // n * row] * n
    if len(splits) != n or sum(splits) != t.shape[0]:
        raise PruneError(f"all_to_all_single {what} splits {splits} do not match {n} members and dim 0 = {t.shape[0]}")
    return [s * row for s in splits]
