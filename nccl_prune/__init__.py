"""Pruned collectives: a target job's op answered from its live (sandbox) members only.

``plan_group`` folds a group (who is live, whom each virtual member mirrors); ``contributions`` says
once per op kind what a virtual member contributes; ``host.execute`` runs a folded op on host tensors
(the coordinator's executor), ``passthrough`` routes p2p with a virtual pipeline neighbour, and
``dist_executor.PrunedGroup`` runs the same plan over a torch.distributed process group of the live
members. Knows collectives and ranks, not Megatron.
"""

from nccl_prune.contributions import (
    KINDS,
    RECORD_MAX_BYTES,
    RECORDED_KINDS,
    RECORDED_REDUCTION_RULE,
    SELF_MIRROR_RULE,
    Contributions,
    check_p2p,
    other_classes,
    recordable,
    recorded_inputs,
    virtual_contributions,
)
from nccl_prune.host import execute, is_in_place_all_gather
from nccl_prune.passthrough import (
    PASSTHROUGH_RULE,
    SECOND_PASS_RULE,
    STANDIN_RULE,
    Route,
    recorded_stream,
    route_recv,
    route_send,
    standin_values,
)
from nccl_prune.plan import GroupPlan, PruneError, plan_group

__all__ = ["KINDS", "PASSTHROUGH_RULE", "RECORDED_KINDS", "RECORDED_REDUCTION_RULE", "RECORD_MAX_BYTES",
           "SECOND_PASS_RULE", "SELF_MIRROR_RULE", "STANDIN_RULE", "Contributions", "GroupPlan", "PruneError", "Route",
           "check_p2p", "execute", "is_in_place_all_gather", "other_classes", "plan_group", "recordable",
           "recorded_inputs", "recorded_stream", "route_recv", "route_send", "standin_values",
           "virtual_contributions"]
