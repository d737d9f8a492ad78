"""How many ATen ops Megatron's local-spec MoE layer issues per phase (CPU; no GPU needed).

A host-bound capture's host seconds are (ops issued) x (host time per op). This counts the ops of the
Qwen3-MoE layer shape the target recipes render without Transformer Engine (local spec, RMSNorm with
QK layernorm, unfused RoPE, SwiGLU experts in ``SequentialMLP``, alltoall dispatcher, fp32 router with
aux loss and forced load balancing, ``--prism-attention sdpa``) on a small model, through prism's CPU
mode, with a dispatch mode that counts every ATen call, and (``[kernel]``) those that are neither
views nor allocations (the ones a GPU runs as a kernel or copy). Op counts do not depend on the hidden
size, the sequence length or the token counts; they do on the number of *local* experts (``--local``:
the expert loop) and on the code path. Expert parallelism is 1 here: the all_to_alls are local.

Per layer figures are the difference between ``--layers 2`` and ``--layers 1`` (embedding, output
layer and loss cancel); the phases are tagged on the last layer.

    python bench/targets/moe_op_census.py --local 8
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

_NOT_KERNELS = {"detach", "empty", "empty_like", "empty_strided", "alias", "lift_fresh"}


def census(layers: int, local: int) -> tuple[Counter, Counter]:
    """(forward, backward) op counts by phase for a ``layers``-layer model with ``local`` experts."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch.utils._python_dispatch import TorchDispatchMode

    model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(
        num_layers=layers, hidden_size=256, ffn_hidden_size=768, num_attention_heads=8, num_query_groups=2,
        kv_channels=32, normalization="RMSNorm", gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, qk_layernorm=True,
        num_moe_experts=local, moe_router_topk=min(8, local), moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-3, moe_router_load_balancing_type="aux_loss",
        moe_router_dtype="fp32", moe_router_force_load_balancing=True, moe_grouped_gemm=False,
        bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, use_cpu_initialization=True,
        params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    spec = get_gpt_layer_local_spec(local, moe_grouped_gemm=False, qk_layernorm=True)
    model = GPTModel(cfg, spec, vocab_size=1024, max_sequence_length=256, position_embedding_type="rope",
                     rotary_base=1000000, share_embeddings_and_output_weights=False)
    mlp = model.decoder.layers[-1].mlp
    counts: Counter = Counter()
    phase = ["rest of the model (embedding, attention, norms, other layers, loss)"]

    class Census(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts[phase[0]] += 1
            schema = func._schema
            if not (schema.is_mutable or any(r.alias_info for r in schema.returns)
                    or func.__name__.split(".")[0] in _NOT_KERNELS):
                counts[phase[0] + " [kernel]"] += 1
            return func(*args, **(kwargs or {}))

    def tag(obj, name: str, label: str) -> None:
        original = getattr(obj, name)

        def tagged(*a, **k):
            prev, phase[0] = phase[0], label
            try:
                return original(*a, **k)
            finally:
                phase[0] = prev
        setattr(obj, name, tagged)

    tag(mlp.router, "forward", "router")
    td = mlp.token_dispatcher
    for name, label in (("dispatch_preprocess", "dispatch: counts, permute"),
                        ("token_dispatch", "dispatch: all_to_all"), ("dispatch_postprocess", "dispatch: sort chunks"),
                        ("combine_preprocess", "combine: sort back"), ("token_combine", "combine: all_to_all"),
                        ("combine_postprocess", "combine: unpermute")):
        tag(td, name, label)
    tag(mlp.experts, "forward", f"experts (SequentialMLP, {local} local)")
    ids = torch.randint(0, 1024, (1, 256))
    pos = torch.arange(256)[None]
    for _ in range(2):  # the second pass is the one kept: first-call caches are warm
        counts.clear()
        with Census():
            loss = model(ids, pos, None, labels=ids).sum()
            forward = Counter(counts)
            counts.clear()
            phase[0] = "backward"
            loss.backward()
            backward = Counter(counts)
        phase[0] = "rest of the model (embedding, attention, norms, other layers, loss)"
    return forward, backward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", type=int, default=8, help="local experts (the target's experts / EP)")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    from prism_megatron.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    import torch.distributed as dist
    from megatron.core import parallel_state

    from prism_megatron.patches import attention

    attention.install()  # --prism-attention sdpa, as the target runs
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=1)
    two = census(2, args.local)  # first: Megatron's MoE metrics tracker keeps the first model's layer count
    one = census(1, args.local)
    print(f"ATen ops of one layer's MoE phases (the last layer of the 2-layer model), {args.local} local experts:")
    for name, n in sorted(two[0].items()):
        if not name.startswith("rest"):
            print(f"  forward  {name:48s} {n:5d}")
    def total(counts: Counter, kernels: bool) -> int:
        return sum(n for k, n in counts.items() if k.endswith("[kernel]") == kernels)

    for which, i in (("forward", 0), ("backward", 1)):
        for kernels in (False, True):
            print(f"per layer, {which} [{'kernel' if kernels else 'all ATen'}]: "
                  f"{total(two[i], kernels) - total(one[i], kernels)}")


if __name__ == "__main__":
    main()
