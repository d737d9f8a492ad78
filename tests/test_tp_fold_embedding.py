"""The vocab-parallel embedding of a rank whose TP peers mirror it (class depth, serial capture): Megatron's own
forward, its TP sum answered as the fold answers it (T members each contributing the live rank's partial), gives
zeros to every token outside the live shard; with ``patches.tp_fold_embedding`` every token gets one real row of
the live shard at its scale, its own row where it is in the shard. Run in a child process: ``install`` patches
the class for the rest of the process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.megatron

CHILD = textwrap.dedent("""
    import torch
    from megatron.core.tensor_parallel import layers
    from prism_megatron.patches import tp_fold_embedding

    T, S, H = 4, 4, 8  # TP size, rows per shard, hidden: vocabulary 16, the live rank holds ids 0-3
    emb = layers.VocabParallelEmbedding.__new__(layers.VocabParallelEmbedding)
    torch.nn.Module.__init__(emb)
    emb.tp_group = type("Group", (), {"size": lambda self: T})()
    emb.vocab_start_index, emb.vocab_end_index, emb.num_embeddings_per_partition = 0, S, S
    emb.deterministic_mode, emb.reduce_scatter_embeddings, emb.gtp_remat_size = False, False, 1
    emb.weight = torch.nn.Parameter(torch.randn(S, H))
    # the TP all-reduce as the fold answers it: every member contributes what the live rank does; its backward
    # is the identity, as Megatron's
    layers.reduce_from_tensor_model_parallel_region = lambda x, group=None: x + (T - 1) * x.detach()
    tokens = torch.arange(16).reshape(2, 8)
    before = emb(tokens).detach()
    print("before: zero rows", int((before.abs().sum(-1) == 0).sum()), "of 16")
    tp_fold_embedding.install()
    tp_fold_embedding.install()  # idempotent
    out = emb(tokens)
    want = emb.weight.detach()[tokens % S]
    print("after: zero rows", int((out.detach().abs().sum(-1) == 0).sum()),
          "equal to row t mod S", torch.allclose(out.detach(), want),
          "own rows exact", torch.allclose(out.detach()[0, :S], emb.weight.detach()))
    out.sum().backward()
    print("grad per row", emb.weight.grad[:, 0].tolist())
""")


def test_a_mirrored_tp_embedding_gives_every_token_a_real_row():
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "before: zero rows 12 of 16"  # the 12 tokens outside the live shard: silent zeros
    assert lines[1] == "after: zero rows 0 equal to row t mod S True own rows exact True"
    # each row is looked up by 4 tokens, each passing 1/T of its gradient: the mirrored sum's own gradient
    assert lines[2] == "grad per row [1.0, 1.0, 1.0, 1.0]"
