"""Seam: ``VocabParallelEmbedding.forward`` - the word embedding of a rank whose tensor-parallel peers are virtual.

At class depth a stage's TP peers are virtual and mirror its tp = 0 rank (``nccl_prune`` mirror); in a
serial capture every TP peer not captured with the rank is answered by self mirror, which is the same
for them. Megatron's vocab-parallel embedding has each TP rank look up the tokens of its own vocabulary
shard, zero the rows of every other token, and sum the shards over the TP group (all-reduce, or
reduce-scatter under sequence parallelism): each token gets its row from exactly one rank. Mirrored,
that sum is T times the live rank's partial (T the TP size): its own tokens' rows T times over and zeros
for every other token. Without biases and with rotary positions (Llama) those zeros go through every
layer of the stage (RMSNorm of zeros, gradients scaled by 1/sqrt(eps)) and on to the next stages: a
silent zero that steers the program (grad norms of hundreds where the full capture logs about 2, and
once stand-ins carry recorded norms, the next stages receive the zeros too). ``RULE`` instead (the loss's
targets take the same translation, ``translated_ids``: ``tp_fold_cross_entropy``). Only installed where the
fold mirrors the rank's TP peers (``ENV_VAR``, set by ``megatron.run``). Checked against the supported
releases (``megatron.versions``).
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()

#: set by ``run`` (to the TP size) for a fold whose live ranks' TP peers are virtual mirrors of them
ENV_VAR = "PRISM_FOLD_TP_MIRROR"

RULE = """\
A rank whose tensor-parallel peers mirror it (class depth with TP > 1; a serial capture) looks every token
t up at row t mod S of its own vocabulary shard (S rows) and divides the rows by T (the TP size) before
Megatron's TP reduction, so the mirrored sum over the T members gives every token one real row of the
model's embedding at its own scale: exactly its row for a token of the live shard, for any other token the
live shard's row t mod S (the rows it lacks are held by virtual peers). Never zeros. Its gradients are those
of that function (each looked-up row gets 1/T of its token's gradient)."""


def translated_ids(input_: Any, vocab_start: int, rows: int) -> Any:
    """Token ids mapped into the live shard: ``vocab_start + (t mod rows)`` (RULE)."""
    return vocab_start + input_ % rows


@once
def install() -> None:
    from megatron.core.tensor_parallel import layers

    cls = seam(layers, "VocabParallelEmbedding", CHECKED)
    original = seam(cls, "forward", CHECKED, ("input_",))

    @functools.wraps(original)
    def forward(self: Any, input_: Any) -> Any:
        size = self.tp_group.size()
        if size <= 1:
            return original(self, input_)
        ids = translated_ids(input_, self.vocab_start_index, self.num_embeddings_per_partition)
        return original(self, ids) / size

    cls.forward = forward
