"""Prism's per-class memory estimate (``memory.estimate``): against a CPU capture's exact peaks, and the
terms Megatron's formula gets wrong (the unfused attention's s x s tensors, sequence parallelism).

Tolerance against measured peaks: 10 %. The estimate counts the tensors autograd keeps per layer and
micro-batch tensor by tensor, the static state exactly, and one working set on top; what it does not
follow op by op (short-lived temporaries of ops it does not model, p2p buffers of the schedule, small
tensors) left it within -7.4 % .. +2.1 % of 19 measured rank classes, GPU and CPU
(``bench/memory_estimate.py``, ``bench/results/memory_estimate-*.txt``); 10 % is that spread with room
for the second megatron-core release, not a figure tuned to one run.
"""

from __future__ import annotations

import argparse

import pytest

from prism_megatron.megatron import cpu_mode
from prism_megatron.memory.estimate import class_estimate, estimate_classes, in_flight_units, job_from_args

TOLERANCE = 0.10
GiB = 1 << 30


@pytest.mark.megatron  # both stacks: the estimate must hold for each supported megatron-core
@pytest.mark.skipif(cpu_mode._gpu_present(), reason="CPU runs of Megatron need CPU mode")
def test_estimate_is_within_tolerance_of_a_cpu_capture(megatron_runs):
    """The plan's estimate per class (CPU: the byte accountant's figures) against the full capture of the
    TP2·PP2·DP2 mini recipe that the fold tests share (one capture per session)."""
    from prism_megatron.megatron.plan import make_plan
    from prism_megatron.megatron.run import launch_config, parse_run_args
    from prism_megatron.report.build import build_report

    request = parse_run_args(["--recipe", "mini-dense-tp2pp2dp2", "--prism-driver", "core"])
    cfg = launch_config(request)
    plan = make_plan(cfg.script, list(cfg.script_args), cfg.world_size, ["cpu"], env=request.env,
                     fold_depth="replica")
    classes = plan.memory["classes"]
    assert plan.memory["source"].startswith("prism") and plan.memory["fits"] is True
    full = megatron_runs.run("mini-dense-tp2pp2dp2", "off")
    measured: dict[str, int] = {}
    for entry in build_report(full["trace"])["memory"]["ranks"]:
        name = plan.fold.classes[plan.fold.class_of[entry["rank"]]].name
        measured[name] = max(measured.get(name, 0), entry["max_allocated"])
    assert set(measured) == set(classes) == {"first", "last"}
    for name, got in measured.items():
        ratio = classes[name]["total"] / got
        assert abs(ratio - 1) <= TOLERANCE, (name, classes[name], got, ratio)
    # the first stage holds two micro-batches (1F1B warm-up 1 + 1), the last one
    assert classes["first"]["in_flight"] == [2] and classes["last"]["in_flight"] == [1]


def _args(**over) -> argparse.Namespace:
    """An 8B-shaped GPT as the core driver parses it (bf16, unfused attention)."""
    base = dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                group_query_attention=True, num_query_groups=8, seq_length=4096, max_position_embeddings=4096,
                micro_batch_size=1, global_batch_size=8, bf16=True, tensor_model_parallel_size=2,
                pipeline_model_parallel_size=4, transformer_impl="local", hidden_dropout=0.1, attention_dropout=0.1)
    return argparse.Namespace(**(base | over))


def test_unfused_attention_is_counted_and_sdpa_drops_it():
    """The 8B-shaped class sandbox that ran out of memory on an H200: its first stage held 67.2 GiB when it
    did (bench/gpu/results/2026-12-01-fold-class-h200.txt); with --prism-attention sdpa the s x s
    probabilities (b·n/t·s² x (fp32 softmax 4 + mask 1 + dropout output 2) bytes per layer) are gone."""
    from prism_megatron.megatron.fold import build_fold_plan, layout_from_args

    args = _args()
    fold = build_fold_plan(layout_from_args(args, 8), "class")
    local = estimate_classes(job_from_args(args, 8, 32256, "cuda"), fold)
    sdpa = estimate_classes(job_from_args(args, 8, 32256, "cuda", "sdpa"), fold)
    assert local["first"]["total"] >= 72_145_931_264  # what the stage held at its OOM: a lower bound
    assert local["first"]["in_flight"] == [4] and local["last"]["in_flight"] == [1]
    probabilities = 1 * (32 // 2) * 4096 * 4096 * (4 + 1 + 2)  # per layer and micro-batch
    per_mb = local["first"]["per_microbatch"][0] - sdpa["first"]["per_microbatch"][0]
    # sdpa keeps its statistics (its output is the context, a view at micro-batch 1); the unfused path also
    # reads the s x s boolean mask once per chunk
    assert 8 * probabilities * 0.9 < per_mb <= 8 * probabilities + 4096 * 4096
    assert sdpa["first"]["total"] < 40 * GiB


def test_sequence_parallel_shards_what_megatron_shards():
    """Norms' inputs and dropout masks are sequence-sharded under --sequence-parallel (Megatron's formula
    counts them whole when selective recompute is off); the attention and MLP inner tensors are TP-sharded
    either way. TP8, fused attention (as a TE target runs): the per-layer figure shrinks by the sharded
    part's 7/8."""
    args = _args(tensor_model_parallel_size=8, pipeline_model_parallel_size=1, transformer_impl="transformer_engine")
    plain = job_from_args(args, 8, 32768, "cuda")
    sp = job_from_args(argparse.Namespace(**(vars(args) | {"sequence_parallel": True})), 8, 32768, "cuda")
    chunk = [["dense"]]
    a = class_estimate(plain, chunk, 0)["per_microbatch"][0]
    b = class_estimate(sp, chunk, 0)["per_microbatch"][0]
    sbh = 4096 * 4096
    # sequence-sharded per layer: 2 norm inputs, 2 linear inputs (bf16), 2 norms' fp32 stats, 2 bool masks
    sharded = sbh * (4 * 2 + 2) + 4096 * 2 * 4 * 2
    assert a - b == sharded - sharded // 8


def test_in_flight_micro_batches_follow_the_schedule():
    assert in_flight_units(3, 1, 8, [10]) == [4]  # 1F1B PP4 stage 0: 3 warm-up forwards, then one more
    assert in_flight_units(3, 1, 2, [10]) == [2]  # fewer micro-batches than the warm-up: all of them
    assert in_flight_units(0, 1, 8, [10]) == [1]  # last stage
    # interleaved PP2 x 2 chunks, group 2, 4 micro-batches, stage 0 (warm-up 4): chunk 0 of a third and fourth
    # micro-batch before chunk 1's backward frees the earlier ones; held by bytes
    assert in_flight_units(4, 2, 4, [10, 1]) == [4, 1]
    assert in_flight_units(4, 2, 4, [1, 10]) == [3, 2]


def _mla_args(**over) -> argparse.Namespace:
    """A DeepSeek-V3-shaped MoE layer (MLA, SwiGLU experts, TP2 SP, EP64 ETP1) on the local spec with SDPA."""
    base = dict(num_layers=4, hidden_size=7168, ffn_hidden_size=18432, num_attention_heads=128, seq_length=4096,
                max_position_embeddings=4096, micro_batch_size=1, global_batch_size=64, bf16=True,
                tensor_model_parallel_size=2, pipeline_model_parallel_size=1, sequence_parallel=True,
                expert_model_parallel_size=64, expert_tensor_parallel_size=1, transformer_impl="local",
                hidden_dropout=0.0, attention_dropout=0.0, swiglu=True, normalization="RMSNorm",
                add_bias_linear=False, num_experts=256, moe_router_topk=8, moe_ffn_hidden_size=2048,
                moe_shared_expert_intermediate_size=2048, multi_latent_attention=True, q_lora_rank=1536,
                kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, qk_layernorm=True,
                kv_channels=128, position_embedding_type="rope")
    return argparse.Namespace(**(base | over))


def _per_layer(args: argparse.Namespace, kind: str = "moe") -> int:
    job = job_from_args(args, 128, 129280, "cuda", "sdpa")
    return class_estimate(job, [[kind]], 0)["per_microbatch"][0]


def test_mla_params_are_the_latent_projections():
    """MLASelfAttention's weights (the local spec's down projections are TP-sharded ColumnParallelLinear),
    not a QKV projection of heads x kv_channels."""
    from prism_megatron.memory.estimate import _layer_params

    job = job_from_args(_mla_args(), 128, 129280, "cuda", "sdpa")
    dense, _ = _layer_params(job, False)
    h, n = 7168, 128
    attn = (h * 1536 + 1536 * n * 192 + h * 576 + 512 * n * 256 + n * 128 * h) // 2 + 1536 + 512 + 2 * h
    assert dense == attn + 3 * h * 18432 // 2


def test_mla_up_proj_recompute_frees_q_k_v():
    """"mla_up_proj" (CheckpointWithoutOutput) frees q, k, v after the core attention and keeps its inputs,
    k_pos_emb a view of the gathered kv_combined [s, kv_lora + qk_pos]."""
    plain = _per_layer(_mla_args())
    up = _per_layer(_mla_args(recompute_granularity="selective", recompute_modules=["mla_up_proj"]))
    qkv = 4096 * 64 * (192 + 192 + 128) * 2
    assert plain - up == qkv - 4096 * 576 * 2


def test_mlp_recompute_acts_on_dense_layers_only():
    """"mlp" checkpoints a dense layer's MLP (transformer_layer.py: ``if not self.is_moe_layer``)."""
    sel = dict(recompute_granularity="selective", recompute_modules=["mlp"])
    assert _per_layer(_mla_args(**sel), "moe") == _per_layer(_mla_args(), "moe")
    dense = _per_layer(_mla_args(), "dense") - _per_layer(_mla_args(**sel), "dense")
    assert dense == 4096 * (2 * 18432 + 18432) // 2 * 2  # fc1's output and the activation's, TP-sharded


def test_experts_keep_no_fc2_output():
    """Per routed token an expert keeps the dispatched token, fc1's output (the weighted SwiGLU's input),
    fc2's input and the routing probability: the probabilities are applied inside the activation."""
    per_token = _per_layer(_mla_args(moe_router_topk=2)) - _per_layer(_mla_args(moe_router_topk=1))
    assert per_token == 2048 * ((7168 + 2 * 2048 + 2048) * 2 + 4)  # 2048 tokens per rank under SP


def test_qk_layernorm_keeps_the_whole_qkv_output():
    """--qk-layernorm without MLA (Qwen3): the query and key norms normalise torch.split views of linear_qkv's
    output, so what they save keeps all of it, besides their per-head statistics (attention.py)."""
    gqa = dict(multi_latent_attention=False, group_query_attention=True, num_query_groups=8, num_attention_heads=64,
               hidden_size=4096, kv_channels=128, tensor_model_parallel_size=2)
    with_norm = _per_layer(_mla_args(**gqa, qk_layernorm=True))
    assert with_norm - _per_layer(_mla_args(**gqa, qk_layernorm=False)) == (
        4096 * (64 + 16) // 2 * 128 * 2 + 4096 * (64 + 8) // 2 * 2 * 4)


def test_a_fused_step_keeps_no_temporary_per_parameter():
    """torch's foreach Adam on a GPU holds an fp32 temporary per updated parameter during the step (Megatron's
    fallback without TE); a fused step (TE's FusedAdam, or --prism-optimizer fused) updates in place. A
    stage with little activation (one micro-batch, short sequences, no distributed optimizer) peaks in the
    foreach step and at the backward with the fused one."""
    from prism_megatron.megatron.fold import build_fold_plan, layout_from_args

    args = _args(seq_length=256, max_position_embeddings=256)
    fold = build_fold_plan(layout_from_args(args, 8), "class")
    foreach = estimate_classes(job_from_args(args, 8, 32256, "cuda", "sdpa"), fold)["first"]
    fused = estimate_classes(job_from_args(args, 8, 32256, "cuda", "sdpa", fused_step=True), fold)["first"]
    assert foreach["optimizer_step"] == foreach["params"] * 4 > 0 and foreach["peak_at"] == "optimizer step"
    assert fused["optimizer_step"] == 0 and fused["peak_at"] == "backward"
    static = {k: fused[k] for k in ("weights", "grads", "optimizer", "buffers")}
    assert static == {k: foreach[k] for k in static}  # only the step differs
    assert fused["total"] == sum(static.values()) + fused["activations"] + fused["transient"] < foreach["total"]


def test_the_plan_estimates_the_step_the_ranks_run(monkeypatch):
    """The plan's estimate follows the ranks' environment: PRISM_OPTIMIZER=fused (a target recipe's choice, or
    the flag) runs the fused step, as does a machine where TE's or apex's fused Adam is importable."""
    from prism_megatron.megatron.fold import build_fold_plan, layout_from_args
    from prism_megatron.megatron.plan import _prism_estimate
    from prism_megatron.patches import fused_optimizer

    args = _args(seq_length=256, max_position_embeddings=256, tokenizer_type="NullTokenizer", vocab_size=32000,
                 make_vocab_size_divisible_by=128)
    fold = build_fold_plan(layout_from_args(args, 8), "class")
    monkeypatch.setattr(fused_optimizer, "fused_adam_importable", lambda: False)
    fused = _prism_estimate(args, 8, fold, ["0"], {fused_optimizer.ENV_VAR: "fused"})
    fallback = _prism_estimate(args, 8, fold, ["0"], {})
    assert fused["fused_step"] is True and fallback["fused_step"] is False
    assert fused["classes"]["first"]["total"] < fallback["classes"]["first"]["total"]
    monkeypatch.setattr(fused_optimizer, "fused_adam_importable", lambda: True)
    assert _prism_estimate(args, 8, fold, ["0"], {})["fused_step"] is True
