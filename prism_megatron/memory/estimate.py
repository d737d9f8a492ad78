"""Prism's estimate of each rank class's peak memory for the program prism runs.

Megatron-LM's ``theoretical_memory_usage`` is a formula for the target's program as its authors
budget it: with ``--sequence-parallel`` and no selective recompute it counts every layer's norms and
dropouts unsharded, and no path of it counts the s x s attention probabilities that the unfused
``DotProductAttention`` (``--transformer-impl local``, what runs where Transformer Engine does not)
keeps for the backward pass. A fit gate on that formula passes ranks that run out of memory. This
module counts, per rank class (pipeline role and its layers from the fold plan; TP/CP/EP/ETP shards,
VPP chunks), what the ranks prism launches hold at their peak:

- *static*: weights (params dtype; MLA's latent projections), the DDP gradient buffer (fp32 where
  gradients reduce in fp32, as bf16 training does), the optimizer's state (Adam: fp32 main params under bf16/fp16, two
  moments; precision-aware dtypes where given; sharded over DP by the distributed optimizer, expert
  params over expert DP), and buffers kept across micro-batches (the unfused attention's score
  buffer, the sequence-parallel all-gather buffer).
- *activations*: the tensors autograd keeps per layer and micro-batch, counted tensor by tensor for
  Megatron's local layer spec (``_layer``: norms' inputs, linear layers' inputs, the QKV output, the
  MLP's activation input and output, dropout masks; sharded by ``--sequence-parallel`` where Megatron
  shards them), the query and key norms (``--qk-layernorm``: linear_qkv's output, whose views they
  normalise), multi-latent attention (``_mla_kept``: the latent down projections' outputs, their
  norms, q/k/v of qk_head + qk_pos and v_head channels), the attention actually run (``local``: fp32
  softmax output, dropout mask and output, b·n/t·s² each; ``sdpa``/``fused``: output and softmax
  statistics only), recompute (full: a layer's input; selective: core_attn drops the s² terms,
  mla_up_proj q/k/v, mlp a dense layer's MLP, moe the MoE layer, shared_experts the shared expert,
  layernorm the norms' outputs), MoE (tokens routed to this rank: tokens x top-k, capped by the
  capacity factor; per routed token what SequentialMLP keeps, the routing probabilities applied in
  the activation), the embedding (dropout mask, token ids) on the first stage and the loss's fp32
  logits (vocab/TP) on the last; times the micro-batches (VPP: micro-batch chunks) in flight under the
  schedule (1F1B warm-up per stage; the interleaved schedule's order). Chunk outputs are not counted:
  the schedules free them once sent (``deallocate_output_tensor``).
- *transient*: the largest working set on top of that at the peak: the backward of one layer's
  attention (the s² gradients in flight), the loss's logits gradient and output-layer weight
  gradient on the last stage, or the optimizer step's temporaries (torch's foreach Adam on a GPU:
  one fp32 tensor per parameter it updates; none for a fused step, TE's or ``--prism-optimizer fused``,
  which updates in place).

The peak is the larger of (static + activations in flight + layer/loss transient) and (static +
optimizer step). Where the device is a CPU (prism's CPU mode), dropout keeps a mask of the input's
dtype (torch's CPU kernel) where a GPU keeps bool, and Adam runs tensor by tensor.

What is not counted: the caching allocator's rounding and fragmentation (reserved > allocated), the
CUDA context, NCCL buffers, small tensors (biases' gradients in flight, scalars, RoPE tables), torch
kernels that keep more than their inputs (a norm is counted as its input and statistics), and MTP
layers (counted as dense layers). The bench (``bench/memory_estimate.py``) prints estimate vs
measured per case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ATTENTIONS", "EstimateError", "Job", "job_from_args", "class_estimate", "estimate_classes",
           "in_flight_units", "ESTIMATE_SOURCE"]

ATTENTIONS = ("local", "sdpa", "fused")
ESTIMATE_SOURCE = "prism (prism_megatron.memory.estimate: the program prism runs, per rank class)"
FP32 = 4


class EstimateError(ValueError):
    """A job the estimate cannot count (the message names the value)."""


@dataclass(frozen=True)
class Job:
    """What decides a rank's memory, read from Megatron's parsed args (``job_from_args``)."""

    hidden: int
    ffn: int
    heads: int
    groups: int  # query groups (= heads without GQA)
    kv: int  # channels per head
    seq: int
    mbs: int
    vocab: int  # padded
    max_pos: int | None  # learned absolute position embedding rows; None: no position table (RoPE)
    gated: bool  # SwiGLU: fc1 is 2 x ffn
    norm_params: int  # per norm and hidden unit: 2 LayerNorm, 1 RMSNorm
    bias: bool
    untied: bool
    experts: int | None
    moe_ffn: int
    topk: int
    capacity: float | None
    shared_ffn: int | None
    dtype: int  # bytes of params/activations (2 bf16/fp16, 4 fp32)
    hidden_dropout: float
    attention_dropout: float
    tp: int
    cp: int
    ep: int
    etp: int
    pp: int
    dp: int
    edp: int
    sp: bool
    distopt: bool
    microbatches: int
    grad_bytes: int  # DDP gradient buffer
    optimizer: str  # adam or sgd
    main_param_bytes: int  # 0: the optimizer updates the model's params themselves (fp32 training)
    moment_bytes: tuple[int, ...]  # per optimizer state tensor (Adam: exp_avg, exp_avg_sq; SGD: momentum)
    recompute: str | None  # None, 'full', 'selective'
    recompute_method: str | None
    recompute_layers: int | None
    recompute_modules: tuple[str, ...]
    attention: str  # one of ATTENTIONS
    device: str  # 'cuda' or 'cpu'
    fused_step: bool = False  # the optimizer step updates in place (a fused Adam): no temporaries
    bias_gelu: bool = False  # Megatron's bias-GeLU function (bias_activation_fusion, GeLU MLP)
    moe_act_fused: bool = False  # experts' weighted SwiGLU function (bias_activation_fusion with --swiglu)
    mla: bool = False  # --multi-latent-attention (MLASelfAttention) instead of the QKV attention
    q_lora: int | None = None  # MLA: query down-projection rank (None: one query projection)
    kv_lora: int = 0
    qk_head: int = 0  # MLA: query/key channels per head without and with RoPE (qk_head + qk_pos), values'
    qk_pos: int = 0
    v_head: int = 0
    qk_norm: bool = False  # --qk-layernorm (MLA: norms of the compressed query and key/value)

    @property
    def half(self) -> bool:
        return self.dtype == 2


def _get(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


_DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1}


def _dtype_bytes(value: Any, default: int, flag: str) -> int:
    if value is None:
        return default
    key = str(value).rsplit(".", 1)[-1].lower()
    if key not in _DTYPE_BYTES:
        raise EstimateError(f"--{flag} {value!r}: a dtype the estimate does not know ({', '.join(_DTYPE_BYTES)})")
    return _DTYPE_BYTES[key]


def job_from_args(args: Any, world_size: int, vocab: int, device: str, attention: str | None = None,
                  fused_step: bool = False) -> Job:
    """The job of Megatron's parsed ``args`` at ``world_size`` ranks, run on ``device`` ('cuda' or 'cpu').

    ``attention``: 'sdpa' where ``--prism-attention sdpa`` replaces the unfused attention; None reads
    the implementation from ``--transformer-impl`` (local: unfused; transformer_engine: fused).
    ``fused_step``: the ranks run a fused Adam (``--prism-optimizer fused``, or TE's where it is importable)."""
    if device not in ("cuda", "cpu"):
        raise EstimateError(f"device {device!r}: expected 'cuda' or 'cpu'")
    h, heads = int(args.hidden_size), int(args.num_attention_heads)
    tp, pp = int(_get(args, "tensor_model_parallel_size", 1)), int(_get(args, "pipeline_model_parallel_size", 1))
    cp, ep = int(_get(args, "context_parallel_size", 1)), int(_get(args, "expert_model_parallel_size", 1))
    etp = int(_get(args, "expert_tensor_parallel_size", tp))
    dp, edp = world_size // (tp * pp * cp), world_size // (etp * ep * pp)
    if dp < 1 or edp < 1:
        raise EstimateError(f"world size {world_size} is smaller than one model replica (TP{tp}·PP{pp}·CP{cp})")
    mbs, gbs = int(args.micro_batch_size), int(_get(args, "global_batch_size", args.micro_batch_size * dp))
    half = bool(_get(args, "bf16", False) or _get(args, "fp16", False))
    impl = _get(args, "transformer_impl", "local")
    if attention is None:
        attention = "fused" if impl == "transformer_engine" else "local"
    if attention not in ATTENTIONS:
        raise EstimateError(f"attention {attention!r}: expected one of {', '.join(ATTENTIONS)}")
    gqa = bool(_get(args, "group_query_attention", False))
    experts = _get(args, "num_experts")
    ffn = int(_get(args, "ffn_hidden_size", 4 * h))
    optimizer = str(_get(args, "optimizer", "adam"))
    if optimizer not in ("adam", "sgd"):
        raise EstimateError(f"--optimizer {optimizer!r}: the estimate counts adam and sgd")
    aware = bool(_get(args, "use_precision_aware_optimizer", False))
    main = _dtype_bytes(_get(args, "main_params_dtype") if aware else None, FP32, "main-params-dtype") if half else 0
    if optimizer == "adam":
        moments = (_dtype_bytes(_get(args, "exp_avg_dtype") if aware else None, FP32, "exp-avg-dtype"),
                   _dtype_bytes(_get(args, "exp_avg_sq_dtype") if aware else None, FP32, "exp-avg-sq-dtype"))
    else:
        moments = (FP32,) if float(_get(args, "sgd_momentum", 0.9)) else ()
    # Megatron-LM's validate_args turns fp32 accumulation on under bf16; the core driver reduces in fp32 there too
    grad_fp32 = _get(args, "accumulate_allreduce_grads_in_fp32", None)
    grad_fp32 = bool(_get(args, "bf16", False)) if grad_fp32 is None else bool(grad_fp32)
    modules = _get(args, "recompute_modules", ["core_attn"])
    mla = bool(_get(args, "multi_latent_attention", False))
    pos = _get(args, "position_embedding_type", "learned_absolute")
    return Job(
        hidden=h, ffn=ffn, heads=heads, groups=int(_get(args, "num_query_groups", heads)) if gqa else heads,
        kv=int(_get(args, "kv_channels", h // heads)), seq=int(args.seq_length), mbs=mbs, vocab=int(vocab),
        max_pos=int(_get(args, "max_position_embeddings", args.seq_length)) if pos == "learned_absolute" else None,
        gated=bool(_get(args, "swiglu", False)), norm_params=1 if _get(args, "normalization", "LayerNorm") == "RMSNorm"
        else 2, bias=bool(_get(args, "add_bias_linear", True)),
        untied=bool(_get(args, "untie_embeddings_and_output_weights", False)),
        experts=int(experts) if experts else None, moe_ffn=int(_get(args, "moe_ffn_hidden_size", ffn)),
        topk=int(_get(args, "moe_router_topk", 2)), capacity=_get(args, "moe_expert_capacity_factor"),
        shared_ffn=_get(args, "moe_shared_expert_intermediate_size"), dtype=2 if half else 4,
        hidden_dropout=float(_get(args, "hidden_dropout", 0.1)),
        attention_dropout=float(_get(args, "attention_dropout", 0.1)), tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, dp=dp,
        edp=edp, sp=bool(_get(args, "sequence_parallel", False)) and tp > 1,
        distopt=bool(_get(args, "use_distributed_optimizer", False)), microbatches=max(1, gbs // (mbs * dp)),
        grad_bytes=FP32 if grad_fp32 or not half else 2, optimizer=optimizer, main_param_bytes=main,
        moment_bytes=moments, recompute=_get(args, "recompute_granularity"),
        recompute_method=_get(args, "recompute_method"), recompute_layers=_get(args, "recompute_num_layers"),
        recompute_modules=tuple(modules), attention=attention, device=device, fused_step=fused_step,
        bias_gelu=bool(_get(args, "bias_gelu_fusion", True)) and not _get(args, "swiglu", False) and not experts,
        # megatron.training.argument_utils: bias_activation_fusion = bias_swiglu_fusion under --swiglu
        moe_act_fused=bool(experts) and bool(_get(args, "swiglu", False))
        and bool(_get(args, "bias_swiglu_fusion", True)),
        # Megatron-LM's argument defaults (q_lora_rank None, kv_lora_rank 32, head dims 128/64/128)
        mla=mla, q_lora=int(args.q_lora_rank) if mla and _get(args, "q_lora_rank") else None,
        kv_lora=int(_get(args, "kv_lora_rank", 32)) if mla else 0,
        qk_head=int(_get(args, "qk_head_dim", 128)) if mla else 0,
        qk_pos=int(_get(args, "qk_pos_emb_head_dim", 64)) if mla else 0,
        v_head=int(_get(args, "v_head_dim", 128)) if mla else 0, qk_norm=bool(_get(args, "qk_layernorm", False)))


# ----------------------------------------------------------------------------- parameters
def _layer_params(j: Job, moe: bool) -> tuple[int, int]:
    """(dense, expert) parameters of one layer on one rank (Megatron's local/TE layer, TP/EP/ETP shards)."""
    h, b = j.hidden, int(j.bias)
    if j.mla:
        attn = _mla_params(j) + b * h + 2 * j.norm_params * h
    else:
        qkv = (j.heads + 2 * j.groups) * j.kv
        attn = h * qkv // j.tp + b * qkv // j.tp + j.heads * j.kv * h // j.tp + b * h + 2 * j.norm_params * h
    if not moe:
        fc1 = j.ffn * (2 if j.gated else 1)
        return attn + h * fc1 // j.tp + b * fc1 // j.tp + j.ffn * h // j.tp + b * h, 0
    fc1 = j.moe_ffn * (2 if j.gated else 1)
    local = j.experts // j.ep
    expert = local * (h * fc1 // j.etp + b * fc1 // j.etp + j.moe_ffn * h // j.etp + b * h)
    router = j.experts * h
    shared = 0
    if j.shared_ffn:
        sfc1 = j.shared_ffn * (2 if j.gated else 1)
        shared = h * sfc1 // j.tp + j.shared_ffn * h // j.tp
    return attn + router + shared, expert


def _mla_params(j: Job) -> int:
    """MLASelfAttention's weights (multi_latent_attention.py; its linears have no bias but linear_proj's):
    down projections h x q_lora and h x (kv_lora + qk_pos) - ColumnParallelLinear in the local spec
    (TP-sharded), TELinear 'duplicated' in TE's -, up projections q_lora x n(qk_head + qk_pos) and
    kv_lora x n(qk_head + v_head), the output projection n·v_head x h, and with --qk-layernorm the
    norms of the compressed query and key/value."""
    h, n, down_tp = j.hidden, j.heads, 1 if j.attention == "fused" else j.tp
    qk = j.qk_head + j.qk_pos
    if j.q_lora is None:
        q = h * n * qk // j.tp
    else:
        q = h * j.q_lora // down_tp + j.q_lora * n * qk // j.tp + (j.norm_params * j.q_lora if j.qk_norm else 0)
    kv = h * (j.kv_lora + j.qk_pos) // down_tp + j.kv_lora * n * (j.qk_head + j.v_head) // j.tp
    kv += j.norm_params * j.kv_lora if j.qk_norm else 0
    return q + kv + n * j.v_head * h // j.tp


def _largest_param(j: Job, chunks: list[list[str]]) -> int:
    """Elements of a rank's largest single parameter tensor (what a tensor-by-tensor optimizer step
    allocates its temporaries for): the embedding or output layer, else a layer's QKV or fc1 weight."""
    h = j.hidden
    items = {x for c in chunks for x in c}
    if j.mla:
        qk = j.qk_head + j.qk_pos
        out = max((j.q_lora or h) * j.heads * qk, j.kv_lora * j.heads * (j.qk_head + j.v_head),
                  j.heads * j.v_head * h) // j.tp
    else:
        out = (j.heads + 2 * j.groups) * j.kv * h // j.tp
    out = max(out, h * j.ffn * (2 if j.gated else 1) // j.tp)
    if "moe" in items:
        out = max(out, h * j.moe_ffn * (2 if j.gated else 1) // j.etp)
    if "embedding" in items or "loss" in items:
        out = max(out, j.vocab * h // j.tp)
    return out


def _chunk_params(j: Job, chunk: list[str]) -> tuple[int, int]:
    dense = expert = 0
    for item in chunk:
        if item in ("dense", "moe", "mtp"):
            d, e = _layer_params(j, item == "moe")
            dense, expert = dense + d, expert + e
        elif item == "embedding":
            dense += j.vocab * j.hidden // j.tp + (j.max_pos or 0) * j.hidden
        elif item == "loss":
            dense += j.norm_params * j.hidden
            # the output layer: its own weight when untied or when the embedding lives on another stage
            if j.untied or "embedding" not in chunk:
                dense += j.vocab * j.hidden // j.tp
    return dense, expert


# ----------------------------------------------------------------------------- activations
def _mask_bytes(j: Job, p: float) -> int:
    """Bytes per element a dropout of probability ``p`` keeps for backward: torch's GPU kernel a bool
    mask, its CPU kernel a scaled mask of the input's dtype; p = 0 returns its input and keeps nothing."""
    if p <= 0:
        return 0
    return 1 if j.device == "cuda" else j.dtype


def _s2_saved(j: Job) -> int:
    """Bytes per attention-probability element the unfused attention keeps: the softmax's output (fp32
    under bf16/fp16: softmax_in_fp32), then either dropout's mask and output, or, without dropout, the
    probabilities cast back to the params dtype (what the value product keeps)."""
    soft = FP32 if j.half else j.dtype
    if j.attention_dropout > 0:
        return soft + _mask_bytes(j, j.attention_dropout) + j.dtype
    return soft + (j.dtype if j.half else 0)


def _s2_backward_extra(j: Job) -> int:
    """Bytes per attention-probability element in flight above ``_s2_saved`` during that attention's
    backward, at its largest (the softmax's backward: its fp32 gradient in and out while the saved
    output is still held), as the autograd nodes run and free their saved tensors in order."""
    soft = FP32 if j.half else j.dtype
    live = saved = _s2_saved(j)
    peak = live
    # value product: gradient of the probabilities (dtype) in, the kept probabilities out
    live += j.dtype
    peak = max(peak, live)
    if j.attention_dropout > 0:
        live -= j.dtype  # dropout's output
        live += j.dtype  # dropout backward: a new gradient
        peak = max(peak, live)
        live -= j.dtype + _mask_bytes(j, j.attention_dropout)
    elif j.half:
        live -= j.dtype  # the cast probabilities
    if j.half:
        live += soft  # cast backward to fp32
        peak = max(peak, live)
        live -= j.dtype
    live += soft  # softmax backward: a new gradient while its input gradient and saved output are held
    peak = max(peak, live)
    return peak - saved


def _selective(j: Job) -> frozenset[str]:
    """The modules ``--recompute-granularity selective`` recomputes (none under other granularities)."""
    return frozenset(j.recompute_modules) if j.recompute == "selective" else frozenset()


def _qkv_kept(j: Job) -> int:
    """Elements per token of the query, key and value the core attention keeps (its inputs)."""
    if j.mla:  # MLA: q and k of qk_head + qk_pos channels per head, v of v_head
        return j.heads // j.tp * (2 * (j.qk_head + j.qk_pos) + j.v_head)
    # local/sdpa: q, k, v per query head once GQA is expanded
    heads = 3 * j.heads if j.attention in ("local", "sdpa") else j.heads + 2 * j.groups
    return heads // j.tp * j.kv


def _mla_kept(j: Job, tokens: int, sp_tokens: int, up_recompute: bool) -> int:
    """What MLASelfAttention (multi_latent_attention.py) keeps between its input linear's input and the
    core attention's q/k/v. The local spec's down projections are ColumnParallelLinear: their outputs come
    back over all the sequence and gathered over TP (``gather_from_tensor_model_parallel_region``); under
    --sequence-parallel the compressed query goes back to s/TP as a slice (mappings._split_along_first_dim:
    ``.contiguous()`` of a first-dim slice is a view), which keeps the whole gathered storage; the
    compressed key/value is a last-dim split, copied. TE's spec has duplicated down projections of s/TP."""
    d = j.dtype
    stats = sp_tokens * 2 * FP32
    down = tokens if j.attention != "fused" else sp_tokens  # rows of the down projections' outputs
    out = 0
    if j.q_lora is not None:
        out += down * j.q_lora * d  # q_compressed's storage (q_layernorm's, else linear_q_up_proj's, input)
        if j.qk_norm:
            out += stats + sp_tokens * j.q_lora * d  # q_layernorm's stats and output (linear_q_up_proj's input)
    kv_all = down * (j.kv_lora + j.qk_pos) * d  # kv_combined's storage
    if j.sp and down != sp_tokens:
        out += sp_tokens * j.kv_lora * d  # kv_compressed scattered to s/TP: a copy
        # up-projection recompute: CheckpointWithoutOutput saves its inputs, k_pos_emb a view of kv_combined
        out += kv_all if up_recompute else 0
    else:
        out += kv_all  # kv_compressed a view of kv_combined (kv_layernorm's, else linear_kv_up_proj's, input)
        if j.sp and up_recompute:  # TE: k_pos_emb gathered over the sequence, saved by the checkpoint
            out += tokens * j.qk_pos * d
    if j.qk_norm:
        out += stats + sp_tokens * j.kv_lora * d  # kv_layernorm's stats and output (linear_kv_up_proj's input)
    return out


def _layer(j: Job, moe: bool, recompute_full: bool) -> int:
    """Bytes one layer keeps for backward per micro-batch on one rank (module docstring)."""
    d = j.dtype
    tokens = j.mbs * j.seq // j.cp  # this rank's tokens
    sp_tokens = tokens // j.tp if j.sp else tokens  # tensors sequence parallelism shards
    h = j.hidden
    if recompute_full:
        return sp_tokens * h * d  # the layer's input; the rest is recomputed in backward
    stats = sp_tokens * 2 * FP32  # a norm's mean and rstd (fp32)
    hm = _mask_bytes(j, j.hidden_dropout)
    heads_tp = j.heads // j.tp
    modules = _selective(j)
    # "layernorm" (transformer_layer.py): both norms' outputs are discarded (CheckpointWithoutOutput)
    norm_out = 0 if "layernorm" in modules else sp_tokens * h * d
    # input norm: input + stats; QKV linear's input (sharded under SP: Megatron saves its pre-gather input)
    out = sp_tokens * h * d + stats + norm_out
    # "mla_up_proj": the up projections run under CheckpointWithoutOutput, whose outputs (q, k, v) are freed
    # once the core attention has run (discard_output_and_register_recompute)
    up_recompute = j.mla and "mla_up_proj" in modules
    if j.mla:
        out += _mla_kept(j, tokens, sp_tokens, up_recompute)
    if not up_recompute:
        out += tokens * _qkv_kept(j) * d
    if j.qk_norm and not j.mla:
        # --qk-layernorm (attention.py, get_query_key_value_tensors): the query and key norms take torch.split
        # views of linear_qkv's output, so the inputs they save keep all of it; and their statistics per head
        groups = (j.heads + 2 * j.groups) // j.tp
        out += tokens * groups * j.kv * d + tokens * (j.heads + j.groups) // j.tp * 2 * FP32
    v_dim = j.v_head if j.mla else j.kv
    if j.attention == "local" and "core_attn" not in modules:
        out += j.mbs * heads_tp * (j.seq // j.cp) * j.seq * _s2_saved(j)
    elif j.attention in ("sdpa", "fused"):
        out += tokens * heads_tp * FP32  # softmax statistics (log-sum-exp per query row)
        if j.attention == "sdpa" and j.mbs > 1:
            # SDPA's output is laid out [b, s, n, d]: with b = 1 the [s, b, n·d] context is a view of it
            out += tokens * heads_tp * v_dim * d
    out += tokens * heads_tp * v_dim * d  # output projection's input (the attention's context)
    out += sp_tokens * h * hm  # bias-dropout-add's mask
    out += sp_tokens * h * d + stats + norm_out  # pre-MLP norm: input + stats; fc1's input
    if not moe:
        # "mlp" checkpoints dense layers' MLP only (transformer_layer.py: ``if not self.is_moe_layer``)
        if "mlp" not in modules:
            fc1 = j.ffn * (2 if j.gated else 1) // j.tp
            out += tokens * (fc1 + j.ffn // j.tp) * d  # activation's input (fc1 out + bias), fc2's input
    elif "moe" not in modules:  # "moe": the whole MoE layer checkpointed, keeping its input (counted above)
        routed = _routed_tokens(j, sp_tokens)
        # router: logits and probabilities (fp32) per token and expert; per routed token the dispatched
        # token (fc1's input, kept once: the dispatcher's permutes and all-to-alls keep indices only), the
        # activation's tensors and the routing probability. "moe_act" acts in TEGroupedMLP only, not in
        # the local spec's SequentialMLP.
        out += sp_tokens * j.experts * 2 * FP32
        out += routed * ((h + _expert_act_kept(j)) * d + FP32)
        if j.shared_ffn and "shared_experts" not in modules:  # "shared_experts": checkpointed
            sfc1 = j.shared_ffn * (2 if j.gated else 1) // j.tp
            out += tokens * (sfc1 + j.shared_ffn // j.tp) * d
    out += sp_tokens * h * hm  # MLP bias-dropout-add's mask
    return out


def _expert_act_kept(j: Job) -> int:
    """Elements per routed token an expert keeps from fc1's output to fc2's input. SequentialMLP passes
    the routing probabilities to MLP.forward as ``per_token_scale``, applied on the activation's output
    (the dispatcher's unpermute gets none): fc2's output is not kept. Fused (weighted_bias_swiglu_impl):
    its input (fc1's output) and fc2's input. Unfused: the activation's input, SwiGLU's silu output (kept
    by the product), the activation's output (kept by the scaling product) and its cast (fc2's input)."""
    f = j.moe_ffn // j.etp
    fc1 = f * (2 if j.gated else 1)
    if j.moe_act_fused:
        return fc1 + f
    return fc1 + (f if j.gated else 0) + 2 * f


def _routed_tokens(j: Job, tokens: int) -> int:
    """Tokens this rank's experts receive per MoE layer and micro-batch: its tokens x top-k (balanced
    routing: what each of EP peers sends it on average), capped by the capacity factor when set."""
    routed = tokens * j.topk
    if j.capacity:
        routed = min(routed, int(math.ceil(j.capacity * tokens * j.topk / j.experts)) * (j.experts // j.ep))
    return routed


def _chunk_activations(j: Job, chunk: list[str]) -> int:
    """Bytes one micro-batch keeps through one model chunk (its layers, embedding and loss terms)."""
    h = j.hidden
    tokens = j.mbs * j.seq // j.cp
    sp_tokens = tokens // j.tp if j.sp else tokens
    layers = [x for x in chunk if x in ("dense", "moe", "mtp")]
    full = _recomputed(j, len(layers))
    out = sum(_layer(j, kind == "moe", full[i]) for i, kind in enumerate(layers))
    reads = "embedding" in chunk or "loss" in chunk
    if reads:  # the batch's token ids (int64) and, for the unfused attention, its s x s boolean mask
        out += j.mbs * j.seq * 8 * 2 + (j.mbs * j.seq * j.seq if j.attention == "local" else 0)
    if "embedding" in chunk:
        out += sp_tokens * h * _mask_bytes(j, j.hidden_dropout)  # embedding dropout's mask
    if "loss" in chunk:
        out += _loss_kept(j) + j.mbs * j.seq * (8 + FP32)  # + labels and loss mask
    return out


def _loss_kept(j: Job) -> int:
    """What the loss keeps per micro-batch: the final norm's input and stats, the output layer's input
    and the cross entropy's fp32 softmax over vocab/TP."""
    tokens = j.mbs * j.seq // j.cp
    sp_tokens = tokens // j.tp if j.sp else tokens
    return sp_tokens * j.hidden * j.dtype * 2 + sp_tokens * 2 * FP32 + tokens * (j.vocab // j.tp) * FP32


def _recomputed(j: Job, n: int) -> list[bool]:
    """Which of a chunk's ``n`` layers keep only their input (full recompute: uniform keeps one input
    per group of ``recompute_num_layers``, counted as every layer's; block recomputes the first N)."""
    if j.recompute != "full":
        return [False] * n
    if j.recompute_method == "block":
        k = int(j.recompute_layers or 0)
        return [i < k for i in range(n)]
    return [True] * n


def _layer_transient(j: Job, chunk: list[str]) -> int:
    """The largest working set one layer's backward (or recompute) adds on top of what is kept."""
    d, h = j.dtype, j.hidden
    tokens = j.mbs * j.seq // j.cp
    heads_tp = j.heads // j.tp
    grads = 2 * tokens * h * d  # the hidden gradient in and out of the layer
    att = 0
    modules = _selective(j)
    if j.attention == "local":
        s2 = j.mbs * heads_tp * (j.seq // j.cp) * j.seq
        att = s2 * _s2_backward_extra(j) + (s2 * _s2_saved(j) if "core_attn" in modules else 0)
    if j.mla and "mla_up_proj" in modules:  # q, k, v rebuilt for the core attention's backward
        att += tokens * _qkv_kept(j) * d
    mlp = _mlp_backward_units(j) * tokens * (j.ffn // j.tp) * d
    layers = [x for x in chunk if x in ("dense", "moe", "mtp")]
    if "mlp" in modules and "dense" in layers:  # a dense MLP's activations rebuilt for its backward
        mlp += tokens * (j.ffn * (2 if j.gated else 1) + j.ffn) // j.tp * d
    full = any(_recomputed(j, len(layers)))
    remat = _layer(j, "moe" in layers, False) if full else 0  # one layer's activations rebuilt in backward
    return grads + max(att, mlp) + remat


def _mlp_backward_units(j: Job) -> int:
    """Tensors of the fc1 output's size in flight in the MLP activation's backward beyond what is kept,
    fc2's kept input (the activation's output) being freed by then: its incoming gradient and its
    result where one kernel computes it (torch's GeLU; Megatron's bias-GeLU compiled by
    ``torch.compile`` on a GPU); prism's CPU mode runs the bias-GeLU backward op by op (torch.compile is
    off there), holding besides the gradient the input sum, its tanh and up to four temporaries."""
    return (7 if j.bias_gelu and j.device == "cpu" else 2) - 1


def _loss_transient(j: Job) -> int:
    """The last stage's loss backward: the logits' gradient cast to the params dtype while the fp32
    softmax is held (bf16/fp16), and the output layer's weight gradient before it is added to the
    gradient buffer."""
    tokens = j.mbs * j.seq // j.cp
    cast = tokens * (j.vocab // j.tp) * j.dtype if j.half else 0
    return cast + j.vocab // j.tp * j.hidden * j.dtype


# ----------------------------------------------------------------------------- schedule
def in_flight_units(warmup: int, group: int, microbatches: int, sizes: list[int]) -> list[int]:
    """Per model chunk (``sizes``: bytes one micro-batch keeps through each), the micro-batches held at
    once at the schedule's worst point: Megatron's forward order (interleaved: ``group`` micro-batches
    per chunk in turn; 1F1B: one chunk) for ``warmup`` forwards, then per step one forward and one
    backward (chunks in reverse order); the peak is after a step's forward, before its backward."""
    chunks = len(sizes)
    total = microbatches * chunks

    def chunk_of(k: int, backward: bool) -> int:
        c = (k % (group * chunks)) // group
        return chunks - 1 - c if backward else c

    first = min(warmup, total)
    held = [0] * chunks
    for k in range(first):
        held[chunk_of(k, False)] += 1
    best = list(held)
    for step in range(total - first):
        held[chunk_of(first + step, False)] += 1
        if sum(n * a for n, a in zip(held, sizes, strict=True)) > sum(n * a for n, a in zip(best, sizes, strict=True)):
            best = list(held)
        held[chunk_of(step, True)] -= 1
    return best


# ----------------------------------------------------------------------------- per class
def class_estimate(j: Job, chunks: list[list[str]], warmup: int, group: int | None = None) -> dict[str, Any]:
    """The peak of one rank of a class whose model chunks are ``chunks`` (the fold plan's stage
    signature) at a pipeline rank with ``warmup`` warm-up forwards (bytes; figures and the terms)."""
    dense, expert = map(sum, zip(*(_chunk_params(j, c) for c in chunks), strict=True))
    params = dense + expert
    weights = params * j.dtype
    grads = params * j.grad_bytes
    per_param = j.main_param_bytes + sum(j.moment_bytes)
    shard_dense = math.ceil(dense / (j.dp * j.cp)) if j.distopt else dense
    shard_expert = math.ceil(expert / j.edp) if j.distopt else expert
    optimizer = (shard_dense + shard_expert) * per_param
    tokens = j.mbs * j.seq // j.cp
    buffers = 0
    if j.attention == "local":  # the unfused attention's score buffer (Megatron's global memory buffer)
        buffers += j.mbs * (j.heads // j.tp) * (j.seq // j.cp) * j.seq * j.dtype
        if not any("embedding" in c or "loss" in c for c in chunks):
            buffers += j.seq * j.seq  # the cached causal mask of stages that read no batch
    if j.sp:  # the sequence-parallel all-gather buffer (Megatron's global memory buffer)
        buffers += tokens * j.hidden * j.dtype
    static = weights + grads + optimizer + buffers
    per_chunk = [_chunk_activations(j, c) for c in chunks]
    held = in_flight_units(warmup, group or j.pp, j.microbatches, per_chunk)
    activations = sum(n * a for n, a in zip(held, per_chunk, strict=True))
    transient = max(_layer_transient(j, c) for c in chunks)
    if any("loss" in c for c in chunks):
        # the loss's backward runs first and frees what the loss kept (its fp32 softmax, the final norm's and
        # output layer's inputs) before any layer's backward: the layer's working set comes on top of less
        transient = max(transient - _loss_kept(j), _loss_transient(j))
    transient += tokens * j.hidden * j.dtype  # the stage's received gradient or activation (p2p)
    if j.fused_step and j.optimizer == "adam":  # in place, one multi-tensor kernel
        step = 0
    elif j.device == "cuda" and j.optimizer == "adam":  # foreach Adam: a temporary per updated parameter
        step = (shard_dense + shard_expert) * FP32
    else:  # tensor by tensor: two temporaries of the largest parameter
        step = 2 * _largest_param(j, chunks) * FP32
    total = max(static + activations + transient, static + step)
    return {"total": int(total), "params": int(params), "weights": int(weights), "grads": int(grads),
            "optimizer": int(optimizer), "buffers": int(buffers), "activations": int(activations),
            "transient": int(transient), "optimizer_step": int(step), "in_flight": held,
            "per_microbatch": [int(a) for a in per_chunk],
            "peak_at": "backward" if static + activations + transient >= static + step else "optimizer step"}


def estimate_classes(j: Job, fold: Any) -> dict[str, dict[str, Any]]:
    """Per class of ``fold`` (a FoldPlan: each class's chunks and pipeline stages, the schedule's
    warm-up per stage): ``class_estimate`` at the class's stage that holds the most, with ``stage``."""
    schedule = getattr(fold, "schedule", None) or {}
    warmups = schedule.get("warmup") or [0] * j.pp
    group = schedule.get("group")
    out: dict[str, dict[str, Any]] = {}
    for c in fold.classes:
        chunks = [list(x) for x in c.coords.get("chunks", [])]
        if not chunks:
            raise EstimateError(f"class {c.name!r} has no chunks in the fold plan (a version-1 plan)")
        best = None
        for p in c.coords.get("pp", [0]):
            w = warmups[p] if p < len(warmups) else 0
            e = class_estimate(j, chunks, int(w), group) | {"stage": p}
            if best is None or e["total"] > best["total"]:
                best = e
        out[c.name] = best
    return out
