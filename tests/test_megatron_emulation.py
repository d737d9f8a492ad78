"""Megatron under prism, end to end on CPU: the numerics contract and the scheduling units.

Each case runs a mini recipe twice with a GPT driver: as W emulated ranks through
``python -m prism_megatron run --recipe NAME --prism-driver D --prism-fold off`` (one slot; the
capture test_fold_megatron compares its folded runs with, run once: ``megatron_runs``) and as W real
gloo processes under torchrun. Both write every rank's per-iteration loss and grad norm
(``PRISM_MEGATRON_METRICS``). Driver ``core`` (megatron.core only) always runs; ``training``
(Megatron-LM's ``pretrain``) where megatron.training is importable (a checkout; hide it with
``PRISM_MEGATRON_LM=none``).

Equality: the loss and grad norm of every rank and iteration must agree to a few float32 ulps
(relative 2e-6), and PP2·VPP2 - where every reduction has at most two members - bit for bit.
Why not bit for bit everywhere: the coordinator sums a reduction in member order, gloo's ring
all-reduce sums x_k + (x_k+1 + (... )) with k the owner of the element's segment; with three or
more members (grad-norm over TP·PP, DP4 grads) the last bit can differ.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from megatron_runs import read_metrics

from conftest import on_a_free_port
from prism_megatron.megatron import cpu_mode
from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT, DRIVER_SCRIPT
from prism_megatron.megatron.megatron_lm import find_megatron_lm, training_available

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = {"core": CORE_DRIVER_SCRIPT, "training": DRIVER_SCRIPT}
_NO_TRAINING = pytest.mark.skipif(not training_available(), reason="Megatron-LM's megatron.training not found "
                                  "(set MEGATRON_LM_PATH to a core_v0.16.1 checkout)")
DRIVERS = [pytest.param("core", id="core"), pytest.param("training", id="training", marks=_NO_TRAINING)]
# The checks of a capture run on one driver per stack: the trainer where megatron.training is importable, the
# core driver otherwise. Both drive the same megatron.core model, schedules, DDP and optimizer through prism's
# seams (the core driver's are a subset of the trainer's: emulate.install_patches); what only the core driver
# does (its parser, its loop, its log line) is megatron-core-independent code, checked where it runs.
HERE = "training" if training_available() else "core"
DRIVER_HERE = [driver for driver in DRIVERS if driver.id == HERE]

pytestmark = [
    pytest.mark.megatron,  # runs megatron-core: CI also runs it on the second stack (.ci/run)
    pytest.mark.skipif(cpu_mode._gpu_present(), reason="these CPU runs need CPU mode, which refuses a GPU"),
]

# case -> (recipe, extra Megatron flags, bit-exact expected)
CASES: dict[str, tuple[str, list[str], bool]] = {
    "tp2pp2": ("mini-dense-tp2pp2", [], False),
    "tp2dp2-distopt": ("mini-dense-tp2dp2-distopt", [], False),
    "pp2vpp2": ("mini-dense-pp2vpp2", [], True),
    "moe-ep2": ("mini-moe-ep2", [], False),  # the recipe itself turns the fused bias-GeLU off (MoE refuses it)
    "tp2pp2dp2": ("mini-dense-tp2pp2dp2", [], False),  # W = 8
}


class _Runs:
    """The prism capture of each case (shared with the files that read the same one: ``megatron_runs``)
    and its real gloo run (once per module), with outputs and wall times."""

    def __init__(self, captures, root: Path) -> None:
        self.captures = captures
        self.root = root
        self.done: dict[tuple[str, str], dict] = {}

    def prism(self, case: str, driver: str = "core") -> dict:
        recipe, extra, _ = CASES[case]
        return self.captures.run(recipe, "off", *extra, driver=driver)

    def gloo(self, case: str, driver: str = "core") -> dict:
        key = (driver, case)
        if key not in self.done:
            from prism_megatron.recipe import load_recipe, render_args, render_env

            recipe_name, extra, _ = CASES[case]
            recipe = load_recipe(recipe_name)
            out = self.root / f"gloo-{driver}-{case}"
            out.mkdir()
            env = dict(os.environ, PRISM_MEGATRON_METRICS=str(out / "metrics.jsonl"), PYTHONUNBUFFERED="1",
                       OMP_NUM_THREADS="1") | render_env(recipe)
            t0 = time.perf_counter()
            proc = on_a_free_port(lambda port: subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={recipe.world_size}",
                 f"--master-port={port}", str(SCRIPTS[driver]), *render_args(recipe), *extra],
                cwd=out, capture_output=True, text=True, timeout=300, env=env))
            wall = time.perf_counter() - t0
            assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
            self.done[key] = {"metrics": read_metrics(out / "metrics.jsonl"), "wall": wall}
        return self.done[key]


@pytest.fixture(scope="module")
def runs(megatron_runs, tmp_path_factory) -> _Runs:
    return _Runs(megatron_runs, tmp_path_factory.mktemp("gloo-runs"))


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=2e-6, abs_tol=0.0)


# Each case once per stack, on the driver HERE, but W = 8 on the core driver (Megatron-LM's trainer there would
# take the file past ~4 min on 2 cores); a driver's own loop runs alike on both sides of the comparison.
_ONE_DRIVER = {case: "core" if case == "tp2pp2dp2" else HERE for case in CASES}
# The second stack (.ci/run) compares TP2·PP2·DP2 (core driver) and MoE EP2 (its trainer) with gloo and leaves the
# other cases' comparisons to the first (``heavy``, pytest.ini); it still captures TP2·PP2 and TP2·DP2 with the
# distributed optimizer there, for the scheduling units, the op labels and the trainer's data loaders below.
_HEAVY_THERE = {"tp2pp2", "tp2dp2-distopt", "pp2vpp2"}
NUMERICS = [pytest.param(case, driver.values[0], id=f"{case}-{driver.id}",
                         marks=[*driver.marks, *([pytest.mark.heavy] if case in _HEAVY_THERE else [])])
            for case in CASES for driver in DRIVERS if driver.id == _ONE_DRIVER[case]]


@pytest.mark.parametrize("case, driver", NUMERICS)
def test_numerics_match_real_gloo_processes(case, driver, runs):
    """Per-iteration loss and grad norm of every rank: prism (1 slot) == W real gloo processes."""
    _, _, exact = CASES[case]
    emulated, real = runs.prism(case, driver), runs.gloo(case, driver)
    got, want = emulated["metrics"], real["metrics"]
    world = int(max(rank for rank, _ in want)) + 1
    assert sorted(got) == sorted(want) and len(want) == world * 3, "every rank reports every iteration"
    identical = 0
    for key in sorted(want):
        (loss_a, norm_a), (loss_b, norm_b) = got[key], want[key]
        assert loss_a.keys() == loss_b.keys(), key
        for name in loss_b:
            assert _close(loss_a[name], loss_b[name]), (case, key, name, loss_a[name], loss_b[name])
        assert _close(norm_a, norm_b), (case, key, "grad norm", norm_a, norm_b)
        identical += (loss_a, norm_a) == (loss_b, norm_b)
    if exact:
        assert identical == len(want), f"{case}: expected bit-identical results, {identical}/{len(want)}"
    last = max(k for k in want if want[k][0])
    assert math.isfinite(want[last][0]["lm loss"])
    assert f"prism: driver {driver} " in emulated["output"], "run names its driver"
    print(f"{driver} {case}: prism {emulated['wall']:.1f} s, gloo {real['wall']:.1f} s, "
          f"{identical}/{len(want)} (rank, iteration) results bit-identical")


# ----------------------------------------------------------------------------- scheduling units
def _units(trace_dir: Path) -> dict[int, list[tuple[str, int, int, int]]]:
    """rank -> [(F|B|I, iteration, microbatch, chunk)] in recorded order (span begins)."""
    from prism_megatron.trace import read_trace

    out: dict[int, list] = {}
    for m in read_trace(trace_dir).marks.to_pylist():
        if m["phase"] != "B" or m["name"] not in ("forward", "backward", "iteration"):
            continue
        a = json.loads(m["attrs"])
        out.setdefault(m["rank"], []).append(
            (m["name"][0].upper(), a["iteration"], a.get("microbatch", -1), a.get("chunk", -1)))
    return out


def _expected_1f1b(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Megatron's non-interleaved 1F1B on one stage: warm-up forwards, steady F/B pairs, cool-down."""
    warmup = min(stages - stage - 1, microbatches)
    seq = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        seq += [("F", warmup + i), ("B", i)]
    return seq + [("B", i) for i in range(microbatches - warmup, microbatches)]


def _expected_interleaved(stage: int, stages: int, chunks: int, microbatches: int) -> list[tuple[str, int, int]]:
    """Megatron's interleaved 1F1B (microbatch groups of `stages` per virtual stage)."""
    table = [(group * stages + j, chunk) for group in range(microbatches // stages)
             for chunk in range(chunks) for j in range(stages)]
    total = len(table)
    warmup = min((stages - stage - 1) * 2 + (chunks - 1) * stages, total)
    fwd = [("F", mb, chunk) for mb, chunk in table]
    bwd = [("B", mb, chunks - 1 - chunk) for mb, chunk in table]
    seq = fwd[:warmup]
    for i in range(total - warmup):
        seq += [fwd[warmup + i], bwd[i]]
    return seq + bwd[total - warmup:]


@pytest.mark.parametrize("driver", DRIVER_HERE)
@pytest.mark.parametrize("case", ["tp2pp2", pytest.param("pp2vpp2", marks=pytest.mark.heavy)])
def test_scheduling_units_match_the_schedule(case, driver, runs):
    """Per rank and iteration: forward and backward units = microbatches x chunks, in 1F1B order."""
    from prism_megatron.recipe import load_recipe

    recipe = load_recipe(CASES[case][0])
    p = recipe.parallel
    stages, chunks = p.pp, (p.vpp or 1)
    microbatches = recipe.num_microbatches
    units = _units(runs.prism(case, driver)["trace"])
    assert sorted(units) == list(range(recipe.world_size))
    for rank, seq in units.items():
        stage = rank // (recipe.world_size // stages)  # RankGenerator order tp-cp-ep-dp-pp: pp outermost
        iterations = [u[1] for u in seq if u[0] == "I"]
        assert iterations == list(range(1, recipe.training.train_iters + 1)), rank
        for it in iterations:
            mine = [u for u in seq if u[1] == it and u[0] != "I"]
            forwards = [u for u in mine if u[0] == "F"]
            backwards = [u for u in mine if u[0] == "B"]
            assert len(forwards) == len(backwards) == microbatches * chunks, (rank, it)
            if chunks == 1:
                got = [(u[0], u[2]) for u in mine]
                assert got == _expected_1f1b(stage, stages, microbatches), (rank, it, got)
                assert {u[3] for u in mine} == {0}
            else:
                got = [(u[0], u[2], u[3]) for u in mine]
                assert got == _expected_interleaved(stage, stages, chunks, microbatches), (rank, it, got)


@pytest.mark.parametrize("driver", DRIVER_HERE)
def test_run_prints_each_iteration_and_the_trace(driver, runs):
    """`run --recipe` shows the last rank's iteration lines (loss, time) and where the trace is."""
    result = runs.prism("tp2pp2", driver)
    lines = [line for line in result["output"].splitlines() if " iteration " in line and "lm loss" in line]
    assert len(lines) == 3 and all("elapsed time per iteration (ms)" in line for line in lines), lines
    assert f"trace written to {result['trace']}" in result["output"]
    # the ranks' parser (Megatron's, or the core driver's) took the prism flags: rank 0 prints them among its arguments
    rank0 = (result["trace"].parent / "trace.logs" / "rank-0.log").read_text()
    assert re.search(r"prism_emulate \.+ True", rank0) and re.search(r"prism_world_size \.+ 4", rank0)


@pytest.mark.parametrize("driver", DRIVER_HERE)
def test_megatron_ops_are_labelled(driver, runs):
    """p2p ops carry the communicator method, DDP buckets and the grad norm their role."""
    from prism_megatron.trace import read_trace

    def labels(case: str) -> set[tuple[str, str]]:
        ops = read_trace(runs.prism(case, driver)["trace"]).ops.to_pylist()
        return {(o["kind"], o["label"]) for o in ops if o["label"]}

    pipeline = labels("tp2pp2")
    assert {("send", "send_forward"), ("recv", "recv_backward"), ("send", "send_forward_recv_backward"),
            ("all_reduce", "grad-all-reduce"), ("all_reduce", "grad-norm")} <= pipeline
    assert all(label for kind, label in pipeline if kind in ("send", "recv"))
    distopt = labels("tp2dp2-distopt")
    assert {("reduce_scatter", "grad-reduce-scatter"), ("all_gather", "param-all-gather")} <= distopt


@pytest.mark.skipif(not training_available(), reason="megatron.training is not importable: the megatron-core "
                    "0.16 wheel lacks it (0.19's wheel ships it; or set MEGATRON_LM_PATH to a checkout)")
def test_pretrain_with_default_data_loader_workers(runs):
    """Megatron's training loop (``megatron.training.pretrain``, called by pretrain_gpt_mini.py as
    Megatron-LM's pretrain_gpt.py calls it) with Megatron's default ``--num-workers 2``: the data-loading
    ranks fork DataLoader workers and ask torch for pinned memory, and no rank may touch CUDA (on PyPI's
    CUDA build of torch, torch.accelerator's device queries would fail in a forked rank)."""
    from prism_megatron.recipe import load_recipe, render_args

    assert not any(a.startswith("--num-workers") for a in render_args(load_recipe(CASES["tp2pp2"][0])))
    result = runs.prism("tp2pp2", "training")
    logs = result["trace"].parent / "trace.logs"
    assert re.search(r"num_workers \.+ 2\n", (logs / "rank-0.log").read_text()), "Megatron's default was used"
    assert "train/valid/test-data-iterators-setup" in result["output"]
    got = result["metrics"]
    assert sorted({it for _, it in got}) == [1, 2, 3] and all(math.isfinite(loss["lm loss"])
                                                              for loss, _ in got.values() if loss)
    assert "re-initialize CUDA" not in result["output"]


@_NO_TRAINING
def test_unmodified_megatron_lm_pretrain_gpt(runs, tmp_path):
    """NVIDIA/Megatron-LM's own pretrain_gpt.py under `run --prism-emulate`: same losses as the driver."""
    from prism_megatron.recipe import load_recipe, render_args, render_env

    root = find_megatron_lm()
    if root is None or not (root / "pretrain_gpt.py").is_file():
        pytest.skip("no Megatron-LM checkout with pretrain_gpt.py")
    recipe = load_recipe("mini-dense-tp2pp2")
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--prism-emulate", "--prism-world-size", "4",
           "--prism-trace-dir", str(tmp_path / "trace"), str(root / "pretrain_gpt.py"), *render_args(recipe),
           "--eval-interval", "1000"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONUNBUFFERED="1") | render_env(recipe))
    assert proc.returncode == 0, proc.stderr[-6000:]

    def losses(text: str) -> list[str]:
        return re.findall(r" iteration +\d+/ +\d+ .*?lm loss: (\S+)", text)

    want = losses(runs.prism("tp2pp2", "training")["output"])
    assert len(want) == 3 and losses(proc.stdout + proc.stderr) == want


def _needs_te(name: str) -> bool:
    from prism_megatron.recipe import load_recipe

    return load_recipe(name).model.transformer_impl == "transformer_engine"


def test_every_shipped_recipe_is_run_by_a_test():
    """A shipped recipe that no test runs broke unnoticed (both MoE recipes died in Megatron's fused
    bias-GeLU): each one is a numerics case, a smoke case below, or needs an extra this machine lacks.
    Target recipes (hundreds to thousands of ranks of 8B-671B models) run on a GPU with rank folding,
    not in CI; their flags are checked by Megatron-LM's parser in test_recipes."""
    from prism_megatron.recipe.load import recipe_names

    covered = {recipe for recipe, _, _ in CASES.values()} | set(SMOKE)
    minis = {n for n in recipe_names() if n.startswith("mini-")}
    assert minis and {n for n in minis if not _needs_te(n)} <= covered


SMOKE = ["mini-dense-tp2-sp", "mini-dense-tp2pp2dp4", "mini-moe-ep4-tp1pp2"]


@pytest.mark.parametrize("recipe", [r if r == "mini-dense-tp2-sp" else pytest.param(r, marks=pytest.mark.heavy)
                                    for r in SMOKE])  # the second stack trains the sequence-parallel one
def test_shipped_recipe_trains_as_shipped(recipe, megatron_runs):
    from prism_megatron.recipe import load_recipe

    rec = load_recipe(recipe)
    got = megatron_runs.run(recipe)["metrics"]  # tp2pp2dp4: the full capture test_fold_megatron compares with
    assert {it for _, it in got} == set(range(1, rec.training.train_iters + 1))
    assert all(math.isfinite(v) for (loss, _) in got.values() for v in loss.values())
