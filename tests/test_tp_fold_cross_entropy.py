"""The vocab-parallel cross entropy of a rank whose TP peers mirror it (class depth, serial capture): Megatron's own
loss, its TP reductions answered as the fold answers them (T members each contributing the live rank's partial),
has no target logit for a target outside the live shard; with ``patches.tp_fold_cross_entropy`` the loss is the
cross entropy of the translated target (row t mod S) over T copies of the live shard, and the gradient Megatron's
softmax minus 1/T of the one-hot there (the live rank's share of the target), for Megatron's unfused and native
fused paths. Run in a child process:
``install`` patches the class for the rest of the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron

CHILD = textwrap.dedent("""
    import os
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy, vocab_parallel_cross_entropy
    from prism_megatron.patches import tp_fold_cross_entropy, tp_fold_embedding

    T, S = 4, 5  # TP size, rows per shard: vocabulary 20, the live rank (tp = 0) holds ids 0-4
    os.environ[tp_fold_embedding.ENV_VAR] = str(T)
    group = type("Group", (), {"size": lambda self: T, "rank": lambda self: 0})()
    parallel_state._TENSOR_MODEL_PARALLEL_GROUP = group
    parallel_state.set_tensor_model_parallel_world_size(T)
    parallel_state.set_tensor_model_parallel_rank(0)
    torch.distributed.is_initialized = lambda: True

    def all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        # the fold's answer: every member contributes what the live rank does
        if op != torch.distributed.ReduceOp.MAX:
            tensor.mul_(T)

    torch.distributed.all_reduce = all_reduce
    torch.manual_seed(0)
    logits = torch.randn(3, 8, S)  # [sequence, batch, shard]
    target = torch.arange(24).reshape(3, 8) % (T * S)  # 5 in the live shard per 20 ids

    def predicted(target):
        z = logits.clone()
        return VocabParallelCrossEntropy.calculate_predicted_logits(z, target, z.max(-1)[0], 0, S)[2]

    outside = target >= S
    own = (logits - logits.max(-1, keepdim=True)[0]).gather(-1, (target % S).unsqueeze(-1)).squeeze(-1)
    before = predicted(target)
    print("before: outside targets' logits zero", int((before[outside] == 0).sum()), "of", int(outside.sum()),
          "inside exact", torch.equal(before[~outside], own[~outside]))
    tp_fold_cross_entropy.install()
    tp_fold_cross_entropy.install()  # idempotent
    after = predicted(target)
    print("after: every target's logit is row t mod S's over T", torch.allclose(after, own / T))

    # expected, independently: torch's cross entropy over T copies of the shard, the target t mod S's mass split
    # evenly over the copies (each member contributes 1/T of its logit); the gradient is the live copy's
    live = logits.clone().requires_grad_(True)
    copies = torch.cat([live] + [logits] * (T - 1), dim=-1).reshape(-1, T * S)
    mass = F.one_hot(target % S, S).float().reshape(-1, S).repeat(1, T) / T
    want = F.cross_entropy(copies, mass, reduction="none").view(3, 8)
    want.sum().backward()
    for name, loss_fn in (("unfused", lambda x: vocab_parallel_cross_entropy(x, target)),
                          ("fused", lambda x: fused_vocab_parallel_cross_entropy(x, target, group))):
        x = logits.clone().requires_grad_(True)
        loss = loss_fn(x)
        loss.sum().backward()
        print(name, "loss", torch.allclose(loss, want, atol=1e-5),
              "grad", torch.allclose(x.grad.float(), live.grad, atol=1e-2 if name == "fused" else 1e-5))
""")


def test_a_mirrored_tp_cross_entropy_has_every_target_term():
    # the fused path's torch.compile runs eagerly (its numbers are the point here, not its compilation)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), TORCHDYNAMO_DISABLE="1")
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "before: outside targets' logits zero 15 of 15 inside exact True"  # T x 0: no target term
    assert lines[1] == "after: every target's logit is row t mod S's over T True"
    assert lines[2] == "unfused loss True grad True"
    assert lines[3] == "fused loss True grad True"  # its gradient in bf16, as Megatron's fused backward casts
