"""Rank classes and the sandbox of a folded run: which ranks run the real program, which are virtual.

A target job of W ranks is folded onto a *sandbox* of live ranks; every other rank is virtual and
does what its representative ``rep[r]`` does, translated to its own position: a rank x that
``rep[r]`` sees (a peer, a group member) is, for r, the rank whose coordinates are
``coords[x] + coords[r] - coords[rep[r]]`` (mod the grid's sizes, axis by axis). Rank coordinates
come only from Megatron's ``RankGenerator`` (``parallel_state``: the dense generator, order
tp-cp-ep-dp-pp, and the expert one): a rank's coordinate along an axis is its position in the group
Megatron builds for that axis, never a formula of ours.

Classes group ranks that do the same work on the same shapes: data-parallel replicas (expert-DP
too), tensor/context-parallel peers, and pipeline stages whose chunks hold the same layers
with the same embedding/loss role (layer counts per stage from Megatron's own
``get_num_layers_to_build``, so uneven first/last stages and ``--pipeline-model-parallel-layout``
make their stages classes of their own). At replica depth expert-parallel peers are not grouped:
they hold different experts and receive different token counts, so each expert rank of a stage is
its own class (and live). At class depth they are one class with the stage (see below).

Two sandbox depths (``--prism-fold-depth``):

- *replica*: one model replica, i.e. every rank whose dense DP index is < k, where k is the smallest
  count of DP indices that holds whole expert tensor-and-expert-parallel groups (k = 1 for dense
  models); ``rep[r]`` is the rank with r's other coordinates and DP index ``d mod k``. A class may
  have several live ranks (its TP/CP peers, its pipeline stages).
- *class*: one live rank per class. ``rep[r]`` is the rank at tp = cp = 0, DP index 0 and the
  lowest pipeline stage of r's class (under 1F1B it holds the most in-flight micro-batches, so its
  peak is the class's); first and last stages keep their own live rank. A MoE stage's expert peers
  fold onto its ep = 0 (etp = 0) rank by the *translated mirror* (``EXPERT_TOKENS``, recorded as the
  plan's ``expert_tokens``): virtual expert rank j does the live rank's work translated by j along
  EP, so it routes to expert g + j·L (L local experts per rank) what the live rank routes to expert
  g. The live rank then receives from peer j the tokens its own router sends to EP offset -j
  (nccl_prune's A2A_RULE by the plan's coordinates) and the per-expert counts that say so
  (prism_megatron.patches.moe_fold rotates the mirrored count all-gather; patches.moe_counts turns the
  router's mirrored count reductions into its peers' translated sums): over its peers, exactly
  the tokens its router sends out, so it holds and computes what a real expert rank holds under
  that routing (a balanced load where real ranks vary). With expert DP > 1 or ETP < TP the plan's
  axes are ``AXES_EXPERT`` (tp, cp, ep, edp, pp): Megatron's expert generator's EP index is
  (tp // ETP) + (TP / ETP)·ep and its expert DP index is edp, so that translations digit by digit
  keep expert groups whole (the ``ep`` axis is the EP index's digits above TP's). CP > 1, ETP not
  dividing TP, or a group that still does not translate onto one is refused (FoldDepthError naming
  it). ``auto`` keeps replica depth for MoE: a replica keeps every expert rank's own routing (``plan``
  takes class depth for a MoE job captured serially whose replica does not fit: a serial capture answers
  expert peers at class depth only).

A folded middle stage does not run its representative's program: under 1F1B pipeline rank p runs
``min(pp - p - 1, M)`` warm-up forwards. The plan records the schedule (``schedule``: Megatron's
warm-up count per pipeline rank, from its own ``get_pp_rank_microbatches``) so that replay can give
each folded stage its own order of units. Under the interleaved schedule (VPP) the plan records its
parameters (chunks, microbatch group, p2p overlap, per-rank warm-up) from which replay computes each
stage's order of (microbatch, chunk) units for the iteration's microbatch count.
"""

from __future__ import annotations

import argparse
import bisect
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FOLD_PLAN_VERSION", "FOLD_PLAN_VERSIONS", "FOLD_DEPTHS", "AXES", "AXES_EXPERT", "SCHEDULES", "FoldError",
           "FoldDepthError", "FoldPlanFormatError", "TargetLayout", "RankClass", "FoldPlan", "layout_from_args",
           "resolve_depth", "build_fold_plan", "check_class_members", "stage_signatures", "pipeline_schedule",
           "import_megatron"]

FOLD_PLAN_VERSION = 2  # what build_fold_plan writes
# what FoldPlan.from_json reads; a version-1 plan has no depth or coords: replica depth, shift = r - rep[r]
FOLD_PLAN_VERSIONS = (1, 2)
FOLD_DEPTHS = ("replica", "class")
AXES = ("tp", "cp", "dp", "pp")  # the dense generator's axes, in the plan's coords
# a MoE layout at class depth with expert DP > 1 or ETP < TP (CP1): Megatron's EP index is (tp // ETP) +
# (TP / ETP)·ep and its expert DP index edp; translating these digits keeps expert groups onto groups
AXES_EXPERT = ("tp", "cp", "ep", "edp", "pp")
ORDER = "tp-cp-ep-dp-pp"  # Megatron's default rank order (initialize_model_parallel)
ORDER_TP_PP_DP = "tp-cp-ep-pp-dp"  # Megatron-LM's --use-tp-pp-dp-mapping
# the plan's schedule.name values: prism_megatron.trace.fold.SCHEDULES (the trace reader's; a test keeps them equal)
SCHEDULES = ("no_pipelining", "1f1b", "interleaved")
#: the rule for the tokens a folded expert rank receives at class depth (the plan's ``expert_tokens``;
#: nccl_prune.contributions.A2A_RULE and prism_megatron.patches.moe_fold implement it)
EXPERT_TOKENS = "translated mirror"


class FoldError(ValueError):
    """A layout Megatron would reject, or a fold that would be wrong; the message names the values."""


class FoldDepthError(FoldError):
    """A fold depth this layout cannot take (class depth for a MoE layout whose expert groups the dense
    grid's translations do not carry onto expert groups): an error whatever the fold mode."""


class FoldPlanFormatError(ValueError):
    """A fold plan's JSON that this version cannot read; the message names the field."""


@dataclass(frozen=True)
class TargetLayout:
    """The target job's parallel layout and what decides each pipeline stage's work."""

    world_size: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None  # expert tensor-parallel size; None: TP's, as Megatron defaults it
    pp: int = 1
    vpp: int | None = None  # virtual stages per pipeline rank (None: not interleaved)
    vp_group: int | None = None  # --microbatch-group-size-per-virtual-pipeline-stage (None: PP, Megatron's default)
    overlap_p2p: bool = False  # overlap_p2p_comm (Megatron-LM turns it on with VPP unless told not to)
    num_layers: int = 1
    hidden_size: int = 8
    num_attention_heads: int = 1
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    account_for_embedding: bool = False  # --account-for-embedding-in-pipeline-split
    account_for_loss: bool = False  # --account-for-loss-in-pipeline-split
    pipeline_layout: str | None = None  # --pipeline-model-parallel-layout
    num_experts: int | None = None
    moe_layer_freq: int | tuple[int, ...] = 1
    mtp_num_layers: int | None = None
    order: str = ORDER
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def describe(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}"]
        if self.vpp:
            parts.append(f"VPP{self.vpp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.num_experts and self.etp != self.tp:
            parts.append(f"ETP{self.etp}")
        parts.append(f"DP{self.dp}")
        return "·".join(parts) + f" = {self.world_size} ranks"


def _arg(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, None)
    return default if value is None else value


def layout_from_args(args: argparse.Namespace | Any, world_size: int, gpus_per_node: int = 8) -> TargetLayout:
    """The layout of a job from Megatron's parsed args (Megatron-LM's parser, or the core driver's).

    Reads Megatron's own argument names; the core driver's VPP flag
    (``num_virtual_stages_per_pipeline_rank``) is read where ``validate_args`` has not set
    ``virtual_pipeline_model_parallel_size``.
    """
    tp = int(_arg(args, "tensor_model_parallel_size", 1))
    vpp = _arg(args, "virtual_pipeline_model_parallel_size") or _arg(args, "num_virtual_stages_per_pipeline_rank")
    layers_per_virtual = _arg(args, "num_layers_per_virtual_pipeline_stage")
    pp = int(_arg(args, "pipeline_model_parallel_size", 1))
    num_layers = _arg(args, "num_layers")
    if num_layers is None:
        raise FoldError("the command gives no --num-layers")
    if vpp is None and layers_per_virtual:  # Megatron-LM's validate_args derives it so
        vpp = num_layers // (pp * int(layers_per_virtual))
    for flag in ("gtp_weight_remat_size", "expert_gtp_weight_remat_size"):  # megatron-core 0.19: a new rank axis
        if int(_arg(args, flag, 1)) > 1:
            raise FoldError(f"--{flag.replace('_', '-')} {_arg(args, flag)}: its rank axis is not folded yet "
                            "(the fold knows the tp-cp-ep-dp-pp grid only)")
    freq = _arg(args, "moe_layer_freq", 1)
    if isinstance(freq, str) or not isinstance(freq, (int, list, tuple)):
        raise FoldError(f"--moe-layer-freq {freq!r}: expected Megatron's parsed form (an int or a list)")
    layout = _arg(args, "pipeline_model_parallel_layout")
    if vpp and int(vpp) > 1 and _arg(args, "overlap_p2p_comm_warmup_flush", False):
        raise FoldError("--overlap-p2p-communication-warmup-flush: that interleaved schedule's p2p order is not "
                        "rebuilt by the fold (leave it off)")
    return TargetLayout(
        world_size=int(world_size), tp=tp, pp=pp, cp=int(_arg(args, "context_parallel_size", 1)),
        ep=int(_arg(args, "expert_model_parallel_size", 1)),
        etp=int(_arg(args, "expert_tensor_parallel_size", tp)),
        vpp=int(vpp) if vpp and int(vpp) > 1 else None, num_layers=int(num_layers),
        vp_group=_arg(args, "microbatch_group_size_per_vp_stage"),
        overlap_p2p=bool(vpp and int(vpp) > 1 and _arg(args, "overlap_p2p_comm", True)),
        hidden_size=int(_arg(args, "hidden_size", 8)), num_attention_heads=int(_arg(args, "num_attention_heads", 1)),
        first_stage_layers=_arg(args, "decoder_first_pipeline_num_layers"),
        last_stage_layers=_arg(args, "decoder_last_pipeline_num_layers"),
        account_for_embedding=bool(_arg(args, "account_for_embedding_in_pipeline_split", False)),
        account_for_loss=bool(_arg(args, "account_for_loss_in_pipeline_split", False)),
        pipeline_layout=None if layout is None else str(layout),
        num_experts=_arg(args, "num_experts"),
        moe_layer_freq=tuple(freq) if isinstance(freq, (list, tuple)) else int(freq),
        mtp_num_layers=_arg(args, "mtp_num_layers"),
        order=ORDER_TP_PP_DP if _arg(args, "use_tp_pp_dp_mapping", False) else ORDER,
        gpus_per_node=int(gpus_per_node),
    )


def validate_layout(layout: TargetLayout) -> None:
    """What ``initialize_model_parallel`` and ``validate_args`` refuse, refused here first (FoldError)."""
    t = layout
    for name in ("world_size", "tp", "cp", "ep", "etp", "pp", "num_layers", "gpus_per_node"):
        if getattr(t, name) < 1:
            raise FoldError(f"{name} {getattr(t, name)} must be at least 1")
    model = t.tp * t.pp * t.cp
    if t.world_size % model:
        raise FoldError(f"world size {t.world_size} is not divisible by TP·PP·CP = {t.tp}·{t.pp}·{t.cp} = {model} "
                        "(Megatron's initialize_model_parallel refuses it)")
    expert = t.etp * t.ep * t.pp
    if t.world_size % expert:
        raise FoldError(f"world size {t.world_size} is not divisible by ETP·EP·PP = {t.etp}·{t.ep}·{t.pp} = {expert} "
                        "(Megatron's initialize_model_parallel refuses it)")
    if t.ep > 1 and not t.num_experts:
        raise FoldError(f"expert-model-parallel size {t.ep} needs --num-experts (Megatron's validate_args)")
    if t.num_experts and t.num_experts % t.ep:
        raise FoldError(f"--num-experts {t.num_experts} is not a multiple of the expert-model-parallel size {t.ep} "
                        "(Megatron's validate_args)")
    if t.vpp and t.pp < 2:
        raise FoldError(f"virtual pipeline size {t.vpp} needs pipeline-model-parallel size > 1, got {t.pp} "
                        "(Megatron's initialize_model_parallel)")
    if t.order != ORDER and t.pp > 1 and t.edp != t.dp:
        raise FoldError(f"order {t.order} with PP{t.pp} needs the same data-parallel size for attention (DP{t.dp}) "
                        f"and experts (expert DP{t.edp}) (Megatron's initialize_model_parallel)")


# ----------------------------------------------------------------------------- Megatron's rank order
def import_megatron() -> None:
    """Import the megatron-core modules the fold reads. megatron-core 0.19 imports triton at module
    level (MoE paged stash) though nothing here launches a kernel: where triton is not installed,
    cpu_cuda_stubs' inert triton is present only while importing, so torch's own triton probes never
    mistake it for an installed one afterwards. Their import-time notes (no Transformer Engine, no apex) are
    kept off the terminal, as the template's preload keeps them: the report names each substitution."""
    import importlib
    import sys
    import warnings

    names = ("megatron.core.parallel_state", "megatron.core.transformer.transformer_config",
             "megatron.core.transformer.transformer_block", "megatron.core.transformer.transformer_layer",
             "megatron.core.pipeline_parallel.schedules")

    def import_all() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in names:
                importlib.import_module(name)

    try:
        import_all()
        return
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "triton" or "triton" in sys.modules:
            raise
    from prism_megatron.megatron.cpu_cuda_stubs import make_triton_stub

    stub = make_triton_stub()
    sys.modules.update(stub)
    try:
        import_all()
    finally:
        for name, module in stub.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


class _Generators:
    """Megatron's dense and expert RankGenerators for a layout, with each token's groups built once."""

    def __init__(self, layout: TargetLayout) -> None:
        from megatron.core.parallel_state import RankGenerator  # keyword args: 0.16.x and 0.19.x agree

        t = layout
        self.dense = RankGenerator(tp=t.tp, ep=1, dp=t.dp, pp=t.pp, cp=t.cp, order=t.order, rank_offset=0)
        self.expert = RankGenerator(tp=t.etp, ep=t.ep, dp=t.edp, pp=t.pp, cp=1, order=t.order, rank_offset=0)
        self._cache: dict[tuple, list[list[int]]] = {}

    def key(self, which: str, token: str) -> tuple:
        """Tokens whose groups are the same: same grid sizes and the same axes of size > 1 masked
        (with CP1, 'dp-cp' is 'dp'; with EP1 and ETP = TP the expert grid is the dense one)."""
        gen = self.dense if which == "dense" else self.expert
        mask = gen.get_mask(gen.order, token)
        return tuple(gen.ordered_size), tuple(m and n > 1 for m, n in zip(mask, gen.ordered_size, strict=True))

    def groups(self, which: str, token: str) -> list[list[int]]:
        key = self.key(which, token)
        if key not in self._cache:
            self._cache[key] = (self.dense if which == "dense" else self.expert).get_ranks(token)
        return self._cache[key]

    def coordinate(self, which: str, token: str, world: int) -> list[int]:
        """Each rank's index along ``token``: its position in Megatron's group for that axis."""
        out = [-1] * world
        for group in self.groups(which, token):
            for i, r in enumerate(group):
                out[r] = i
        return out


# Groups whose fold the plan checks: those initialize_model_parallel builds (dense and expert).
_DENSE_TOKENS = ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-pp", "tp-dp", "tp-dp-cp")
_EXPERT_TOKENS = ("tp", "ep", "tp-ep", "tp-ep-pp", "dp")


# ----------------------------------------------------------------------------- stages
def _moe_pattern(layout: TargetLayout) -> list[bool]:
    """Which layers are MoE layers: Megatron's ``moe_layer_freq`` rule (int N: every N-th layer from
    layer 0; list: the pattern itself)."""
    n = layout.num_layers
    if not layout.num_experts:
        return [False] * n
    freq = layout.moe_layer_freq
    if isinstance(freq, tuple):
        if len(freq) != n:
            raise FoldError(f"--moe-layer-freq has {len(freq)} entries, the model {n} layers")
        return [bool(x) for x in freq]
    return [i % freq == 0 for i in range(n)]


def _transformer_config(layout: TargetLayout) -> Any:
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    t = layout
    try:
        return TransformerConfig(
            num_layers=t.num_layers, hidden_size=t.hidden_size, num_attention_heads=t.num_attention_heads,
            pipeline_model_parallel_size=t.pp, virtual_pipeline_model_parallel_size=t.vpp,
            num_layers_in_first_pipeline_stage=t.first_stage_layers,
            num_layers_in_last_pipeline_stage=t.last_stage_layers,
            account_for_embedding_in_pipeline_split=t.account_for_embedding,
            account_for_loss_in_pipeline_split=t.account_for_loss,
            pipeline_model_parallel_layout=t.pipeline_layout, mtp_num_layers=t.mtp_num_layers,
            pipeline_dtype=torch.float32,
        )
    except (AssertionError, ValueError, TypeError) as e:
        raise FoldError(_split_refused(t, e)) from None


def _split_refused(t: TargetLayout, e: Exception) -> str:
    return (f"Megatron refuses the pipeline split of {t.num_layers} layers over PP{t.pp}"
            f"{f' x VPP{t.vpp}' if t.vpp else ''}: {e or type(e).__name__}")


def stage_signatures(layout: TargetLayout) -> list[tuple]:
    """Per pipeline rank, what it builds: per virtual chunk, its layers (kind of each) and its
    embedding/loss role. Two stages with equal signatures do the same work on the same shapes."""
    t = layout
    chunks = t.vpp or 1
    if t.pp == 1 and not t.pipeline_layout:
        kinds = ["moe" if m else "dense" for m in _moe_pattern(t)]
        return [(("embedding", *kinds, "loss"),)]
    config = _transformer_config(t)
    moe = _moe_pattern(t)
    layout_obj = getattr(config, "pipeline_model_parallel_layout", None)
    if layout_obj is not None:  # a custom layout names every stage's layers, embedding and loss itself
        chunks = len(layout_obj.layout[0])  # the layout's own virtual stages per rank
        names: dict[tuple[int, int], list[str]] = {}
        layer = 0
        for v in range(chunks):  # Megatron numbers decoder layers chunk-major (get_layer_offset)
            for p in range(t.pp):
                items = []
                for x in layout_obj.layout[p][v]:
                    kind = getattr(x, "name", str(x))
                    if kind == "decoder":
                        kind = "moe" if moe[layer] else "dense"
                        layer += 1
                    items.append(kind)
                names[(p, v)] = items
        return [tuple(tuple(names[(p, v)]) for v in range(chunks)) for p in range(t.pp)]
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out = []
    for p in range(t.pp):
        stage = []
        for v in range(chunks):
            vp = v if t.vpp else None
            try:
                n = get_num_layers_to_build(config, vp_stage=vp, pp_rank=p)
                off = get_transformer_layer_offset(config, vp_stage=vp, pp_rank=p)
            except AssertionError as e:
                raise FoldError(_split_refused(t, e)) from None
            items: list[str] = ["embedding"] if (p == 0 and v == 0) else []
            items += ["moe" if moe[i] else "dense" for i in range(off, off + n)]
            if p == t.pp - 1 and v == chunks - 1:
                items += ["mtp"] * (t.mtp_num_layers or 0) + ["loss"]
            stage.append(tuple(items))
        out.append(tuple(stage))
    return out


def _stage_role(signature: tuple) -> str:
    """'first: embedding; 2 layers' etc. from a stage signature (``stage_signatures``)."""
    flat = [x for chunk in signature for x in chunk]
    roles = [r for r, key in (("first: embedding", "embedding"), ("last: loss", "loss")) if key in flat]
    layers = [sum(x in ("dense", "moe") for x in chunk) for chunk in signature]
    what = "+".join(map(str, layers)) + (" layer" if sum(layers) == 1 else " layers")
    if len(signature) > 1:
        what += f" in {len(signature)} chunks"
    if "moe" in flat:
        what += f", {flat.count('moe')} MoE"
    if "mtp" in flat:
        what += f", {flat.count('mtp')} MTP"
    return (", ".join(roles) or "middle") + f"; {what}"


def _stages_text(stages: list[int]) -> str:
    if len(stages) == 1:
        return f"stage {stages[0]}"
    if stages == list(range(stages[0], stages[-1] + 1)):
        return f"stages {stages[0]}-{stages[-1]}"
    return "stages " + ",".join(map(str, stages))


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class RankClass:
    """Ranks that do the same work on the same shapes; ``sandbox`` holds its live ranks."""

    name: str
    role: str
    count: int
    sandbox: list[int]
    coords: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "count": self.count, "sandbox": list(self.sandbox),
                "coords": dict(self.coords)}


@dataclass(frozen=True)
class FoldPlan:
    """Which ranks are live, each rank's representative and class (see the module docstring)."""

    world_size: int
    live: list[int]
    rep: list[int]
    classes: list[RankClass]
    class_of: list[int]
    gpus_per_node: int
    k: int = 1  # DP indices in the sandbox
    # the target layout's sizes (tp, cp, ep, etp, pp, vpp, num_layers, order, dp, edp) and its moe_layers (the
    # count of MoE layers: 0 for a dense model; what decides a serial capture's second pass under auto)
    layout: dict[str, Any] = field(default_factory=dict)
    depth: str = "replica"  # one of FOLD_DEPTHS (module docstring)
    sizes: list[int] = field(default_factory=list)  # the grid's size per axis (``axes``); empty in a v1 plan
    coords: list[list[int]] = field(default_factory=list)  # per rank, its position per axis (Megatron's groups)
    # {"name": one of SCHEDULES, "warmup": per pipeline rank}: pipeline_schedule; {} in a v1 plan
    schedule: dict[str, Any] = field(default_factory=dict)
    # EXPERT_TOKENS when expert-parallel peers are virtual (class depth of a MoE layout); "" otherwise
    expert_tokens: str = ""
    axes: tuple[str, ...] = AXES  # AXES, or AXES_EXPERT (class depth of MoE with expert DP > 1 or ETP < TP)

    def is_live(self, rank: int) -> bool:
        i = bisect.bisect_left(self.live, rank)
        return i < len(self.live) and self.live[i] == rank

    def class_name(self, rank: int) -> str:
        """The name of ``rank``'s class (its pipeline-stage role: first, middle, last, only...)."""
        return self.classes[self.class_of[rank]].name

    def shift(self, rank: int) -> int:
        """A version-1 plan's translation (``rank - rep[rank]``); a version-2 plan translates by coords."""
        return rank - self.rep[rank]

    @property
    def virtual_count(self) -> int:
        return self.world_size - len(self.live)

    @property
    def version(self) -> int:
        """2 with coordinates, 1 for a plan read from a version-1 JSON (no coordinates)."""
        return FOLD_PLAN_VERSION if self.coords else 1

    def to_json(self) -> dict[str, Any]:
        out = {"version": self.version, "world_size": self.world_size, "gpus_per_node": self.gpus_per_node,
               "k": self.k, "layout": dict(self.layout), "live": list(self.live), "rep": list(self.rep),
               "class_of": list(self.class_of), "classes": [c.to_json() for c in self.classes]}
        if self.coords:
            out.update(depth=self.depth, axes=list(self.axes), sizes=list(self.sizes),
                       coords=[list(c) for c in self.coords])
            if self.schedule:
                out["schedule"] = dict(self.schedule, warmup=list(self.schedule["warmup"]))
            if self.expert_tokens:
                out["expert_tokens"] = self.expert_tokens
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any], source: str = "fold plan") -> FoldPlan:
        def need(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
            if key not in obj:
                raise FoldPlanFormatError(f"{source}: field {where}{key} is missing")
            value = obj[key]
            if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
                raise FoldPlanFormatError(f"{source}: field {where}{key} has the wrong type ({type(value).__name__})")
            return value

        if not isinstance(data, Mapping):
            raise FoldPlanFormatError(f"{source}: not a JSON object")
        version = need(data, "version", int, "")
        if version not in FOLD_PLAN_VERSIONS:
            raise FoldPlanFormatError(f"{source}: field version {version} is not supported "
                                      f"(this prism reads versions {', '.join(map(str, FOLD_PLAN_VERSIONS))})")
        world = need(data, "world_size", int, "")
        live, rep, class_of = (need(data, k, list, "") for k in ("live", "rep", "class_of"))
        classes = []
        for i, c in enumerate(need(data, "classes", list, "")):
            where = f"classes[{i}]."
            if not isinstance(c, Mapping):
                raise FoldPlanFormatError(f"{source}: field classes[{i}] is not an object")
            classes.append(RankClass(name=need(c, "name", str, where), role=need(c, "role", str, where),
                                     count=need(c, "count", int, where), sandbox=list(need(c, "sandbox", list, where)),
                                     coords=dict(need(c, "coords", dict, where))))
        if len(rep) != world or len(class_of) != world:
            raise FoldPlanFormatError(f"{source}: fields rep/class_of have {len(rep)}/{len(class_of)} entries, "
                                      f"world_size is {world}")
        if live != sorted(set(live)) or any(not (0 <= x < world) or rep[x] != x for x in live):
            raise FoldPlanFormatError(f"{source}: field live must be sorted distinct ranks with rep[l] == l")
        live_set = set(live)
        if any(r not in live_set for r in rep):
            raise FoldPlanFormatError(f"{source}: field rep names a rank that is not live")
        if any(not (0 <= c < len(classes)) for c in class_of):
            raise FoldPlanFormatError(f"{source}: field class_of names a class out of range")
        grid: dict[str, Any] = {}
        if version >= 2:
            depth = need(data, "depth", str, "")
            if depth not in FOLD_DEPTHS:
                raise FoldPlanFormatError(f"{source}: field depth {depth!r} is not one of {', '.join(FOLD_DEPTHS)}")
            axes = need(data, "axes", list, "")
            if axes not in (list(AXES), list(AXES_EXPERT)):
                raise FoldPlanFormatError(f"{source}: field axes is {axes}; this prism reads {list(AXES)} or "
                                          f"{list(AXES_EXPERT)}")
            sizes = need(data, "sizes", list, "")
            if (len(sizes) != len(axes) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes)
                    or math.prod(sizes) != world):
                raise FoldPlanFormatError(f"{source}: field sizes is {sizes}: expected {len(axes)} positive sizes "
                                          f"whose product is world_size {world}")
            coords = need(data, "coords", list, "")
            _check_coords(coords, sizes, world, source)
            grid = {"depth": depth, "sizes": list(sizes), "coords": [list(c) for c in coords], "axes": tuple(axes)}
            if "schedule" in data:
                grid["schedule"] = _read_schedule(data["schedule"], sizes[axes.index("pp")], source)
            if "expert_tokens" in data:
                if data["expert_tokens"] != EXPERT_TOKENS:
                    raise FoldPlanFormatError(f"{source}: field expert_tokens is {data['expert_tokens']!r}; this "
                                              f"prism folds expert peers by {EXPERT_TOKENS!r} only")
                grid["expert_tokens"] = EXPERT_TOKENS
        return cls(world_size=world, live=live, rep=rep, classes=classes, class_of=class_of,
                   gpus_per_node=need(data, "gpus_per_node", int, ""), k=int(data.get("k", 1)),
                   layout=dict(data.get("layout") or {}), **grid)


def _read_schedule(value: Any, stages: int, source: str) -> dict[str, Any]:
    """A plan's ``schedule`` field checked (FoldPlanFormatError naming the field)."""
    if not isinstance(value, Mapping) or value.get("name") not in SCHEDULES:
        got = value.get("name") if isinstance(value, Mapping) else value
        raise FoldPlanFormatError(f"{source}: field schedule.name is {got!r}, expected one of {', '.join(SCHEDULES)}")
    warmup = value.get("warmup")
    if not isinstance(warmup, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in warmup):
        raise FoldPlanFormatError(f"{source}: field schedule.warmup is {warmup!r}, expected a list of integers >= 0")
    if value["name"] == "1f1b" and len(warmup) != stages:
        raise FoldPlanFormatError(f"{source}: field schedule.warmup has {len(warmup)} entries; a 1f1b schedule needs "
                                  f"one per pipeline rank ({stages})")
    if value["name"] == "interleaved" and "chunks" in value:
        for key in ("chunks", "group"):
            x = value.get(key)
            if isinstance(x, bool) or not isinstance(x, int) or x < (2 if key == "chunks" else stages):
                raise FoldPlanFormatError(f"{source}: field schedule.{key} is {x!r}, expected an integer >= "
                                          f"{2 if key == 'chunks' else stages}")
        flags = (value.get("overlap_p2p", False), value.get("wait_sends", False))
        if not all(isinstance(x, bool) for x in flags) or len(warmup) != stages:
            raise FoldPlanFormatError(f"{source}: field schedule of an interleaved schedule needs one warm-up per "
                                      f"pipeline rank ({stages}) and booleans overlap_p2p, wait_sends")
        return {"name": "interleaved", "warmup": list(warmup), "chunks": value["chunks"], "group": value["group"],
                "overlap_p2p": flags[0], "wait_sends": flags[1]}
    return {"name": value["name"], "warmup": list(warmup)}


def pipeline_schedule(layout: TargetLayout) -> dict[str, Any]:
    """The schedule Megatron runs for ``layout`` and each pipeline rank's warm-up before Megatron caps it at
    the iteration's (virtual) microbatch count: from Megatron's ``get_pp_rank_microbatches`` where the
    installed release has it (asked with more microbatches than any warm-up reaches), else the formula
    its schedules write (``pp_size - pp_rank - 1``; interleaved: ``2·(pp_size - pp_rank - 1) +
    (chunks - 1)·group``). An interleaved schedule adds its ``chunks``, microbatch ``group``
    (``microbatch_group_size_per_vp_stage``) and whether p2p overlaps compute (``overlap_p2p``): replay
    computes each stage's order for the iteration's M from these (replay.stage_schedule)."""
    t = layout
    if t.pp == 1:
        return {"name": "no_pipelining", "warmup": [0]}
    from megatron.core.pipeline_parallel import schedules

    get_pp_rank_microbatches = getattr(schedules, "get_pp_rank_microbatches", None)  # not in every release
    chunks = t.vpp or 1
    group = (t.vp_group or t.pp) if t.vpp else 1
    if t.vpp and group < t.pp:
        raise FoldError(f"microbatch group per virtual stage {group} is below PP{t.pp}: Megatron's interleaved "
                        "schedule refuses it")
    most = 2 * t.pp + chunks * group  # microbatches beyond every stage's warm-up
    warmup = []
    for p in range(t.pp):
        if get_pp_rank_microbatches is None:
            warmup.append((t.pp - p - 1) * 2 + (chunks - 1) * group if t.vpp else t.pp - p - 1)
            continue
        _total, _all, n, _rest = get_pp_rank_microbatches(
            most if t.vpp else t.pp, chunks, group if t.vpp else None,
            p2p_communicator=_Stage(_StageGroup(t.pp, p), t.vpp))  # keyword: 0.16.x and 0.19.x agree
        warmup.append(int(n))
    if t.vpp:
        return {"name": "interleaved", "warmup": warmup, "chunks": chunks, "group": group,
                "overlap_p2p": t.overlap_p2p, "wait_sends": t.overlap_p2p and _waits_forward_sends(schedules)}
    return {"name": "1f1b", "warmup": warmup}


def _waits_forward_sends(schedules: Any) -> bool:
    """Whether the installed ``forward_backward_pipelining_with_interleaving`` waits each steady
    forward's send to the next stage as soon as it is posted when ``deallocate_pipeline_outputs`` is
    on (as Megatron-LM's config sets it): megatron-core 0.19 does, to free the output safely; 0.16
    waits it when the next forward's send is posted. Read from the schedule's source, the one place
    that says which release does what."""
    import inspect

    try:
        source = inspect.getsource(schedules.forward_backward_pipelining_with_interleaving)
    except (OSError, TypeError) as e:
        raise FoldError(f"cannot read megatron-core's interleaved schedule to tell when it waits its sends: {e}") \
            from None
    return "send_next_wait_handle is not None and config.deallocate_pipeline_outputs" in source


@dataclass(frozen=True)
class _StageGroup:
    """What ``get_pp_rank_microbatches`` asks of a pipeline group: its size and this stage's rank."""

    n: int
    p: int

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return self.p


@dataclass(frozen=True)
class _Stage:
    """What ``get_pp_rank_microbatches`` asks of a P2PCommunicator (a non-interleaved pipeline)."""

    pp_group: _StageGroup
    virtual_pipeline_model_parallel_size: int | None = None


def _check_coords(coords: list, sizes: list[int], world: int, source: str) -> None:
    """A plan's coords: one entry per rank, in range, no two ranks at one position (FoldPlanFormatError)."""
    if len(coords) != world:
        raise FoldPlanFormatError(f"{source}: field coords has {len(coords)} entries, world_size is {world}")
    seen = bytearray(world)
    for r, c in enumerate(coords):
        if (not isinstance(c, list) or len(c) != len(sizes)
                or any(isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < n
                       for x, n in zip(c, sizes, strict=True))):
            raise FoldPlanFormatError(f"{source}: field coords[{r}] is {c!r}: expected {len(sizes)} integers "
                                      f"within sizes {sizes}")
        flat = 0
        for x, n in zip(c, sizes, strict=True):
            flat = flat * n + x
        if seen[flat]:
            raise FoldPlanFormatError(f"{source}: field coords[{r}] is {c}, the position of another rank too")
        seen[flat] = 1


def resolve_depth(layout: TargetLayout, requested: str = "auto") -> tuple[str, str]:
    """The sandbox depth for ``--prism-fold-depth requested``, and why (FoldError for class depth on MoE)."""
    if requested not in ("auto", *FOLD_DEPTHS):
        raise FoldDepthError(f"fold depth {requested!r} is not one of auto, {', '.join(FOLD_DEPTHS)}")
    moe = f"a MoE layout ({layout.num_experts} experts, EP{layout.ep})"
    if requested == "auto":
        if layout.num_experts:
            return "replica", (f"auto: replica for {moe}: its expert ranks stay live (class depth, which folds "
                               f"them onto ep 0 by {EXPERT_TOKENS} of its routing, only when asked)")
        return "class", "auto: class for a dense layout"
    if requested == "class" and layout.num_experts:
        return "class", f"class (asked) for {moe}: expert peers receive the {EXPERT_TOKENS} of ep 0's routing"
    return requested, f"{requested} (asked)"


class _Grid:
    """Megatron's grid: each rank's coordinates (its position in Megatron's group of each axis) and the
    rank at a position, both as arrays (O(W) once). Axes AXES (the dense generator's) or, with
    ``expert``, AXES_EXPERT (the expert generator's EP digits above TP's, and its expert-DP axis)."""

    def __init__(self, gens: _Generators, layout: TargetLayout, expert: bool = False) -> None:
        import numpy as np

        world = layout.world_size
        t = layout
        self.axes = AXES_EXPERT if expert else AXES
        inner = t.tp // t.etp if expert else 1  # dense-TP positions inside one EP position
        self.sizes = np.array([t.tp, t.cp, t.ep // inner, t.edp, t.pp] if expert else [t.tp, t.cp, t.dp, t.pp],
                              dtype=np.int64)
        which = {"ep": ("expert", "ep"), "edp": ("expert", "dp")}
        self.coords = np.array([gens.coordinate(*which.get(axis, ("dense", axis)), world) for axis in self.axes],
                               dtype=np.int64).T.copy()
        if expert and inner > 1:  # EP position = (tp // ETP) + inner · ep: its digits above TP's are the axis
            ep = self.coords[:, 2].copy()
            if ((ep % inner) != (self.coords[:, 0] // t.etp)).any():
                raise FoldError(f"{t.describe()}: the EP index is not the dense TP index's digits above ETP{t.etp} "
                                "plus the next ones: its translation is not digit by digit")
            self.coords[:, 2] = ep // inner
        if (self.coords < 0).any():
            r = int(np.flatnonzero((self.coords < 0).any(axis=1))[0])
            raise FoldError(f"rank {r} is in no group of Megatron's rank generator along some axis: not a grid")
        keys = self._flat(self.coords)
        self.index = np.full(world, -1, dtype=np.int64)
        self.index[keys] = np.arange(world, dtype=np.int64)
        if (self.index < 0).any():
            raise FoldError("Megatron's groups give two ranks the same coordinates: this layout is not a grid")

    def _flat(self, coords: Any) -> Any:
        flat = coords[:, 0].copy()
        for a in range(1, len(self.axes)):
            flat = flat * self.sizes[a] + coords[:, a]
        return flat

    def at(self, coords: Any) -> Any:
        """The rank at each row of ``coords`` (taken mod the sizes: the grid is a torus)."""
        return self.index[self._flat(coords % self.sizes)]


def _sandbox_k(layout: TargetLayout, gens: _Generators, dp_index: list[int]) -> int:
    """Smallest k (a divisor of DP) whose blocks of k dense DP indices hold whole expert
    tensor-and-expert-parallel groups (k = 1 for a dense model)."""
    if not layout.num_experts:
        return 1
    groups = gens.groups("expert", "tp-ep")
    for k in range(1, layout.dp + 1):
        if layout.dp % k:
            continue
        if all(len({dp_index[r] // k for r in g}) == 1 for g in groups):
            return k
    raise FoldError(f"no block of data-parallel indices holds whole expert groups (EP{layout.ep}, ETP{layout.etp})")


def _group_kinds(gens: _Generators, layout: TargetLayout) -> list[tuple[str, list[list[int]]]]:
    """(name, groups) of every kind of group ``initialize_model_parallel`` builds, each set of groups
    once, without kinds of single-rank groups (they fold trivially)."""
    from megatron.core.parallel_state import default_embedding_ranks

    out, seen = [], set()
    for which, tokens in (("dense", _DENSE_TOKENS), ("expert", _EXPERT_TOKENS)):
        for token in tokens:
            key = gens.key(which, token)
            if key in seen or not any(key[1]):
                continue
            seen.add(key)
            out.append((f"{which} {token}", gens.groups(which, token)))
    if layout.pp > 1:  # the word-embedding groups: first and last stage of each pipeline (Megatron's default)
        out.append(("embedding", [default_embedding_ranks(g) for g in gens.groups("dense", "pp")]))
    return out


def _check_fold(kinds: list[tuple[str, list[list[int]]]], grid: _Grid, rep: Any) -> None:
    """Every group Megatron builds folds, or FoldError naming the group:

    1. a group with live members holds each virtual member's rep (nccl_prune mirrors its input);
    2. for every rank r, rep[r]'s group translated by ``coords[r] - coords[rep[r]]`` is r's group of the
       same kind (so every group without live members is the translation of one with live members).
       Checked at O(W) per kind: translations compose, so it holds for every r when each generator of
       the kind's translations (per axis, the gcd of their steps) carries every group onto one group.
    """
    import numpy as np

    world = len(rep)
    live = rep == np.arange(world)
    steps = (grid.coords - grid.coords[rep]) % grid.sizes
    for name, groups in kinds:
        lengths = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
        members = np.fromiter((r for g in groups for r in g), dtype=np.int64, count=int(lengths.sum()))
        gid = np.full(world, -1, dtype=np.int64)
        gid[members] = np.repeat(np.arange(len(groups)), lengths)
        covered = gid >= 0
        rep_gid = gid[rep]
        bad = np.flatnonzero(covered & (rep_gid < 0))
        if bad.size:
            r = int(bad[0])
            raise FoldError(f"{name} group {_short(groups[gid[r]])} holds rank {r}, whose representative {rep[r]} "
                            "is in no group of that kind: this layout does not fold")
        has_live = np.zeros(len(groups), dtype=bool)
        has_live[gid[covered & live]] = True
        bad = np.flatnonzero(covered & has_live[np.maximum(gid, 0)] & (rep_gid != gid))
        if bad.size:
            r = int(bad[0])
            raise FoldError(f"{name} group {_short(groups[gid[r]])} has live members but rank {r}'s "
                            f"representative {rep[r]} is outside it: this layout does not fold")
        firsts = np.cumsum(lengths) - lengths
        for a, axis in enumerate(grid.axes):
            step = int(np.gcd.reduce(np.append(steps[covered, a], grid.sizes[a])))
            if step == grid.sizes[a]:
                continue  # no translation moves along this axis
            moved = grid.coords.copy()
            moved[:, a] += step
            target = gid[grid.at(moved)]
            want = target[members[firsts]]  # where each group's first member lands
            bad = np.flatnonzero(covered & ((target < 0) | (target != want[np.maximum(gid, 0)])))
            if bad.size:
                g = groups[gid[int(bad[0])]]
                raise FoldError(f"{name} group {_short(g)} moved by {axis}+{step} is not one group of that kind "
                                f"(its virtual members could not do their representatives' work translated): "
                                "this layout does not fold")


def _short(group: Sequence[int]) -> str:
    return str(list(group)) if len(group) <= 8 else f"[{group[0]}, {group[1]}, ..., {group[-1]}] ({len(group)} ranks)"


def build_fold_plan(layout: TargetLayout, depth: str = "auto",
                    progress: Callable[[str], None] | None = None) -> FoldPlan:
    """Classes, sandbox (``depth``: replica, class, or auto: ``resolve_depth``), ``rep``, ``class_of``
    and coordinates of every rank; O(W) per group kind."""
    import numpy as np

    validate_layout(layout)
    depth, _why = resolve_depth(layout, depth)
    import_megatron()
    say = progress or (lambda _m: None)
    t, world = layout, layout.world_size
    say("stage signatures (Megatron's layer split)")
    signatures = stage_signatures(t)
    say(f"Megatron's rank order for {world} ranks")
    gens = _Generators(t)
    moe_class = depth == "class" and bool(t.num_experts) and t.ep > 1
    if moe_class and (t.cp != 1 or t.etp > t.tp or t.tp % t.etp or t.ep % (t.tp // t.etp)):
        raise FoldDepthError(f"fold depth class for this MoE layout ({t.describe()}): its expert-parallel axis is "
                             f"not made of the dense TP axis's digits above ETP and data-parallel digits (ETP{t.etp}, "
                             f"TP{t.tp}, EP{t.ep}, CP{t.cp}: ETP must divide TP, TP/ETP divide EP, CP1), so the "
                             f"{EXPERT_TOKENS} of the live rank's routing is not defined for its peers; use "
                             "--prism-fold-depth replica")
    grid = _Grid(gens, t, expert=moe_class and (t.edp > 1 or t.etp != t.tp))
    pp_axis = len(grid.axes) - 1
    dp_index = gens.coordinate("dense", "dp", world)
    k = _sandbox_k(t, gens, dp_index)

    by_signature: dict[Hashable, list[int]] = {}
    for p, sig in enumerate(signatures):
        by_signature.setdefault(sig, []).append(p)
    stage_class = [0] * t.pp
    lowest = [0] * t.pp  # the lowest stage of each stage's class: where class depth keeps it live
    for si, stages in enumerate(by_signature.values()):
        for p in stages:
            stage_class[p], lowest[p] = si, stages[0]

    if depth == "class":
        to = np.zeros_like(grid.coords)  # TP/CP peers and DP replicas (expert peers) onto 0 (k = 1)
        to[:, pp_axis] = np.array(lowest, dtype=np.int64)[grid.coords[:, pp_axis]]
        rep = grid.at(to)
    else:
        rep = np.empty(world, dtype=np.int64)
        for g in gens.groups("dense", "dp"):  # position in Megatron's DP group = DP index
            for d, r in enumerate(g):
                rep[r] = g[d % k]
    live = np.flatnonzero(rep == np.arange(world)).tolist()
    say(f"checking the fold of every group kind ({world - len(live)} virtual ranks)")
    try:
        _check_fold(_group_kinds(gens, t), grid, rep)
    except FoldError as e:
        if depth == "class" and t.num_experts:
            raise FoldDepthError(f"fold depth class for this MoE layout ({t.describe()}, EP{t.ep}, expert DP{t.edp}"
                                 f", ETP{t.etp}): {e}; use --prism-fold-depth replica") from None
        raise

    # Expert-parallel peers hold different experts and receive different token counts (routing):
    # not the same shapes, so each expert rank is a class of its own within its stages.
    # At class depth they fold onto the stage's ep = 0 rank: one class per stage, EXPERT_TOKENS.
    experts = t.ep if t.num_experts and t.ep > 1 and depth != "class" else 1
    classes: list[RankClass] = []
    per_class = world // t.pp // experts
    middle = sum(1 for sig in by_signature if _stage_role(sig).startswith("middle"))
    for sig, stages in by_signature.items():
        role = _stage_role(sig)
        first, last = role.startswith("first"), "last: loss" in role
        name = ("only" if first and last else "first" if first else "last" if last
                else "middle" if middle == 1 else f"middle-{stages[0]}")
        for e in range(experts):
            coords = {"pp": stages, "tp": t.tp, "cp": t.cp, "dp": t.dp, "ep": t.ep, "etp": t.etp, "edp": t.edp,
                      "chunks": [list(chunk) for chunk in sig]}
            where = f"{_stages_text(stages)} ({role})"
            if experts > 1:
                coords["ep_rank"] = e
                where += f", expert rank {e} of {experts}"
            classes.append(RankClass(name=f"{name}/ep{e}" if experts > 1 else name, role=where,
                                     count=per_class * len(stages), sandbox=[], coords=coords))
    class_of_arr = np.array(stage_class, dtype=np.int64)[grid.coords[:, pp_axis]]
    if experts > 1:
        class_of_arr = class_of_arr * experts + np.array(gens.coordinate("expert", "ep", world), dtype=np.int64)
    class_of = class_of_arr.tolist()
    for r in live:
        classes[class_of[r]].sandbox.append(r)
    return FoldPlan(world_size=world, live=live, rep=rep.tolist(), classes=classes, class_of=class_of,
                    gpus_per_node=t.gpus_per_node, k=k,
                    layout={key: getattr(t, key) for key in ("tp", "cp", "ep", "etp", "pp", "vpp", "num_layers",
                                                             "order")} | {"dp": t.dp, "edp": t.edp,
                                                                          "moe_layers": sum(_moe_pattern(t))},
                    depth=depth, sizes=grid.sizes.tolist(), coords=grid.coords.tolist(), schedule=pipeline_schedule(t),
                    expert_tokens=EXPERT_TOKENS if moe_class else "", axes=grid.axes)


def check_class_members(plan: FoldPlan, observed: Mapping[int, Sequence[Any] | Mapping[str, Sequence[Any]]],
                        what: str = "op sequence") -> None:
    """Refuse a fold whose live ranks of one class turned out to differ: FoldError naming the class,
    the two ranks and the first difference in ``what`` (``observed[rank]``: e.g. its ops' kinds and shapes,
    or such sequences by the part of the program they belong to, compared part by part and named)."""
    for cls in plan.classes:
        ranks = [r for r in cls.sandbox if r in observed]
        if len(ranks) < 2:
            continue
        a = ranks[0]
        for b in ranks[1:]:
            diff = _first_difference(observed[a], observed[b])
            if diff is not None:
                raise FoldError(f"class {cls.name!r} ({cls.role}): ranks {a} and {b} differ in their {what}{diff}; "
                                "they cannot stand for each other")


def _first_difference(ref: Sequence[Any] | Mapping[str, Sequence[Any]],
                      got: Sequence[Any] | Mapping[str, Sequence[Any]]) -> str | None:
    """Where two ranks' observations first differ (' in PART at entry i: x vs y'), None where they do not."""
    if isinstance(ref, Mapping) and isinstance(got, Mapping):
        for part in [*ref, *(p for p in got if p not in ref)]:
            diff = _first_difference(ref.get(part, ()), got.get(part, ()))
            if diff is not None:
                return f" in {part}{diff}"
        return None
    ref, got = list(ref), list(got)
    if got == ref:
        return None
    i = next((i for i, (x, y) in enumerate(zip(ref, got, strict=False)) if x != y), min(len(ref), len(got)))
    left = ref[i] if i < len(ref) else "<end>"
    right = got[i] if i < len(got) else "<end>"
    return f" at entry {i}: {left!r} vs {right!r}"
