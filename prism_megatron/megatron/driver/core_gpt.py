"""A small GPT pretraining driver that needs megatron.core only (no ``megatron.training``).

The megatron-core 0.16.1 wheel - the only one for Python 3.11 - ships no ``megatron.training``, so
``pretrain_gpt_mini.py`` needs a Megatron-LM checkout. This driver trains the same model from the
same flags with the core building blocks that ``pretrain`` itself uses: ``parallel_state``, the
local layer spec, core DDP, ``get_megatron_optimizer``, the schedules of
``get_forward_backward_func`` with ``finalize_model_grads``, and ``MockGPTDataset``. It prints
Megatron's iteration line on the last rank and, with ``PRISM_MEGATRON_METRICS=FILE``, appends every
rank's per-iteration loss and grad norm as JSON lines (the format of ``patches.metrics``).
``PRISM_ROUTER_STATE=FILE`` (a check) appends every rank's per-iteration router counts and expert bias.
``PRISM_SAME_BATCHES=1`` (a check, not training): every data-parallel replica reads replica 0's samples, so
a full run's data-parallel reduction returns what a fold's mirror returns and the two runs' weights, MoE
routing and memory can be compared at every iteration, not only the first.

Flags (``core_flags.py``): those it uses plus Megatron flags it knowingly ignores; any other
flag is an error naming it, so a typo is never silently dropped. ``--prism-*`` flags are accepted.
Without a GPU it enables prism's CPU mode and, outside prism, uses gloo (as the Megatron-LM driver).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any

if int(os.environ.get("RANK", "0")) != 0:  # warnings from rank 0 only, as pretrain_gpt.py
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)

from prism_megatron.megatron import cpu_mode  # noqa: E402

if not cpu_mode.cpu_mode_active() and not cpu_mode._gpu_present():
    cpu_mode.enable_cpu_mode()
_EMULATED = os.environ.get("PRISM_EMULATED") == "1"  # set by prism's launcher in every logical rank

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from prism_megatron.megatron.driver.core_flags import FlagError, parse_args  # noqa: E402

NAME = "core"


def _print_args(args: argparse.Namespace) -> None:
    """Megatron's argument dump (rank 0), so logs show what ran, the --prism-* flags included."""
    print("------------------------ arguments ------------------------", flush=True)
    for key in sorted(vars(args)):
        print(f"  {key} {'.' * (48 - len(key))} {getattr(args, key)}", flush=True)
    print("-------------------- end of arguments ---------------------", flush=True)


# ----------------------------------------------------------------------------- model, data, loss
def _transformer_config(args: argparse.Namespace) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.num_virtual_stages_per_pipeline_rank,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        sequence_parallel=args.sequence_parallel,
        num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff, moe_grouped_gemm=False,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, params_dtype=_dtype(args), pipeline_dtype=_dtype(args), bf16=args.bf16,
        add_bias_linear=args.add_bias_linear,
        # 0.16.1's fused bias-GeLU refuses MoE's per-token probabilities: MoE gets plain GeLU
        bias_activation_fusion=args.bias_gelu_fusion and not args.num_experts,
        masked_softmax_fusion=args.masked_softmax_fusion, bias_dropout_fusion=args.bias_dropout_fusion,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        # as Megatron-LM's core_transformer_config_from_args
        deallocate_pipeline_outputs=True, batch_p2p_comm=not args.overlap_p2p_comm,
        overlap_p2p_comm=args.overlap_p2p_comm,
    )


def _dtype(args: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float32


def _padded_vocab(args: argparse.Namespace) -> int:
    """NullTokenizer's vocabulary (one EOD id added), padded as Megatron-LM pads it."""
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return math.ceil((args.vocab_size + 1) / multiple) * multiple


def build_model(args: argparse.Namespace, config: Any) -> list[Any]:
    """One GPTModel chunk per virtual stage, wrapped in core DDP (Megatron-LM's get_model)."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(args.num_experts, moe_grouped_gemm=False)
    vpp = args.num_virtual_stages_per_pipeline_rank
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        model = GPTModel(
            config=config, transformer_layer_spec=spec, vocab_size=_padded_vocab(args),
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type="learned_absolute", vp_stage=vp_stage,
        )
        model.model_type = ModelType.encoder_or_decoder
        if vpp:
            model.vp_stage = stage
        for param in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if not cpu_mode.cpu_mode_active():
            model.cuda(torch.cuda.current_device())
        if args.bf16:  # as Megatron-LM's get_model: bf16 weights, fp32 in and out
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(config, model)
        chunks.append(model)
    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, use_distributed_optimizer=args.use_distributed_optimizer,
        bucket_size=max(40_000_000, 1_000_000 * dp) if args.overlap_grad_reduce else None,
    )
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
            for i, chunk in enumerate(chunks)]


def build_dataset(args: argparse.Namespace, num_samples: int, built: bool = True) -> Any:
    """Megatron's MockGPTDataset (deterministic token ids; uses the wheel's compiled helpers).

    Split and sizes as Megatron-LM's defaults with no evaluation, so the samples are the same.
    Every rank calls the builder, as Megatron-LM's ``pretrain`` does: it synchronises all ranks
    (a world barrier), and ranks that read no data (``built`` False: middle pipeline stages) take
    part and get None.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None, split="969,30,1",
        path_to_cache=None, tokenizer=NullTokenizer(args.vocab_size), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=True,
    )
    train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [num_samples, 0, 0], lambda: built, config).build()
    return train if built else None


def batches(dataset: Any, args: argparse.Namespace, dp_rank: int, dp_size: int) -> Iterator[dict]:
    """This DP rank's microbatches in Megatron's order (MegatronPretrainingSampler: global sample
    k*mbs*dp + dp_rank*mbs + j); every TP rank reads the same samples, which is what Megatron's
    broadcast from TP rank 0 yields."""
    mbs, step = args.micro_batch_size, 0
    while True:
        start = step * mbs * dp_size + dp_rank * mbs
        samples = [dataset[i] for i in range(start, start + mbs)]
        yield {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        step += 1


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple:
    """Token-summed loss and token count ('lm loss'), as Megatron-LM's pretrain_gpt.py reports it."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator: Iterator[dict], model: Any) -> tuple:
    """One microbatch through one model chunk; only chunks that embed or compute the loss read data."""
    from megatron.core.utils import get_attr_wrapped_model

    pre, post = get_attr_wrapped_model(model, "pre_process"), get_attr_wrapped_model(model, "post_process")
    if pre or post:
        batch = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items()}
        tokens, position_ids, labels = batch["tokens"], batch["position_ids"], batch["labels"]
        attention_mask, loss_mask = batch["attention_mask"], batch["loss_mask"]
    else:
        tokens = position_ids = labels = attention_mask = loss_mask = None
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


# ----------------------------------------------------------------------------- training
def _init_distributed(args: argparse.Namespace) -> None:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if not cpu_mode.cpu_mode_active():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if args.fake_process_group:  # as Megatron-LM's initialize: RANK/WORLD_SIZE of the target, nothing sent
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group(backend="fake", store=FakeStore(), world_size=world, rank=rank)
    else:
        if world == 1 and "MASTER_ADDR" not in os.environ:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
        dist.init_process_group(backend=args.distributed_backend, world_size=world, rank=rank,
                                timeout=datetime.timedelta(minutes=10))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.num_virtual_stages_per_pipeline_rank,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        create_gloo_process_groups=not args.fake_process_group,  # gloo cannot run on a fake store (as Megatron-LM)
    )
    dp = parallel_state.get_data_parallel_world_size()
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise FlagError(f"core driver: --global-batch-size {args.global_batch_size} is not a multiple of "
                        f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}")
    init_num_microbatches_calculator(rank, None, args.global_batch_size, args.micro_batch_size, dp)
    # Megatron-LM's _set_random_seed: one seed per pipeline stage
    seed = args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _metrics_writer() -> Any:
    """The ``PRISM_MEGATRON_METRICS`` hook: every rank appends its iterations (``patches.metrics``' format)."""
    path = os.environ.get("PRISM_MEGATRON_METRICS")
    if not path:
        return None

    def write(iteration: int, loss: dict[str, float], grad_norm: float | None) -> None:
        record = {"rank": dist.get_rank(), "iteration": iteration, "loss": loss, "grad_norm": grad_norm}
        if torch.cuda.is_initialized() and not cpu_mode.cpu_mode_active():  # what a real GPU run held
            record["max_allocated"] = int(torch.cuda.max_memory_allocated())
            record["max_reserved"] = int(torch.cuda.max_memory_reserved())
            free, total = torch.cuda.mem_get_info()  # device-wide: the process's context and NCCL buffers too
            record["device_used"], record["reserved"] = int(total - free), int(torch.cuda.memory_reserved())
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    return write


def _router_state_hook(model: list[Any], finalize: Any) -> Any:
    """``PRISM_ROUTER_STATE=FILE`` (a check): ``finalize`` wrapped so that every rank appends, per iteration, its
    routers' per-expert token counts (its own, before the reduction) and expert bias after the update."""
    path = os.environ.get("PRISM_ROUTER_STATE")
    if not path:
        return finalize
    routers = [m for chunk in model for m in chunk.modules() if getattr(m, "expert_bias", None) is not None]
    iteration = 0

    def recorded(*args: Any, **kwargs: Any) -> Any:
        nonlocal iteration
        iteration += 1
        counts = [m.local_tokens_per_expert.tolist() for m in routers]
        out = finalize(*args, **kwargs)
        record = {"rank": dist.get_rank(), "iteration": iteration, "tokens_per_expert": counts,
                  "expert_bias": [m.expert_bias.tolist() for m in routers]}
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return out

    return recorded


_ACCOUNTANT: Any = None  # PRISM_CPU_BYTE_ACCOUNTANT=1 on CPU: memory figures where no allocator exists


def _report_memory(iteration: int) -> None:
    """Megatron-LM's memory line after iterations 1 and 2 on data-parallel rank 0 (report_memory)."""
    from megatron.core import parallel_state

    if iteration > 2 or parallel_state.get_data_parallel_rank() != 0:
        return
    if _ACCOUNTANT is not None:
        figures = (_ACCOUNTANT.current, _ACCOUNTANT.peak, _ACCOUNTANT.current, _ACCOUNTANT.peak)
    elif not cpu_mode.cpu_mode_active() and torch.cuda.is_initialized():
        figures = (torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved(),
                   torch.cuda.max_memory_reserved())
    else:
        return
    mib = 1024.0 * 1024.0
    print(f"[Rank {dist.get_rank()}] (after {iteration} iterations) memory (MB) | allocated: {figures[0] / mib:.2f} | "
          f"max allocated: {figures[1] / mib:.2f} | reserved: {figures[2] / mib:.2f} | max reserved: "
          f"{figures[3] / mib:.2f}", flush=True)


def train(args: argparse.Namespace) -> None:
    """Megatron-LM's train loop for this model: zero grads, schedule, optimizer step, loss across DP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from prism_megatron.memory.snapshot import start_from_env
    from prism_megatron.patches import schedules
    from prism_megatron.trace.markers import span

    dump_snapshot = start_from_env()
    config = _transformer_config(args)
    model = build_model(args, config)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, params_dtype=_dtype(args), bf16=args.bf16,
        use_distributed_optimizer=args.use_distributed_optimizer,
    ), model, use_gloo_process_groups=not args.fake_process_group)
    gbs = args.global_batch_size
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters * gbs,
        lr_decay_steps=args.train_iters * gbs, lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay,
        end_wd=args.weight_decay, wd_incr_steps=args.train_iters * gbs, wd_incr_style="constant")

    config.grad_scale_func = optimizer.scale_loss
    if args.overlap_grad_reduce:  # as Megatron-LM's train(): overlap within the schedule
        config.no_sync_func = [chunk.no_sync for chunk in model]
        config.grad_sync_func = [chunk.start_grad_sync for chunk in model]
        if len(model) == 1:
            config.no_sync_func, config.grad_sync_func = config.no_sync_func[0], config.grad_sync_func[0]
    config.finalize_model_grads_func = _router_state_hook(model, finalize_model_grads)

    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    num_microbatches = get_num_microbatches()
    needs_data = parallel_state.is_pipeline_first_stage(ignore_virtual=True) or \
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    dataset = build_dataset(args, args.train_iters * gbs, built=needs_data)

    data_rank = 0 if os.environ.get("PRISM_SAME_BATCHES") == "1" else dp_rank  # see the module docstring

    def iterator() -> Iterator[dict] | None:
        return batches(dataset, args, data_rank, dp_size) if dataset is not None else None

    data = [iterator() for _ in model] if len(model) > 1 else iterator()
    forward_backward = get_forward_backward_func()
    record = _metrics_writer()
    last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    for chunk in model:
        chunk.train()
    from prism_megatron.megatron.workload import mark_rank

    mark_rank(args, _padded_vocab(args))
    for iteration in range(1, args.train_iters + 1):
        start = time.perf_counter()
        schedules.STATE.begin_iteration(iteration)
        with span("iteration", iteration=iteration):
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            losses = forward_backward(
                forward_step_func=forward_step, data_iterator=data, model=model if len(model) > 1 else model[0],
                num_microbatches=num_microbatches, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
                decoder_seq_length=None, forward_only=False)
            update_successful, grad_norm, _ = optimizer.step()
            if update_successful:
                scheduler.step(increment=gbs)
            loss: dict[str, float] = {}
            if last_stage:
                for key in losses[0]:
                    total = torch.vstack([x[key].view(-1) for x in losses]).sum(dim=0)
                    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
                    loss[key] = float(total[0] / total[1])
        norm = None if grad_norm is None else float(grad_norm)
        _report_memory(iteration)
        if record is not None:
            record(iteration, loss, norm)
        from prism_megatron.runtime.backend import logs_as_last_rank

        if logs_as_last_rank() and iteration % args.log_interval == 0:
            elapsed = (time.perf_counter() - start) * 1000.0
            from prism_megatron.runtime.live import format_predicted_ms, predicted_iteration_time

            shown_ms = format_predicted_ms(predicted_iteration_time(iteration), elapsed)  # None outside prism
            now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
            shown = " ".join(f"{k}: {v:.6E} |" for k, v in loss.items())
            print(f" [{now}] iteration {iteration:8d}/{args.train_iters:8d} | consumed samples: "
                  f"{iteration * gbs:12d} | elapsed time per iteration (ms): {shown_ms} | learning rate: "
                  f"{optimizer.param_groups[0]['lr']:.6E} | global batch size: {gbs:5d} | {shown} loss scale: 1.0 | "
                  f"grad norm: {norm if norm is not None else float('nan'):.3f} |", flush=True)
    if args.overlap_param_gather:  # the last step's parameter all-gathers are still in flight
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    dump_snapshot()


def main(argv: list[str] | None = None) -> None:
    """Parse, set up the process groups, train; rank 0 says which driver runs."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if cpu_mode.cpu_mode_active():
        if not _EMULATED:
            from prism_megatron.patches import gloo_p2p

            gloo_p2p.install()  # real gloo processes only: async sends must own their bytes
    from prism_megatron.patches import dataset_helpers

    dataset_helpers.install()
    if cpu_mode.cpu_mode_active() and os.environ.get("PRISM_CPU_BYTE_ACCOUNTANT") == "1":
        global _ACCOUNTANT
        from prism_megatron.memory.accountant import ByteAccountant

        _ACCOUNTANT = ByteAccountant()
        _ACCOUNTANT.__enter__()
    _init_distributed(args)
    if dist.get_rank() == 0:
        print("prism: driver core (megatron.core only: parallel_state, GPTModel local spec, core DDP, "
              "get_megatron_optimizer, get_forward_backward_func; no megatron.training)", flush=True)
        _print_args(args)
    train(args)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
