"""--prism-attention sdpa: Megatron's local DotProductAttention computed by torch's fused attention.

The values (forward and gradients) are the unfused path's within rounding, and what autograd keeps
for the backward pass holds no s x s probabilities; what the seam cannot compute as Megatron would is
refused by name. The cases run in a child process (Megatron's parallel state, one gloo rank)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.megatron

CASES = ("causal", "layer-scaling", "padding", "mla")

# One child for every case (its start, Megatron's import and parallel state, is most of a case's time):
# each case's layer and inputs are built, and the unfused references computed, before the seam is
# installed (it replaces DotProductAttention.forward for the rest of the process).
CHILD = textwrap.dedent("""
    import json, os, socket, sys
    import torch
    from prism_megatron.megatron.cpu_mode import enable_cpu_mode
    enable_cpu_mode()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    heads, groups, d, s, b = 8, 2, 16, 48, 2

    from prism_megatron.patches import mla_attention
    mla_attention.install()  # MLA's k_channels / v_channels (as the ranks get it, before the layers are built)
    dk, dv = 24, 12  # MLA: query/key head size (nope + rope) and value head size differ

    def build(case):
        torch.manual_seed(0)
        mla = case == "mla"
        config = TransformerConfig(num_layers=2, hidden_size=heads * d, num_attention_heads=heads,
                                   num_query_groups=heads if mla else groups, kv_channels=d,
                                   use_cpu_initialization=True, attention_dropout=0.0,
                                   apply_query_key_layer_scaling=case == "layer-scaling")
        mask_type = AttnMaskType.padding if case == "padding" else AttnMaskType.causal
        extra = dict(k_channels=dk, v_channels=dv, softmax_scale=0.3) if mla else {}
        attn = DotProductAttention(config, layer_number=2, attn_mask_type=mask_type, attention_type="self", **extra)
        kv_heads = heads if mla else groups
        q = torch.randn(s, b, heads, dk if mla else d, requires_grad=True)
        k = torch.randn(s, b, kv_heads, dk if mla else d, requires_grad=True)
        v = torch.randn(s, b, kv_heads, dv if mla else d, requires_grad=True)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).expand(b, 1, s, s)
        return attn, (q, k, v), mask

    def run(attn, qkv, mask):
        kept = []
        def pack(t):
            kept.append(tuple(t.shape)); return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = attn(*qkv, mask)
        out.square().sum().backward()
        grads = [t.grad.clone() for t in qkv]
        for t in qkv:
            t.grad = None
        return out.detach(), grads, kept

    cases = {case: build(case) for case in sys.argv[1:]}
    refs = {case: run(*built) for case, built in cases.items() if case != "padding"}
    from prism_megatron.patches import attention
    attention.install()
    squares = lambda shapes: sum(1 for sh in shapes if len(sh) >= 2 and sh[-1] == s and sh[-2] == s)
    results = {}
    for case, built in cases.items():
        try:
            out, grads, kept = run(*built)
        except attention.UnsupportedAttention as e:
            results[case] = {"refused": str(e)}
            continue
        ref, ref_grads, ref_kept = refs[case]
        results[case] = {
            "shape": list(out.shape), "ref_shape": list(ref.shape),
            "max_diff": (out - ref).abs().max().item(),
            "grad_diff": max((g - r).abs().max().item() for g, r in zip(grads, ref_grads)),
            "ref_s_by_s_kept": squares(ref_kept), "s_by_s_kept": squares(kept)}
        if case == "mla":  # independent of Megatron's path: softmax(q k^T * scale, causal) v per head
            q, k, v = (t.detach().permute(1, 2, 0, 3) for t in built[1])
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            p = (q @ k.transpose(-1, -2) * 0.3).masked_fill(~causal, float("-inf")).softmax(-1)
            manual = (p @ v).permute(2, 0, 1, 3).reshape(s, b, heads * dv)
            results[case]["manual_diff"] = (out - manual).abs().max().item()
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def results() -> dict:
    """Each case's figures (or its refusal) from one child process."""
    import json

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", CHILD, *CASES], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["causal", "layer-scaling"])
def test_sdpa_gives_the_unfused_values_and_keeps_no_s_by_s_probabilities(case, results):
    r = results[case]
    assert "refused" not in r, r
    assert r["shape"] == r["ref_shape"] == [48, 2, 128]  # [s, b, heads x d]
    assert r["max_diff"] < 1e-4 and r["grad_diff"] < 1e-3, r
    assert r["ref_s_by_s_kept"] >= 1  # Megatron's unfused path keeps the probabilities for backward
    assert r["s_by_s_kept"] == 0


def test_mla_head_sizes_build_the_local_attention_and_both_paths_agree(results):
    """MLA's core attention (query/key head 24, value head 12, its own scale): the local layer takes the
    head sizes (patches.mla_attention) and the unfused path, sdpa and a hand-written attention agree."""
    r = results["mla"]
    assert "refused" not in r, r
    assert r["shape"] == r["ref_shape"] == [48, 2, 8 * 12]  # [s, b, heads x value head]
    assert r["max_diff"] < 1e-4 and r["grad_diff"] < 1e-3 and r["manual_diff"] < 1e-4, r


def test_a_mask_sdpa_cannot_take_is_refused_by_name(results):
    r = results["padding"]
    assert "attention mask type padding" in r["refused"] and "--prism-attention megatron" in r["refused"]
