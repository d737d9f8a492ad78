"""Seam: ``megatron.core.transformer.dot_product_attention.DotProductAttention.forward`` - fused attention.

A target job runs Transformer Engine's fused (flash) attention; where TE is not installed the job is
rendered with ``--transformer-impl local``, whose ``DotProductAttention`` materialises the attention
probabilities, b·n/t·s² values per layer and micro-batch, and keeps them for the backward pass. At
sequence 4096 that is hundreds of MiB per layer: the emulated rank holds, and spends time on, what
the target's rank never does, so its memory verdict is wrong (a Llama-3-8B stage reaches 67 GiB on
scores alone). With ``--prism-attention sdpa`` the same layer computes with
``torch.nn.functional.scaled_dot_product_attention``, whose flash / memory-efficient kernels keep
only the output and the softmax statistics, as TE's do. Values agree with the unfused path within
floating-point rounding.

What TE's fused attention holds that this does not: grouped-query K/V are expanded to every query
head before the call (2·(n - g)/t·s·b·d extra values per layer: small beside s²), because a backend
that cannot take grouped K/V directly would otherwise fall back to the unfused kernel unannounced.
Only causal self-attention of equal query and key lengths is taken; any other mask, packed sequences,
an attention bias, a sliding window or a non-vanilla softmax is refused at the first call, naming it.
Checked against the supported releases (``megatron.versions``).
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table

#: ``--prism-attention`` reaches the ranks as this variable ('sdpa' installs the seam).
ENV_VAR = "PRISM_ATTENTION"


class UnsupportedAttention(RuntimeError):
    """An attention call ``--prism-attention sdpa`` cannot compute as Megatron would."""


def _refusal(self: Any, mask_type: Any, attention_bias: Any, packed_seq_params: Any,
             query: Any, key: Any) -> str | None:
    from megatron.core.transformer.enums import AttnMaskType

    if packed_seq_params is not None:
        return "packed sequences (packed_seq_params)"
    if attention_bias is not None:
        return "an attention bias"
    if mask_type != AttnMaskType.causal:
        return f"attention mask type {getattr(mask_type, 'name', mask_type)} (only causal is taken)"
    if query.size(0) != key.size(0):
        return f"query length {query.size(0)} != key length {key.size(0)}"
    if getattr(self.scale_mask_softmax, "window_size", None) is not None:
        return f"a sliding window ({self.scale_mask_softmax.window_size})"
    if getattr(self, "softmax_offset", None) is not None:
        return f"softmax type {self.config.softmax_type!r}"
    return None


@once
def install() -> None:
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.transformer import dot_product_attention as dpa

    cls = seam(dpa, "DotProductAttention", CHECKED)
    original = seam(cls, "forward", CHECKED, ("query", "key", "value", "attention_mask", "attn_mask_type",
                                              "attention_bias", "packed_seq_params"))

    @functools.wraps(original)
    def forward(self: Any, query: Any, key: Any, value: Any, attention_mask: Any, attn_mask_type: Any = None,
                attention_bias: Any = None, packed_seq_params: Any = None) -> Any:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        why = _refusal(self, mask_type, attention_bias, packed_seq_params, query, key)
        if why is not None:
            raise UnsupportedAttention(f"prism: --prism-attention sdpa does not take {why} (layer "
                                       f"{self.layer_number}); run with --prism-attention megatron")
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:  # [s, b, g, d] -> [s, b, n, d], as the unfused path expands them
            key = key.repeat_interleave(groups, dim=2)
            value = value.repeat_interleave(groups, dim=2)
        # the unfused path scales by softmax_scale, then by the layer number inside the softmax
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        p = self.attention_dropout.p if self.training else 0.0
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]

        def attend() -> Any:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                                    scale=scale)

        if p > 0.0 and not self.config.sequence_parallel:  # the unfused path's RNG stream for dropout
            with tensor_parallel.get_cuda_rng_tracker().fork():
                context = attend()
        else:
            context = attend()
        # [b, n, s, d] -> [s, b, n·d]
        return context.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), self.hidden_size_per_partition)

    cls.forward = forward
