"""Render a recipe to Megatron-LM ``pretrain_gpt.py`` flags, and the text ``recipe show`` prints.

Flags are those of Megatron-LM at tag ``core_v0.16.1`` (the parser lives in Megatron-LM's
``megatron/training/arguments.py``; the megatron-core wheel does not ship it). The tests parse
every shipped recipe's flags with that real parser and run its ``validate_args``.
"""

from __future__ import annotations

import math
import os
import shlex

from .load import load_recipe
from .schema import Recipe

# Megatron-LM's default --make-vocab-size-divisible-by; the padded vocab is a multiple of it * TP.
_VOCAB_DIVISOR = 128
#: extra_args flags that change the model's architecture away from what estimate_parameters counts.
ARCHITECTURE_FLAGS = frozenset({
    "--swiglu", "--normalization", "--kv-channels", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--position-embedding-type", "--qk-layernorm", "--multi-latent-attention",
    "--moe-layer-freq", "--moe-shared-expert-intermediate-size", "--make-vocab-size-divisible-by",
})


def render_args(recipe: Recipe) -> list[str]:
    """Megatron-LM flags for the recipe, in a stable order, with ``extra_args`` last and verbatim."""
    m, p, t = recipe.model, recipe.parallel, recipe.training
    args = [
        "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn),
        "--num-attention-heads", str(m.num_attention_heads),
    ]
    if m.num_query_groups is not None:
        args += ["--group-query-attention", "--num-query-groups", str(m.num_query_groups)]
    args += [
        "--seq-length", str(m.seq_length),
        "--max-position-embeddings", str(m.max_positions),
        # Mock data with the null tokenizer: token ids in [0, vocab_size], no files needed.
        "--tokenizer-type", "NullTokenizer",
        "--vocab-size", str(m.vocab_size),
        "--mock-data",
        "--micro-batch-size", str(t.micro_batch_size),
        "--global-batch-size", str(t.global_batch_size),
        "--train-iters", str(t.train_iters),
        "--lr", repr(t.lr),
        "--seed", str(t.seed),
        "--optimizer", t.optimizer,
    ]
    if t.precision == "bf16":
        args.append("--bf16")
    elif t.precision == "fp16":
        args.append("--fp16")
    args += [
        "--tensor-model-parallel-size", str(p.tp),
        "--pipeline-model-parallel-size", str(p.pp),
    ]
    if p.pipeline_layout is not None:
        # Megatron derives VPP from the layout's stage count; the two VPP flags may not be added.
        args += ["--pipeline-model-parallel-layout", p.pipeline_layout]
    elif p.vpp is not None and p.vpp > 1:
        # 0.16.1 has no --virtual-pipeline-model-parallel-size; of its two VPP flags this one states
        # the degree itself (the other, --num-layers-per-virtual-pipeline-stage, shifts meaning with
        # --account-for-embedding/loss-in-pipeline-split).
        args += ["--num-virtual-stages-per-pipeline-rank", str(p.vpp)]
    args += [
        "--context-parallel-size", str(p.cp),
        "--expert-model-parallel-size", str(p.ep),
    ]
    if m.moe is not None or p.etp is not None:
        args += ["--expert-tensor-parallel-size", str(recipe.etp)]
    if p.account_for_embedding_in_pipeline_split:
        args.append("--account-for-embedding-in-pipeline-split")
    if p.account_for_loss_in_pipeline_split:
        args.append("--account-for-loss-in-pipeline-split")
    if p.sequence_parallel:
        args.append("--sequence-parallel")
    if p.distributed_optimizer:
        args.append("--use-distributed-optimizer")
    if p.overlap_grad_reduce:
        args.append("--overlap-grad-reduce")
    if p.overlap_param_gather:
        args.append("--overlap-param-gather")
    if m.moe is not None:
        args += [
            "--num-experts", str(m.moe.num_experts),
            "--moe-router-topk", str(m.moe.router_topk),
            "--moe-token-dispatcher-type", m.moe.token_dispatcher,
            "--moe-ffn-hidden-size", str(m.moe_ffn),
            "--moe-aux-loss-coeff", repr(m.moe.aux_loss_coeff),
        ]
    rc = t.recompute
    if rc is not None:
        args += ["--recompute-granularity", rc.granularity]
        if rc.method is not None:
            args += ["--recompute-method", rc.method, "--recompute-num-layers", str(rc.num_layers)]
        if rc.modules:
            args += ["--recompute-modules", *rc.modules]
    args += ["--transformer-impl", m.transformer_impl]
    if m.transformer_impl == "local":
        # Megatron-LM defaults to gradient-accumulation fusion, which the local linear layers only
        # have with apex's fused_weight_gradient_mlp_cuda (tensor_parallel/layers.py raises without).
        args.append("--no-gradient-accumulation-fusion")
    return args + list(recipe.extra_args)


def render_env(recipe: Recipe) -> dict[str, str]:
    """Environment the target job needs for these flags.

    validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 when TP>1 or CP>1 on GPUs before Blackwell.
    """
    if recipe.parallel.tp > 1 or recipe.parallel.cp > 1:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def padded_vocab_size(recipe: Recipe) -> int:
    """Vocab rows Megatron allocates: NullTokenizer adds EOD, then pads to a multiple of divisor*TP.

    The divisor is 128 unless extra_args set ``--make-vocab-size-divisible-by``.
    """
    args = list(recipe.extra_args)
    divisor = _VOCAB_DIVISOR
    for i, tok in enumerate(args):
        if tok == "--make-vocab-size-divisible-by" and i + 1 < len(args):
            divisor = int(args[i + 1])
        elif tok.startswith("--make-vocab-size-divisible-by="):
            divisor = int(tok.split("=", 1)[1])
    multiple = divisor * recipe.parallel.tp
    return math.ceil((recipe.model.vocab_size + 1) / multiple) * multiple


def estimate_parameters(recipe: Recipe) -> int:
    """Unique parameters of the GPT model Megatron builds for this recipe.

    Matches megatron-core 0.16.1's GPTModel with the local layer spec (LayerNorm, biases on,
    learned absolute positions, GeLU MLP, tied input/output embeddings, one router bias per expert);
    it is exact for those defaults and an estimate once extra_args change them.
    """
    m = recipe.model
    h = m.hidden_size
    kv = (h // m.num_attention_heads) * m.query_groups
    # (Architecture flags in extra_args, e.g. --swiglu or --kv-channels, are not counted: see summary.)
    embed = padded_vocab_size(recipe) * h + m.max_positions * h
    attention = 2 * h + h * (h + 2 * kv) + (h + 2 * kv) + h * h + h
    if m.moe is None:
        mlp = h * m.ffn + m.ffn + m.ffn * h + h
    else:
        f, e = m.moe_ffn, m.moe.num_experts
        mlp = h * e + e + e * (h * f + f + f * h + h)
    per_layer = attention + 2 * h + mlp
    return embed + m.num_layers * per_layer + 2 * h


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def format_args(args: list[str], indent: str = "  ") -> str:
    """One flag (with its values) per line, shell-quoted, joined by backslash continuations."""
    lines: list[list[str]] = []
    for token in args:
        if token.startswith("--") or not lines:
            lines.append([token])
        else:
            lines[-1].append(token)
    text = [indent + " ".join(shlex.quote(tok) for tok in line) for line in lines]
    return " \\\n".join(text)


def summary(recipe: Recipe) -> str:
    """The readable facts of a recipe: who, how many GPUs, which layout, how big."""
    m, p, t = recipe.model, recipe.parallel, recipe.training
    params = estimate_parameters(recipe)
    if m.moe is None:
        experts = f"EP{p.ep} (dense model)"
    else:
        experts = (f"EP{p.ep} x ETP{recipe.etp}, expert DP{recipe.expert_dp}; {m.moe.num_experts} experts, "
                   f"top-{m.moe.router_topk}, {m.moe.token_dispatcher} dispatcher, expert FFN {m.moe_ffn}")
    if p.pipeline_layout is not None:
        vpp = f"{p.vpp or 1} (from the pipeline layout {p.pipeline_layout})"
    elif p.vpp is not None and p.vpp > 1:
        units = m.num_layers + p.account_for_embedding_in_pipeline_split + p.account_for_loss_in_pipeline_split
        vpp = f"{p.vpp} (interleaved; {units // (p.pp * p.vpp)} layer(s) per virtual stage)"
    else:
        vpp = "none"
    arch = sorted({a for a in recipe.extra_args if a in ARCHITECTURE_FLAGS})
    if arch:
        params_text = (f"not estimated: extra_args change the architecture ({', '.join(arch)}); Megatron "
                       "prints its own count at start-up")
    else:
        params_text = f"{_human(params)} ({params:,}; GPT with LayerNorm, biases, tied embeddings)"
    rc = t.recompute
    recompute = "none" if rc is None else (
        f"full, {rc.method}, {rc.num_layers} layer(s)" if rc.granularity == "full"
        else "selective" + (f" ({', '.join(rc.modules)})" if rc.modules else ""))
    groups = f", {m.query_groups} query groups" if m.num_query_groups is not None else ""
    dp_opts = [name for name, on in (("sequence parallel", p.sequence_parallel),
                                     ("distributed optimizer", p.distributed_optimizer),
                                     ("overlap grad reduce", p.overlap_grad_reduce),
                                     ("overlap param gather", p.overlap_param_gather)) if on]
    env = render_env(recipe)
    rows = [
        ("recipe", f"{recipe.name}  ({recipe.source}, version {recipe.version})"),
        ("", recipe.description.strip()),
        ("world size", f"{recipe.world_size} GPUs"),
        ("layout", f"{recipe.layout}  (TP*PP*CP*DP = {recipe.world_size}; rank order tp-cp-ep-dp-pp)"),
        ("experts", experts),
        ("VPP", vpp),
        ("options", ", ".join(dp_opts) or "none"),
        ("model", f"{m.kind}, {m.num_layers} layers, hidden {m.hidden_size}, ffn {m.ffn}, "
                  f"{m.num_attention_heads} heads{groups}, seq {m.seq_length}, vocab {m.vocab_size} "
                  f"(padded {padded_vocab_size(recipe)}), {m.transformer_impl} layers"),
        ("parameters", params_text),
        ("batch", f"micro {t.micro_batch_size} x DP{recipe.dp} x {recipe.num_microbatches} microbatches "
                  f"= global {t.global_batch_size}; {t.train_iters} iterations"),
        ("training", f"{t.precision}, {t.optimizer}, lr {t.lr!r}, seed {t.seed}, recompute {recompute}"),
        ("target", f"gpu {recipe.target.gpu or '-'}, cluster {recipe.target.cluster or '-'}"
                   + (f", {recipe.target.gpus_per_node} GPUs per node" if recipe.target.gpus_per_node else "")),
        ("environment", " ".join(f"{k}={v}" for k, v in env.items()) or "-"),
    ]
    chosen = recipe.emulation.chosen()
    if chosen:  # what run and plan take where no flag gives it
        rows.append(("emulation", " ".join(f"--prism-{k.replace('_', '-')} {v}" for k, v in chosen.items())
                     + "  (unless a flag says otherwise)"))
    for i, src in enumerate(recipe.sources):
        rows.append(("sources" if i == 0 else "", f"{src.what}: {src.repository} {src.path}"
                     + (f" ({src.name})" if src.name else "") + f" @ {src.commit}"))
    for i, sub in enumerate(recipe.substitutions):
        rows.append(("substitutions" if i == 0 else "",
                     f"{sub.setting}: published {sub.published} -> rendered {sub.rendered}; affects {sub.affects}"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}".rstrip() for label, value in rows if value or label)


def show(name_or_path: str | os.PathLike[str]) -> str:
    """What ``prism-megatron recipe show NAME`` prints: the summary, then the flags to paste."""
    recipe = load_recipe(name_or_path)
    return (f"{summary(recipe)}\n\nMegatron-LM pretrain_gpt.py flags (megatron-core 0.16.1):\n"
            f"{format_args(render_args(recipe))}\n")
