"""A small GPT pretraining entry (dense and MoE) for tests and the demo.

The megatron-core wheel ships no ``pretrain_gpt.py``; this is its GPT path, reduced to mock data
and the null tokenizer: it calls ``megatron.training.pretrain`` and accepts the standard Megatron
flags (``--num-layers``, ``--tensor-model-parallel-size``, ``--num-experts``, ...), e.g. those
``prism-megatron recipe show NAME`` prints. Run it with ``prism-megatron run`` (emulated ranks),
``torchrun`` (real processes) or plain ``python`` (one rank).

On a machine without a GPU it enables prism's CPU execution mode itself and, outside prism,
defaults ``--distributed-backend`` to gloo, so ``torchrun`` gives the real-process reference that the
numerics contract compares prism against. Without apex it adds ``--no-persist-layer-norm`` (the
torch LayerNorm Megatron falls back to refuses the persistent kernel flag, on by default). On gloo
(not under prism) async p2p sends get a private copy of their buffer (``patches.gloo_p2p``).
With ``PRISM_MEGATRON_METRICS=FILE`` each rank appends its per-iteration loss and grad norm (full
precision, JSON lines) to ``FILE``; with ``PRISM_MEMORY_SNAPSHOT=PREFIX`` each rank on a GPU dumps its
allocator's history to PREFIX-rankR.pickle (``memory.snapshot``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from functools import partial

from prism_megatron.megatron import cpu_mode
from prism_megatron.megatron.megatron_lm import ensure_megatron_training

if int(os.environ.get("RANK", "0")) != 0:  # as Megatron-LM's pretrain_gpt.py: warnings from rank 0 only
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)

if not cpu_mode.cpu_mode_active() and not cpu_mode._gpu_present():
    cpu_mode.enable_cpu_mode()
_EMULATED = os.environ.get("PRISM_EMULATED") == "1"  # set by prism's launcher in every logical rank
if cpu_mode.cpu_mode_active() and not _EMULATED and not any(a.startswith("--distributed-backend") for a in sys.argv):
    sys.argv += ["--distributed-backend", "gloo"]  # real processes on CPU; prism serves any backend
if importlib.util.find_spec("apex") is None and "--no-persist-layer-norm" not in sys.argv:
    sys.argv.append("--no-persist-layer-norm")  # the torch LayerNorm fallback refuses persist
ensure_megatron_training()

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.utils import get_attr_wrapped_model  # noqa: E402
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402
from megatron.training.utils import is_first_or_last_pipeline_stage  # noqa: E402

try:  # megatron-core 0.16.x: batch helpers in megatron.training.utils, reading the iterator themselves
    from megatron.training.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank  # noqa: E402

    _CORE_BATCH_HELPERS = False
except ImportError:  # 0.19.x: in megatron.core.utils, taking the batch and every setting as arguments
    from megatron.core.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank  # noqa: E402

    _CORE_BATCH_HELPERS = True

from prism_megatron.patches import cpu_trainer, dataset_helpers, gloo_p2p  # noqa: E402

dataset_helpers.install()
if cpu_mode.cpu_mode_active():
    cpu_trainer.install()
    if not _EMULATED:
        gloo_p2p.install()  # real gloo processes only: async sends must own their bytes
if os.environ.get("PRISM_MEGATRON_METRICS"):
    from prism_megatron.patches import metrics

    metrics.install(os.environ["PRISM_MEGATRON_METRICS"])


def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config=None, pg_collection=None) -> GPTModel:
    """GPTModel with the local or TransformerEngine layer spec (a block spec for MoE)."""
    args = get_args()
    if config is None:
        config = core_transformer_config_from_args(args)
    use_te = args.transformer_impl == "transformer_engine"
    if use_te and importlib.util.find_spec("transformer_engine") is None:
        raise SystemExit("prism driver: --transformer-impl transformer_engine (Megatron's default) needs the "
                         "transformer-engine package, which is not installed; pass --transformer-impl local")
    if args.num_experts:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization=args.normalization,
                                          qk_l2_norm=args.qk_l2_norm, vp_stage=vp_stage)
    elif use_te:
        spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                        normalization=args.normalization)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy, parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, vp_stage=vp_stage, pg_collection=pg_collection,
    )


_BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator, vp_stage: int | None = None):
    """This TP rank's slice of the batch (stages that neither embed nor compute the loss get None)."""
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    if not _CORE_BATCH_HELPERS:
        batch = get_batch_on_this_cp_rank(get_batch_on_this_tp_rank(data_iterator))
    else:  # as Megatron-LM's pretrain_gpt.py of 0.19 (pretraining: no packed sequences, no MTP)
        args = get_args()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        batch = {}
        if tp_rank == 0:
            batch = next(data_iterator)
            batch = {k: (batch[k].cuda(non_blocking=True) if batch.get(k) is not None else None)
                     for k in _BATCH_KEYS}
            batch["cu_seqlens"] = None
        batch = get_batch_on_this_tp_rank(
            batch, has_cu_seqlens=False, is_hybrid_cp=False,
            create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
            broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
            broadcast_group=parallel_state.get_tensor_model_parallel_group(),
            cp_size=args.context_parallel_size, tp_rank=tp_rank, micro_batch_size=args.micro_batch_size,
            seq_length=args.seq_length, mtp_on_this_rank=False,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            is_pipeline_first_stage=parallel_state.is_pipeline_first_stage(),
            is_pipeline_last_stage=parallel_state.is_pipeline_last_stage())
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                          cp_group=parallel_state.get_context_parallel_group())
    return tuple(batch.get(k) for k in _BATCH_KEYS)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-summed loss and token count, reported as Megatron's pretrain_gpt.py does ('lm loss')."""
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model: GPTModel, return_schedule_plan: bool = False):
    """The forward pass, or (combined 1F1B, ``--overlap-moe-expert-parallel-comm``) its schedule plan."""
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    if return_schedule_plan:
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def _dataset_built_on_rank(vp_stage: int | None = None) -> bool:
    return is_first_or_last_pipeline_stage(vp_stage) and parallel_state.get_tensor_model_parallel_rank() == 0


def train_valid_test_datasets_provider(num_samples, vp_stage: int | None = None):
    """Mock GPT datasets (random token ids from the seed): no data files needed."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=None, blend_per_split=None,
        split=args.split or "969,30,1", path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )
    print_rank_0("> building mock GPT datasets ...")
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, num_samples, partial(_dataset_built_on_rank, vp_stage=vp_stage), config).build()


def main() -> None:
    train_valid_test_datasets_provider.is_distributed = True
    from prism_megatron.megatron.driver import DRIVER_ARG_DEFAULTS

    defaults = dict(DRIVER_ARG_DEFAULTS)
    from megatron.training import arguments

    if not hasattr(arguments, "parse_and_validate_args"):  # 0.16.x: pretrain parses and takes a provider
        pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
                 args_defaults=defaults)
        return
    # 0.19.x, as its pretrain_gpt.py: arguments become a config container; Megatron's GPT builder
    # makes the model from it (model_provider is the 0.16 path)
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args

    args = arguments.parse_and_validate_args(args_defaults=defaults)
    pretrain(pretrain_cfg_container_from_args(args, gpt_config_from_args(args)), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    from prism_megatron.memory.snapshot import start_from_env

    dump_snapshot = start_from_env()  # PRISM_MEMORY_SNAPSHOT: the allocator's history, also of a run that fails
    try:
        main()
    finally:
        dump_snapshot()
