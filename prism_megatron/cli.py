"""The `prism-megatron` command. It only parses, validates and calls; nothing imports it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from prism_megatron.launcher import fork_safe_cuda_checks
from prism_megatron.launcher.config import LaunchConfig, LaunchError, parse_devices
from prism_megatron.options import JobOptions, LaunchOnlyOptions, Option, RunOnlyOptions, option, options_of


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="prism-megatron")
def main() -> None:
    """Emulate a large Megatron-Core (or any torch.distributed) job's ranks on a few devices."""
    fork_safe_cuda_checks()


_SHORT = {"world_size": ["-w"]}  # short aliases (launch only)
_LAUNCH_REQUIRED = ("world_size",)  # run takes it from a recipe; launch has none


def _click_option(o: Option) -> Callable:
    """A click option generated from one field of prism_megatron.options (run's flags come from it too)."""
    kwargs: dict[str, Any] = {"help": o.help, "required": o.name in _LAUNCH_REQUIRED}
    if o.is_switch:
        kwargs.update(is_flag=True, default=o.default)
    elif o.repeatable:
        kwargs.update(type=o.type, multiple=True, default=o.default)
    else:
        kwargs.update(type=click.Choice(o.choices) if o.choices else o.type, default=o.default,
                      show_default=o.default is not None)
    return click.option(o.flag, *_SHORT.get(o.name, []), o.name, **kwargs)


def _launch_options(f: Callable) -> Callable:
    for o in reversed(options_of(JobOptions) + options_of(LaunchOnlyOptions)):
        f = _click_option(o)(f)
    return f


@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@_launch_options
@click.argument("script", type=click.Path(path_type=Path))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch(script: Path, script_args: tuple[str, ...], **options: Any) -> None:
    """Run SCRIPT as WORLD_SIZE logical ranks through the prism backend and write a PrismTrace.

    Example: prism-megatron launch --world-size 64 --devices cpu --slots-per-device 2 -- train.py --lr 1e-3
    """
    from prism_megatron.launcher.launch import launch as run

    job = JobOptions(**{o.name: options[o.name] for o in options_of(JobOptions)})
    only = LaunchOnlyOptions(**{o.name: options[o.name] for o in options_of(LaunchOnlyOptions)})
    try:
        cfg = LaunchConfig.from_options(job, script, list(script_args), preload=list(only.preload)).validate()
        code = run(cfg)  # checks the destination and the host before anything starts (LaunchError)
    except LaunchError as e:
        raise click.UsageError(str(e)) from None
    sys.exit(code)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                               "help_option_names": []}, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(args: tuple[str, ...]) -> None:
    """Run a Megatron pretrain script; with --prism-emulate (or --recipe), emulated through prism.

    prism-megatron run [PRISM OPTIONS] [SCRIPT.py] [MEGATRON ARGS]; see `prism-megatron run --help`.
    """
    from prism_megatron.launcher.config import LaunchError
    from prism_megatron.megatron.flags import prism_parser
    from prism_megatron.megatron.run import USAGE, RunError, parse_run_args
    from prism_megatron.megatron.run import run as run_request
    from prism_megatron.recipe import RecipeError

    if not args or args[0] in ("-h", "--help"):
        click.echo(USAGE + prism_parser().format_help().split("prism-megatron emulation", 1)[-1])
        return
    try:
        request = parse_run_args(list(args))
        code = run_request(request)
    except (RunError, LaunchError, RecipeError) as e:
        raise click.UsageError(str(e)) from None
    sys.exit(code)


@main.command("plan", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                        "help_option_names": []}, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def plan_cmd(args: tuple[str, ...]) -> None:
    """Fold a job: rank classes, sandbox, virtual ranks, memory needed here, rough time (--json for programs).

    prism-megatron plan [--json] [--devices D] [PRISM OPTIONS] [SCRIPT.py] [MEGATRON ARGS], as `run` takes them.
    """
    import json

    from rich.console import Console

    from prism_megatron.megatron.fold import FoldError
    from prism_megatron.megatron.megatron_args import ArgsError
    from prism_megatron.megatron.microbatch_mode import MicrobatchModeError, choose_microbatches
    from prism_megatron.megatron.plan import make_plan, plan_fits, plan_json, render_plan, start_planning
    from prism_megatron.megatron.run import RunError, parse_run_args
    from prism_megatron.memory.targets import TargetError, resolve_target
    from prism_megatron.recipe import RecipeError

    tokens, as_json = [], False
    for token in args:  # plan's own --json; --devices as run's --prism-devices
        if token == "--json":
            as_json = True
        else:
            tokens.append("--prism-devices" if token == "--devices" else token)
    if not tokens or tokens[0] in ("-h", "--help"):
        click.echo(plan_cmd.__doc__)
        return
    try:
        request = parse_run_args(tokens)
        o = request.options
        if o.get("prism_world_size") is None:
            raise RunError("plan needs --prism-world-size W (the target job's number of ranks) or --recipe")
        said: list[str] = []  # micro-batch folding: the plan is of the command the ranks will run
        start_planning(request.script, request.script_args, int(o["prism_world_size"]), request.env,
                       gpus=parse_devices(o["prism_devices"]) != ["cpu"] and o["prism_device_memory"] is None)
        script_args, microbatches = choose_microbatches(
            o["prism_fold_microbatches"], request.script, request.script_args, int(o["prism_world_size"]),
            o["prism_gpus_per_node"], env=request.env, say=said.append)
        plan = make_plan(request.script, script_args, int(o["prism_world_size"]),
                         parse_devices(o["prism_devices"]), o["prism_gpus_per_node"], o["prism_device_memory"],
                         o["prism_host_memory"], o["prism_swap"], env=request.env,
                         source=o.get("prism_recipe") or str(request.script), fold_depth=o["prism_fold_depth"],
                         capture=o["prism_fold_capture"], second_pass=o["prism_fold_second_pass"],
                         microbatches=microbatches,
                         target=(resolve_target(o["prism_target_gpu"], o.get("prism_target_context"))
                                 if o.get("prism_target_gpu") is not None else None))
    except (RunError, RecipeError, LaunchError, MicrobatchModeError, TargetError) as e:
        raise click.UsageError(str(e)) from None
    except (FoldError, ArgsError) as e:
        raise click.ClickException(str(e)) from None
    said = [*request.notes, *said]  # the recipe's choices first: the plan is of the options they set
    if as_json:
        click.echo(json.dumps(plan_json(plan, microbatches, said), indent=1))
    else:
        for line in said:
            click.echo(line)
        render_plan(plan, Console(width=120, soft_wrap=True))
    if plan_fits(plan) is False:
        if plan.capture.get("refused"):
            raise click.ClickException(f"serial capture refused: {plan.capture['why']}")
        why = plan.capture["why"] if plan.capture["mode"] == "serial" else plan.memory["why"]
        raise click.ClickException(f"the sandbox does not fit here: {why}")


@main.group()
def recipe() -> None:
    """Mini and target recipes: validated YAML descriptions of a Megatron job."""


@recipe.command("show")
@click.argument("name")
def recipe_show(name: str) -> None:
    """Print a recipe's summary and the Megatron flags it renders to."""
    from prism_megatron.recipe import RecipeError, show

    try:
        click.echo(show(name), nl=False)
    except RecipeError as e:
        raise click.ClickException(str(e)) from None


@recipe.command("list")
def recipe_list() -> None:
    """Names of the shipped recipes."""
    from prism_megatron.recipe import recipe_names

    click.echo("\n".join(recipe_names()))


@main.group()
def trace() -> None:
    """Inspect and export PrismTrace directories."""


@trace.command("show")
@click.argument("trace_dir", type=click.Path(path_type=Path))
def trace_show(trace_dir: Path) -> None:
    """Summarise a trace: ranks, groups, ops per kind, compute time per rank."""
    from prism_megatron.trace import TraceFormatError
    from prism_megatron.trace.summary import summarize

    try:
        click.echo(summarize(trace_dir))
    except TraceFormatError as e:
        raise click.ClickException(str(e)) from None


@trace.command("chrome")
@click.argument("trace_dir", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
def trace_chrome(trace_dir: Path, out: Path) -> None:
    """Export a trace to Chrome trace-event JSON (open it in Perfetto)."""
    from prism_megatron.trace import TraceFormatError, read_trace
    from prism_megatron.trace.chrome import write_chrome

    try:
        write_chrome(read_trace(trace_dir), out)
    except TraceFormatError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(_cannot_write(out, e)) from None
    click.echo(f"wrote {out}")


def _cannot_write(path: Path, e: OSError) -> str:
    return f"cannot write {str(path)!r}: {e.strerror or e}" + (f" ({e.filename})" if e.filename else "")


@main.command("replay")
@click.argument("trace_dir", type=click.Path(path_type=Path))
@click.option("--cluster", default=None, help="Cluster profile (name or YAML) that costs communication, or "
              "'none' for communication free; default: the profile the run recorded in the trace (none recorded: "
              "free).")
@click.option("--chrome", "chrome_out", type=click.Path(path_type=Path), default=None,
              help="Write the predicted timeline as Chrome trace-event JSON.")
@click.option("--full", is_flag=True, help="Folded trace: synthesise and replay every rank (default: the fastest "
              "exact way: the live ranks symmetrically, or one synthesised pipeline when stages are folded).")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=None,
              help="Target placement for communication costs (default: the fold's, else the cluster profile's).")
def replay_cmd(trace_dir: Path, cluster: str | None, chrome_out: Path | None, full: bool,
               gpus_per_node: int | None) -> None:
    """Replay a trace's graph: predicted iteration times, per-rank breakdown, critical path.

    The bare graph's compute times are each rank's own compute as captured, with ranks multiplexed
    (uncalibrated): the prediction says so.
    """
    from prism_megatron.replay.engine import GraphError, replay
    from prism_megatron.replay.graph import graph_from_trace
    from prism_megatron.report.build import cost_model, provenance
    from prism_megatron.report.costing import choose_costing
    from prism_megatron.trace import TraceFormatError, read_trace

    try:
        trace = read_trace(trace_dir)
        costing = choose_costing(cluster, trace)
        graph = graph_from_trace(trace)
        fold = graph.fold
        result = replay(graph, cost_model(costing.cluster, fold, gpus_per_node),
                        fold_method="full" if full else "auto")
    except (TraceFormatError, GraphError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(result.summary(None if fold is None else {r: fold.class_name(r) for r in result.graph.ranks}))
    said = provenance(costing.cluster, fold=fold, gpus_per_node=gpus_per_node, method=result.method,
                      microbatches=trace.microbatches, recorded=costing.recorded)
    click.echo(f"  provenance: {said}")
    if chrome_out is not None:
        from prism_megatron.replay.export import write_chrome

        try:
            write_chrome(result, chrome_out, {"trace": str(trace_dir), "cluster": costing.cluster})
        except OSError as e:
            raise click.ClickException(_cannot_write(chrome_out, e)) from None
        click.echo(f"wrote {chrome_out}")


@main.command("calibrate", context_settings={"ignore_unknown_options": True})
@click.argument("bare_trace", type=click.Path(path_type=Path))
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Directory for the slices' traces and the calibrated graph (OUT/calibrated).")
@click.option("--devices", default="cpu", show_default=True, help="'cpu' or CUDA device indices, e.g. 0 or 0,1.")
@click.option("--ranks-per-device", type=int, default=1, show_default=True,
              help="Slice ranks that compute at once on each device (a slice holds devices x this).")
@click.option("--cluster", default=None, help="Cluster profile (name or YAML) that costs the ops no slice "
              "measured whole, and those spanning target nodes; default: those ops are free.")
@click.argument("script", type=click.Path(path_type=Path))
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def calibrate_cmd(bare_trace: Path, out_dir: Path, devices: str, ranks_per_device: int, cluster: str | None,
                  script: Path, script_args: tuple[str, ...]) -> None:
    """Calibrate BARE_TRACE: run each slice of SCRIPT for real (the other ranks replayed), align the slices.

    Example: prism-megatron calibrate prism-trace --out calib --ranks-per-device 2 -- train.py --lr 1e-3
    """
    from prism_megatron.calibration import AlignError, SliceError
    from prism_megatron.calibration.slice_run import SliceRunError, calibrate_job, format_iterations
    from prism_megatron.calibration.virtual_rank import VirtualRankError
    from prism_megatron.replay.engine import GraphError
    from prism_megatron.trace import TraceFormatError

    try:
        path, rows, name = calibrate_job(bare_trace, out_dir, script=script, script_args=script_args,
                                         devices=parse_devices(devices), ranks_per_device=ranks_per_device,
                                         cluster=cluster)
    except LaunchError as e:
        raise click.UsageError(str(e)) from None
    except (TraceFormatError, GraphError, SliceError, AlignError, VirtualRankError, SliceRunError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(_cannot_write(out_dir, e)) from None
    click.echo(f"calibrated graph: {path}")
    for line in format_iterations(rows, name):
        click.echo(line)


@main.command("report")
@click.argument("trace_dir", type=click.Path(path_type=Path))
@click.option("--cluster", default=None, help="Cluster profile (name or YAML) that costs communication, or "
              "'none' for communication free; default: the profile the run recorded in the trace (none recorded: "
              "free).")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Directory for report.json, report.html and timeline.json (default: TRACE_DIR).")
@click.option("--timeline", type=click.Choice(option(RunOnlyOptions, "timeline").choices),
              default=option(RunOnlyOptions, "timeline").default, show_default=True,
              help=option(RunOnlyOptions, "timeline").help)
def report_cmd(trace_dir: Path, cluster: str | None, out_dir: Path | None, timeline: str) -> None:
    """Report on a trace: OOM or fit per rank class, predicted iteration time, timeline (HTML + JSON)."""
    from prism_megatron.report import ReportFormatError, make_report, print_summary, read_report
    from prism_megatron.trace import TraceFormatError

    try:
        paths = make_report(trace_dir, out_dir, cluster, timeline=timeline,
                            say=lambda m: click.echo(f"report: {m}", err=True))
        report = read_report(paths["report"])
    except (TraceFormatError, ReportFormatError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    print_summary(report)
    for kind, path in paths.items():
        click.echo(f"wrote {path}" + ("  (open in a browser)" if kind == "html" else ""))


@main.command("compare")
@click.argument("reports", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--cluster", default=None, help="Cluster profile for entries that are traces, or 'none' for "
              "communication free; default: each trace's recorded profile (reports keep the profile they were made "
              "with).")
@click.option("--label", "labels", multiple=True, help="Name of each entry, in order (default: its recipe's "
              "name, else its directory name).")
@click.option("--recipe", "recipes", multiple=True, help="The recipe each entry ran, in order: its substitutions "
              "(what the emulation machine ran instead) are shown beside the entry's figures.")
@click.option("--wandb-group", default=None, help="Log one W&B run per layout into this group (offline unless "
              "W&B is configured; WANDB_MODE=online/offline/disabled decides).")
@click.option("--wandb-dir", type=click.Path(path_type=Path), default=Path("."), show_default=True,
              help="Where W&B writes the runs (DIR/wandb).")
@click.option("--wandb-project", default=None, help="W&B project (default: prism-megatron).")
def compare_cmd(reports: tuple[Path, ...], cluster: str | None, labels: tuple[str, ...], recipes: tuple[str, ...],
                wandb_group: str | None, wandb_dir: Path, wandb_project: str | None) -> None:
    """Layouts of one model side by side, fastest first: REPORTS are report.json files or trace directories.

    Example: prism-megatron compare runs/tp2pp8 runs/tp1pp8 --cluster h100-nvlink-ib400 --wandb-group qwen3-235b
    """
    from prism_megatron.recipe import RecipeError
    from prism_megatron.report import ReportFormatError
    from prism_megatron.report.compare import compare, comparison_text, log_comparison
    from prism_megatron.trace import TraceFormatError

    try:
        rows = compare(list(reports), cluster, list(labels) or None, list(recipes) or None)
    except (TraceFormatError, ReportFormatError, RecipeError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(comparison_text(rows))
    if wandb_group:
        for run in log_comparison(rows, wandb_group, run_dir=wandb_dir, project=wandb_project):
            click.echo(run.describe())


@main.group()
def cluster() -> None:
    """Cluster profiles: the links of the target cluster that costs communication."""


@cluster.command("fit")
@click.argument("log", type=click.Path(path_type=Path))
def cluster_fit(log: Path) -> None:
    """Fit latency and bandwidth from nccl-tests output (all_reduce_perf etc.)."""
    from prism_megatron.calibration.nccl_tests import fit_main

    if not log.is_file():
        raise click.ClickException(f"nccl-tests log {str(log)!r} does not exist")
    try:
        click.echo(fit_main(log))
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@cluster.command("list")
def cluster_list() -> None:
    """Shipped cluster profiles."""
    from prism_megatron.calibration.profiles import profile_names

    for name in profile_names():
        click.echo(name)


if __name__ == "__main__":
    main()
