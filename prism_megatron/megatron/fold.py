"""Rank classes and the sandbox of a folded run: which ranks run the real program, which are virtual.

A target job of W ranks is folded onto a *sandbox* of live ranks; every other rank is virtual and
mirrors its representative ``rep[r]`` shifted into its own replica (``shift(r) = r - rep[r]``).
Rank coordinates come only from Megatron's ``RankGenerator`` (``parallel_state``: the dense
generator, order tp-cp-ep-dp-pp, and the expert one): a rank's coordinate along an axis is its
position in the group Megatron builds for that axis, never a formula of ours.

Classes group ranks that do the same work on the same shapes: data-parallel replicas (expert-DP
too), tensor/context-parallel peers, and pipeline stages whose chunks hold the same layers
with the same embedding/loss role (layer counts per stage from Megatron's own
``get_num_layers_to_build``, so uneven first/last stages and ``--pipeline-model-parallel-layout``
make their stages classes of their own). Expert-parallel peers are not grouped: they hold different
experts and receive different token counts, so each expert rank of a stage is its own class.

v1 sandbox rule: one model replica, i.e. every rank whose dense DP index is < k, where k is the
smallest count of DP indices that holds whole expert tensor-and-expert-parallel groups (k = 1 for
dense models); ``rep[r]`` is the rank with r's other coordinates and DP index ``d mod k``.
"""

from __future__ import annotations

import argparse
import bisect
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FOLD_PLAN_VERSION", "FoldError", "FoldPlanFormatError", "TargetLayout", "RankClass", "FoldPlan",
           "layout_from_args", "build_fold_plan", "check_class_members", "stage_signatures"]

FOLD_PLAN_VERSION = 1
ORDER = "tp-cp-ep-dp-pp"  # Megatron's default rank order (initialize_model_parallel)
ORDER_TP_PP_DP = "tp-cp-ep-pp-dp"  # Megatron-LM's --use-tp-pp-dp-mapping


class FoldError(ValueError):
    """A layout Megatron would reject, or a fold that would be wrong; the message names the values."""


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
    return TargetLayout(
        world_size=int(world_size), tp=tp, pp=pp, cp=int(_arg(args, "context_parallel_size", 1)),
        ep=int(_arg(args, "expert_model_parallel_size", 1)),
        etp=int(_arg(args, "expert_tensor_parallel_size", tp)),
        vpp=int(vpp) if vpp and int(vpp) > 1 else None, num_layers=int(num_layers),
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
def _import_megatron() -> None:
    """Import the megatron-core modules the fold reads. megatron-core 0.19 imports triton at module
    level (MoE paged stash) though nothing here launches a kernel: where triton is not installed,
    cpu_cuda_stubs' inert triton is present only while importing, so torch's own triton probes never
    mistake it for an installed one afterwards."""
    import importlib
    import sys

    names = ("megatron.core.parallel_state", "megatron.core.transformer.transformer_config",
             "megatron.core.transformer.transformer_block", "megatron.core.transformer.transformer_layer")
    try:
        for name in names:
            importlib.import_module(name)
        return
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "triton" or "triton" in sys.modules:
            raise
    from prism_megatron.megatron.cpu_cuda_stubs import make_triton_stub

    stub = make_triton_stub()
    sys.modules.update(stub)
    try:
        for name in names:
            importlib.import_module(name)
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
    layout: dict[str, Any] = field(default_factory=dict)

    def is_live(self, rank: int) -> bool:
        i = bisect.bisect_left(self.live, rank)
        return i < len(self.live) and self.live[i] == rank

    def shift(self, rank: int) -> int:
        return rank - self.rep[rank]

    @property
    def virtual_count(self) -> int:
        return self.world_size - len(self.live)

    def to_json(self) -> dict[str, Any]:
        return {"version": FOLD_PLAN_VERSION, "world_size": self.world_size, "gpus_per_node": self.gpus_per_node,
                "k": self.k, "layout": dict(self.layout), "live": list(self.live), "rep": list(self.rep),
                "class_of": list(self.class_of), "classes": [c.to_json() for c in self.classes]}

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
        if version != FOLD_PLAN_VERSION:
            raise FoldPlanFormatError(f"{source}: field version {version} is not supported "
                                      f"(this prism reads version {FOLD_PLAN_VERSION})")
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
        return cls(world_size=world, live=live, rep=rep, classes=classes, class_of=class_of,
                   gpus_per_node=need(data, "gpus_per_node", int, ""), k=int(data.get("k", 1)),
                   layout=dict(data.get("layout") or {}))


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


def _check_fold(gens: _Generators, live: bytearray, rep: list[int]) -> None:
    """Every group Megatron builds folds: with live members, each virtual member's rep is in it
    (its input can be mirrored); without, it is a live-holding group shifted as one."""
    checked: set[tuple] = set()
    for which, tokens in (("dense", _DENSE_TOKENS), ("expert", _EXPERT_TOKENS)):
        for token in tokens:
            key = gens.key(which, token)
            if key in checked or not any(key[1]):  # the same groups again, or groups of one (fold trivially)
                continue
            checked.add(key)
            groups = gens.groups(which, token)
            known: set[tuple[int, ...]] | None = None
            for g in groups:
                if any(live[r] for r in g):
                    members = set(g)
                    bad = next((r for r in g if rep[r] not in members), None)
                    if bad is not None:
                        raise FoldError(f"{which} {token} group {_short(g)} has live members but rank {bad}'s "
                                        f"representative {rep[bad]} is outside it: this layout does not fold")
                    continue
                s = g[0] - rep[g[0]]
                if known is None:
                    known = {tuple(x) for x in groups}
                if any(r - rep[r] != s for r in g) or tuple(r - s for r in g) not in known:
                    raise FoldError(f"{which} {token} group {_short(g)} is not a sandbox group shifted by {s}: "
                                    "this layout does not fold")


def _short(group: Sequence[int]) -> str:
    return str(list(group)) if len(group) <= 8 else f"[{group[0]}, {group[1]}, ..., {group[-1]}] ({len(group)} ranks)"


def build_fold_plan(layout: TargetLayout, progress: Callable[[str], None] | None = None) -> FoldPlan:
    """Classes, sandbox (v1: one replica), ``rep`` and ``class_of`` of every rank; O(W) per group kind."""
    validate_layout(layout)
    _import_megatron()
    say = progress or (lambda _m: None)
    t, world = layout, layout.world_size
    say("stage signatures (Megatron's layer split)")
    signatures = stage_signatures(t)
    say(f"Megatron's rank order for {world} ranks")
    gens = _Generators(t)
    dp_index = gens.coordinate("dense", "dp", world)
    pp_index = gens.coordinate("dense", "pp", world)
    k = _sandbox_k(t, gens, dp_index)
    rep = [0] * world
    for g in gens.groups("dense", "dp"):  # position in Megatron's DP group = DP index
        for d, r in enumerate(g):
            rep[r] = g[d % k]
    live_mask = bytearray(world)
    for r in range(world):
        if rep[r] == r:
            live_mask[r] = 1
    live = [r for r in range(world) if live_mask[r]]
    say(f"checking the fold of every group kind ({world - len(live)} virtual ranks)")
    _check_fold(gens, live_mask, rep)

    by_signature: dict[Hashable, list[int]] = {}
    for p, sig in enumerate(signatures):
        by_signature.setdefault(sig, []).append(p)
    # Expert-parallel peers hold different experts and receive different token counts (routing):
    # not the same shapes, so each expert rank is a class of its own within its stages.
    experts = t.ep if t.num_experts and t.ep > 1 else 1
    ep_index = gens.coordinate("expert", "ep", world) if experts > 1 else None
    stage_class = [0] * t.pp
    classes: list[RankClass] = []
    per_class = world // t.pp // experts
    middle = sum(1 for sig in by_signature if _stage_role(sig).startswith("middle"))
    for si, (sig, stages) in enumerate(by_signature.items()):
        for p in stages:
            stage_class[p] = si
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
    if ep_index is None:
        class_of = [stage_class[pp_index[r]] for r in range(world)]
    else:
        class_of = [stage_class[pp_index[r]] * experts + ep_index[r] for r in range(world)]
    for r in live:
        classes[class_of[r]].sandbox.append(r)
    return FoldPlan(world_size=world, live=live, rep=rep, classes=classes, class_of=class_of,
                    gpus_per_node=t.gpus_per_node, k=k,
                    layout={key: getattr(t, key) for key in ("tp", "cp", "ep", "etp", "pp", "vpp", "num_layers",
                                                             "order")} | {"dp": t.dp, "edp": t.edp})


def check_class_members(plan: FoldPlan, observed: Mapping[int, Sequence[Any]], what: str = "op sequence") -> None:
    """Refuse a fold whose live ranks of one class turned out to differ: FoldError naming the class,
    the two ranks and the first difference in ``what`` (``observed[rank]``: e.g. its ops' kinds and shapes)."""
    for cls in plan.classes:
        ranks = [r for r in cls.sandbox if r in observed]
        if len(ranks) < 2:
            continue
        a = ranks[0]
        ref = list(observed[a])
        for b in ranks[1:]:
            got = list(observed[b])
            if got == ref:
                continue
            i = next((i for i, (x, y) in enumerate(zip(ref, got, strict=False)) if x != y), min(len(ref), len(got)))
            left = ref[i] if i < len(ref) else "<end>"
            right = got[i] if i < len(got) else "<end>"
            raise FoldError(f"class {cls.name!r} ({cls.role}): ranks {a} and {b} differ in their {what} at "
                            f"entry {i}: {left!r} vs {right!r}; they cannot stand for each other")
