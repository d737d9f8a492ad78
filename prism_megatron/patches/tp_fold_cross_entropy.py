"""Seams: ``VocabParallelCrossEntropy.calculate_predicted_logits`` and ``prepare_gradient_calculation_operands`` -
the loss of a rank whose tensor-parallel peers are virtual.

Megatron's vocab-parallel cross entropy has each TP rank take the target's logit where the target id falls in its
vocabulary shard, else 0, and sum those over the TP group with the shards' sums of exps (all-reduce SUM; the
max logit by all-reduce MAX); its backward subtracts the one-hot on the owning shard only. Where the TP peers
mirror the live rank (``tp_fold_embedding.ENV_VAR``) every member contributes the live rank's partial: the sum
of exps is T times the live shard's (a softmax over T copies of it: a stand-in for the full vocabulary), but
the target's logit is T x 0 for every target outside the live shard - the loss misses its target term and the
gradient its -1 for those tokens. ``RULE`` instead: the embedding's translation
(``tp_fold_embedding.translated_ids``) applied to the targets. Two seams of ``VocabParallelCrossEntropy`` (the
target's logit, the backward's one-hot) that both of Megatron's native paths call
(``tensor_parallel.vocab_parallel_cross_entropy``, ``fusions.fused_vocab_parallel_cross_entropy``);
Transformer Engine's fused loss is not covered. Checked against the supported releases
(``megatron.versions``).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam
from prism_megatron.patches.tp_fold_embedding import ENV_VAR, translated_ids

CHECKED = checked_versions()

RULE = """\
A rank whose tensor-parallel peers mirror it treats every target t as the live shard's row t mod S (S rows; the
embedding's translation) and divides that target's logit by T (the TP size) before Megatron's TP sum, so the
mirrored sums give the cross entropy of the translated target over T copies of the live shard:
log(T * sum(exp(shard))) - logit[t mod S], never a missing target term. Its gradient is that function's, as
the embedding's: Megatron's softmax over the T copies minus the one-hot at t mod S divided by T (each member
contributed 1/T of the target's logit), so the mirrored sum of the hidden states' gradient over TP has the
target's row once, as the full run has it, not T times."""


def mirror_size() -> int:
    """T, the TP size whose peers mirror this rank (``ENV_VAR``, set by ``megatron.run``)."""
    value = os.environ.get(ENV_VAR, "")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"prism: {ENV_VAR}={value!r} is not a tensor-parallel size (a positive integer)")
    return int(value)


@once
def install() -> None:
    size = mirror_size()
    from megatron.core.tensor_parallel import cross_entropy

    cls = seam(cross_entropy, "VocabParallelCrossEntropy", CHECKED)
    original = seam(cls, "calculate_predicted_logits", CHECKED,
                    ("vocab_parallel_logits", "target", "logits_max", "vocab_start_index", "vocab_end_index"))

    @functools.wraps(original)
    def calculate_predicted_logits(vocab_parallel_logits: Any, target: Any, logits_max: Any,
                                   vocab_start_index: int, vocab_end_index: int) -> Any:
        target = translated_ids(target, vocab_start_index, vocab_end_index - vocab_start_index)
        target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = original(
            vocab_parallel_logits, target, logits_max, vocab_start_index, vocab_end_index)
        return target_mask, masked_target_1d, predicted_logits / size, sum_exp_logits, exp_logits

    prepare = seam(cls, "prepare_gradient_calculation_operands", CHECKED, ("softmax", "target_mask"))

    @functools.wraps(prepare)
    def prepare_gradient_calculation_operands(softmax: Any, target_mask: Any) -> Any:
        grad_2d, arange_1d, softmax_update, grad_input = prepare(softmax, target_mask)
        return grad_2d, arange_1d, softmax_update / size, grad_input

    cls.calculate_predicted_logits = staticmethod(calculate_predicted_logits)
    cls.prepare_gradient_calculation_operands = staticmethod(prepare_gradient_calculation_operands)
