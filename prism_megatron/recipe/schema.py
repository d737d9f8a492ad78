"""Recipe schema (versions 1 to 3): dataclasses, the reader of plain data, and the validation rules.

A recipe names a *target* Megatron job (model, parallel layout, batch, world size). It is
checked here, before any process starts, against the rules megatron-core 0.16.1 and
Megatron-LM's ``megatron/training/arguments.py`` (tag ``core_v0.16.1``) enforce, so a bad
layout fails in milliseconds with the file and field named instead of minutes later inside
1,000 ranks. Every violation is collected and reported together in one :class:`RecipeError`.
Where our rule is stricter than Megatron, the comment says so.

Version 2 adds what a *target* recipe (a published configuration at scale) needs, all optional:
``sources`` (where each figure came from: repository, path, commit), ``substitutions`` (settings
the emulation machine cannot run, with what is rendered instead and which prediction it affects),
``target.gpus_per_node``, ``training.recompute``, and the pipeline split options
``parallel.pipeline_layout`` / ``account_for_embedding_in_pipeline_split`` /
``account_for_loss_in_pipeline_split``. A version-1 file using any of them is rejected, naming the
field, so a file never means something its version did not define.

Version 3 adds ``emulation``: the prism options ``run --recipe`` and ``plan --recipe`` take for the recipe
where no flag gives them (``EMULATION_OPTIONS``), so that ``run --recipe NAME --prism-devices 0`` alone
emulates a target on one GPU (what stands in for Transformer Engine's attention, how it is captured) rather
than every user having to know which flags it needs.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from prism_megatron.options import RunOnlyOptions, option

SUPPORTED_VERSIONS: tuple[int, ...] = (1, 2, 3)
MODEL_KINDS = ("gpt",)
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd")
# Megatron also accepts "flex", which needs DeepEP/HybridEP kernels we do not emulate.
TOKEN_DISPATCHERS = ("alltoall", "allgather")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")

# Megatron flags that a recipe field already sets; `extra_args` may not repeat them, or argparse
# would silently keep the last one and the layout we emulate would differ from the one run.
RECIPE_FLAGS: dict[str, str] = {
    "--num-layers": "model.num_layers",
    "--hidden-size": "model.hidden_size",
    "--ffn-hidden-size": "model.ffn_hidden_size",
    "--num-attention-heads": "model.num_attention_heads",
    "--group-query-attention": "model.num_query_groups",
    "--num-query-groups": "model.num_query_groups",
    "--seq-length": "model.seq_length",
    "--max-position-embeddings": "model.max_position_embeddings",
    "--vocab-size": "model.vocab_size",
    "--tokenizer-type": "model.vocab_size",
    "--mock-data": "model.vocab_size",
    "--transformer-impl": "model.transformer_impl",
    "--no-gradient-accumulation-fusion": "model.transformer_impl",
    "--num-experts": "model.moe.num_experts",
    "--moe-router-topk": "model.moe.router_topk",
    "--moe-token-dispatcher-type": "model.moe.token_dispatcher",
    "--moe-ffn-hidden-size": "model.moe.ffn_hidden_size",
    "--moe-aux-loss-coeff": "model.moe.aux_loss_coeff",
    "--tensor-model-parallel-size": "parallel.tp",
    "--pipeline-model-parallel-size": "parallel.pp",
    "--num-virtual-stages-per-pipeline-rank": "parallel.vpp",
    "--num-layers-per-virtual-pipeline-stage": "parallel.vpp",
    "--pipeline-model-parallel-layout": "parallel.pipeline_layout",
    "--account-for-embedding-in-pipeline-split": "parallel.account_for_embedding_in_pipeline_split",
    "--account-for-loss-in-pipeline-split": "parallel.account_for_loss_in_pipeline_split",
    "--recompute-granularity": "training.recompute",
    "--recompute-method": "training.recompute",
    "--recompute-num-layers": "training.recompute",
    "--recompute-modules": "training.recompute",
    "--context-parallel-size": "parallel.cp",
    "--expert-model-parallel-size": "parallel.ep",
    "--expert-tensor-parallel-size": "parallel.etp",
    "--sequence-parallel": "parallel.sequence_parallel",
    "--use-distributed-optimizer": "parallel.distributed_optimizer",
    "--overlap-grad-reduce": "parallel.overlap_grad_reduce",
    "--overlap-param-gather": "parallel.overlap_param_gather",
    "--micro-batch-size": "training.micro_batch_size",
    "--global-batch-size": "training.global_batch_size",
    "--train-iters": "training.train_iters",
    "--lr": "training.lr",
    "--seed": "training.seed",
    "--bf16": "training.precision",
    "--fp16": "training.precision",
    "--optimizer": "training.optimizer",
}

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")


class RecipeError(ValueError):
    """A recipe that cannot be used; ``problems`` lists every (field, message) found.

    One error carries all violations so that a user fixes a file in one pass.
    """

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = list(problems)
        super().__init__("\n".join(f"{source}: {where}: {msg}" for where, msg in self.problems))

    def fields(self) -> list[str]:
        """The dotted field names that are at fault, in report order."""
        return [where for where, _ in self.problems]


# --- field declarations -------------------------------------------------------------------------

_REQUIRED = object()


def _f(kind: str, default: Any = _REQUIRED, *, nullable: bool = False, choices: tuple = (), section=None,
       since: int = 1):
    """Declare a recipe key: its kind drives the type check, a missing default makes it required.

    ``since``: the first recipe version that has the key (a file of an older version may not use it).
    """
    md = {"kind": kind, "nullable": nullable, "choices": choices, "section": section, "since": since}
    if default is _REQUIRED:
        return field(metadata=md)
    if callable(default):
        return field(default_factory=default, metadata=md)
    return field(default=default, metadata=md)


@dataclass(frozen=True, kw_only=True)
class MoeSpec:
    """Mixture-of-experts part of the model; absent (null) for a dense model."""

    num_experts: int = _f("pos_int")
    router_topk: int = _f("pos_int", 2)
    token_dispatcher: str = _f("choice", "alltoall", choices=TOKEN_DISPATCHERS)
    ffn_hidden_size: int | None = _f("pos_int", None, nullable=True)  # null: model.ffn_hidden_size
    aux_loss_coeff: float = _f("nonneg_float", 0.0)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The network; sizes are those of the target model, not of anything we run locally."""

    kind: str = _f("choice", "gpt", choices=MODEL_KINDS)
    num_layers: int = _f("pos_int")
    hidden_size: int = _f("pos_int")
    ffn_hidden_size: int | None = _f("pos_int", None, nullable=True)  # null: 4 * hidden (Megatron)
    num_attention_heads: int = _f("pos_int")
    num_query_groups: int | None = _f("pos_int", None, nullable=True)  # null: plain multi-head
    seq_length: int = _f("pos_int")
    max_position_embeddings: int | None = _f("pos_int", None, nullable=True)  # null: seq_length
    vocab_size: int = _f("pos_int")
    # Not in the original sketch: context parallelism needs Transformer Engine's attention.
    transformer_impl: str = _f("choice", "local", choices=TRANSFORMER_IMPLS)
    moe: MoeSpec | None = _f("section", None, nullable=True, section=MoeSpec)

    @property
    def ffn(self) -> int:
        """FFN width in effect (Megatron's default 4h when null)."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Query groups in effect (heads when null: multi-head attention)."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def max_positions(self) -> int:
        """Position-embedding table size in effect."""
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length

    @property
    def moe_ffn(self) -> int | None:
        """Expert FFN width in effect (Megatron falls back to ffn_hidden_size), None when dense."""
        if self.moe is None:
            return None
        return self.moe.ffn_hidden_size if self.moe.ffn_hidden_size is not None else self.ffn


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """Parallel layout; dp null means derived as world_size / (tp*pp*cp)."""

    tp: int = _f("pos_int", 1)
    pp: int = _f("pos_int", 1)
    vpp: int | None = _f("pos_int", None, nullable=True)
    cp: int = _f("pos_int", 1)
    ep: int = _f("pos_int", 1)
    etp: int | None = _f("pos_int", None, nullable=True)  # null: tp (Megatron's default)
    dp: int | None = _f("pos_int", None, nullable=True)
    sequence_parallel: bool = _f("bool", False)
    distributed_optimizer: bool = _f("bool", False)
    overlap_grad_reduce: bool = _f("bool", False)
    overlap_param_gather: bool = _f("bool", False)
    # v2: uneven pipeline splits of published recipes. pipeline_layout is Megatron's
    # --pipeline-model-parallel-layout string (Megatron parses and checks it; it fixes VPP itself).
    pipeline_layout: str | None = _f("str", None, nullable=True, since=2)
    account_for_embedding_in_pipeline_split: bool = _f("bool", False, since=2)
    account_for_loss_in_pipeline_split: bool = _f("bool", False, since=2)


@dataclass(frozen=True, kw_only=True)
class RecomputeSpec:
    """Activation recomputation, as Megatron's --recompute-* flags (v2)."""

    granularity: str = _f("choice", choices=RECOMPUTE_GRANULARITIES)
    method: str | None = _f("choice", None, nullable=True, choices=RECOMPUTE_METHODS)  # full only
    num_layers: int | None = _f("pos_int", None, nullable=True)  # full only
    modules: tuple[str, ...] = _f("str_list", ())  # selective only; empty: Megatron's default (core_attn)


@dataclass(frozen=True, kw_only=True)
class TrainingSpec:
    """Batch and optimisation settings that shape the schedule and memory."""

    micro_batch_size: int = _f("pos_int")
    global_batch_size: int = _f("pos_int")
    train_iters: int = _f("pos_int")
    lr: float = _f("pos_float", 1.0e-4)
    seed: int = _f("nonneg_int", 1234)
    precision: str = _f("choice", "fp32", choices=PRECISIONS)
    optimizer: str = _f("choice", "adam", choices=OPTIMIZERS)
    recompute: RecomputeSpec | None = _f("section", None, nullable=True, section=RecomputeSpec, since=2)


@dataclass(frozen=True, kw_only=True)
class TargetSpec:
    """The target hardware: `run --recipe`'s default --prism-target-gpu (memory cap and OOM verdict)
    and --prism-cluster (the profile that costs communication); checked when the recipe is run."""

    gpu: str | None = _f("str", None, nullable=True)
    cluster: str | None = _f("str", None, nullable=True)
    # v2: ranks per node on the target (placement: rank r on node r // gpus_per_node).
    gpus_per_node: int | None = _f("pos_int", None, nullable=True, since=2)


@dataclass(frozen=True, kw_only=True)
class SourceSpec:
    """Where a recipe's figures come from: one public file at one commit (v2)."""

    what: str = _f("str")  # which figures this file gives, e.g. "layout, batch, precision"
    repository: str = _f("str")  # owner/name on GitHub
    path: str = _f("str")
    commit: str = _f("str")  # 40 hex digits
    name: str | None = _f("str", None, nullable=True)  # the function or config inside the file


@dataclass(frozen=True, kw_only=True)
class SubstitutionSpec:
    """A published setting the emulation machine cannot run, and what the recipe renders instead (v2)."""

    setting: str = _f("str")  # a recipe field ("training.precision") or a Megatron flag
    published: str = _f("str")
    rendered: str = _f("str")
    affects: str = _f("str")  # which prediction it changes, and how


def te_substituted(substitutions: list[dict[str, str]] | None) -> bool:
    """Whether a run's substitutions (``SubstitutionSpec``'s as dicts) say it rendered a published Transformer
    Engine model with another implementation."""
    return any(s["setting"] == "model.transformer_impl" and "transformer_engine" in s["published"]
               and "transformer_engine" not in s["rendered"] for s in substitutions or ())


def _emulation_field(name: str):
    """A key of ``emulation``: the ``run`` option of that name, its choices checked where it has them."""
    choices = option(RunOnlyOptions, name).choices
    return _f("choice" if choices else "str", None, nullable=True, choices=choices or ())


@dataclass(frozen=True, kw_only=True)
class EmulationSpec:
    """The ``--prism-*`` options ``run --recipe`` takes where the command line gives none (v3): how the job is
    emulated (what stands in for what the emulation machine lacks, how far it folds), never where (devices,
    memory) or what follows the run. Each is printed as the recipe's choice; a flag overrides it."""

    attention: str | None = _emulation_field("attention")
    experts: str | None = _emulation_field("experts")
    optimizer: str | None = _emulation_field("optimizer")
    fold: str | None = _emulation_field("fold")
    fold_depth: str | None = _emulation_field("fold_depth")
    fold_capture: str | None = _emulation_field("fold_capture")
    fold_microbatches: str | None = _emulation_field("fold_microbatches")  # 'auto', 'off' or a count
    fold_second_pass: str | None = _emulation_field("fold_second_pass")

    def chosen(self) -> dict[str, str]:
        """The options the recipe sets, by option name, in declaration order."""
        return {name: getattr(self, name) for name in EMULATION_OPTIONS if getattr(self, name) is not None}


EMULATION_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EmulationSpec))


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A validated target job. Build one with :func:`from_dict` (or the loaders), not directly."""

    version: int = _f("int")
    name: str = _f("str")
    description: str = _f("str", "")
    model: ModelSpec = _f("section", section=ModelSpec)
    parallel: ParallelSpec = _f("section", ParallelSpec, section=ParallelSpec)
    training: TrainingSpec = _f("section", section=TrainingSpec)
    world_size: int = _f("pos_int")
    target: TargetSpec = _f("section", TargetSpec, section=TargetSpec)
    extra_args: tuple[str, ...] = _f("str_list", ())
    sources: tuple[SourceSpec, ...] = _f("section_list", (), section=SourceSpec, since=2)
    substitutions: tuple[SubstitutionSpec, ...] = _f("section_list", (), section=SubstitutionSpec, since=2)
    emulation: EmulationSpec = _f("section", EmulationSpec, section=EmulationSpec, since=3)
    # Where the recipe came from, for error messages; not a YAML key.
    source: str = field(default="<memory>", compare=False, metadata={"internal": True})

    @property
    def dp(self) -> int:
        """Data-parallel size: given, or world_size / (TP*PP*CP) as Megatron derives it."""
        p = self.parallel
        return p.dp if p.dp is not None else self.world_size // (p.tp * p.pp * p.cp)

    @property
    def etp(self) -> int:
        """Expert tensor-parallel size in effect (Megatron: defaults to TP)."""
        return self.parallel.etp if self.parallel.etp is not None else self.parallel.tp

    @property
    def expert_dp(self) -> int:
        """Expert data-parallel size: world / (ETP*EP*PP), as parallel_state builds it."""
        return self.world_size // (self.etp * self.parallel.ep * self.parallel.pp)

    @property
    def num_microbatches(self) -> int:
        """Microbatches per iteration on each DP rank: GBS / (MBS * DP)."""
        return self.training.global_batch_size // (self.training.micro_batch_size * self.dp)

    @property
    def layout(self) -> str:
        """Dense layout as ``TPxPPxCPxDP``, e.g. ``TP2xPP2xCP1xDP1``."""
        p = self.parallel
        return f"TP{p.tp}xPP{p.pp}xCP{p.cp}xDP{self.dp}"


# --- reading plain data ---------------------------------------------------------------------------

_KIND_TEXT = {
    "int": "an integer",
    "pos_int": "a positive integer",
    "nonneg_int": "an integer >= 0",
    "pos_float": "a number > 0",
    "nonneg_float": "a number >= 0",
    "bool": "true or false",
    "str": "a string",
    "str_list": "a list of strings",
    "section": "a mapping",
    "section_list": "a list of mappings",
}


def _type_name(value: Any) -> str:
    return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string",
            list: "list", dict: "mapping"}.get(type(value), type(value).__name__)


def _looks_like_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class _Reader:
    """Turns nested dicts into the dataclasses, noting every problem instead of stopping at one."""

    def __init__(self, version: int = max(SUPPORTED_VERSIONS)) -> None:
        self.version = version
        self.problems: list[tuple[str, str]] = []
        self.bad: set[str] = set()  # fields whose value is unusable; rules on them are skipped

    def problem(self, where: str, msg: str) -> None:
        self.problems.append((where, msg))
        self.bad.add(where)

    def section(self, cls: type, data: Any, prefix: str) -> Any:
        if not isinstance(data, dict):
            self.problem(prefix or "(top level)", f"expected a mapping, got {_type_name(data)} {data!r}")
            return None
        fields = [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
        names = [f.name for f in fields]
        for key in data:
            if key not in names:
                where = f"{prefix}.{key}" if prefix else str(key)
                hint = difflib.get_close_matches(str(key), names, n=1)
                extra = f"; did you mean '{hint[0]}'?" if hint else f"; known keys: {', '.join(names)}"
                self.problem(where, f"unknown key{extra}")
        values: dict[str, Any] = {}
        for f in fields:
            where = f"{prefix}.{f.name}" if prefix else f.name
            if f.name in data and f.metadata["since"] > self.version:
                self.problem(where, f"needs version: {f.metadata['since']} (this file is version {self.version})")
                continue
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    self.problem(where, "required key is missing")
                    values[f.name] = None
                continue
            values[f.name] = self.value(f, data[f.name], where)
        return cls(**values)

    def value(self, f: dataclasses.Field, value: Any, where: str) -> Any:
        kind, md = f.metadata["kind"], f.metadata
        if value is None:
            if md["nullable"]:
                return None
            self.problem(where, f"expected {_KIND_TEXT.get(kind, 'a value')}, got null")
            return None
        if kind == "section":
            return self.section(md["section"], value, where)
        if kind == "section_list":
            if not isinstance(value, list):
                self.problem(where, f"expected a list of mappings, got {_type_name(value)} {value!r}")
                return None
            items = [self.section(md["section"], item, f"{where}[{i}]") for i, item in enumerate(value)]
            return None if any(item is None for item in items) else tuple(items)
        if kind == "choice":
            if isinstance(value, str) and value in md["choices"]:
                return value
            self.problem(where, f"{value!r} is not one of {', '.join(md['choices'])}")
            return None
        if kind == "str_list":
            if not isinstance(value, list):
                self.problem(where, f"expected a list of strings, got {_type_name(value)} {value!r}")
                return None
            ok = True
            for i, item in enumerate(value):
                if not isinstance(item, str) or not item:
                    hint = " (quote it in YAML)" if isinstance(item, (int, float, bool)) else ""
                    self.problem(f"{where}[{i}]", f"expected a non-empty string, got "
                                 f"{_type_name(item)} {item!r}{hint}")
                    ok = False
            if not ok:
                self.bad.add(where)
            return tuple(value) if ok else None
        if kind == "bool":
            if isinstance(value, bool):
                return value
        elif kind == "str":
            if isinstance(value, str):
                return value
        elif kind in ("int", "pos_int", "nonneg_int"):
            if isinstance(value, int) and not isinstance(value, bool):
                if kind == "pos_int" and value <= 0:
                    self.problem(where, f"{value} must be a positive integer")
                    return None
                if kind == "nonneg_int" and value < 0:
                    self.problem(where, f"{value} must be >= 0")
                    return None
                return value
        elif kind in ("pos_float", "nonneg_float"):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                if kind == "pos_float" and not value > 0:
                    self.problem(where, f"{value} must be > 0")
                    return None
                if kind == "nonneg_float" and not value >= 0:
                    self.problem(where, f"{value} must be >= 0")
                    return None
                return float(value)
            if isinstance(value, str) and _looks_like_float(value):
                self.problem(where, f"expected a number, got the string {value!r} (YAML reads 1e-4 as "
                             "text: write 1.0e-4)")
                return None
        self.problem(where, f"expected {_KIND_TEXT[kind]}, got {_type_name(value)} {value!r}")
        return None


def from_dict(data: Any, source: str = "<memory>") -> Recipe:
    """Build and validate a :class:`Recipe` from parsed YAML; raises :class:`RecipeError`.

    The version is checked first and alone: another version's keys may mean other things.
    """
    if not isinstance(data, dict):
        got = _type_name(data)
        raise RecipeError(source, [("(top level)", f"expected a mapping of recipe keys, got {got}")])
    supported = ", ".join(str(v) for v in SUPPORTED_VERSIONS)
    if "version" not in data:
        raise RecipeError(source, [("version", f"required key is missing; supported versions: {supported}")])
    version = data["version"]
    if isinstance(version, bool) or version not in SUPPORTED_VERSIONS:
        msg = f"{version!r} is not supported; supported versions: {supported}"
        raise RecipeError(source, [("version", msg)])
    reader = _Reader(version)
    recipe = reader.section(Recipe, data, "")
    if recipe is not None:
        recipe = dataclasses.replace(recipe, source=source)
        _check_rules(recipe, reader)
    if reader.problems:
        raise RecipeError(source, reader.problems)
    return recipe


def validate(recipe: Recipe) -> Recipe:
    """Re-check a recipe built or changed in code (e.g. by ``dataclasses.replace``)."""
    return from_dict(to_dict(recipe), recipe.source)


def to_dict(recipe: Recipe) -> dict[str, Any]:
    """Plain data of a recipe (the YAML shape), e.g. to write a derived recipe back out."""
    data = dataclasses.asdict(recipe)
    data.pop("source", None)
    data["extra_args"] = list(recipe.extra_args)
    for f in dataclasses.fields(Recipe):  # keys an older version's file may not carry (at their defaults there)
        if f.metadata.get("since", 1) > recipe.version:
            data.pop(f.name, None)
    if recipe.version < 2:
        for section, cls in (("parallel", ParallelSpec), ("training", TrainingSpec), ("target", TargetSpec)):
            for f in dataclasses.fields(cls):
                if f.metadata.get("since", 1) > recipe.version:
                    data[section].pop(f.name, None)
    else:
        data["sources"] = [dataclasses.asdict(x) for x in recipe.sources]
        data["substitutions"] = [dataclasses.asdict(x) for x in recipe.substitutions]
        if recipe.training.recompute is not None:
            data["training"]["recompute"]["modules"] = list(recipe.training.recompute.modules)
    return data


# --- rules ------------------------------------------------------------------------------------------


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


def pipeline_layout_stages(layout: str) -> int | None:
    """Pipeline stages in a --pipeline-model-parallel-layout string, None when it does not parse.

    The grammar Megatron reads: stages separated by '|', a stage's layers as letters (E embedding,
    t decoder layer, m MTP, L loss), ``X*N`` repeats one letter, ``(...)*N`` repeats a group.
    """
    text = layout.replace(" ", "").replace(",", "")
    group = re.compile(r"\(([^()]*)\)\*(\d+)")
    while True:
        text, n = group.subn(lambda mt: mt.group(1) * int(mt.group(2)), text)
        if not n:
            break
    text = re.sub(r"([A-Za-z])\*(\d+)", lambda mt: mt.group(1) * int(mt.group(2)), text)
    if not text or not re.fullmatch(r"[A-Za-z|]*", text):
        return None
    return text.rstrip("|").count("|") + 1


def _check_rules(r: Recipe, reader: _Reader) -> None:
    """Cross-field rules; each names the field at fault and the Megatron source it mirrors."""
    bad = reader.bad

    def ok(*paths: str) -> bool:
        return not any(p == b or p.startswith(b + ".") or b.startswith(p + ".") for p in paths for b in bad)

    def err(where: str, msg: str) -> None:
        reader.problems.append((where, msg))

    m, p, t = r.model, r.parallel, r.training

    if ok("name") and not _NAME_RE.match(r.name):
        err("name", f"{r.name!r} must be lower-case letters, digits, '.', '_' or '-'")

    # --- model shape -----------------------------------------------------------------------------
    if ok("model.hidden_size", "model.num_attention_heads") and m.hidden_size % m.num_attention_heads:
        # arguments.py validate_args: kv_channels = hidden_size // num_attention_heads (asserted exact).
        err("model.num_attention_heads",
            f"{m.num_attention_heads} does not divide model.hidden_size={m.hidden_size}")
    if ok("model.num_query_groups", "model.num_attention_heads") and m.num_attention_heads % m.query_groups:
        # attention.py: heads are split evenly over query groups (divide()).
        err("model.num_query_groups",
            f"{m.query_groups} does not divide model.num_attention_heads={m.num_attention_heads}")
    if ok("model.max_position_embeddings", "model.seq_length") and m.max_positions < m.seq_length:
        # validate_args: max_position_embeddings >= seq_length.
        err("model.max_position_embeddings",
            f"{m.max_positions} is smaller than model.seq_length={m.seq_length}")

    # --- world size and DP -----------------------------------------------------------------------
    layout_ok = ok("parallel.tp", "parallel.pp", "parallel.cp", "world_size")
    if layout_ok:
        model_size = p.tp * p.pp * p.cp
        if p.dp is None:
            # validate_args / parallel_state.initialize_model_parallel: world_size % (tp*pp*cp) == 0.
            if r.world_size % model_size:
                err("world_size", f"{r.world_size} is not divisible by TP*PP*CP = "
                    f"{p.tp}*{p.pp}*{p.cp} = {model_size}, so DP is not an integer")
                layout_ok = False
        elif ok("parallel.dp") and model_size * p.dp != r.world_size:
            err("parallel.dp", f"TP*PP*CP*DP = {p.tp}*{p.pp}*{p.cp}*{p.dp} = {model_size * p.dp} "
                f"but world_size is {r.world_size}")
            layout_ok = False
        elif not ok("parallel.dp"):
            layout_ok = False

    # --- tensor parallel -------------------------------------------------------------------------
    if ok("parallel.tp", "model.num_attention_heads") and m.num_attention_heads % p.tp:
        # TransformerConfig.__post_init__: num_attention_heads % tensor_model_parallel_size == 0.
        err("parallel.tp", f"{p.tp} does not divide model.num_attention_heads={m.num_attention_heads}")
    if ok("parallel.tp", "model.num_query_groups", "model.num_attention_heads", "model.transformer_impl"):
        g = m.query_groups
        if m.transformer_impl == "local" and g % p.tp:
            # dot_product_attention.py (local): divide(num_query_groups, tp) asserts exact division.
            err("parallel.tp", f"{p.tp} does not divide model.num_query_groups={g} "
                "(the local attention splits query groups over TP ranks)")
        elif m.transformer_impl == "transformer_engine" and g % p.tp and p.tp % g:
            # TransformerConfig.__post_init__: query groups must be a multiple or a divisor of TP.
            err("parallel.tp", f"{p.tp} and model.num_query_groups={g}: neither divides the other")
    if ok("parallel.tp", "model.ffn_hidden_size", "model.hidden_size") and m.ffn % p.tp:
        # tensor_parallel/layers.py ColumnParallelLinear: divide(output_size, tp).
        err("parallel.tp", f"{p.tp} does not divide model.ffn_hidden_size={m.ffn}")

    if ok("parallel.sequence_parallel", "parallel.tp") and p.sequence_parallel:
        if p.tp < 2:
            # ModelParallelConfig.__post_init__: "Cannot use sequence parallelism without tensor
            # parallelism" (Megatron-LM's validate_args silently turns it off at TP=1; we refuse).
            err("parallel.sequence_parallel", f"true needs parallel.tp >= 2, got {p.tp}")
        elif ok("model.seq_length", "parallel.cp") and (m.seq_length // p.cp) % p.tp:
            # mappings.py scatter_to_sequence_parallel_region: divide(seq_len, tp) on the local sequence.
            err("parallel.sequence_parallel", f"model.seq_length={m.seq_length} / CP={p.cp} is not "
                f"divisible by parallel.tp={p.tp}, which sequence parallelism splits it over")

    # --- pipeline / virtual pipeline -------------------------------------------------------------
    layout = p.pipeline_layout if ok("parallel.pipeline_layout") else None
    extra_units = (int(bool(p.account_for_embedding_in_pipeline_split))
                   + int(bool(p.account_for_loss_in_pipeline_split))) if ok("parallel") else 0
    units = m.num_layers + extra_units if ok("model.num_layers") else None
    units_text = f"model.num_layers={m.num_layers}" + (f" + {extra_units} (embedding/loss counted as layers)"
                                                         if extra_units else "")
    if layout is not None:
        # Megatron checks the layout string itself (TransformerConfig); we only check its stage count,
        # from which validate_args derives VPP: stages / PP.
        stages = pipeline_layout_stages(layout)
        if stages is None:
            err("parallel.pipeline_layout", f"{layout!r} is not a layout string (stages separated by '|', "
                "groups as (..)*N)")
        elif ok("parallel.pp", "parallel.vpp") and (stages % p.pp or stages // p.pp != (p.vpp or 1)):
            err("parallel.vpp", f"{p.vpp} but parallel.pipeline_layout has {stages} stages over parallel.pp="
                f"{p.pp}: VPP must be stages / PP" + (f" = {stages // p.pp}" if stages % p.pp == 0 else
                                                         " (not divisible)"))
        if extra_units:
            err("parallel.pipeline_layout", "set with account_for_*_in_pipeline_split: the layout already "
                "places the embedding (E) and loss (L)")
    elif ok("parallel.pp", "model.num_layers") and units % p.pp:
        # validate_args: "Number of layers should be divisible by the pipeline-model-parallel size"
        # (after adding one per --account-for-embedding/loss-in-pipeline-split).
        err("parallel.pp", f"{p.pp} does not divide {units_text}")
    if layout is None and ok("parallel.vpp", "parallel.pp", "model.num_layers") and p.vpp is not None:
        if p.vpp == 1:
            err("parallel.vpp", "1 means no interleaving; write null")
        elif p.pp < 2:
            # parallel_state.initialize_model_parallel: "pipeline-model-parallel size should be greater
            # than 1 with interleaved schedule" (validate_args: > 2 unless p2p overlap, on by default).
            err("parallel.vpp", f"{p.vpp} needs parallel.pp >= 2, got {p.pp}")
        elif units % (p.pp * p.vpp):
            # transformer_block.get_num_layers_to_build: "num_layers_per_pipeline_rank ... should be
            # divisible by vp_size" (validate_args checks the same for --num-layers-per-virtual-...).
            err("parallel.vpp", f"PP*VPP = {p.pp}*{p.vpp} = {p.pp * p.vpp} does not divide {units_text}")

    # --- context parallel ------------------------------------------------------------------------
    if ok("parallel.cp", "model.seq_length") and p.cp > 1 and m.seq_length % (2 * p.cp):
        # validate_args: "seq-length should be a multiple of 2 * context-parallel-size".
        err("parallel.cp", f"{p.cp} needs model.seq_length={m.seq_length} divisible by 2*CP = {2 * p.cp}")
    if ok("parallel.cp", "model.transformer_impl") and p.cp > 1 and m.transformer_impl == "local":
        # transformer/dot_product_attention.py: "Context parallelism is only supported by
        # TEDotProductAttention!" (the local implementation asserts context_parallel_size == 1).
        err("parallel.cp", f"{p.cp} needs model.transformer_impl: transformer_engine "
            "(Megatron's local attention supports only CP=1)")

    # --- experts ---------------------------------------------------------------------------------
    moe_ok = ok("model.moe")
    if ok("parallel.ep") and p.ep > 1 and moe_ok and m.moe is None:
        # validate_args: "num_experts must be non None to use expert model parallelism".
        err("parallel.ep", f"{p.ep} needs model.moe (expert parallelism without experts)")
    if moe_ok and m.moe is not None:
        e = m.moe
        if ok("parallel.ep") and e.num_experts % p.ep:
            # validate_args: "Number of experts should be a multiple of expert model parallel_size".
            err("parallel.ep", f"{p.ep} does not divide model.moe.num_experts={e.num_experts}")
        if e.router_topk > e.num_experts:
            # router.py: torch.topk over num_experts scores.
            err("model.moe.router_topk", f"{e.router_topk} exceeds model.moe.num_experts={e.num_experts}")
        elif (e.router_topk == 1 and ok("extra_args")
              and "--moe-router-pre-softmax" not in {_flag_name(a) for a in r.extra_args}):
            # TransformerConfig.__post_init__: "Please use --moe-router-pre-softmax when topk is 1."
            err("model.moe.router_topk", "1 needs '--moe-router-pre-softmax' in extra_args "
                "(softmax over one score has zero gradient)")
        if ok("parallel.etp", "parallel.tp", "model.ffn_hidden_size", "model.hidden_size") \
                and m.moe_ffn % r.etp:
            # Expert MLPs split their FFN over the expert tensor-parallel group.
            err("parallel.etp", f"ETP={r.etp} does not divide the expert FFN width {m.moe_ffn}")
        if ok("parallel.etp", "parallel.tp", "extra_args") and r.etp != 1 \
                and "--disable-bias-linear" not in {_flag_name(a) for a in r.extra_args}:
            # TransformerConfig.__post_init__: "Bias in Moe is only supported when ETP==1"
            # (Megatron-LM keeps linear biases unless --disable-bias-linear).
            src = "" if p.etp is not None else " (null: defaults to parallel.tp)"
            err("parallel.etp", f"ETP={r.etp}{src}: MoE with linear biases needs ETP=1; set etp: 1 "
                "or add '--disable-bias-linear' to extra_args")
        if ok("parallel.ep", "parallel.tp", "parallel.sequence_parallel") and p.ep > 1 and p.tp > 1 \
                and not p.sequence_parallel:
            # TransformerConfig (ModelParallelConfig.__post_init__): "When using expert parallelism
            # and tensor parallelism for training, sequence parallelism must be used" (a warning there).
            err("parallel.sequence_parallel", "must be true when parallel.ep > 1 and parallel.tp > 1")
    if layout_ok and ok("parallel.ep", "parallel.etp"):
        span = r.etp * p.ep * p.pp
        if r.world_size % span:
            # parallel_state.initialize_model_parallel: world_size % (etp*ep*pp) == 0 (expert DP size).
            where = "parallel.ep" if p.ep > 1 else "parallel.etp"
            err(where, f"ETP*EP*PP = {r.etp}*{p.ep}*{p.pp} = {span} does not divide world_size="
                f"{r.world_size}, so the expert data-parallel size is not an integer")

    # --- batch -----------------------------------------------------------------------------------
    if layout_ok and ok("training.micro_batch_size", "training.global_batch_size"):
        step = t.micro_batch_size * r.dp
        if t.global_batch_size % step:
            # num_microbatches_calculator.py: "global batch size (...) is not divisible by micro batch
            # size (...) times data parallel size (...)".
            err("training.global_batch_size", f"{t.global_batch_size} is not divisible by "
                f"micro_batch_size*DP = {t.micro_batch_size}*{r.dp} = {step}")
        elif p.vpp is not None and p.vpp > 1 and ok("parallel.vpp", "parallel.pp") and p.pp > 1:
            n = t.global_batch_size // step
            if n < p.pp or n % p.pp:
                # pipeline_parallel/schedules.py (interleaved): microbatch groups of PP microbatches;
                # fewer than PP, or a remainder, raises (default group size = PP).
                err("training.global_batch_size", f"interleaved pipeline (VPP) needs the microbatches "
                    f"per DP rank ({t.global_batch_size}/({t.micro_batch_size}*{r.dp}) = {n}) to be a "
                    f"positive multiple of parallel.pp={p.pp}")

    # --- data-parallel options -------------------------------------------------------------------
    if ok("parallel.overlap_param_gather", "parallel.distributed_optimizer", "parallel.overlap_grad_reduce") \
            and p.overlap_param_gather:
        # validate_args: "--overlap-param-gather only supported with distributed optimizer" and
        # "Must use --overlap-param-gather with --overlap-grad-reduce".
        if not p.distributed_optimizer:
            err("parallel.overlap_param_gather", "true needs parallel.distributed_optimizer: true")
        if not p.overlap_grad_reduce:
            err("parallel.overlap_param_gather", "true needs parallel.overlap_grad_reduce: true")

    # --- recompute (v2) ---------------------------------------------------------------------------
    rc = t.recompute if ok("training", "training.recompute") else None
    if rc is not None:
        if rc.granularity == "full" and (rc.method is None or rc.num_layers is None):
            # TransformerConfig.__post_init__: full recompute needs recompute_method and
            # recompute_num_layers.
            err("training.recompute", "granularity full needs method (uniform or block) and num_layers")
        if rc.granularity == "selective" and (rc.method is not None or rc.num_layers is not None):
            # validate_args: "recompute method is not yet supported for selective recomputing granularity".
            err("training.recompute", "granularity selective takes no method or num_layers")
        if rc.granularity == "full" and rc.modules:
            err("training.recompute.modules", "apply to granularity selective only")

    # --- provenance (v2) ---------------------------------------------------------------------------
    if ok("sources"):
        for i, src in enumerate(r.sources):
            if not _COMMIT_RE.match(src.commit):
                err(f"sources[{i}].commit", f"{src.commit!r} must be a full commit id (40 lower-case hex digits)")
            if src.repository.count("/") != 1:
                err(f"sources[{i}].repository", f"{src.repository!r} must be owner/name")

    # --- pass-through flags ----------------------------------------------------------------------
    if ok("extra_args"):
        for i, arg in enumerate(r.extra_args):
            owner = RECIPE_FLAGS.get(_flag_name(arg))
            if owner is not None:
                err(f"extra_args[{i}]", f"{_flag_name(arg)!r} is set from the recipe ({owner}); "
                    "change that field instead")

    # --- emulation (v3) ----------------------------------------------------------------------------
    e = r.emulation if ok("emulation") else None
    if e is not None and e.fold_microbatches is not None and ok("emulation.fold_microbatches"):
        from prism_megatron.megatron.microbatch_mode import MicrobatchModeError, parse_value

        try:
            parse_value(e.fold_microbatches)
        except MicrobatchModeError:
            err("emulation.fold_microbatches", f"{e.fold_microbatches!r} is not auto, off or a number of "
                "micro-batches >= 1 (quote a number in YAML)")
    if e is not None and e.fold_capture == "serial" and e.fold == "off":
        err("emulation.fold_capture", "serial captures a folded run one live rank at a time; emulation.fold is off")
