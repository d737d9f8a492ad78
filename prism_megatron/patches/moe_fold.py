"""Seam: ``MoEAlltoAllTokenDispatcher.preprocess`` - the per-expert token counts of folded expert peers.

At class depth a MoE stage's expert-parallel peers are virtual and fold onto its ep = 0 rank
(``fold.EXPERT_TOKENS``, the *translated mirror*): virtual expert rank v at EP offset j does what
the live rank does, translated by j along the expert-parallel axis, so it routes to expert
``g + j·L`` (L local experts per rank, mod the expert count) what the live rank routes to expert g.
The all-to-all of tokens follows from the coordinator's rule (nccl_prune A2A_RULE: the live rank
receives from peer j the tokens its mirror sends to offset -j). The count exchange before it, an
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


def rotate_peer_counts(gathered: Any, ep_size: int, tp_size: int, num_experts: int, ep_rank: int) -> Any:
    """The gathered per-expert counts ([ep_size·tp_size·num_experts], rows in the tp-ep group's order:
    ep-major) with the rows of EP offset e rolled by ``(e - ep_rank)`` blocks of local experts: what
    peers that route like this rank, translated to their own EP offsets, would have sent."""
    import torch

    local = num_experts // ep_size
    rows = gathered.reshape(ep_size, tp_size, num_experts)
    out = torch.stack([torch.roll(rows[e], shifts=(e - ep_rank) * local, dims=-1) for e in range(ep_size)])
    return out.reshape(gathered.shape)


@once
def install() -> None:
    from megatron.core.transformer.moe import token_dispatcher as td

    cls = seam(td, "MoEAlltoAllTokenDispatcher", CHECKED)
    original = seam(cls, "preprocess", CHECKED, ("routing_map",))
    seam(td, "gather_from_sequence_parallel_region", CHECKED, ("group",))

    @functools.wraps(original)
    def preprocess(self: Any, routing_map: Any) -> Any:
        gather = td.gather_from_sequence_parallel_region
        ep_rank = self.local_expert_indices[0] // self.num_local_experts

        def translated(tensor: Any, *args: Any, group: Any = None, **kwargs: Any) -> Any:
            out = gather(tensor, *args, group=group, **kwargs)
            if group is self.tp_ep_group and tensor.dim() == 1 and tensor.numel() == self.num_experts:
                out = rotate_peer_counts(out, self.ep_size, self.tp_size, self.num_experts, ep_rank)
            return out

        td.gather_from_sequence_parallel_region = translated
        try:
            return original(self, routing_map)
        finally:
            td.gather_from_sequence_parallel_region = gather

    cls.preprocess = preprocess
