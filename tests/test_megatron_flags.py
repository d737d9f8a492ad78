"""The --prism-* flags: parsed by `prism-megatron run` and by Megatron's own parser; seams fail loudly."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from prism_megatron.megatron.flags import PRISM_FLAGS
from prism_megatron.megatron.megatron_lm import find_megatron_lm
from prism_megatron.megatron.run import RunError, parse_run_args, run
from prism_megatron.patches import SeamMoved, seam

pytestmark = pytest.mark.megatron  # runs megatron-core: CI also runs it on the second stack (.ci/run)

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- run's command line
def test_prism_options_before_and_among_script_flags(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    req = parse_run_args(["--prism-emulate", "--prism-world-size", "8", str(script), "--lr", "1e-3",
                          "--prism-slots-per-device=2", "--num-layers", "4", "--prism-trace-dir", "t"])
    assert req.emulate and req.script == script
    assert req.options["prism_world_size"] == 8 and req.options["prism_slots_per_device"] == 2
    assert req.options["prism_trace_dir"] == "t"
    assert req.script_args == ["--lr", "1e-3", "--num-layers", "4"]
    flags = req.prism_argv()  # what the ranks' Megatron parser receives
    assert flags[:3] == ["--prism-emulate", "--prism-world-size", "8"] and "--prism-recipe" not in flags


def test_swap_flags_reach_the_launcher_and_bad_ones_are_named(tmp_path):
    """--prism-swap / --prism-device-memory / --prism-host-memory (issue 4's override) set the launch."""
    from prism_megatron.launcher.config import LaunchError
    from prism_megatron.megatron.run import launch_config

    script = tmp_path / "train.py"
    script.write_text("")
    base = ["--prism-emulate", "--prism-world-size", "2", str(script)]
    cfg = launch_config(parse_run_args([*base, "--prism-swap", "none", "--prism-device-memory", "40",
                                        "--prism-host-memory", "20"])).validate()
    assert (cfg.swap, cfg.device_memory, cfg.host_memory) == ("none", [40 * 2**30], 20 * 2**30)
    with pytest.raises(LaunchError, match="--swap checkpoint needs GPU --devices"):
        launch_config(parse_run_args([*base, "--prism-swap", "checkpoint"])).validate()
    with pytest.raises(LaunchError, match="--host-memory must be a positive number of GiB, got -1.0"):
        launch_config(parse_run_args([*base, "--prism-host-memory", "-1"])).validate()
    with pytest.raises(RunError, match="prism-swap"):
        parse_run_args([*base, "--prism-swap", "sometimes"])


def test_recipe_supplies_script_flags_env_and_world_size():
    from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT
    from prism_megatron.recipe import load_recipe, render_args

    req = parse_run_args(["--recipe", "mini-dense-tp2pp2", "--prism-driver", "core", "--train-iters", "5"])
    assert req.emulate and req.script == CORE_DRIVER_SCRIPT and req.options["prism_world_size"] == 4
    assert req.script_args == [*render_args(load_recipe("mini-dense-tp2pp2")), "--train-iters", "5"]
    assert req.env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PRISM_MEGATRON_DRIVER": "core"}
    assert req.driver_note.startswith("prism: driver core (core_gpt.py; --prism-driver core")


def test_auto_driver_follows_the_supported_table(monkeypatch):
    """auto never falls back silently: the note names the driver and why (the table's reason for the
    installed release); training fails when absent; a release outside the table gets the core driver."""
    from megatron.core import package_info

    from prism_megatron.megatron import run as run_mod
    from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT, DRIVER_SCRIPT
    from prism_megatron.megatron.megatron_lm import training_available
    from prism_megatron.megatron.versions import support_for

    installed = run_mod._megatron_core_version()
    assert installed is not None and installed.split(".")[:2] == [str(package_info.MAJOR), str(package_info.MINOR)]
    row = support_for(installed)
    assert row is not None, f"megatron-core {installed} is installed but not in the supported table"
    expected = "training" if row.auto_driver == "training" and training_available() else "core"
    req = parse_run_args(["--recipe", "mini-dense-tp2pp2"])
    assert req.env["PRISM_MEGATRON_DRIVER"] == expected
    assert req.script == {"training": DRIVER_SCRIPT, "core": CORE_DRIVER_SCRIPT}[expected]
    if expected == "training":
        assert row.why in req.driver_note and installed in req.driver_note
    monkeypatch.setenv("PRISM_MEGATRON_LM", "none")  # hides megatron.training, installed or a checkout
    req = parse_run_args(["--recipe", "mini-dense-tp2pp2"])
    assert req.script == CORE_DRIVER_SCRIPT and req.env["PRISM_MEGATRON_DRIVER"] == "core"
    assert "megatron.training is not importable" in req.driver_note
    with pytest.raises(RunError, match="--prism-driver training needs megatron.training"):
        parse_run_args(["--recipe", "mini-dense-tp2pp2", "--prism-driver", "training"])
    monkeypatch.delenv("PRISM_MEGATRON_LM")
    monkeypatch.setattr(run_mod, "_megatron_core_version", lambda: "0.21.0")
    req = parse_run_args(["--recipe", "mini-dense-tp2pp2"])
    assert req.script == CORE_DRIVER_SCRIPT and "megatron-core 0.21.0 is not a supported release" in req.driver_note



_CORE_REJECTS = [
    (["--bogus-flag", "1"], "unknown flag.*--bogus-flag"),
    (["--transformer-impl", "transformer_engine"], "transformer_engine is not supported"),
    (["--context-parallel-size", "2"], "context-parallel-size"),
]
# Loads the core driver (it imports megatron-core: seconds) once and parses each command line in turn, as
# the interpreter would end a run of it: exit status and what would reach stderr (an exit's message, a traceback).
_PARSE_EACH = """
import contextlib, importlib.util, io, json, sys, traceback
spec = importlib.util.spec_from_file_location("core_gpt", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
results = []
for argv in json.loads(sys.argv[2]):
    out, err, code = io.StringIO(), io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            a = m.parse_args(argv)
            print("OK", a.tensor_model_parallel_size, a.prism_world_size)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        err.write("" if isinstance(e.code, int) or e.code is None else str(e.code))
    except BaseException:
        code = 1
        err.write(traceback.format_exc())
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def core_driver_parses() -> dict[tuple[str, ...], dict]:
    """The core driver's parse_args on a recipe's flags, alone (key ()) and with each of _CORE_REJECTS' flags."""
    from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT
    from prism_megatron.recipe import load_recipe, render_args

    base = [*render_args(load_recipe("mini-dense-tp2pp2")), "--no-persist-layer-norm", "--prism-emulate",
            "--prism-world-size", "4"]
    extras = [[], *(argv for argv, _ in _CORE_REJECTS)]
    proc = subprocess.run([sys.executable, "-c", _PARSE_EACH, str(CORE_DRIVER_SCRIPT),
                           json.dumps([[*base, *extra] for extra in extras])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    return {tuple(extra): result for extra, result in zip(extras, results, strict=True)}


@pytest.mark.parametrize("argv, message", _CORE_REJECTS)
def test_core_driver_rejects_what_it_cannot_honour(argv, message, core_driver_parses):
    """The core driver's parser: recipe flags parse, unknown or unsupported ones are named."""
    ok = core_driver_parses[()]
    assert ok["code"] == 0 and "OK 2 4" in ok["stdout"], ok["stderr"][-3000:]
    rejected = core_driver_parses[tuple(argv)]
    assert rejected["code"] != 0 and re.search(message, rejected["stderr"]), rejected["stderr"][-3000:]


@pytest.mark.parametrize("argv, message", [
    (["--prism-emulate", "x.py"], "does not exist"),
    (["--prism-bogus", "1", "x.py"], "unknown prism option"),
    (["--recipe", "mini-dense-tp2pp2", "--prism-world-size", "8"], "differs from recipe"),
    (["--prism-slots-per-device", "two", "--recipe", "mini-dense-tp2pp2"], "slots-per-device: invalid int"),
    ([], "no script given"),
    # a target recipe under the core driver: what to do first, then what the driver refused
    (["--recipe", "llama3-70b-h100x64", "--prism-driver", "core"],
     r"recipe llama3-70b-h100x64 needs Megatron-LM's training driver: set MEGATRON_LM_PATH .* "
     r"--prism-driver training\. The core driver \(--prism-driver core\) refuses it: core driver: unknown flag\(s\) "
     r"--swiglu --no-rope-fusion --rotary-base 500000$"),
])
def test_bad_run_arguments_are_named(argv, message):
    with pytest.raises(RunError, match=message):
        parse_run_args(argv)


def test_checking_a_recipe_leaves_the_launcher_out_of_cpu_mode():
    """The launcher checks a recipe's flags with the core driver's parser. The driver itself switches its
    process to CPU mode where there is no GPU; the check must not, or every later CUDA request of the
    launcher (or of a test process) would silently land on the host."""
    code = textwrap.dedent("""
        from prism_megatron.megatron import cpu_mode
        from prism_megatron.megatron.run import RunError, parse_run_args
        parse_run_args(["--recipe", "mini-dense-tp2pp2", "--prism-driver", "core"])
        try:
            parse_run_args(["--recipe", "llama3-70b-h100x64", "--prism-driver", "core"])
        except RunError:
            print("refused")
        print("cpu mode", cpu_mode.cpu_mode_active())
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["refused", "cpu", "mode", "False"], done.stdout


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine installed")
def test_transformer_engine_jobs_without_the_package_are_refused_before_any_rank_starts(tmp_path):
    """mini-dense-cp2 needs TE attention; without the package the ranks died of a NameError deep in
    Megatron's layer specs. Now run refuses it first, naming the recipe or the flag."""
    with pytest.raises(RunError, match="recipe mini-dense-cp2 asks for --transformer-impl transformer_engine.*"
                                       "not installed"):
        parse_run_args(["--recipe", "mini-dense-cp2"])
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(RunError, match="the command asks for --transformer-impl transformer_engine"):
        parse_run_args(["--prism-emulate", "--prism-world-size", "2", str(script), "--transformer-impl=local",
                        "--transformer-impl", "transformer_engine"])
    parse_run_args(["--prism-emulate", "--prism-world-size", "2", str(script), "--transformer-impl", "local"])


def test_emulate_needs_a_world_size(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(RunError, match="--prism-world-size"):
        parse_run_args(["--prism-emulate", str(script)])


def test_without_emulate_the_script_runs_as_before(tmp_path, monkeypatch):
    """Nothing patched, prism flags removed, the script sees its own flags only."""
    out = tmp_path / "argv.json"
    script = tmp_path / "train.py"
    script.write_text(f"import json, sys\njson.dump(sys.argv[1:], open({str(out)!r}, 'w'))\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    code = run(parse_run_args(["--prism-devices", "cpu", str(script), "--lr", "1", "--prism-hang-timeout", "5"]))
    assert code == 0 and json.loads(out.read_text()) == ["--lr", "1"]


def test_cli_help_and_recipe_show():
    out = subprocess.run([sys.executable, "-m", "prism_megatron", "run", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and all(flag in out.stdout for flag in PRISM_FLAGS)
    out = subprocess.run([sys.executable, "-m", "prism_megatron", "recipe", "show", "mini-dense-tp2pp2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--tensor-model-parallel-size 2" in out.stdout
    out = subprocess.run([sys.executable, "-m", "prism_megatron", "run", "--recipe", "no-such-recipe"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no-such-recipe" in out.stderr


def test_a_run_whose_trace_dir_cannot_be_made_is_refused_before_it_plans(tmp_path):
    """The destination is checked before Megatron's parser runs for the micro-batch and fold plans (tens of
    seconds on a GPU machine): one clear error, no plan line printed."""
    (tmp_path / "file").write_text("")
    out = subprocess.run([sys.executable, "-m", "prism_megatron", "run", "--recipe", "mini-dense-tp2pp2",
                          "--prism-emulate", "--prism-fold-microbatches", "auto",
                          "--prism-trace-dir", str(tmp_path / "file" / "trace")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"{str(tmp_path / 'file')!r} is a file, not a directory" in out.stderr, out.stderr
    assert "micro-batches" not in out.stderr


_SAVE = textwrap.dedent("""
    import functools, json
    from prism_megatron.megatron.megatron_lm import ensure_megatron_training
    ensure_megatron_training()
    import megatron.training.training as training
    from prism_megatron.trace import markers
    seen, calls = [], []

    @functools.wraps(training.save_checkpoint_and_time)  # the seam checks the real one's parameters
    def saving(*args, **kwargs):
        calls.append(list(seen))

    training.save_checkpoint_and_time = saving
    from prism_megatron.patches import training_loop
    training_loop.install()

    class Sink:
        def record_mark(self, name, phase, attrs):
            seen.append([name, phase])

    markers.set_sink(Sink())
    training.save_checkpoint_and_time(5, None, None)
    print(json.dumps({"seen": seen, "calls": calls}))
""")


def test_a_checkpoint_save_is_a_span_the_iteration_time_leaves_out(tmp_path):
    """Megatron stops its iteration timer inside ``save_checkpoint_and_time``; the trace must say where a
    save ran (the replay leaves ``TIMER_PAUSES`` out of an iteration's time) on the installed release."""
    from prism_megatron.megatron.megatron_lm import training_available
    from prism_megatron.trace.markers import CHECKPOINT_SAVE, TIMER_PAUSES

    if not training_available():
        pytest.skip("megatron.training not importable (a Megatron-LM checkout or megatron-core 0.17+)")
    out = subprocess.run([sys.executable, "-c", _SAVE], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"seen": [[CHECKPOINT_SAVE, "B"], [CHECKPOINT_SAVE, "E"]], "calls": [[[CHECKPOINT_SAVE, "B"]]]}
    assert CHECKPOINT_SAVE in TIMER_PAUSES


def test_the_logged_line_says_what_emulating_that_iteration_took_not_megatrons_interval_mean():
    """megatron-core 0.19 logs iteration 1 without resetting its timer, so its iteration-2 figure is the mean of
    the first two (and with --log-interval N every figure is an interval's mean): beside the prediction the
    line gives the logged iteration's own emulation time, measured around its train_step."""
    from prism_megatron.patches import training_loop

    line = (" [2026-12-04 18:14:47.481303] iteration        2/       3 | consumed samples:         3072 | "
            "elapsed time per iteration (ms): 34327.4 | learning rate: 1.000000E-04 |")
    assert training_loop._with_prediction(line) == line  # nothing asked for iteration 2: Megatron's line as it is
    training_loop._PREDICTED[2] = ((1.25, "host and GPU time measured"), 17.2)
    shown = training_loop._with_prediction(line)
    assert "elapsed time per iteration (ms): 1250.0 (predicted, host and GPU time measured; emulation took " \
           "17200.0) | learning rate" in shown, shown
    assert 2 not in training_loop._PREDICTED  # used once
    training_loop._PREDICTED[2] = ((None, "no live prediction in this run"), 17.2)
    assert "(ms): 17200.0 (emulation wall time, not a prediction: no live prediction in this run) |" in \
           training_loop._with_prediction(line)


# ----------------------------------------------------------------------------- Megatron's parser
_PARSE = textwrap.dedent("""
    import json, sys
    from prism_megatron.megatron.megatron_lm import ensure_megatron_training
    ensure_megatron_training()
    import megatron.training.arguments as arguments
    from prism_megatron.recipe import load_recipe, render_args
    flags = render_args(load_recipe("mini-dense-tp2pp2")) + ["--distributed-backend", "gloo"]
    prism = ["--prism-emulate", "--prism-world-size", "4", "--prism-slots-per-device", "2",
             "--prism-trace-dir", "tr", "--prism-hang-timeout", "30", "--prism-devices", "0,1"]
    sys.argv = ["pretrain_gpt.py", *flags, *prism]
    result = {}
    try:
        arguments.parse_args()
        result["unpatched"] = "accepted"
    except SystemExit:
        result["unpatched"] = "rejected"
    from prism_megatron.patches import arguments as seam
    seam.install()
    def extra(parser):  # a script's own extra_args_provider still works next to ours
        parser.add_argument("--my-flag", type=int, default=7)
        return parser
    args = arguments.parse_args(extra_args_provider=extra)
    result["args"] = {k: v for k, v in vars(args).items() if k.startswith("prism_") or k == "my_flag"}
    sys.argv = ["pretrain_gpt.py", *flags]
    result["defaults"] = {k: v for k, v in vars(arguments.parse_args()).items() if k.startswith("prism_")}
    print("RESULT" + json.dumps(result))
""")


@pytest.mark.skipif(find_megatron_lm() is None, reason="no Megatron-LM checkout (set MEGATRON_LM_PATH)")
def test_flags_parse_through_megatrons_parser(tmp_path):
    """Megatron's strict parser rejects --prism-* until the seam adds them; then they land in args."""
    proc = subprocess.run([sys.executable, "-c", _PARSE], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, WORLD_SIZE="4", RANK="0"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert result["unpatched"] == "rejected"
    given = {"prism_emulate": True, "prism_world_size": 4, "prism_devices": "0,1", "prism_slots_per_device": 2,
             "prism_trace_dir": "tr", "prism_hang_timeout": 30.0}
    # every other --prism-* flag at its default: the expected args follow the one option table
    defaults = {flag[2:].replace("-", "_"): kw.get("default", False) for flag, kw in PRISM_FLAGS.items()}
    assert result["args"] == {**defaults, **given, "my_flag": 7}
    assert result["defaults"]["prism_emulate"] is False


# ----------------------------------------------------------------------------- seams
def test_a_moved_seam_fails_loudly():
    module = types.ModuleType("megatron_fake")

    def forward_step(forward_step_func, data_iterator, model):
        return None

    module.forward_step = forward_step
    assert seam(module, "forward_step", ("0.16.1",), ("model",)) is forward_step
    with pytest.raises(SeamMoved, match=r"megatron_fake\.backward_step is gone .*checked against 0\.16\.1"):
        seam(module, "backward_step", ("0.16.1",))
    with pytest.raises(SeamMoved, match="lost parameter.*vp_stage"):
        seam(module, "forward_step", ("0.16.1",), ("model", "vp_stage"))


def test_every_patch_module_states_its_versions():
    import importlib
    import pkgutil

    import prism_megatron.patches as patches

    names = [m.name for m in pkgutil.iter_modules(patches.__path__)]
    assert {"arguments", "schedules", "training_loop"} <= set(names)
    for name in names:
        module = importlib.import_module(f"prism_megatron.patches.{name}")
        assert module.CHECKED and all(v.count(".") == 2 for v in module.CHECKED), name
        assert "checked against" in " ".join(module.__doc__.lower().split()), name
        assert callable(module.install), name


def test_recipe_target_sets_the_default_verdict_and_flags_override_it(tmp_path):
    """The main recipe names a target GPU and cluster: `run --recipe` caps memory at that GPU and costs
    communication with that profile unless a flag says otherwise; a name that does not resolve is
    refused before anything starts, naming the recipe's file and field."""
    from prism_megatron.megatron.run import launch_config
    from prism_megatron.recipe import load_recipe

    recipe = load_recipe("mini-dense-tp2pp2dp2")
    assert (recipe.target.gpu, recipe.target.cluster) == ("h100-80gb", "h100-nvlink-ib400")
    req = parse_run_args(["--recipe", "mini-dense-tp2pp2dp2", "--prism-driver", "core"])
    assert req.job_options().target_gpu == "h100-80gb" and req.run_options().cluster == "h100-nvlink-ib400"
    assert any("target.gpu" in n for n in req.notes) and any("target.cluster" in n for n in req.notes)
    cfg = launch_config(req)
    assert cfg.target_gpu["name"] == "h100-80gb" and cfg.tracks_memory
    assert cfg.predictor_options == {"cluster": "h100-nvlink-ib400"}
    req = parse_run_args(["--recipe", "mini-dense-tp2pp2dp2", "--prism-driver", "core",
                          "--prism-target-gpu", "a100-80gb", "--prism-cluster", "h200-nvlink-ib400"])
    assert (req.job_options().target_gpu, req.run_options().cluster) == ("a100-80gb", "h200-nvlink-ib400")
    assert req.notes == []
    text = (REPO / "prism_megatron" / "recipes" / "mini" / "dense-tp2pp2dp2.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(text.replace("gpu: h100-80gb", "gpu: h999-1gb"))
    with pytest.raises(RunError, match=r"bad.yaml: target.gpu: .*'h999-1gb' is neither a known GPU"):
        parse_run_args(["--recipe", str(bad), "--prism-driver", "core"])
    bad.write_text(text.replace("cluster: h100-nvlink-ib400", "cluster: nowhere-cluster"))
    with pytest.raises(RunError, match=r"bad.yaml: target.cluster: .*nowhere-cluster"):
        parse_run_args(["--recipe", str(bad), "--prism-driver", "core"])
