"""Seam: the router's per-expert token-count reductions of a fold whose expert peers are virtual.

At class depth a MoE stage's expert-parallel peers do the live rank's work *translated* along EP
(``fold.EXPERT_TOKENS``; ``moe_fold``): the peer at EP offset t routes to block ``p + t`` of L local
experts (digit by digit when ETP < TP) what the live rank routes to block p, so its per-expert count
vector is the live rank's with its blocks permuted by t. The router sums such vectors over dense
groups - the aux loss's and the sequence aux loss's over the tensor-and-context group, the global aux
loss's and the expert-bias update's over the tensor-data-and-context group - and every member of those
groups is virtual but the live rank, so the coordinator's plain mirror returns N x the live rank's
counts: the live rank's imbalance, where the members' translated counts sum to a far more even load.
Those sums decide the aux loss and the expert bias, hence later routing.

This seam replaces the mirrored sum by the translated one. A group's members hold each EP translation
of one subgroup H equally often (N / |H| each): for the tensor-data-and-context group every EP
position (H = all of EP), for the tensor-and-context group the EP digits inside TP (H = the TP / ETP
inner positions; trivial when ETP = TP). Their translated sum is (N / |H|) x the sum over H of the
translated live counts; for each local expert i that is, in every block, the sum of block positions
in H's orbit, so (mirrored sum, summed over the orbit) / |H| - an exact integer division, as N / |H|
is an integer. That sum is invariant under H, so the aux loss a translated member computes (its
translated probabilities against it) equals the live rank's, which makes the mirrored loss logging
exact too, and the expert bias it updates stays invariant under EP translation: a peer routing
translated is what a real peer with that bias does. The mirrored sum is N x the live rank's counts
because a class-depth fold keeps one live rank per class and a stage's ranks are one class: no other
live member (nor, in a serial capture, a self-mirrored one) is in these groups. A count reduction over
any other group is refused (``CountGroupError``), never answered by the mirror silently. Installed
where ``moe_fold`` is (``moe_fold.ENV_VAR``), whatever the dispatcher: the rule is the plan's (the
allgather dispatcher's token exchange stays the plain mirror's, ``moe_fold``). Checked against the
supported releases (``megatron.versions``).
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()

#: the groups whose count sums this seam translates: every EP position, or only the EP digits inside TP
WHOLE, INNER = "whole", "inner"


class CountGroupError(RuntimeError):
    """A per-expert count reduction over a group whose translations this seam does not know."""


def translated_sum(mirrored: Any, num_experts: int, ep_size: int, inner: int, orbit: str) -> Any:
    """The members' translated per-expert counts from their mirrored sum (N x the live rank's counts).

    ``mirrored``: [..., k·num_experts] (k per-sequence vectors for the sequence aux loss), blocks of
    ``num_experts / ep_size`` local experts, block p = a + inner·b (a: the EP digit inside TP).
    ``orbit``: ``WHOLE`` (every EP translation) or ``INNER`` (only a). Same dtype and shape."""
    if orbit not in (WHOLE, INNER):
        raise ValueError(f"orbit must be {WHOLE!r} or {INNER!r}, not {orbit!r}")
    if ep_size < 1 or inner < 1 or ep_size % inner or num_experts % ep_size or mirrored.shape[-1] % num_experts:
        raise ValueError(f"counts of shape {tuple(mirrored.shape)} do not split into {ep_size} EP blocks of "
                         f"{num_experts} experts with {inner} positions inside TP")
    size = ep_size if orbit == WHOLE else inner
    if size == 1:
        return mirrored
    blocks = mirrored.reshape(-1, ep_size // inner, inner, num_experts // ep_size)
    total = blocks.sum(dim=(1, 2) if orbit == WHOLE else 2, keepdim=True).expand_as(blocks)
    if total.is_floating_point():
        total = total / size
    else:
        total = total.div(size, rounding_mode="floor")
    return total.to(mirrored.dtype).reshape(mirrored.shape)


def _orbit(group: Any) -> str:
    """Which translations the members of ``group`` hold (the router's reduce groups), else CountGroupError."""
    from megatron.core import parallel_state as ps

    known = ((WHOLE, ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
             (INNER, ps.get_tensor_and_context_parallel_group()))
    for orbit, g in known:
        if group is g:
            return orbit
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group) if group is not None else None
    for orbit, g in known:
        if ranks is not None and ranks == dist.get_process_group_ranks(g):
            return orbit
    raise CountGroupError(f"prism: a per-expert token-count reduction over group {ranks} (neither the tensor-and-"
                          "context nor the tensor-data-and-context group) in a fold whose expert peers are virtual: "
                          "its members' EP translations are unknown, so the mirror would return the live rank's "
                          "untranslated counts; update prism_megatron.patches.moe_counts")


def _layout() -> tuple[int, int]:
    """(EP size, dense-TP positions inside one EP position: TP / ETP, at least 1)."""
    from megatron.core import parallel_state as ps

    inner = ps.get_tensor_model_parallel_world_size() // ps.get_expert_tensor_parallel_world_size()
    return ps.get_expert_model_parallel_world_size(), max(inner, 1)


@once
def install() -> None:
    import importlib

    import torch.distributed as dist
    from megatron.core.transformer.moe import router

    # the module (megatron.core.distributed's attribute of that name is the function)
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")

    counts = seam(router, "get_tokens_per_expert_and_token_count", CHECKED, ("routing_map", "reduce_group"))
    cls = seam(router, "TopKRouter", CHECKED)
    routing = seam(cls, "routing", CHECKED, ("logits",))
    update = seam(fmg, "get_updated_expert_bias", CHECKED, ("tokens_per_expert", "expert_bias"))

    @functools.wraps(routing)
    def translated_routing(self: Any, *args: Any, **kwargs: Any) -> Any:
        experts = self.config.num_moe_experts

        def translated_counts(routing_map: Any, reduce_group: Any, *a: Any, **kw: Any) -> Any:
            summed, local, total = counts(routing_map, reduce_group, *a, **kw)
            ep, inner = _layout()
            return translated_sum(summed, experts, ep, inner, _orbit(reduce_group)), local, total

        router.get_tokens_per_expert_and_token_count = translated_counts
        try:
            return routing(self, *args, **kwargs)
        finally:
            router.get_tokens_per_expert_and_token_count = counts

    @functools.wraps(update)
    def translated_update(tokens_per_expert: Any, *args: Any, **kwargs: Any) -> Any:
        all_reduce = dist.all_reduce

        def translated_all_reduce(tensor: Any, *a: Any, **kw: Any) -> Any:
            work = all_reduce(tensor, *a, **kw)
            if tensor is tokens_per_expert:  # [layers, experts]: the update's one reduction, synchronous
                group = kw.get("group", a[1] if len(a) > 1 else None)  # all_reduce(tensor, op, group, async_op)
                ep, inner = _layout()
                tensor.copy_(translated_sum(tensor, tensor.shape[-1], ep, inner, _orbit(group)))
            return work

        dist.all_reduce = translated_all_reduce
        try:
            return update(tokens_per_expert, *args, **kwargs)
        finally:
            dist.all_reduce = all_reduce

    cls.routing = translated_routing
    fmg.get_updated_expert_bias = translated_update
