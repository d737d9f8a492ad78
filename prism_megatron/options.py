"""The user's options, defined once: typed dataclasses with a docstring per field.

Both front ends are generated from these classes, so a name, default, choice list or help text
lives in exactly one place: ``launch``'s click options (``--hang-timeout``) and ``run``'s
``--prism-*`` flags (``--prism-hang-timeout``), which Megatron's own parser also accepts
(``patches.arguments``). A field's type gives the parser's type, a ``Literal`` its choices, a
``bool`` a switch; the string literal under a field is its help. :class:`JobOptions` is what both
front ends share (how the target job's ranks are emulated); :class:`LaunchOnlyOptions` and
:class:`RunOnlyOptions` belong to one front end each. The launcher turns a :class:`JobOptions`
into its validated ``LaunchConfig`` (``LaunchConfig.from_options``), one mapping for both.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

__all__ = ["JobOptions", "LaunchOnlyOptions", "RunOnlyOptions", "Option", "options_of", "option"]


@dataclass
class JobOptions:
    """How the target job's ranks are emulated; ``launch`` and ``run`` both take these."""

    world_size: int | None = None
    """Ranks of the target job (required; `run --recipe` takes it from the recipe)."""

    devices: str = "cpu"
    """'cpu' or CUDA device indices, e.g. 0 or 0,1."""

    slots_per_device: int = 1
    """Ranks that compute at once on each device."""

    hang_timeout: float = 120.0
    """Seconds with every rank blocked before the job is declared hung."""

    trace_dir: str = "prism-trace"
    """Where the PrismTrace goes (logs go to TRACE_DIR.logs)."""

    gpus_per_node: int = 8
    """GPUs per node of the target cluster (sets LOCAL_RANK/LOCAL_WORLD_SIZE)."""

    log_ranks: str = "last"
    """Ranks whose output reaches the terminal: '0,last', '0-3', 'all' or 'none' (Megatron prints its
    iteration lines on the last rank)."""

    threads_per_rank: int | None = None
    """torch threads per emulated rank; default: what torchrun gives the target's ranks (OMP_NUM_THREADS where
    it is set, else 1 where a node runs more than one rank, else every core of this machine), leaving one core
    beside the ranks computing at once to prism's coordinator and launcher."""

    swap: Literal["auto", "none", "inprocess", "checkpoint", "budget", "budget-auto", "budget-inprocess"] = "auto"
    """Move blocked ranks' GPU state to host memory when a device is full (inprocess: each rank moves its
    allocator's segments itself, GPU timing stays on; checkpoint: CUDA process checkpoint, which excludes
    GPU timing; auto: inprocess where this torch and cuda-bindings offer it, else checkpoint until every
    rank ended iteration 1, after which a device that needed no swap is timed and swaps no more).
    budget, budget-auto, budget-inprocess: checkpoint, auto's checkpoint and inprocess with a stand-in
    that enforces the device memory without a GPU (tests)."""

    device_memory: float | None = None
    """GiB per device that ranks' state may take (default: the GPU's total)."""

    host_memory: float | None = None
    """GiB of host RAM swapped-out GPU state may take (default: 90% of the RAM available at start)."""

    target_gpu: str | None = None
    """GPU of the target cluster (h100-80gb, h200-141gb, a100-80gb, ... or a capacity in GiB): each rank
    is capped at its memory, so an OOM it would hit happens here and is reported as a prediction
    (exit 5); `run --recipe` defaults to the recipe's target.gpu."""

    target_context: float | None = None
    """GiB a rank of the target holds outside PyTorch's allocator (CUDA context, cuBLAS, NCCL buffers);
    default: prism's estimate, named in the report's provenance."""

    track_memory: Literal["auto", "on", "off"] = "auto"
    """Per-rank memory figures: 'auto' is on for GPUs and for a capped CPU run (the CPU byte accountant
    costs a few microseconds per op)."""

    gpu_timing: Literal["auto", "on", "off"] = "auto"
    """On GPUs, each compute segment's host time and device busy time (CUDA profiler), so the prediction
    lets the host run ahead as with NCCL; 'auto' is on for GPUs unless the swap mode is checkpoint (they
    exclude each other)."""

    listen: str = "127.0.0.1"
    """Address the job's coordinator and TCPStore listen on: loopback keeps them off the network (every rank
    runs on this host); 0.0.0.0 (every interface) or a host address only for ranks on other hosts."""

    staging: Literal["auto", "pageable"] = "auto"
    """GPU ranks' staging memory for collectives, and the host region in-process swaps copy through: 'auto'
    page-locks them (faster copies between the GPU and the coordinator or the region; the region in 1 GiB
    granules as a rank's swaps first reach them, held until the rank ends); 'pageable' does not."""

    rank_start: Literal["auto", "fork", "exec"] = "auto"
    """How each rank's process starts: 'fork' from the launcher's template, whose imports (torch, a preload) the
    ranks share (a rank starts in milliseconds and costs little host memory); 'exec' as a fresh interpreter that
    imports them itself, as a process of torchrun does (seconds, and host memory of its own). 'auto' is exec for
    GPU ranks, whose host work ran slower in a fork of the template (docs/measurements.md, "The fork from the
    launcher's template"), and fork on the CPU."""


@dataclass
class LaunchOnlyOptions:
    """``launch`` only: it runs any torch.distributed script."""

    preload: tuple[str, ...] = ()
    """Module the template imports before forking ranks (repeatable); ranks started as fresh interpreters
    (--rank-start) import only what their program imports."""


@dataclass
class RunOnlyOptions:
    """``run`` only: a Megatron job, its recipe, and what follows the run (calibration, report)."""

    emulate: bool = False
    """Emulate the target job with prism (without it nothing is patched)."""

    recipe: str | None = None
    """Recipe name or file (also --recipe); implies emulation. Where no flag gives them, its target sets
    --prism-target-gpu and --prism-cluster and its emulation section how the job is emulated (a target recipe's:
    attention, serial capture, micro-batch fold); each is printed as the recipe's choice."""

    driver: Literal["auto", "core", "training"] = "auto"
    """GPT driver a recipe runs: 'training' (Megatron-LM's pretrain, needs megatron.training), 'core'
    (megatron.core only), 'auto' (training if importable, else core)."""

    attention: Literal["megatron", "sdpa"] = "megatron"
    """Core attention of --transformer-impl local layers: 'megatron' runs Megatron's own unfused
    DotProductAttention (it keeps every head's s x s attention probabilities for the backward pass);
    'sdpa' computes the same values with torch's scaled_dot_product_attention, whose flash kernels keep
    only the output and softmax statistics, as Transformer Engine's fused attention does: the closest
    runnable setting where the target runs TE and this machine lacks it. Causal self-attention only
    (anything else is refused at its first call, named)."""

    experts: Literal["megatron", "grouped"] = "megatron"
    """Local experts of an MoE layer without Transformer Engine (megatron-core's SequentialMLP, what prism
    renders for --moe-grouped-gemm): 'megatron' runs Megatron's loop of one fc1, activation and fc2 per
    local expert; 'grouped' computes the same values with one torch grouped_mm per linear over the same
    parameters (viewed in place, never copied), as TE's grouped GEMM does: far fewer kernel launches where
    the loop is host-bound. Weights that no uniform stride can view (DDP bucket padding between two
    experts), expert biases and FP8 are refused at the first call, named: so 'megatron' is the default, and
    a target recipe whose job runs grouped GEMM can choose 'grouped' in its emulation section."""

    optimizer: Literal["megatron", "fused"] = "megatron"
    """Optimizer step where neither Transformer Engine nor apex is importable: 'megatron' runs Megatron's
    fallback (torch's foreach Adam/AdamW, one fp32 temporary per updated parameter during the step; a temporary
    per gradient when the grad norm is clipped; a host synchronisation per gradient in the norm); 'fused' runs
    torch's fused Adam/AdamW and in-place foreach clip, copies and norm, as TE's FusedAdam and fused kernels do
    on the target's stack: the same update, without those temporaries. Adam only (Megatron's other optimizers
    are left as it builds them); where a fused Adam is importable, Megatron's own is kept."""

    cluster: str | None = None
    """Cluster profile that costs communication in the prediction (prism-megatron cluster list);
    default: the recipe's target cluster, else free communication."""

    live_prediction: Literal["on", "off"] = "on"
    """Megatron's log line under emulation: 'on' shows each logged iteration's predicted time, for which the
    coordinator snapshots the trace so far and replays it (going on from the last prediction's replay) while the
    logging rank waits (its clock paused: no compute time); the snapshot grows, so each logged iteration waits a
    little longer than the last; 'off' shows the emulation's own time there and leaves the prediction to the
    report (a long emulation, or a rank that must not wait)."""

    fold: Literal["auto", "on", "off"] = "auto"
    """Rank folding: 'on' runs only the sandbox (one model replica: every rank class's live ranks) and
    answers for every other rank without a process (its ops mirror its class's live rank); 'off' runs
    every rank (full capture); 'auto' folds when the full job does not fit this machine: the ranks of
    each class x prism's memory estimate for the class (the program prism runs, its attention included;
    prism-megatron plan shows it beside Megatron's formula, which is not used) + 1 GiB of process per
    rank, against the devices plus 90% of the available host RAM (on CPU: host RAM alone). The fold's
    classes are printed before the run."""

    fold_depth: Literal["auto", "replica", "class"] = "auto"
    """How far a fold goes: 'replica' keeps one model replica live (DP replicas folded; every TP/CP peer
    and pipeline stage runs); 'class' keeps one live rank per rank class (dense layouts only: TP/CP peers
    folded onto tp = cp = 0, middle pipeline stages of one kind onto the lowest of them, DP replicas too;
    first and last stages stay live); 'auto' is replica when one model replica fits this machine by
    prism's memory estimate per class (or that estimate is unavailable) and for MoE, else class."""

    fold_capture: Literal["together", "serial"] = "together"
    """How a folded run captures its live ranks: 'together' runs them as processes at once; 'serial' runs one
    capture per live rank (only that rank a process, every other rank virtual, the other live ranks too) and
    merges the captures into one trace, so that only the largest live rank must fit here. In a serial capture a
    virtual member whose class has no live rank in it contributes what that capture's live member of the group
    contributes (self mirror) and a receive from a virtual pipeline neighbour gets a seeded stand-in of the
    posted shape (docs/features.md). Folded runs only."""

    fold_second_pass: Literal["auto", "on", "off"] = "auto"
    """A serial capture whose pipeline stand-ins had no recorded norm, or whose small reductions over another
    class (grad norm) had no recording of its inputs (their senders are captured later), is captured again after
    the first pass (nccl_prune.SECOND_PASS_RULE; up to 3k-2 captures for k live ranks): 'on' always, 'off'
    never, 'auto' only where the fold has MoE layers, and only until a capture taken again routes every token as
    its take before did. The stand-ins' norms and those reductions steer values (grad norm, clipping, losses);
    only through MoE routing do they change shapes, time or memory. What was skipped is printed, recorded in
    the merged trace and said in the report. Serial captures only."""

    fold_resume: bool = False
    """Resume a serial capture: a capture whose trace an earlier run of this same job left complete (or ended
    by its class's predicted OOM) beside --prism-trace-dir (TRACE.captures) is reused instead of run again, and
    only the others run; a run cut short (a time limit, a crash in a later capture) loses none of its finished
    captures. Reused only where that capture was given the same capture plan and the same command (the
    Megatron script by name, its flags but where the trace and logs go) on the same GPU model, CPU model,
    Python, torch and megatron-core; each capture says whether it was reused, or why not. Serial captures only."""

    fold_microbatches: str = "off"
    """Micro-batch folding: 'N' runs N of the target's M micro-batches per iteration (its global batch run as
    N x micro batch x DP) and the replay gives every rank the target's M, copies of steady units standing
    for the ones not run; 'auto' does so with the minimum whenever M exceeds it; 'off' runs M. Under
    non-interleaved schedules the minimum is the largest pipeline warm-up + 2 (PP1: 3): every stage runs
    its whole warm-up, a steady forward/backward pair and its own first and last micro-batch. Under an
    interleaved pipeline (VPP) N is M less whole micro-batch groups (microbatch_group_size_per_vp_stage),
    at least the first group, a steady group whose units stand for the missing ones and the last group
    (3 groups at the default group of PP); the extra groups are replayed in the schedule's own order of
    (micro-batch, chunk) units and p2p calls. Either way the activations in flight are bounded by the
    warm-up, so the captured peak memory is the target's. Batch-size ramp-up is refused."""

    calibrate: Literal["off", "on"] = "off"
    """After the run, calibrate: re-run the job once per slice (coupled groups such as TP kept whole)
    with the slice's ranks computing for real and the others replayed; the report then predicts from
    the calibrated graph."""

    calibrate_ranks_per_device: int = 2
    """Slice ranks computing at once on each device while calibrating (a slice holds devices x this)."""

    report: Literal["on", "off"] = "on"
    """After the run: the report (terminal, report.json/html, timeline) and W&B."""

    timeline: Literal["iteration", "all"] = "iteration"
    """What the report's Perfetto timeline (timeline.json) holds: 'iteration' the iteration the headline time
    is the median of (every rank's whole train step in it, and the loop's time before it that the iteration's
    time counts), 'all' every replayed iteration (at a thousand ranks, hundreds of MB: more than a browser
    may open)."""

    anchor_fake_pg: bool = False
    """After the run, also run one rank per class alone under Megatron's --fake-process-group (the same
    rendered program and micro-batches as prism's ranks) and show its peak memory beside ours in the report."""


@dataclass(frozen=True)
class Option:
    """One field of an options class, as the front ends need it."""

    name: str  # the field name: --name-with-dashes on launch, --prism-name-with-dashes on run
    type: type  # int, float, str or bool (the value type without None)
    default: Any
    choices: tuple[str, ...] | None
    help: str
    repeatable: bool = False  # a tuple field: the option may be given several times

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def prism_flag(self) -> str:
        return "--prism-" + self.name.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        return self.type is bool


@cache
def options_of(cls: type) -> tuple[Option, ...]:
    """The options of ``cls`` in declaration order; every field must have a docstring."""
    docs = _field_docs(cls)
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.name not in docs:
            raise TypeError(f"{cls.__name__}.{f.name} has no docstring: every option needs its help")
        value_type, choices, repeatable = _describe(hints[f.name], f"{cls.__name__}.{f.name}")
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        if choices is not None and default not in choices:
            raise TypeError(f"{cls.__name__}.{f.name}: default {default!r} is not one of {choices}")
        out.append(Option(f.name, value_type, default, choices, docs[f.name], repeatable))
    return tuple(out)


def option(cls: type, name: str) -> Option:
    """The option ``name`` of ``cls`` (its choices, default and help, for messages that name them)."""
    for o in options_of(cls):
        if o.name == name:
            return o
    raise KeyError(f"{cls.__name__} has no option {name!r}")


def _describe(hint: Any, where: str) -> tuple[type, tuple[str, ...] | None, bool]:
    """(value type, choices, repeatable) of a field's annotation."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{where}: only 'X | None' unions are options")
        return _describe(rest[0], where)
    if typing.get_origin(hint) is Literal:
        if not all(isinstance(a, str) for a in args):
            raise TypeError(f"{where}: choices must be strings")
        return str, tuple(args), False
    if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0], None, True
    if hint in (int, float, str, bool):
        return hint, None, False
    raise TypeError(f"{where}: {hint!r} is not an option type (int, float, str, bool, Literal, tuple[X, ...])")


def _field_docs(cls: type) -> dict[str, str]:
    """The string literal under each field (attribute docstrings), one paragraph of plain text."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs
