"""One definition per option: `launch`'s click options and `run`'s --prism-* flags are generated from
prism_megatron.options and agree on every option's name, default, choices, type and help."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from prism_megatron.cli import launch as launch_cmd
from prism_megatron.launcher.config import LaunchConfig, LaunchError
from prism_megatron.megatron.flags import PRISM_FLAGS, prism_parser
from prism_megatron.megatron.run import RunError, launch_config, parse_run_args
from prism_megatron.options import JobOptions, LaunchOnlyOptions, RunOnlyOptions, options_of

CLICK = {p.name: p for p in launch_cmd.params if isinstance(p, click.Option)}
ARGPARSE = {a.option_strings[0]: a for a in prism_parser()._actions if a.option_strings}


def _click_choices(param: click.Option) -> tuple[str, ...] | None:
    return tuple(param.type.choices) if isinstance(param.type, click.Choice) else None


@pytest.mark.parametrize("opt", options_of(JobOptions), ids=lambda o: o.name)
def test_both_front_ends_agree_on_a_shared_option(opt):
    c, a = CLICK[opt.name], ARGPARSE[opt.prism_flag]
    assert c.opts[0] == opt.flag and a.option_strings == [opt.prism_flag]
    assert c.default == a.default == opt.default
    assert _click_choices(c) == (tuple(a.choices) if a.choices else None) == opt.choices
    assert c.help == a.help.replace("%%", "%") == opt.help and opt.help
    if opt.choices is None and not opt.is_switch:
        assert c.type.name == {int: "integer", float: "float", str: "text"}[opt.type] and a.type is opt.type


def test_each_front_end_has_exactly_the_defined_options():
    job = {o.name for o in options_of(JobOptions)}
    assert set(CLICK) == job | {o.name for o in options_of(LaunchOnlyOptions)}
    defined = {o.prism_flag for o in (*options_of(JobOptions), *options_of(RunOnlyOptions))}
    assert set(PRISM_FLAGS) == defined == set(ARGPARSE)
    for o in options_of(RunOnlyOptions):  # run's own flags carry the definition's help and default too
        assert ARGPARSE[o.prism_flag].help.replace("%%", "%") == o.help
        assert ARGPARSE[o.prism_flag].default == o.default


def test_launch_config_defaults_are_the_options_defaults(tmp_path):
    """Code that builds a LaunchConfig directly gets what a command line without the option gets."""
    script = tmp_path / "s.py"
    script.write_text("")
    direct = LaunchConfig(script, world_size=4).validate()
    via = launch_config(parse_run_args(["--prism-emulate", "--prism-world-size", "4", str(script)])).validate()
    for name in ("slots_per_device", "hang_timeout", "trace_dir", "gpus_per_node", "threads_per_rank", "swap",
                 "staging", "device_memory", "host_memory", "track_memory", "gpu_timing", "target_gpu", "listen"):
        assert getattr(direct, name) == getattr(via, name), name
    assert direct.echoed_ranks == via.log_ranks == [3]  # 'last'


def test_bad_choices_are_refused_naming_every_accepted_value(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    swaps = dict((o.name, o) for o in options_of(JobOptions))["swap"].choices
    assert len(swaps) == 7
    listed = ", ".join(swaps[:-1]) + f" or {swaps[-1]}"
    with pytest.raises(LaunchError, match=f"--swap must be {listed}, got 'sometimes'"):
        LaunchConfig(script, swap="sometimes").validate()
    with pytest.raises(RunError, match="invalid choice: 'sometimes'.*'budget-inprocess'"):
        parse_run_args(["--prism-emulate", "--prism-world-size", "2", str(script), "--prism-swap", "sometimes"])
    result = CliRunner().invoke(launch_cmd, ["-w", "2", "--swap", "sometimes", str(script)])
    assert result.exit_code == 2 and "budget-inprocess" in result.output


def test_an_option_without_help_is_refused():
    @dataclasses.dataclass
    class Undocumented:
        x: int = 1

    with pytest.raises(TypeError, match="Undocumented.x has no docstring"):
        options_of(Undocumented)


def test_typed_configs_reach_the_launcher_and_the_coordinator(tmp_path):
    from prism_megatron.launcher.launch import coordinator_config
    from prism_megatron.runtime.config import CoordinatorConfig

    script = tmp_path / "s.py"
    script.write_text("")
    job = JobOptions(world_size=4, hang_timeout=7.0, log_ranks="0,last", track_memory="on", gpu_timing="off",
                     target_gpu="h100", trace_dir=str(tmp_path / "t"))
    cfg = LaunchConfig.from_options(job, script, ["--x"]).validate()
    assert (cfg.hang_timeout, cfg.log_ranks, cfg.track_memory, cfg.gpu_timing) == (7.0, [0, 3], True, False)
    assert cfg.target_gpu["name"] == "h100-80gb" and cfg.trace_dir == Path(tmp_path / "t")
    conf = coordinator_config(cfg)
    assert CoordinatorConfig.from_json(conf.to_json()) == conf and conf.device_of == {0: 0, 1: 0, 2: 0, 3: 0}
    with pytest.raises(LaunchError, match="--world-size is required"):
        LaunchConfig.from_options(JobOptions(), script, [])
