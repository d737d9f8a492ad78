"""Seam: ``megatron.core.transformer.dot_product_attention.DotProductAttention.__init__`` - MLA's head sizes.

Multi-latent attention (``MLASelfAttention``) builds its core attention with ``k_channels`` (the
query/key head size: ``qk_head_dim + qk_pos_emb_head_dim``) and ``v_channels`` (``v_head_dim``).
Transformer Engine's ``DotProductAttention`` takes them; the local one does not, in every supported
release, so a DeepSeek-style target rendered with ``--transformer-impl local`` cannot build its model
(``TypeError: ... unexpected keyword argument 'k_channels'``), on a GPU as on CPU. This seam takes them
as TE does: the output per partition is ``v_channels`` x the heads per partition (what the attention
returns; the unfused path and ``--prism-attention sdpa`` read every other head size from the
tensors), and without an explicit ``softmax_scale`` the scale is 1/sqrt(``k_channels``) (MLA passes
its own, with YaRN's mscale). A layer built without them is unchanged; a release whose local
attention takes them itself is left alone. Checked against the supported releases
(``megatron.versions``).
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

__all__ = ["install"]

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table


@once
def install() -> None:
    cls = seam("megatron.core.transformer.dot_product_attention", "DotProductAttention", CHECKED)
    original = seam(cls, "__init__", CHECKED, ("config", "layer_number", "softmax_scale"))
    if "k_channels" in inspect.signature(original).parameters:  # the release takes MLA's head sizes itself
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, k_channels: int | None = None, v_channels: int | None = None,
                 **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition
        if k_channels is not None and kwargs.get("softmax_scale") is None:
            scale = 1.0 / math.sqrt(k_channels)
            self.softmax_scale = scale / (self.layer_number if self.config.apply_query_key_layer_scaling else 1)

    cls.__init__ = __init__
