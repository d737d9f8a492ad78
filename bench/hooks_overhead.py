"""Overhead of prism's scheduling-unit hooks + PrismTrace markers on a real mini Megatron step,
against torch.profiler on the same step, measured side by side in one process (CPU).

  python bench/hooks_overhead.py [steps]

One megatron-core GPTModel (local spec, 4 layers, hidden 256, seq 256, 8 microbatches of 2) trained
with Megatron's DDP, optimizer and no-pipelining schedule in CPU mode. Phases, each `steps` steps,
median step time reported: A plain; B with the schedule hooks installed and a marker sink that
records every unit (as a rank under prism does, minus the socket); C plain again (drift check);
D under torch.profiler (CPU activity, record_shapes=False). Target: B/A <= 1.01.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import time

import torch


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    torch.set_num_threads(1)
    from prism_megatron.megatron.cpu_mode import enable_cpu_mode

    enable_cpu_mode()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(1)
    model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8, use_cpu_initialization=True)
    vocab, seq, mbs, micro = 1024, 256, 2, 8
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=vocab,
                     max_sequence_length=seq)
    ddp = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(), module=model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4), [ddp])
    config.finalize_model_grads_func = finalize_model_grads
    tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq).unsqueeze(0).expand(mbs, -1)
    mask = torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq) < 0.5

    def forward_step(data_iterator, model):
        out = model(tokens[:, :-1], pos, mask, labels=tokens[:, 1:])
        return out, lambda o: (o.float().mean(), {"lm loss": o.float().mean().detach()})

    def step() -> float:
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None] * micro), model=[ddp],
                                    num_microbatches=micro, seq_length=seq, micro_batch_size=mbs, forward_only=False)
        optimizer.step()
        return time.perf_counter() - t0

    def phase(n: int) -> float:
        return statistics.median(step() for _ in range(n))

    phase(2)  # warm-up
    a = phase(steps)
    from prism_megatron.patches import schedules
    from prism_megatron.trace import markers

    class Sink:
        def __init__(self) -> None:
            self.records: list[tuple] = []

        def record_mark(self, name, phase, attrs) -> None:
            self.records.append((time.perf_counter(), name, phase, attrs))

    sink = Sink()
    markers.set_sink(sink)
    schedules.install()
    b = phase(steps)
    units = len(sink.records) // 2
    markers.set_sink(None)
    c = phase(steps)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        d = phase(steps)
    events = len(prof.events())
    print(f"mini GPT step (4 layers, h256, seq 256, {micro} microbatches), median of {steps} steps, 1 thread:")
    print(f"  A plain                         {a * 1e3:8.1f} ms")
    print(f"  B prism hooks + markers         {b * 1e3:8.1f} ms   ({units} units recorded)  B/A = {b / a:.4f}"
          " (target <= 1.01)")
    print(f"  C plain again (drift)           {c * 1e3:8.1f} ms   C/A = {c / a:.4f}")
    print(f"  D torch.profiler                {d * 1e3:8.1f} ms   ({events} events)  D/A = {d / a:.4f}")
    print(f"  records per step: prism {units * 2 // steps}, torch.profiler {events // steps}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
