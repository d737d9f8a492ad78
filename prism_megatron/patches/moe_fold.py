"""Seam: ``MoEAlltoAllTokenDispatcher.preprocess`` - the per-expert token counts of folded expert peers.

At class depth a MoE stage's expert-parallel peers are virtual and fold onto its ep = 0 rank
(``fold.EXPERT_TOKENS``, the *translated mirror*): virtual expert rank v at EP offset j does what
the live rank does, translated by j along the expert-parallel axis, so it routes to expert
``g + j·L`` (L local experts per rank, mod the expert count) what the live rank routes to expert g.
(With ETP < TP an EP position holds TP / ETP dense-TP positions and the translation shifts each
digit on its own: ``rotate_peer_counts``.) The all-to-all of tokens follows from the coordinator's
rule (nccl_prune A2A_RULE: the live rank receives from peer j the tokens its mirror sends to its
counterpart, offset -j). The count exchange before it, an
all-gather over the expert tensor-and-expert-parallel group, is mirrored by the coordinator as the
live rank's own per-expert counts, which index experts by global id: this seam rotates each peer's
row by its EP offset so that the counts say what the tokens are (``output_splits``, the tokens per
local expert), and the dispatcher's shapes, its sorting of received tokens and the combine's splits
all agree with the all-to-all. Only installed where every EP peer of the live ranks is virtual
(``ENV_VAR``); the allgather dispatcher is not rotated (its gathered routing map mirrors the live
rank's: each peer sends the live rank's experts what the live rank routes to them). Checked against
the supported releases (``megatron.versions``).
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()

#: set by ``run`` for a fold whose expert peers are virtual (the plan's ``expert_tokens``)
ENV_VAR = "PRISM_FOLD_EXPERT_TOKENS"


def rotate_peer_counts(gathered: Any, ep_size: int, tp_size: int, num_experts: int, ep_rank: int,
                       inner: int = 1) -> Any:
    """The gathered per-expert counts ([ep_size·tp_size·num_experts], rows in the tp-ep group's order:
    ep-major) with each EP row's blocks of local experts permuted by that row's translation from
    ``ep_rank``: what peers that route like this rank, translated to their own EP positions, would have
    sent. An EP position e has digits (e mod inner, e div inner), ``inner`` = TP / ETP dense-TP
    positions inside it (1 when ETP = TP: the translation is a shift along EP, a roll of the blocks);
    a peer translated by (a, b) routes to block ((p mod inner + a) mod inner) + inner·((p div inner
    + b) mod (EP / inner)) what this rank routes to block p (``fold``'s translation, digit by digit).
    One gather with a cached index: this runs inside the rank's measured compute, every MoE layer and
    micro-batch, so its cost must stay that of one kernel (not EP² indexing calls)."""
    local = num_experts // ep_size
    rows = gathered.reshape(ep_size, tp_size, ep_size, local)
    source = _source_blocks(ep_size, ep_rank, inner, str(gathered.device))
    index = source[:, None, :, None].expand(ep_size, tp_size, ep_size, local)
    return rows.gather(2, index).reshape(gathered.shape)


@functools.lru_cache(maxsize=32)
def _source_blocks(ep_size: int, ep_rank: int, inner: int, device: str) -> Any:
    """[e, q] -> the block p of row e that lands in block q (the inverse of the translation above)."""
    import torch

    outer = ep_size // inner
    source = torch.empty(ep_size, ep_size, dtype=torch.long)
    for e in range(ep_size):
        a = (e % inner - ep_rank % inner) % inner
        b = (e // inner - ep_rank // inner) % outer
        for p in range(ep_size):
            source[e, (p % inner + a) % inner + inner * ((p // inner + b) % outer)] = p
    return source.to(device)


@once
def install() -> None:
    from megatron.core.transformer.moe import token_dispatcher as td

    cls = seam(td, "MoEAlltoAllTokenDispatcher", CHECKED)
    original = seam(cls, "preprocess", CHECKED, ("routing_map",))
    seam(td, "gather_from_sequence_parallel_region", CHECKED, ("group",))

    from megatron.core import parallel_state

    @functools.wraps(original)
    def preprocess(self: Any, routing_map: Any) -> Any:
        gather = td.gather_from_sequence_parallel_region
        ep_rank = self.local_expert_indices[0] // self.num_local_experts
        # dense-TP positions inside one EP position (TP / ETP): the fold's translation digit by digit
        inner = parallel_state.get_tensor_model_parallel_world_size() // self.tp_size

        def translated(tensor: Any, *args: Any, group: Any = None, **kwargs: Any) -> Any:
            out = gather(tensor, *args, group=group, **kwargs)
            if group is self.tp_ep_group and tensor.dim() == 1 and tensor.numel() == self.num_experts:
                out = rotate_peer_counts(out, self.ep_size, self.tp_size, self.num_experts, ep_rank, max(inner, 1))
            return out

        td.gather_from_sequence_parallel_region = translated
        try:
            return original(self, routing_map)
        finally:
            td.gather_from_sequence_parallel_region = gather

    cls.preprocess = preprocess
