"""What a rank is (its place in the parallel layout) and what an iteration is worth (tokens, FLOPs).

Two trace marks, once per rank, that the report needs and only Megatron knows: ``layout`` (the
rank's TP/PP/DP/CP/EP coordinates, from ``parallel_state`` — Megatron's own rank order, never a
re-derivation) groups ranks into classes such as "last pipeline stage"; ``workload`` turns a
predicted iteration time into tokens/s and TFLOP/s per GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
from typing import Any

from prism_megatron.trace.markers import mark


def layout_attrs() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_rank(), "tp_size": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_rank(), "pp_size": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_rank(), "cp_size": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_rank(), "ep_size": ps.get_expert_model_parallel_world_size(),
        "vpp_size": ps.get_virtual_pipeline_model_parallel_world_size(),
    }


def _get(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else value


def flops_per_iteration(args: Any, vocab: int) -> float:
    """Model FLOPs of one training iteration (forward + backward = 3 x forward), whole job.

    Per token and layer: QKV, attention scores and values over the full sequence (Megatron's
    convention: no causal halving), output projection, MLP (SwiGLU: 3 matrices; MoE: top-k experts
    plus the router), then the logits. Activation recomputation is not counted (model FLOPs).
    """
    h, layers, s = args.hidden_size, args.num_layers, args.seq_length
    heads = args.num_attention_heads
    kv = _get(args, "kv_channels", h // heads)
    groups = _get(args, "num_query_groups", heads) if _get(args, "group_query_attention", False) else heads
    q = heads * kv
    mats = 3 if _get(args, "swiglu", False) else 2
    experts = _get(args, "num_experts", 0)
    if experts:
        ffn = _get(args, "moe_ffn_hidden_size", _get(args, "ffn_hidden_size", 4 * h))
        mlp = 2 * mats * h * ffn * _get(args, "moe_router_topk", 2) + 2 * h * experts
    else:
        mlp = 2 * mats * h * _get(args, "ffn_hidden_size", 4 * h)
    per_layer = 2 * h * (q + 2 * groups * kv) + 4 * s * q + 2 * q * h + mlp
    forward_per_token = layers * per_layer + 2 * h * vocab
    return 3.0 * forward_per_token * args.global_batch_size * s


# what megatron.training.theoretical_memory_usage reads that a core-driver namespace may lack
_FORMULA_DEFAULTS = {"is_hybrid_model": False, "multi_latent_attention": False, "mtp_num_layers": None,
                     "moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None, "recompute_granularity": None,
                     "normalization": "LayerNorm", "q_lora_rank": None, "kv_lora_rank": None, "swiglu": False,
                     "group_query_attention": False, "num_query_groups": None, "sequence_parallel": False,
                     "use_distributed_optimizer": False, "untie_embeddings_and_output_weights": False}


class _FormulaArgs(argparse.Namespace):
    """The driver's args for Megatron's formula: a flag the namespace lacks (the core driver parses only
    the flags it uses; each Megatron version adds some, e.g. 0.19's ``hybrid_layer_pattern``) reads as
    its entry in _FORMULA_DEFAULTS, else None (off)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _FORMULA_DEFAULTS.get(name)


def megatron_estimate(args: Any, vocab: int | None, data_parallel_size: int | None = None,
                      num_microbatches: int | None = None) -> dict[str, Any]:
    """Megatron's own theoretical memory of the most loaded shard (bytes), or why there is none.

    The report shows it beside the measured peaks: it is what users compare us with. Sizes not
    given are read from ``parallel_state`` and the microbatch calculator (a running rank); a plan,
    before any rank runs, gives them.
    """
    try:
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training.theoretical_memory_usage import report_theoretical_memory
    except ImportError as e:
        return {"error": f"megatron.training is not importable ({e.name})"}
    ns = _FormulaArgs(**{**_FORMULA_DEFAULTS, **vars(args)})
    ns.padded_vocab_size = getattr(args, "padded_vocab_size", None) or vocab
    ns.kv_channels = getattr(args, "kv_channels", None) or args.hidden_size // args.num_attention_heads
    # Megatron-LM's validate_args fills it in; the core driver's parser leaves it None (0.19's formula reads it)
    ns.expert_tensor_parallel_size = (getattr(args, "expert_tensor_parallel_size", None)
                                      or getattr(args, "tensor_model_parallel_size", None) or 1)
    ns.data_parallel_size = (data_parallel_size or getattr(args, "data_parallel_size", None)
                             or ps.get_data_parallel_world_size())
    sizes = [getattr(args, f"{p}_parallel_size", None) or 1 for p in ("tensor_model", "pipeline_model", "context")]
    ns.world_size = getattr(args, "world_size", None) or ns.data_parallel_size * math.prod(sizes)
    ns.virtual_pipeline_model_parallel_size = (getattr(args, "virtual_pipeline_model_parallel_size", None)
                                               or getattr(args, "num_virtual_stages_per_pipeline_rank", None)
                                               or ps.get_virtual_pipeline_model_parallel_world_size())
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its figures; the report shows them
            weights, activations, total = report_theoretical_memory(
                ns, num_microbatches=num_microbatches or get_num_microbatches())
    except Exception as e:  # a flag combination the formula does not handle
        return {"error": f"{type(e).__name__}: {e}"}
    mib = 1 << 20  # its "MB"
    return {"weight_and_optimizer": int(weights * mib), "activation": int(activations * mib),
            "total": int(total * mib), "source": "megatron.training.theoretical_memory_usage (most loaded shard)"}


def mark_rank(args: Any, vocab: int | None) -> None:
    """Record this rank's ``layout`` and the job's ``workload`` (call once parallel_state is set up);
    rank 0 adds Megatron's theoretical memory estimate (``megatron_estimate``)."""
    mark("layout", **layout_attrs())
    import torch.distributed as dist

    if dist.get_rank() == 0:
        mark("megatron_estimate", **megatron_estimate(args, vocab))
    tokens = int(args.global_batch_size) * int(args.seq_length)
    flops = flops_per_iteration(args, vocab) if vocab else None
    mark("workload", global_batch_size=int(args.global_batch_size), seq_length=int(args.seq_length),
         tokens_per_iteration=tokens, flops_per_iteration=flops)
