"""The norm seam an emulated rank on a GPU gets (no CPU mode): Megatron's torch norm refuses
``--sequence-parallel``; with the seam it builds, and marks its parameters for the TP gradient
all-reduce as TE's and apex's norms do. (On CPU the same seam is part of CPU mode, whose two-process
SP training test checks that the marks reach Megatron's finalize step.) Run in a child process:
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
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from prism_megatron.patches import norm

    def config(sp, normalization):
        return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=2,
                                 sequence_parallel=sp, normalization=normalization)

    try:
        WrappedTorchNorm(config(True, "RMSNorm"), 8)
    except AssertionError as e:
        print("refused:", e)
    norm.install()
    norm.install()  # idempotent: one wrapper, not two
    for kind, cls in (("RMSNorm", torch.nn.RMSNorm), ("LayerNorm", torch.nn.LayerNorm)):
        cfg = config(True, kind)
        layer = WrappedTorchNorm(cfg, 8)
        assert type(layer) is cls and cfg.sequence_parallel, (type(layer), cfg.sequence_parallel)
        marks = [getattr(p, "sequence_parallel", None) for p in layer.parameters()]
        print(kind, "sp marks:", marks)
        plain = WrappedTorchNorm(config(False, kind), 8)
        print(kind, "plain marks:", [getattr(p, "sequence_parallel", None) for p in plain.parameters()])
        x = torch.randn(4, 2, 8)
        assert torch.equal(layer(x), plain(x))  # the same arithmetic on the same tokens
""")


def test_torch_norm_takes_sequence_parallel_and_marks_its_parameters():
    pytest.importorskip("megatron.core")
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert any(line.startswith("refused:") and "sequence parallel" in line for line in lines), out.stdout
    assert "RMSNorm sp marks: [True]" in lines and "LayerNorm sp marks: [True, True]" in lines, out.stdout
    assert "RMSNorm plain marks: [None]" in lines and "LayerNorm plain marks: [None, None]" in lines, out.stdout
