"""The core driver's flags: which Megatron flags it honours, which it knowingly ignores, and the parser.

Apart from ``core_gpt.py`` so that the launcher can check a recipe's flags before anything starts
without importing the driver, which switches the importing process to prism's CPU mode on a machine
without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from prism_megatron.megatron import cpu_mode
from prism_megatron.megatron.flags import add_prism_arguments

# flag -> argparse kwargs; the defaults are Megatron-LM's (core_v0.16.1 arguments.py)
_USED: dict[str, dict[str, Any]] = {
    "--num-layers": dict(type=int, required=True),
    "--hidden-size": dict(type=int, required=True),
    "--ffn-hidden-size": dict(type=int, default=None),
    "--num-attention-heads": dict(type=int, required=True),
    "--group-query-attention": dict(action="store_true"),
    "--num-query-groups": dict(type=int, default=None),
    "--seq-length": dict(type=int, required=True),
    "--max-position-embeddings": dict(type=int, default=None),
    "--vocab-size": dict(type=int, required=True),
    "--make-vocab-size-divisible-by": dict(type=int, default=128),
    "--tokenizer-type": dict(type=str, default="NullTokenizer"),
    "--mock-data": dict(action="store_true"),
    "--micro-batch-size": dict(type=int, required=True),
    "--global-batch-size": dict(type=int, default=None),
    "--train-iters": dict(type=int, required=True),
    "--lr": dict(type=float, required=True),
    "--min-lr": dict(type=float, default=0.0),
    "--lr-decay-style": dict(type=str, default="linear", choices=["constant", "linear", "cosine"]),
    "--lr-warmup-iters": dict(type=int, default=0),
    "--weight-decay": dict(type=float, default=0.01),
    "--clip-grad": dict(type=float, default=1.0),
    "--adam-beta1": dict(type=float, default=0.9),
    "--adam-beta2": dict(type=float, default=0.999),
    "--adam-eps": dict(type=float, default=1e-8),
    "--sgd-momentum": dict(type=float, default=0.9),
    "--optimizer": dict(type=str, default="adam", choices=["adam", "sgd"]),
    "--seed": dict(type=int, default=1234),
    "--init-method-std": dict(type=float, default=0.02),
    "--hidden-dropout": dict(type=float, default=0.1),
    "--attention-dropout": dict(type=float, default=0.1),
    "--untie-embeddings-and-output-weights": dict(action="store_true"),
    "--bf16": dict(action="store_true"),
    "--fp16": dict(action="store_true"),
    "--tensor-model-parallel-size": dict(type=int, default=1),
    "--pipeline-model-parallel-size": dict(type=int, default=1),
    "--num-virtual-stages-per-pipeline-rank": dict(type=int, default=None),
    "--context-parallel-size": dict(type=int, default=1),
    "--expert-model-parallel-size": dict(type=int, default=1),
    "--expert-tensor-parallel-size": dict(type=int, default=None),
    "--num-experts": dict(type=int, default=None),
    "--moe-router-topk": dict(type=int, default=2),
    "--moe-token-dispatcher-type": dict(type=str, default="allgather", choices=["allgather", "alltoall"]),
    "--moe-ffn-hidden-size": dict(type=int, default=None),
    "--moe-aux-loss-coeff": dict(type=float, default=0.0),
    "--moe-router-load-balancing-type": dict(type=str, default="aux_loss",
                                              choices=["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn",
                                                       "none"]),
    "--moe-router-score-function": dict(type=str, default="softmax", choices=["softmax", "sigmoid"]),
    "--moe-router-enable-expert-bias": dict(action="store_true"),
    "--moe-router-bias-update-rate": dict(type=float, default=1e-3),
    "--sequence-parallel": dict(action="store_true"),
    "--use-distributed-optimizer": dict(action="store_true"),
    "--overlap-grad-reduce": dict(action="store_true"),
    "--overlap-param-gather": dict(action="store_true"),
    "--no-overlap-p2p-communication": dict(action="store_false", dest="overlap_p2p_comm"),
    "--transformer-impl": dict(type=str, default="local", choices=["local", "transformer_engine"]),
    "--distributed-backend": dict(type=str, default=None, choices=["nccl", "gloo"]),
    "--fake-process-group": dict(action="store_true"),  # Megatron-LM's: one rank, communication skipped
    "--log-interval": dict(type=int, default=100),
    # Megatron-LM's fusions are on by default; without apex/TE they run as eager torch code
    "--no-bias-gelu-fusion": dict(action="store_false", dest="bias_gelu_fusion"),
    "--no-bias-dropout-fusion": dict(action="store_false", dest="bias_dropout_fusion"),
    "--no-masked-softmax-fusion": dict(action="store_false", dest="masked_softmax_fusion"),
    # megatron-core 0.19.2's expert MLP adds its bias in place on a custom Function's output, which
    # autograd refuses on the GPU: MoE jobs there need it (as Megatron-LM's pretrain_gpt.py does)
    "--disable-bias-linear": dict(action="store_false", dest="add_bias_linear"),
}
# Megatron flags that are legal here but change nothing this driver does: flag -> takes a value.
_IGNORED: dict[str, bool] = {
    "--no-gradient-accumulation-fusion": False,  # never fused here (needs apex)
    "--no-persist-layer-norm": False,  # never persistent here (needs apex)
    "--eval-iters": True,  # no evaluation
    "--eval-interval": True,
    "--save-interval": True,
    "--split": True,
    "--data-cache-path": True,
    "--timing-log-level": True,
    "--log-throughput": False,
    "--use-cpu-initialization": False,
    "--use-mcore-models": False,
    "--position-embedding-type": True,  # only learned_absolute is built; checked below
    "--normalization": True,  # only LayerNorm is built; checked below
}


class FlagError(SystemExit):
    """A flag this driver cannot honour; the message names it."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise FlagError(f"{self.prog}: error: {message}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse Megatron-style flags: used ones, knowingly ignored ones, ``--prism-*``; anything else fails."""
    parser = _Parser(prog="core_gpt.py (prism-megatron core driver)", allow_abbrev=False)
    for flag, kwargs in _USED.items():
        parser.add_argument(flag, **kwargs)
    ignored = parser.add_argument_group("ignored Megatron flags")
    for flag, takes_value in _IGNORED.items():
        ignored.add_argument(flag, dest="ignored_" + flag[2:].replace("-", "_"),
                             **({"type": str} if takes_value else {"action": "store_true"}))
    add_prism_arguments(parser)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        raise FlagError(f"core driver: unknown flag(s) {' '.join(unknown)}; it accepts {', '.join(_USED)} "
                        f"and ignores {', '.join(_IGNORED)}")
    if args.transformer_impl != "local":
        raise FlagError("core driver: --transformer-impl transformer_engine is not supported (local layer spec "
                        "only); use --transformer-impl local or the Megatron-LM driver")
    if args.context_parallel_size != 1:
        raise FlagError("core driver: --context-parallel-size > 1 needs TransformerEngine attention")
    if args.fp16:
        raise FlagError("core driver: --fp16 is not supported (it needs loss scaling); use --bf16 or fp32")
    if args.bf16 and args.masked_softmax_fusion and importlib.util.find_spec("scaled_masked_softmax_cuda") is None:
        raise FlagError("core driver: --bf16 with the fused masked softmax needs apex's scaled_masked_softmax_cuda, "
                        "which is not installed; pass --no-masked-softmax-fusion")
    if not args.mock_data or args.tokenizer_type != "NullTokenizer":
        raise FlagError("core driver: only --mock-data with --tokenizer-type NullTokenizer is supported")
    for flag, allowed in (("--position-embedding-type", "learned_absolute"), ("--normalization", "LayerNorm")):
        value = getattr(args, "ignored_" + flag[2:].replace("-", "_"))
        if value not in (None, allowed):
            raise FlagError(f"core driver: {flag} {value} is not supported (only {allowed})")
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.num_experts:
        args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    else:
        args.moe_ffn_hidden_size = None
    if args.num_virtual_stages_per_pipeline_rank is not None and args.num_virtual_stages_per_pipeline_rank <= 1:
        args.num_virtual_stages_per_pipeline_rank = None
    if args.num_virtual_stages_per_pipeline_rank is None:
        args.overlap_p2p_comm = False  # as Megatron-LM's validate_args
    if args.distributed_backend is None:
        args.distributed_backend = "gloo" if cpu_mode.cpu_mode_active() or not cpu_mode._gpu_present() else "nccl"
    return args
