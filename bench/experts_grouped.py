"""Host time of one MoE layer's local experts, forward + backward: Megatron's SequentialMLP loop against
``--prism-experts grouped`` (torch grouped_mm over the same weights), side by side in one process.

  python bench/experts_grouped.py [--device cpu|cuda] [--hidden H] [--ffn F] [--experts E] [--tokens T]
                                  [--reps N] [--dtype fp32|bf16] [--distopt]

One SequentialMLP (SwiGLU experts, no bias, fused weighted SwiGLU as the local spec runs it), E local
experts, T routed tokens split unevenly over them (one expert gets none), wrapped in Megatron's DDP
(``--distopt``: the distributed optimizer's buffer, experts in reverse order). Both paths run on the
same parameters, alternating rep by rep (the loop through SequentialMLP's own forward kept aside before
the seam is installed). Per path: median host seconds per forward + backward (to the return of
backward, no device sync: what the rank's host spends issuing it); on CUDA also the median wall with a
sync after each rep and the device busy time (profiler, kernels summed) of one rep; the ATen calls of
one rep (a dispatch mode: each a host dispatch, on a GPU mostly a kernel launch); the largest output
and weight-gradient difference. Defaults: CPU, small shapes (host-bound as on the GPU);
``--device cuda`` defaults to one Qwen3-30B-A3B layer's experts on one EP16 rank (H 2048, F 768,
8 local experts, 32768 routed tokens, bf16).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import types

import torch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--hidden", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--dtype", choices=("fp32", "bf16"))
    p.add_argument("--distopt", action="store_true")
    a = p.parse_args()
    gpu = a.device == "cuda"
    a.hidden = a.hidden or (2048 if gpu else 256)
    a.ffn = a.ffn or (768 if gpu else 128)
    a.tokens = a.tokens or (32768 if gpu else 1024)
    a.dtype = a.dtype or ("bf16" if gpu else "fp32")
    return a


def counts_for(tokens: int, experts: int) -> list[int]:
    """Uneven counts (weights 1..E-1, expert 1 none) summing to ``tokens``, multiples of 8 where they can be."""
    weights = [0 if e == 1 else e + 1 for e in range(experts)]
    counts = [tokens * w // sum(weights) // 8 * 8 for w in weights]
    counts[0] += tokens - sum(counts)
    return counts


def main() -> None:
    a = parse()
    gpu = a.device == "cuda"
    torch.set_num_threads(1 if not gpu else torch.get_num_threads())
    if not gpu:
        from prism_megatron.megatron.cpu_mode import enable_cpu_mode

        enable_cpu_mode()  # as a CPU rank runs: jit_fuser functions uncompiled
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    device = torch.device("cuda" if gpu else "cpu")
    cfg = TransformerConfig(num_layers=1, hidden_size=a.hidden, num_attention_heads=16, num_moe_experts=a.experts,
                            moe_ffn_hidden_size=a.ffn, ffn_hidden_size=4 * a.hidden, gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=True,
                            params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=not gpu)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=a.distopt, overlap_grad_reduce=False)
    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)

    def build(state: dict | None = None) -> torch.nn.Module:
        m = SequentialMLP(a.experts, cfg, subs, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        if state is not None:
            m.load_state_dict(state)
        return DistributedDataParallel(cfg, ddp, m.to(device))

    torch.manual_seed(0)
    loop = build()
    state = {k: v.clone() if torch.is_tensor(v) else v for k, v in loop.module.state_dict().items()}
    from prism_megatron.patches import grouped_experts, megatron_version

    original = grouped_experts.seam("megatron.core.transformer.moe.experts", "SequentialMLP", ()).forward
    grouped_experts.install()
    loop.module.forward = types.MethodType(original, loop.module)  # this instance keeps Megatron's loop
    grouped = build(state)

    counts = counts_for(a.tokens, a.experts)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(a.tokens, a.hidden, generator=g).to(device=device, dtype=dtype)
    probs = torch.rand(a.tokens, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(a.tokens, a.hidden, generator=g).to(device=device, dtype=dtype)
    tokens_per_expert = torch.tensor(counts)  # on the host, as the all-to-all dispatcher hands it over

    def step(m: torch.nn.Module) -> tuple[float, torch.Tensor, torch.Tensor]:
        xi = x.detach().requires_grad_()
        t0 = time.perf_counter()
        out, _ = m(xi, tokens_per_expert, probs)
        out.backward(dy)
        host = time.perf_counter() - t0
        return host, out.detach(), xi.grad

    def grads(m: torch.nn.Module) -> list[torch.Tensor]:
        return [getattr(e, n).weight.main_grad.float().clone() for e in m.module.local_experts
                for n in ("linear_fc1", "linear_fc2")]

    paths = {"loop (SequentialMLP)": loop, "grouped (grouped_mm)": grouped}
    host = {k: [] for k in paths}
    wall = {k: [] for k in paths}
    outs = {}
    for rep in range(a.reps + 2):  # 2 warm-up reps
        for name, m in paths.items():
            m.zero_grad_buffer()
            if gpu:
                torch.cuda.synchronize()
            w0 = time.perf_counter()
            h, out, dx = step(m)
            if gpu:
                torch.cuda.synchronize()
            if rep >= 2:
                host[name].append(h)
                wall[name].append(time.perf_counter() - w0)
            outs[name] = (out, dx, grads(m))
    from torch.utils._python_dispatch import TorchDispatchMode

    class Census(TorchDispatchMode):
        """ATen calls issued (each one host dispatch; on a GPU, most of them a kernel launch)."""

        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    calls = {}
    for name, m in paths.items():
        with Census() as census:
            step(m)
        calls[name] = census.calls
    busy = {}
    if gpu:
        from torch.profiler import ProfilerActivity, profile

        for name, m in paths.items():
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step(m)
                torch.cuda.synchronize()
            busy[name] = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6

    (o1, dx1, g1), (o2, dx2, g2) = outs.values()
    print(f"# python bench/experts_grouped.py {' '.join(sys.argv[1:])}")
    print(f"# torch {torch.__version__}, megatron-core {megatron_version()}, device "
          f"{torch.cuda.get_device_name() if gpu else 'cpu'}, threads {torch.get_num_threads()}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print(f"# one MoE layer's local experts: hidden {a.hidden}, expert ffn {a.ffn} (SwiGLU), {a.experts} local "
          f"experts, {a.tokens} tokens {counts}, {a.dtype}, DDP{' + distributed optimizer' if a.distopt else ''}; "
          f"{a.reps} reps each, alternating, medians")
    cols = "host s / fwd+bwd   ATen calls" + ("   wall s (synced)   device busy s" if gpu else "")
    print(f"{'path':24s} {cols}")
    for name in paths:
        line = f"{name:24s} {statistics.median(host[name]):16.6f} {calls[name]:12d}"
        if gpu:
            line += f" {statistics.median(wall[name]):18.6f} {busy[name]:17.6f}"
        print(line)
    ratio = statistics.median(host["loop (SequentialMLP)"]) / statistics.median(host["grouped (grouped_mm)"])
    print(f"host time loop / grouped: {ratio:.2f}x")
    print(f"max |difference| grouped - loop: output {(o2.float() - o1.float()).abs().max().item():.3g} "
          f"(of {o1.float().abs().max().item():.3g}), input grad {(dx2.float() - dx1.float()).abs().max().item():.3g}, "
          f"weight grads {max((b - c).abs().max().item() for b, c in zip(g2, g1, strict=True)):.3g}")


if __name__ == "__main__":
    main()
