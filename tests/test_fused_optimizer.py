"""--prism-optimizer fused (``patches.fused_optimizer``): the target's fused optimizer step rendered by torch's
fused Adam and in-place foreach ops, where Megatron would fall back to torch's foreach Adam and its local clip
and norm. The same values as Megatron's fallback, without its temporaries; Megatron builds it; a job trains."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.megatron


def _tensors(n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(17 * (i + 1), generator=g) for i in range(n)]


def test_scale_clips_in_place_and_copies_without_a_temporary_as_megatrons_fallback_computes():
    from megatron.core.utils import local_multi_tensor_scale

    from prism_megatron.patches.fused_optimizer import scale

    grads, want = _tensors(), _tensors()
    ptrs = [t.data_ptr() for t in grads]
    local_multi_tensor_scale(0, None, [want, want], 0.37)
    scale(0, None, [grads, grads], 0.37)  # the clip: the same tensors on both sides
    assert all(torch.equal(a, b) for a, b in zip(grads, want, strict=True))
    assert [t.data_ptr() for t in grads] == ptrs
    src, dst, ref = _tensors(seed=1), [torch.empty(17 * (i + 1)) for i in range(4)], [torch.empty(17 * (i + 1))
                                                                                   for i in range(4)]
    scale(0, None, [src, dst], 1.0)  # a copy (main grads to model grads, parameters back)
    local_multi_tensor_scale(0, None, [src, ref], 1.0)
    assert all(torch.equal(a, b) for a, b in zip(dst, ref, strict=True))
    scale(0, None, [src, dst], 0.5)  # any other scaled copy: computed as the fallback computes it
    local_multi_tensor_scale(0, None, [src, ref], 0.5)
    assert all(torch.equal(a, b) for a, b in zip(dst, ref, strict=True))


def test_the_norm_of_every_tensor_together_in_one_foreach_norm():
    from prism_megatron.patches.fused_optimizer import l2_norm

    a, b = _tensors(3), _tensors(2, seed=2)
    got, per_tensor = l2_norm(0, None, [a, b], False)
    want = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in a + b]))
    assert per_tensor is None and got.shape == (1,) and got.dtype == torch.float32
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert l2_norm(0, None, [[]], False)[0].item() == 0.0


def test_fused_adam_takes_what_megatron_passes_te_and_updates_as_torchs_foreach():
    from prism_megatron.patches.fused_optimizer import FusedTorchAdam

    ps, qs = _tensors(), _tensors()
    for p, q in zip(ps, qs, strict=True):
        p.requires_grad_(), q.requires_grad_()
        p.grad = torch.ones_like(p) * 0.1
        q.grad = torch.ones_like(q) * 0.1
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "capturable": False}
    fused = FusedTorchAdam([{"params": ps}], adam_w_mode=True, **kwargs)
    assert isinstance(fused, torch.optim.AdamW) and fused.defaults["fused"] is True
    plain = torch.optim.AdamW([{"params": qs}], foreach=True, **kwargs)
    for _ in range(3):
        fused.step()
        plain.step()
    assert max((p - q).abs().max().item() for p, q in zip(ps, qs, strict=True)) < 1e-6
    assert type(FusedTorchAdam(_tensors(1), adam_w_mode=False, lr=1e-3)) is torch.optim.Adam


def test_install_points_megatrons_fallbacks_at_the_fused_step(monkeypatch):
    import megatron.core.optimizer as pkg
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.optimizer as optimizer_mod

    from prism_megatron.patches import fused_optimizer

    if not pkg.USING_PYTORCH_OPTIMIZER:
        pytest.skip("a fused Adam (Transformer Engine's or apex's) is importable: Megatron's own is kept")
    for mod, name in ((pkg, "Adam"), (pkg, "USING_PYTORCH_OPTIMIZER"), (clip_grads, "multi_tensor_scale_impl"),
                      (clip_grads, "l2_norm_impl"), (optimizer_mod, "multi_tensor_scale_impl")):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # restored after the test
    fused_optimizer.install.__wrapped__()
    assert pkg.Adam is fused_optimizer.FusedTorchAdam and pkg.USING_PYTORCH_OPTIMIZER is False
    assert clip_grads.multi_tensor_scale_impl is optimizer_mod.multi_tensor_scale_impl is fused_optimizer.scale
    assert clip_grads.l2_norm_impl is fused_optimizer.l2_norm


@pytest.mark.heavy
def test_a_job_trains_with_the_fused_step_and_records_it(megatron_runs):
    """TP2·PP2·DP2 with the distributed optimizer's clip path: iteration 1's loss and grad norm as with Megatron's
    fallback (the step has not run yet: the norm is the same sum), later ones within Adam's rounding; the trace's
    job names the step."""
    from prism_megatron.trace import read_trace

    plain = megatron_runs.run("mini-dense-tp2pp2dp2", "off")
    fused = megatron_runs.run("mini-dense-tp2pp2dp2", "off", "--prism-optimizer", "fused")
    for (r, it), (loss, norm) in plain["metrics"].items():
        got_loss, got_norm = fused["metrics"][(r, it)]
        assert got_norm == pytest.approx(norm, rel=1e-5 if it == 1 else 1e-2), (r, it)
        for k, v in loss.items():
            assert math.isfinite(got_loss[k]) and got_loss[k] == pytest.approx(v, rel=1e-6 if it == 1 else 1e-3)
    subs = read_trace(fused["trace"]).manifest["job"]["substitutions"]
    assert [s["setting"] for s in subs] == ["optimizer step (--prism-optimizer fused)"]
