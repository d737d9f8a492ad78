"""``prism-megatron run [prism options] [SCRIPT.py] [megatron args]``: a Megatron command, emulated.

Prism options (``PRISM_FLAGS``) may come before the script or among the script's own flags; the
ranks always receive them among the script's flags, where Megatron's parser accepts them
(``patches.arguments``) and shows them in ``args``. ``--recipe NAME`` (or ``--prism-recipe``)
supplies the script (the mini GPT driver), the flags, the environment and the world size of a
recipe, and implies ``--prism-emulate``; flags after it are appended, so they override.
``--prism-driver`` picks that script: ``training`` (``pretrain_gpt_mini.py``, Megatron-LM's
``pretrain``), ``core`` (``core_gpt.py``, megatron.core only: what a machine with only the
megatron-core wheel can run) or ``auto`` (training when importable). The choice is printed and
passed to the ranks as ``PRISM_MEGATRON_DRIVER`` (``emulate.rank_setup`` reads it).

Without ``--prism-emulate`` nothing is patched: the script runs in this process exactly as
``python SCRIPT.py ARGS`` would (under ``torchrun`` too), with the ``--prism-*`` flags removed.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from prism_megatron.megatron.flags import PRISM_FLAGS, add_prism_arguments, flag_takes_value
from prism_megatron.options import JobOptions, RunOnlyOptions, options_of

__all__ = ["RunRequest", "RunError", "parse_run_args", "run", "select_driver", "RANK_SETUP", "PRELOAD", "USAGE",
           "DRIVER_ENV"]

RANK_SETUP = "prism_megatron.megatron.emulate:rank_setup"
PRELOAD = "prism_megatron.megatron.preload"
PREDICTOR = "prism_megatron.report.live:predict_iteration"  # Megatron's log line shows the predicted time
_ALIASES = {"--recipe": "--prism-recipe"}
DRIVER_ENV = "PRISM_MEGATRON_DRIVER"  # 'core' or 'training': what the ranks set up for

USAGE = """Usage: prism-megatron run [PRISM OPTIONS] [SCRIPT.py] [MEGATRON ARGS]...

  Run a Megatron pretrain script; with --prism-emulate (or --recipe) every rank of the target job
  runs as an emulated logical rank through prism, and a PrismTrace is written.

  Examples:
    prism-megatron run --recipe mini-dense-tp2pp2
    prism-megatron run --prism-emulate --prism-world-size 4 pretrain_gpt.py --tensor-model-parallel-size 2 ...

Prism options (also accepted among the script's flags):
"""


class RunError(ValueError):
    """Bad ``run`` input; the message names the option."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises (naming the option) instead of printing and exiting."""

    def error(self, message: str) -> NoReturn:
        raise RunError(f"bad prism option: {message}")


@dataclass
class RunRequest:
    """A parsed ``run`` command line."""

    options: dict = field(default_factory=dict)  # dest -> value, every PRISM_FLAGS entry
    script: Path | None = None
    script_args: list[str] = field(default_factory=list)  # without any --prism-* flag
    env: dict[str, str] = field(default_factory=dict)  # extra environment (a recipe's)
    driver_note: str | None = None  # which recipe driver runs, and why (printed by run)
    notes: list[str] = field(default_factory=list)  # defaults a recipe chose (printed by run)
    substitutions: list[dict] = field(default_factory=list)  # the recipe's (recorded in the trace's job)

    @property
    def emulate(self) -> bool:
        return bool(self.options.get("prism_emulate"))

    def job_options(self) -> JobOptions:
        """The options ``launch`` shares, typed (``--prism-x`` is field ``x``)."""
        return JobOptions(**{o.name: self.options["prism_" + o.name] for o in options_of(JobOptions)})

    def run_options(self) -> RunOnlyOptions:
        """``run``'s own options, typed."""
        return RunOnlyOptions(**{o.name: self.options["prism_" + o.name] for o in options_of(RunOnlyOptions)})

    def prism_argv(self) -> list[str]:
        """The prism options as flags (what the ranks' Megatron parser sees)."""
        out: list[str] = []
        for flag, kwargs in PRISM_FLAGS.items():
            value = self.options.get(flag[2:].replace("-", "_"))
            if kwargs.get("action") == "store_true":
                if value:
                    out.append(flag)
            elif value is not None:
                out += [flag, str(value)]
        return out


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """Pull ``--prism-*`` (and ``--recipe``) tokens, with their values, out of ``argv``."""
    prism: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, _ = token.partition("=")
        name = _ALIASES.get(name, name)
        if name in PRISM_FLAGS:
            if eq:
                prism.append(name + token[len(token.partition("=")[0]):])
            elif flag_takes_value(name):
                if i + 1 >= len(argv):
                    raise RunError(f"{token} needs a value")
                prism += [name, argv[i + 1]]
                i += 1
            else:
                prism.append(name)
        elif token.startswith("--prism-"):
            known = ", ".join(PRISM_FLAGS)
            raise RunError(f"unknown prism option {name!r}; known: {known}")
        else:
            rest.append(token)
        i += 1
    return prism, rest


def select_driver(choice: str) -> tuple[str, Path, str]:
    """``(name, script, why)`` of the recipe driver for ``--prism-driver choice``; never a silent fallback."""
    from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT, DRIVER_SCRIPT
    from prism_megatron.megatron.megatron_lm import ENV_VAR, training_available

    if choice == "core":
        return "core", CORE_DRIVER_SCRIPT, "--prism-driver core"
    if choice == "training":
        if not training_available():
            raise RunError(f"--prism-driver training needs megatron.training: set {ENV_VAR} to a Megatron-LM "
                           "checkout at the tag matching megatron-core, or use --prism-driver core")
        return "training", DRIVER_SCRIPT, "--prism-driver training"
    from prism_megatron.megatron.versions import auto_driver

    version = _megatron_core_version()
    driver, why = auto_driver(version)
    if driver == "training" and training_available():
        return "training", DRIVER_SCRIPT, f"auto: megatron-core {version}: {why}"
    if driver == "training":
        return "core", CORE_DRIVER_SCRIPT, "auto: megatron.training is not importable (megatron-core wheel only)"
    return "core", CORE_DRIVER_SCRIPT, f"auto: megatron-core {version}: {why} (--prism-driver training to opt in)"


def _megatron_core_version() -> str | None:
    """The installed megatron-core's version, from its package metadata (without importing it)."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def _refuse_what_the_core_driver_cannot_run(recipe: str, args: list[str], why: str) -> None:
    """A recipe whose flags the core driver does not run (a target recipe's SwiGLU, RoPE, ...) is refused before
    anything starts, saying which driver runs it and how to get it, not with the driver's flag error later."""
    from prism_megatron.megatron.driver.core_flags import FlagError, parse_args
    from prism_megatron.megatron.megatron_lm import ENV_VAR

    try:
        parse_args(args)
    except FlagError as e:
        refusal = str(e.code).split("; it accepts")[0]
        raise RunError(f"recipe {recipe} needs Megatron-LM's training driver: set {ENV_VAR} to a Megatron-LM "
                       "checkout at the tag matching megatron-core (bench/targets/setup.sh unpacks one) and run "
                       f"with --prism-driver training. The core driver ({why}) refuses it: {refusal}") from None


def parse_run_args(argv: list[str]) -> RunRequest:
    """Parse ``run``'s arguments (the recipe, if any, is loaded and validated here)."""
    lead: list[str] = []
    i = 0
    while i < len(argv) and argv[i].startswith("--"):  # prism options before the script
        name = _ALIASES.get(argv[i].partition("=")[0], argv[i].partition("=")[0])
        if name not in PRISM_FLAGS:
            break
        take = 2 if flag_takes_value(name) and "=" not in argv[i] else 1
        lead += argv[i:i + take]
        i += take
    script: Path | None = None
    if i < len(argv) and not argv[i].startswith("-"):
        script = Path(argv[i])
        i += 1
    prism_tokens, script_args = _split(lead + argv[i:])
    namespace = _Parser(prog="prism-megatron run", add_help=False, allow_abbrev=False)
    namespace = add_prism_arguments(namespace).parse_args(prism_tokens)
    request = RunRequest(options=vars(namespace), script=script, script_args=script_args)
    recipe_name = request.options.get("prism_recipe")
    core_why: str | None = None  # why a recipe runs on the core driver, where it does
    if recipe_name:
        from prism_megatron.recipe import load_recipe, render_args, render_env

        recipe = load_recipe(recipe_name)  # RecipeError names the file and field
        request.options["prism_emulate"] = True
        if request.options.get("prism_world_size") is None:
            request.options["prism_world_size"] = recipe.world_size
        elif request.options["prism_world_size"] != recipe.world_size:
            raise RunError(f"--prism-world-size {request.options['prism_world_size']} differs from recipe "
                           f"{recipe.name}'s world_size {recipe.world_size}")
        request.env = render_env(recipe)
        request.substitutions = [dict(vars(x)) for x in recipe.substitutions]
        _take_recipe_target(request, recipe)
        _take_recipe_emulation(request, recipe, {t.partition("=")[0] for t in prism_tokens if t.startswith("--")})
        if request.script is None:
            name, request.script, why = select_driver(request.options.get("prism_driver") or "auto")
            request.env[DRIVER_ENV] = name
            request.driver_note = f"prism: driver {name} ({request.script.name}; {why})"
            core_why = why if name == "core" else None
        request.script_args = render_args(recipe) + request.script_args
    if request.emulate and request.options.get("prism_attention") == "sdpa":
        from prism_megatron.patches.attention import ENV_VAR as ATTENTION_ENV

        request.env[ATTENTION_ENV] = "sdpa"
        request.substitutions.append({
            "setting": "core attention (--prism-attention sdpa)",
            "published": "--transformer-impl local: Megatron's unfused DotProductAttention",
            "rendered": "torch scaled_dot_product_attention (flash kernels, as Transformer Engine's fused attention)",
            "affects": "activation memory (no s x s attention probabilities kept per layer and micro-batch) and "
                       "attention time"})
    if request.emulate and request.options.get("prism_experts") == "grouped":
        _render_grouped_experts(request)
    if request.emulate:
        _name_the_optimizer_step(request)
    if request.driver_note is None and request.options.get("prism_driver") in ("core", "training"):
        request.env[DRIVER_ENV] = request.options["prism_driver"]  # a script of one's own: only the rank setup
    if request.script is None:
        raise RunError("no script given: prism-megatron run [PRISM OPTIONS] SCRIPT.py [ARGS] (or --recipe NAME)")
    if not request.script.is_file():
        raise RunError(f"script {str(request.script)!r} does not exist or is not a file")
    if request.emulate and request.options.get("prism_world_size") is None:
        raise RunError("--prism-emulate needs --prism-world-size W (the target job's number of ranks) or --recipe")
    if request.emulate and _flag_value(request.script_args, "--transformer-impl") == "transformer_engine":
        import importlib.util

        if importlib.util.find_spec("transformer_engine") is None:
            where = f"recipe {recipe_name}" if recipe_name else "the command"
            raise RunError(f"{where} asks for --transformer-impl transformer_engine, but the transformer-engine "
                           "package is not installed (an optional extra): install it, or use --transformer-impl "
                           "local where the job allows it")
    if recipe_name and core_why is not None:
        _refuse_what_the_core_driver_cannot_run(recipe_name, request.script_args, core_why)
    return request


#: The optimizer step Megatron runs where neither Transformer Engine nor apex is importable (megatron/core/optimizer
#: __init__.py and clip_grads.py): a target recipe's stack has TE, so its step is fused; here it is not.
OPTIMIZER_FALLBACK = {
    "setting": "optimizer step (Megatron's fallback without Transformer Engine or apex)",
    "published": "Transformer Engine's FusedAdam, multi_tensor_scale and multi_tensor_l2norm (fused kernels, in place)",
    "rendered": "torch's Adam/AdamW (foreach: one fp32 temporary per updated parameter during the step), Megatron's "
                "local_multi_tensor_scale (a temporary per gradient when the grad norm is clipped) and local l2 norm "
                "(a host synchronisation per gradient)",
    "affects": "memory during the optimizer step (the peak where the step sets it; which cached blocks the next "
               "iteration's allocations find) and the step's time"}


#: What ``--prism-optimizer fused`` renders the step with (``patches.fused_optimizer``).
OPTIMIZER_FUSED = ("torch's fused Adam/AdamW (one multi-tensor kernel, in place) and in-place foreach clip, copies "
                   "and norm (--prism-optimizer fused)")


def _name_the_optimizer_step(request: RunRequest) -> None:
    """A recipe that publishes Transformer Engine, run where no fused Adam is importable, records the step
    Megatron falls back to (``OPTIMIZER_FALLBACK``), or under ``--prism-optimizer fused`` what renders the
    target's; the ranks install that seam. Where a fused Adam is importable Megatron runs it: nothing to say."""
    from prism_megatron.patches.fused_optimizer import fused_adam_importable

    fused = request.options.get("prism_optimizer") == "fused"
    if fused_adam_importable():
        if fused:
            request.notes.append("prism: --prism-optimizer fused not needed: a fused Adam (Transformer Engine's or "
                                 "apex's) is importable here, so Megatron's own fused step runs")
        return
    if fused:
        from prism_megatron.patches.fused_optimizer import ENV_VAR as OPTIMIZER_ENV

        request.env[OPTIMIZER_ENV] = "fused"
    from prism_megatron.recipe.schema import te_substituted

    if te_substituted(request.substitutions):
        entry = dict(OPTIMIZER_FALLBACK)
        if fused:
            entry.update(rendered=OPTIMIZER_FUSED, affects="the step's time (torch's kernels, not TE's); its memory "
                         "as the target's: no temporary per parameter or gradient")
        request.substitutions.append(entry)
    elif fused:
        request.substitutions.append({
            "setting": "optimizer step (--prism-optimizer fused)",
            "published": f"Megatron's fallback without Transformer Engine or apex: {OPTIMIZER_FALLBACK['rendered']}",
            "rendered": OPTIMIZER_FUSED,
            "affects": "memory during the optimizer step (no temporary per parameter or gradient) and its time"})


def _render_grouped_experts(request: RunRequest) -> None:
    """--prism-experts grouped: the ranks install the seam, and the report's substitution for the target's
    --moe-grouped-gemm (or a new one) says what renders the experts."""
    from prism_megatron.patches.grouped_experts import ENV_VAR as EXPERTS_ENV

    request.env[EXPERTS_ENV] = "grouped"
    rendered = "torch grouped_mm over SequentialMLP's own expert weights (--prism-experts grouped)"
    affects = ("expert compute time (one grouped GEMM per linear, as TE's, instead of one GEMM per expert); memory: a "
               "linear's E expert weight grads alive at once for a moment (SequentialMLP: one at a time); under the "
               "distributed optimizer each linear's experts trade slots in DDP's buffer (ascending, so no token is "
               "copied into their order; the same offsets and buckets)")
    for i, s in enumerate(request.substitutions):
        if s.get("setting") == "--moe-grouped-gemm":  # the recipe's entry for the target's grouped GEMM
            request.substitutions[i] = dict(s, rendered=rendered, affects=affects)
            return
    entry = {"setting": "local experts (--prism-experts grouped)",
             "published": "--moe-grouped-gemm off: Megatron's SequentialMLP, one fc1, activation and fc2 per local "
                          "expert", "rendered": rendered, "affects": affects}
    request.substitutions.append(entry)


def _take_recipe_target(request: RunRequest, recipe) -> None:
    """The recipe's target hardware is the default verdict: memory against its GPU, communication
    costed by its cluster profile. Flags override it; a name that does not resolve is refused here,
    naming the recipe's file and field, before anything starts."""
    from prism_megatron.calibration.profiles import ProfileError, load_profile
    from prism_megatron.memory.targets import TargetError, resolve_target

    for option, key, value in (("prism_target_gpu", "gpu", recipe.target.gpu),
                               ("prism_cluster", "cluster", recipe.target.cluster)):
        if value is None or request.options.get(option) is not None:
            continue
        try:
            resolve_target(value) if key == "gpu" else load_profile(value)
        except (TargetError, ProfileError) as e:
            raise RunError(f"{recipe.source}: target.{key}: {e}") from None
        request.options[option] = value
        request.notes.append(f"prism: --{option.replace('_', '-')} {value} (recipe {recipe.name}'s target.{key})")


def ruled_out(name: str, value: str, options: dict) -> str | None:
    """Why ``--prism-<name> value`` cannot run beside the other ``options`` (dest -> value), or None: what ``run``
    refuses, and what a recipe's emulation choice yields to."""
    if name == "fold_capture" and value == "serial":
        if options["prism_fold"] == "off":
            return "--prism-fold off runs every rank together"
        if options["prism_calibrate"] == "on":
            return "--prism-calibrate on re-runs slices of a capture together"
    if name == "fold_microbatches" and value != "off" and options["prism_calibrate"] == "on":
        return "--prism-calibrate on re-runs the captured micro-batches"
    return None


def _take_recipe_emulation(request: RunRequest, recipe, given: set[str]) -> None:
    """The recipe's ``emulation`` options where no flag in ``given`` sets them, each said as the recipe's; one the
    flags rule out (``ruled_out``) yields to them, said."""
    o = request.options
    for name, value in recipe.emulation.chosen().items():
        flag = "--prism-" + name.replace("_", "-")
        if flag in given:
            continue
        if clash := ruled_out(name, value, o):
            request.notes.append(f"prism: recipe {recipe.name}'s emulation.{name} {value} not taken: {clash}")
            continue
        o["prism_" + name] = value
        request.notes.append(f"prism: {flag} {value} (recipe {recipe.name}'s emulation.{name})")


def _run_in_process(request: RunRequest) -> int:
    """Plain run: what ``python SCRIPT.py ARGS`` does, nothing patched."""
    script = str(request.script.resolve())
    sys.argv = [script, *request.script_args]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


def cpu_defaults(script_args: list[str]) -> list[str]:
    """Flags a CPU emulation needs that a GPU command line lacks.

    Without apex, Megatron falls back to torch's LayerNorm, which refuses the persistent-kernel
    option that Megatron turns on by default; ``--no-persist-layer-norm`` is what a GPU user without
    apex passes too. Nothing else changes: any ``--distributed-backend`` works (prism serves all).
    """
    import importlib.util

    if importlib.util.find_spec("apex") is None and "--no-persist-layer-norm" not in script_args:
        return ["--no-persist-layer-norm"]
    return []


def launch_config(request: RunRequest):
    """The launcher's configuration for an emulated run (validated by the caller)."""
    from prism_megatron.calibration.profiles import profile_reference
    from prism_megatron.launcher.config import LaunchConfig, parse_devices
    from prism_megatron.trace.costing import JOB_KEY as CLUSTER_KEY

    job = request.job_options()
    script_args = [*request.script_args, *request.prism_argv()]
    if parse_devices(job.devices) == ["cpu"]:
        script_args += cpu_defaults(script_args)
    cluster = request.run_options().cluster
    # the trace records the profile the run costs communication with: its report, remade later, predicts the same
    extra: dict = {CLUSTER_KEY: None if cluster is None else profile_reference(cluster),
                   "megatron_core": installed_megatron_core()}
    if request.substitutions:
        extra["substitutions"] = request.substitutions
    return LaunchConfig.from_options(
        job, request.script, script_args, preload=[PRELOAD], rank_setup=[RANK_SETUP],
        expected_iterations=_flag_int(request.script_args, "--train-iters"),
        predictor=PREDICTOR if request.run_options().live_prediction == "on" else None,
        predictor_options={"cluster": cluster},
        memory_classes=stage_classes(request.script_args, job.world_size),
        job_extra=extra,
    )


def installed_megatron_core() -> str | None:
    """The installed megatron-core's version (None: none installed, e.g. only a checkout on the path): what the
    ranks ran, recorded with the trace."""
    from importlib import metadata

    try:
        return metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        return None


def stage_classes(args: list[str], world_size: int | None) -> dict[int, str]:
    """Rank -> its pipeline stage: the class by whose measured peak a rank not yet through an
    iteration is admitted to a shared device (runtime.peaks). The ranks of one stage (its tensor-,
    context- and data-parallel peers) hold alike; Megatron's default rank order (tp-cp-ep-dp-pp)
    puts the stage outermost. Where that is not so (--use-tp-pp-dp-mapping) or ranks of a stage may
    hold unlike amounts (MoE: experts see different token counts), each rank is its own class."""
    if not world_size or "--use-tp-pp-dp-mapping" in args or (_flag_int(args, "--num-experts") or 0) > 1:
        return {}
    pp = _flag_int(args, "--pipeline-model-parallel-size") or 1
    if pp < 1 or world_size % pp:
        return {}
    per_stage = world_size // pp
    return {r: f"pipeline stage {r // per_stage}" for r in range(world_size)}


def _flag_value(args: list[str], flag: str) -> str | None:
    """The last value given for ``flag`` (``--flag V`` or ``--flag=V``), as Megatron's parser takes it."""
    value = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.partition("=")[2]
    return value


def _flag_int(args: list[str], flag: str) -> int | None:
    """The last value of ``flag`` in a Megatron command line (the parser keeps the last), if an int."""
    value = _flag_value(args, flag)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def run(request: RunRequest) -> int:
    """Run the request; returns the exit code (the launcher's codes when emulating)."""
    os.environ.update(request.env)
    for note in [request.driver_note, *request.notes]:
        if note:
            print(note, file=sys.stderr, flush=True)
    if not request.emulate:
        return _run_in_process(request)
    from prism_megatron.launcher.exit_codes import OOM
    from prism_megatron.launcher.launch import launch

    cfg = launch_config(request)
    cfg.check_trace_dir()  # before the planning: a bad destination is said at once, not after the plans
    if cfg.template_preloads_on_gpu:  # its child runs beside the fold's and micro-batch plans' children
        from prism_megatron.launcher.launch import start_cuda_import_check

        start_cuda_import_check(cfg.preload)
    after = request.run_options()
    if after.fold_microbatches != "off" or after.fold != "off":
        from prism_megatron.megatron.plan import start_planning

        start_planning(cfg.script, cfg.script_args, cfg.world_size, request.env, fold=after.fold != "off",
                       gpus=cfg.on_gpu)
        from prism_megatron.launcher.coordinator_ahead import start_first

        start_first()  # its imports run beside the parsing child's; the first launch adopts it
    if after.fold_microbatches != "off":
        from prism_megatron.launcher.exit_codes import BAD_INPUT
        from prism_megatron.megatron.microbatch_mode import MicrobatchModeError, choose_microbatches

        try:
            if why := ruled_out("fold_microbatches", after.fold_microbatches, request.options):
                raise MicrobatchModeError(f"--prism-fold-microbatches {after.fold_microbatches}: not yet ({why}); run "
                                          "with --prism-fold-microbatches off")
            cfg.script_args, record = choose_microbatches(
                after.fold_microbatches, cfg.script, list(cfg.script_args), cfg.world_size, cfg.gpus_per_node,
                request.env, say=lambda m: print(f"prism: {m}", file=sys.stderr, flush=True))
        except MicrobatchModeError as e:
            print(f"prism: {e}", file=sys.stderr, flush=True)
            return BAD_INPUT
        if record is not None:
            cfg.job_extra = {**cfg.job_extra, "microbatches": record}
    if after.fold != "off":
        from prism_megatron.megatron.fold_mode import FoldModeError, choose_fold

        try:
            cfg.fold = choose_fold(after.fold, cfg, request.env, say=lambda m: print(f"prism: {m}", file=sys.stderr,
                                                                                  flush=True), depth=after.fold_depth,
                                   capture=after.fold_capture)
        except FoldModeError as e:
            print(f"prism: {e}", file=sys.stderr, flush=True)
            from prism_megatron.launcher.exit_codes import BAD_INPUT

            return BAD_INPUT
        if cfg.fold is not None and cfg.fold.get("expert_tokens"):  # the ranks' side of the rule
            from prism_megatron.patches.moe_fold import ENV_VAR as EXPERT_TOKENS_ENV

            os.environ[EXPERT_TOKENS_ENV] = cfg.fold["expert_tokens"]
    from prism_megatron.megatron.megatron_args import close_parser

    close_parser()  # planned: the parsing child's Megatron imports are not the ranks' to share memory with
    from prism_megatron.patches.tp_fold_embedding import ENV_VAR as TP_MIRROR_ENV

    tp = tp_mirrored(cfg.fold, after.fold_capture)
    if tp > 1:  # the ranks' side of the rule: their TP peers mirror them (patches.tp_fold_embedding)
        os.environ[TP_MIRROR_ENV] = str(tp)
    else:  # never inherited from an earlier run in this process: it changes every TP embedding
        os.environ.pop(TP_MIRROR_ENV, None)
    serial = after.fold_capture == "serial"
    if serial and (why := ruled_out("fold_capture", after.fold_capture, request.options)):
        from prism_megatron.launcher.exit_codes import BAD_INPUT

        print(f"prism: --prism-fold-capture serial captures a folded run one live rank at a time; {why}",
              file=sys.stderr, flush=True)
        return BAD_INPUT
    if not serial and after.fold_second_pass != "auto":
        print(f"prism: --prism-fold-second-pass {after.fold_second_pass}: only a serial capture "
              "(--prism-fold-capture serial) takes a second pass; ignored", file=sys.stderr, flush=True)
    if not serial and after.fold_resume:
        print("prism: --prism-fold-resume: only a serial capture (--prism-fold-capture serial) is resumed; every "
              "rank runs", file=sys.stderr, flush=True)
    if serial and cfg.fold is None:
        print("prism: --prism-fold-capture serial: the run is not folded (every rank runs), so it is captured "
              "together", file=sys.stderr, flush=True)
    cfg.validate()
    if serial and cfg.fold is not None:
        from prism_megatron.launcher.serial import capture_serially

        code = capture_serially(cfg, launch, say=lambda m: print(f"prism: {m}", file=sys.stderr, flush=True),
                                second=after.fold_second_pass, resume=after.fold_resume)
    else:
        code = launch(cfg)
    if cfg.fold is not None and code == 0 and (cfg.trace_dir / "manifest.json").exists():
        from prism_megatron.megatron.fold_mode import FoldModeError, check_trace_classes

        try:
            check_trace_classes(cfg.trace_dir)
        except FoldModeError as e:
            print(f"prism: {e}", file=sys.stderr, flush=True)
            from prism_megatron.launcher.exit_codes import BAD_INPUT

            return BAD_INPUT
    from prism_megatron.launcher.exit_codes import interrupted

    traced = (cfg.trace_dir / "manifest.json").exists()
    stopped, written = traced and interrupted(code), traced and code in (0, OOM)
    if stopped and after.report == "on":  # what was captured before the stop is not lost: its report
        print(f"prism: the run was stopped (exit {code}); the report covers what it captured", file=sys.stderr,
              flush=True)
    if written and after.anchor_fake_pg:
        from prism_megatron.megatron.anchors import run_fake_pg_anchor

        args = list(cfg.script_args) + (cpu_defaults(cfg.script_args) if not cfg.on_gpu else [])  # as the ranks ran
        run_fake_pg_anchor(cfg.trace_dir, request.script, args, on_cpu=not cfg.on_gpu)
    calibrated = None
    if written and code == 0 and after.calibrate == "on":
        calibrated = _calibrate(cfg, after)
    if after.report == "on" and (written or stopped):
        from prism_megatron.report.publish import publish

        config = {"recipe": after.recipe, "script": str(request.script),
                  "flags": request.script_args,
                  "prism": {k: v for k, v in request.options.items() if v is not None}}
        publish(cfg.trace_dir, cluster=after.cluster, config=config,
                wandb_project=os.environ.get("WANDB_PROJECT", "prism-megatron"), calibrated=calibrated,
                timeline=after.timeline)
    return code


def _calibrate(cfg, options: RunOnlyOptions) -> Path | None:
    """Calibrate the bare trace just written (``--prism-calibrate on``): the calibrated graph's
    directory, or None after saying why it could not be built (the bare trace and report stand)."""
    from prism_megatron.calibration import AlignError, SliceError
    from prism_megatron.calibration.slice_run import SliceRunError, calibrate_job, format_iterations
    from prism_megatron.calibration.virtual_rank import VirtualRankError

    out = cfg.trace_dir.with_name(cfg.trace_dir.name + ".calibration")
    try:
        path, rows, name = calibrate_job(
            cfg.trace_dir, out, script=cfg.script, script_args=cfg.script_args, devices=cfg.devices,
            ranks_per_device=options.calibrate_ranks_per_device,
            cluster=options.cluster, preload=cfg.preload, rank_setup=cfg.rank_setup)
    except (SliceError, AlignError, VirtualRankError, SliceRunError) as e:
        print(f"prism: calibration failed, the report predicts from the bare graph: {e}", file=sys.stderr)
        return None
    for line in format_iterations(rows, name):
        print(f"prism: {line}", file=sys.stderr)
    return path


def tp_mirrored(fold: dict | None, capture: str) -> int:
    """The TP size when a fold's live ranks have their tensor-parallel peers mirror them (class depth, where
    TP peers fold onto tp = 0; a serial capture, where every peer not captured with the rank is virtual),
    else 1 (no fold, TP 1, or TP peers live together at replica depth)."""
    if fold is None:
        return 1
    axes, sizes = fold.get("axes") or (), fold.get("sizes") or ()
    tp = int(sizes[list(axes).index("tp")]) if "tp" in axes else 1
    return tp if fold.get("depth") == "class" or capture == "serial" else 1
