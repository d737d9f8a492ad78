"""CPU execution mode: device redirection, torch.cuda stand-ins, the GPU refusal, Megatron's RNG
tracker, and real megatron-core GPTModel training steps (TP1, TP2, TP2+SP, MoE EP2) on CPU."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.overrides import _get_current_function_mode_stack

from conftest import free_port
from prism_megatron.megatron import cpu_cuda_stubs, cpu_mode
from prism_megatron.megatron.cpu_mode import (
    cpu_mode_active,
    disable_cpu_mode,
    enable_cpu_mode,
)

pytestmark = pytest.mark.megatron  # runs megatron-core: CI also runs it on the second stack (.ci/run)

REPO = Path(__file__).resolve().parents[1]
GPU = cpu_mode._gpu_present()
cpu_only = pytest.mark.skipif(GPU, reason="CPU mode refuses to run where a GPU is present")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


needs_megatron = pytest.mark.skipif(not _installed("megatron.core"), reason="megatron-core missing")


@pytest.fixture(autouse=True)
def _leave_cpu_mode_off():
    yield
    if cpu_mode_active():
        disable_cpu_mode()


def _cuda_attributes() -> dict[tuple[str, str], object]:
    """Every torch.cuda attribute CPU mode may replace, by identity."""
    found = {}
    for module_name, stand_ins in cpu_cuda_stubs.cuda_stand_ins().items():
        module = sys.modules[module_name]
        for name in stand_ins:
            found[(module_name, name)] = module.__dict__.get(name, "<missing>")
    found[("torch.autograd", "_engine_run_backward")] = torch.autograd._engine_run_backward
    found[("torch.autograd.graph", "_engine_run_backward")] = torch.autograd.graph._engine_run_backward
    found[("torch.Tensor", "record_stream")] = torch.Tensor.__dict__.get("record_stream", "<missing>")
    return found


# ----------------------------------------------------------------------------- redirection
@cpu_only
def test_without_the_mode_cuda_requests_fail():
    """The control: on this machine a CUDA request fails, so the tests below can fail."""
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(2, device="cuda")
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


@cpu_only
def test_factory_device_kwargs_go_to_cpu():
    enable_cpu_mode(patch_megatron=False)
    assert cpu_mode_active()
    base = torch.ones(3)
    made = [
        torch.empty(2, device="cuda"),
        torch.zeros(2, device="cuda:1"),
        torch.ones(2, device=torch.device("cuda", 0)),
        torch.full((2,), 3.0, device=0),
        torch.arange(4, device=torch.cuda.current_device()),
        torch.tensor([1.0, 2.0], device="cuda"),
        torch.randn(2, 2, device=torch.device("cuda")),
        torch.empty_like(base, device="cuda"),
        base.new_zeros(5, device="cuda"),
        torch.empty(2, device="cuda", pin_memory=True),
    ]
    assert all(t.device.type == "cpu" for t in made)
    assert torch.empty(2, device="cpu").device.type == "cpu"


@cpu_only
def test_cuda_and_to_go_to_cpu():
    enable_cpu_mode(patch_megatron=False)
    x = torch.arange(6.0).view(2, 3)
    assert x.cuda() is x and x.cuda(0) is x
    assert x.to("cuda").device.type == "cpu"
    assert x.to(device="cuda:0").device.type == "cpu"
    assert x.to(0).device.type == "cpu"
    y = x.to(torch.device("cuda", 0), torch.float16, non_blocking=True)
    assert y.device.type == "cpu" and y.dtype == torch.float16
    assert x.to(torch.float64).dtype == torch.float64  # dtype-only calls untouched
    assert x.pin_memory() is x
    x.record_stream(torch.cuda.current_stream())  # no-op instead of a TypeError
    module = torch.nn.Linear(3, 2).cuda()
    module.to("cuda", torch.float64)
    assert module.weight.device.type == "cpu" and module.weight.dtype == torch.float64
    assert module(x.double()).shape == (2, 2)


@cpu_only
def test_type_strings_report_cuda_and_convert():
    enable_cpu_mode(patch_megatron=False)
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.half).type() == "torch.cuda.HalfTensor"
    assert torch.nn.Parameter(torch.ones(1, dtype=torch.bfloat16)).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type("torch.cuda.HalfTensor").dtype == torch.float16
    assert torch.ones(1).type(torch.cuda.DoubleTensor).dtype == torch.float64
    assert torch.ones(1).is_cuda is False  # deliberately truthful (module docstring)
    disable_cpu_mode()
    assert torch.ones(1).type() == "torch.FloatTensor"


class _MakesCudaTensorsInBackward(torch.autograd.Function):
    """Like Megatron's tensor-parallel functions: allocates on the 'current device' in backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        scale = torch.full(grad.shape, 3.0, device=torch.cuda.current_device())
        return grad * scale


@cpu_only
def test_mode_stays_active_in_backward():
    enable_cpu_mode(patch_megatron=False)
    x = torch.ones(3, device="cuda", requires_grad=True)
    _MakesCudaTensorsInBackward.apply(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 3.0))
    x.grad = None
    torch.autograd.backward(_MakesCudaTensorsInBackward.apply(x).sum())
    assert torch.equal(x.grad, torch.full((3,), 3.0))
    (grad,) = torch.autograd.grad(_MakesCudaTensorsInBackward.apply(x).sum(), x)
    assert torch.equal(grad, torch.full((3,), 3.0))
    assert len(_get_current_function_mode_stack()) == 1


@cpu_only
def test_cuda_stand_ins():
    enable_cpu_mode(patch_megatron=False)
    assert torch.cuda.is_available() is False  # deliberately the truth (cpu_cuda_stubs docstring)
    assert torch.accelerator.is_available() is False and torch.accelerator.current_accelerator() is None
    assert torch.accelerator.current_device_index() == 0
    assert torch.accelerator.current_stream() is torch.cuda.current_stream()
    assert not torch.accelerator.current_stream().is_capturing() and not torch.cuda.is_current_stream_capturing()
    torch.accelerator.synchronize()
    assert torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
    torch.cuda.set_device(0)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    assert 15.0 <= start.elapsed_time(end) < 2000.0
    side = torch.cuda.Stream()
    assert torch.cuda.current_stream() is torch.cuda.default_stream()
    with torch.cuda.stream(side):
        assert torch.cuda.current_stream() is side
        side.wait_stream(torch.cuda.default_stream())
        side.record_event().synchronize()
    assert torch.cuda.current_stream() is torch.cuda.default_stream()
    assert torch.cuda.memory_allocated() == 0 and torch.cuda.max_memory_reserved() == 0
    assert torch.cuda.memory_stats()["allocated_bytes.all.peak"] == 0
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    assert 0 < free <= total == torch.cuda.get_device_properties(0).total_memory
    assert torch.cuda.get_device_capability() == (0, 0)
    assert "cpu" in torch.cuda.get_device_name().lower()
    torch.cuda.nvtx.range_push("x")
    torch.cuda.nvtx.range_pop()
    with torch.cuda.nvtx.range("y"), torch.cuda.device(0):
        pass
    torch.cuda.manual_seed(5)
    first = torch.rand(3, device="cuda")
    torch.cuda.set_rng_state(torch.cuda.get_rng_state())
    assert torch.cuda.default_generators[0] is torch.default_generator
    torch.cuda.manual_seed_all(5)
    assert torch.equal(first, torch.rand(3, device="cuda"))


@cpu_only
def test_a_scripts_compiled_function_runs_eagerly_and_disable_gives_dynamo_back():
    import torch._dynamo

    before = torch._dynamo.config.disable
    enable_cpu_mode(patch_megatron=False)
    traced = []

    def scaled_gelu(x):
        traced.append(torch.compiler.is_compiling())
        return torch.nn.functional.gelu(x.cuda()) * 2

    compiled = torch.compile(scaled_gelu)
    x = torch.randn(4)
    assert torch.equal(compiled(x), torch.nn.functional.gelu(x) * 2)
    assert traced == [False]  # run op by op: dynamo never traced it
    disable_cpu_mode()
    assert torch._dynamo.config.disable is before


@cpu_only
def test_stream_context_is_reusable_like_torchs():
    """Megatron's DDP keeps one ``torch.cuda.stream(s)`` and enters it twice (grad reduce, then the
    all-reduce across distributed-optimizer instances); torch's StreamContext allows it."""
    enable_cpu_mode(patch_megatron=False)
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    ctx = torch.cuda.stream(side)
    assert isinstance(ctx, torch.cuda.StreamContext)
    for _ in range(2):
        with ctx:
            assert torch.cuda.current_stream() is side
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
    with ctx:  # entered inside itself and inside another stream's context: each exit restores its own
        with torch.cuda.StreamContext(other), ctx:
            assert torch.cuda.current_stream() is side
        assert torch.cuda.current_stream() is side
    assert torch.cuda.current_stream() is torch.cuda.default_stream()
    with torch.cuda.stream(None):  # None selects nothing, as in torch
        assert torch.cuda.current_stream() is torch.cuda.default_stream()
    with pytest.raises(KeyError), ctx:  # an error inside still restores the stream
        raise KeyError
    assert torch.cuda.current_stream() is torch.cuda.default_stream()


@cpu_only
@needs_megatron
def test_enable_disable_restores_everything():
    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as dispatcher
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def megatron_seams():
        return (
            mrandom._lazy_call,
            mrandom._lazy_init,
            mrandom.device_ctx_manager,
            moe_utils.maybe_move_tensor_to_cpu,
            dispatcher.maybe_move_tensor_to_cpu,
            moe_utils.__dict__.get("te_general_gemm", "<missing>"),
            WrappedTorchNorm.__dict__["__new__"],
            tuple(logging.getLogger(mrandom.__name__).filters),
        )

    before, seams_before, modules_before = _cuda_attributes(), megatron_seams(), set(sys.modules)
    enable_cpu_mode(patch_megatron=False)
    assert megatron_seams() == seams_before
    enable_cpu_mode()  # adds the megatron seams to the active mode
    enable_cpu_mode()  # idempotent
    changed = {k for k, v in _cuda_attributes().items() if v is not before[k]}
    assert ("torch.cuda", "current_device") in changed and ("torch.cuda.random", "get_rng_state") in changed
    assert ("torch.cuda", "is_available") in changed and ("torch.accelerator", "current_stream") in changed
    assert megatron_seams() != seams_before
    assert len(_get_current_function_mode_stack()) == 1
    disable_cpu_mode()
    disable_cpu_mode()  # no-op
    after = _cuda_attributes()
    assert all(after[k] is before[k] for k in before)
    assert megatron_seams() == seams_before
    assert _get_current_function_mode_stack() == []
    assert "triton" not in set(sys.modules) - modules_before
    with pytest.raises((RuntimeError, AssertionError)):
        torch.empty(1, device="cuda")
    with cpu_mode.cpu_mode(patch_megatron=False):
        assert torch.empty(1, device="cuda").device.type == "cpu"
    assert not cpu_mode_active()


class _TouchedCuda(AssertionError):
    pass


def _as_a_cuda_build_without_a_gpu(monkeypatch) -> None:
    """Make this CPU build answer as PyPI's CUDA build does on a machine without a GPU, in a rank the
    launcher started (NVML-based availability check), with every way into the CUDA runtime failing."""
    def touched(*args, **kwargs):
        raise _TouchedCuda("a CUDA runtime call was made")

    import torch._dynamo  # noqa: F401  (the optimizers import it lazily; on a CUDA build it binds CUDA internals)

    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_lazy_init", touched)
    monkeypatch.setattr(torch._C, "_accelerator_getAccelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: 0, raising=False)  # no GPU (absent on CPU)
    for name in ("_accelerator_getDeviceIndex", "_accelerator_getStream", "_accelerator_synchronizeDevice",
                 "_accelerator_setDeviceIndex"):
        monkeypatch.setattr(torch._C, name, touched)


@cpu_only
def test_torch_accelerator_paths_never_touch_cuda_on_a_cuda_build(monkeypatch):
    """torch 2.13's device-generic code under CPU mode on a CUDA build: Adam's graph-capture health check
    (torch.accelerator.current_stream) and a DataLoader with Megatron's defaults (2 workers, pin_memory)
    take their host paths; without the accelerator stand-ins both reached the CUDA runtime."""
    _as_a_cuda_build_without_a_gpu(monkeypatch)
    assert torch.accelerator.current_accelerator() == torch.device("cuda")  # the fake holds
    enable_cpu_mode(patch_megatron=False)
    assert not torch.cuda.is_available() and torch.accelerator.current_accelerator(check_available=True) is None
    weight = torch.nn.Parameter(torch.ones(4, device="cuda"))
    optimizer = torch.optim.Adam([weight], lr=0.1)
    weight.sum().backward()
    optimizer.step()
    assert torch.all(weight < 1)
    data = torch.utils.data.TensorDataset(torch.arange(8.0))
    loader = torch.utils.data.DataLoader(data, batch_size=2, num_workers=2, pin_memory=True,
                                         persistent_workers=True)
    with pytest.warns(UserWarning, match="no accelerator"):
        batches = iter(loader)
    assert sorted(float(x) for (batch,) in batches for x in batch) == [float(i) for i in range(8)]
    assert getattr(batches, "_pin_memory_thread", None) is None
    batches._shutdown_workers()


# ----------------------------------------------------------------------------- safety
def _assert_nothing_patched(before):
    assert not cpu_mode_active()
    assert _get_current_function_mode_stack() == []
    assert all(_cuda_attributes()[k] is before[k] for k in before)


def test_refuses_when_a_gpu_is_present(monkeypatch):
    before = _cuda_attributes()
    monkeypatch.setattr(cpu_mode, "_gpu_present", lambda: True)
    with pytest.raises(RuntimeError, match="GPU is present"):
        enable_cpu_mode()
    with pytest.raises(RuntimeError, match="GPU is present"), cpu_mode.cpu_mode():
        pass
    _assert_nothing_patched(before)


@pytest.mark.parametrize("real", ["_REAL_IS_AVAILABLE", "_REAL_DEVICE_COUNT", "_REAL_IS_INITIALIZED"])
def test_gpu_check_uses_the_real_torch_cuda(monkeypatch, real):
    """The check reads torch.cuda as captured at import, so a stub answering 'no GPU' cannot fool it."""
    before = _cuda_attributes()
    monkeypatch.setattr(cpu_mode, real, lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert cpu_mode._gpu_present()
    with pytest.raises(RuntimeError, match="GPU is present"):
        enable_cpu_mode(patch_megatron=False)
    monkeypatch.undo()
    _assert_nothing_patched(before)


def test_gpu_check_ignores_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 2)  # NVML ignores the env var
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cpu_mode._gpu_present()


@pytest.mark.skipif(not GPU, reason="needs a machine with a GPU")
def test_refuses_on_a_real_gpu_machine():
    before = _cuda_attributes()
    with pytest.raises(RuntimeError, match="GPU is present"):
        enable_cpu_mode()
    _assert_nothing_patched(before)


# ----------------------------------------------------------------------------- RNG tracker
@cpu_only
@needs_megatron
def test_megatron_rng_tracker_is_seeded_and_forks(caplog):
    enable_cpu_mode()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    def draw(seed, tp_rank=0):
        model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
        default = torch.rand(4, device="cuda")
        with get_cuda_rng_tracker().fork():
            forked = torch.rand(4, device="cuda")
            dropped = torch.nn.functional.dropout(torch.ones(64, device="cuda"), p=0.5)
        after = torch.rand(4, device="cuda")
        with get_cuda_rng_tracker().fork():
            forked_again = torch.rand(4, device="cuda")
        return default, forked, dropped, after, forked_again

    def stream(seed, n):
        return torch.rand(n, generator=torch.Generator().manual_seed(seed))

    with caplog.at_level(logging.WARNING):
        a, b, c, d = draw(7), draw(7), draw(8), draw(7, tp_rank=1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), "same seed must reproduce"
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[1], c[1]), "another seed must differ"
    default, forked, dropped, after, forked_again = a
    # the default stream is the data-parallel seed and the fork did not consume it
    assert torch.equal(torch.cat([default, after]), stream(7, 8))
    # the fork really switched to the tensor-parallel seed (seed + 2718 + tp_rank) and resumes it
    assert torch.equal(forked, stream(7 + 2718, 4))
    torch.manual_seed(7 + 2718)
    torch.rand(4)
    assert torch.equal(dropped, torch.nn.functional.dropout(torch.ones(64), p=0.5))
    assert torch.equal(forked_again, torch.rand(4))
    assert torch.equal(d[0], default) and not torch.equal(d[1], forked), "TP ranks fork apart"
    assert "CPU RNG state changed" not in caplog.text


# ----------------------------------------------------------------------------- MoE / triton seams
def test_moe_split_sizes_become_host_lists():
    sizes = cpu_mode._move_tensor_to_host(torch.tensor([3, 5]), as_numpy=True)
    assert sizes.tolist() == [3, 5] and not torch.is_tensor(sizes)
    assert cpu_mode._move_tensor_to_host(None) is None


@pytest.mark.skipif(_installed("triton"), reason="triton is installed: no stub needed")
def test_triton_stub_only_when_an_import_needs_it(tmp_path, monkeypatch):
    (tmp_path / "needs_triton_mod.py").write_text(
        textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def kernel(x_ptr, N: tl.constexpr):
            pass
        """)
    )
    (tmp_path / "broken_mod.py").write_text("import not_a_real_module_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    patches = cpu_mode._Patches()
    try:
        module = cpu_mode._import_with_triton_fallback("needs_triton_mod", patches)
        assert cpu_cuda_stubs.triton_stub_installed()
        with pytest.raises(RuntimeError, match="triton is not installed"):
            module.kernel[(1,)](None, N=4)
        with pytest.raises(ModuleNotFoundError):
            cpu_mode._import_with_triton_fallback("broken_mod", patches)
    finally:
        patches.restore()
        sys.modules.pop("needs_triton_mod", None)
    assert "triton" not in sys.modules and "triton.language" not in sys.modules


# ----------------------------------------------------------------------------- end to end
def _train_gpt(rank: int, world_size: int, port: int, tp: int, sp: bool, moe: bool) -> dict:
    """One rank: tiny megatron-core GPTModel, DDP, Megatron optimizer, the no-pipelining
    schedule, 3 steps, written as for a GPU (device='cuda', .cuda(), current_device())."""
    enable_cpu_mode()
    torch.distributed.init_process_group(
        "gloo", rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}"
    )
    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=world_size if moe else 1)
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)
    moe_args = (
        dict(
            num_moe_experts=4,
            moe_router_topk=2,
            moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0,
            add_bias_linear=False,
        )
        if moe
        else {}
    )
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        hidden_dropout=0.1,
        attention_dropout=0.1,
        **moe_args,
    )
    vocab, seq, mbs = 128, 32, 2
    spec = get_gpt_layer_local_spec(num_experts=moe_args.get("num_moe_experts"))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq)
    model.cuda(torch.cuda.current_device())
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, clip_grad=1.0), [ddp])
    config.finalize_model_grads_func = finalize_model_grads

    tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=torch.Generator().manual_seed(0)).cuda()
    position_ids = torch.arange(seq, device="cuda").unsqueeze(0).expand(mbs, -1)
    attention_mask = torch.tril(torch.ones(seq, seq, device="cuda")).view(1, 1, seq, seq) < 0.5
    loss_mask = torch.ones(mbs * seq, device=torch.cuda.current_device())

    def forward_step(data_iterator, model):
        output = model(tokens[:, :-1], position_ids, attention_mask, labels=tokens[:, 1:])

        def loss_func(output_tensor):
            loss = torch.sum(output_tensor.float().view(-1) * loss_mask) / loss_mask.sum()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    losses = []
    for _ in range(3):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None]),
            model=[ddp],
            num_microbatches=1,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        assert ok
        losses.append(float(reduced[0]["lm loss"]))
    norms = [float(p.detach().double().sum()) for n, p in model.named_parameters() if "layernorm" in n]
    torch.distributed.destroy_process_group()
    return dict(
        losses=losses,
        grad_norm=float(grad_norm),
        norm_sums=norms,
        cuda_used=torch.cuda.is_initialized() or torch.cuda.is_available(),
    )


def _run_ranks(world_size: int, tp: int = 1, sp: bool = False, moe: bool = False) -> list[dict]:
    """Each rank in its own interpreter, so torch.distributed/megatron state cannot leak."""
    port = free_port()
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore",
        PYTHONPATH=os.pathsep.join([str(REPO), str(Path(__file__).parent)]),
    )
    code = (
        "import json, sys; from test_cpu_mode import _train_gpt; "
        "print('RESULT ' + json.dumps(_train_gpt(*map(int, sys.argv[1:]))))"
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                code,
                str(rank),
                str(world_size),
                str(port),
                str(tp),
                str(int(sp)),
                str(int(moe)),
            ],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    results = []
    try:
        for rank, proc in enumerate(procs):
            out, err = proc.communicate(timeout=150)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert proc.returncode == 0 and lines, f"rank {rank} failed:\n{err[-4000:]}"
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results


def _check_training(results: list[dict]) -> None:
    for result in results:
        losses = result["losses"]
        assert all(map(lambda v: v == v and abs(v) < 1e6, losses)), losses  # finite
        assert losses[-1] < losses[0], losses
        assert not result["cuda_used"]
    for other in results[1:]:
        assert other["losses"] == results[0]["losses"]
        assert other["norm_sums"] == results[0]["norm_sums"]


@cpu_only
@needs_megatron
def test_gpt_training_single_process():
    _check_training(_run_ranks(1))


@cpu_only
@needs_megatron
# `heavy` (pytest.ini): on the second stack the TP2 step without SP and the MoE step are the Megatron code that
# test_megatron_emulation's captures and gloo runs already train there in CPU mode (TP2·PP2·DP2, MoE EP2 all-to-all)
@pytest.mark.parametrize("sp", [pytest.param(False, id="tp2", marks=pytest.mark.heavy),
                                pytest.param(True, id="tp2-sequence-parallel")])
def test_gpt_training_tensor_parallel_two_processes(sp):
    """Equal losses on both ranks; with SP, norm weights stay equal only if their grads were
    all-reduced, i.e. only if the sequence_parallel tag reached Megatron's finalize step."""
    _check_training(_run_ranks(2, tp=2, sp=sp))


@cpu_only
@needs_megatron
@pytest.mark.heavy  # see test_gpt_training_tensor_parallel_two_processes
def test_gpt_moe_alltoall_expert_parallel_two_processes():
    _check_training(_run_ranks(2, moe=True))
