"""One-GPU ground truth for per-rank compute: real single-GPU runs against prism's prediction of the same job.

A job of W data-parallel ranks whose ranks do identical work, with communication costed free, must
predict the real single-GPU run of one replica: no link model stands between the two, so this is the
exact ground truth for what every multi-rank prediction stands on (ARCHITECTURE.md). For each
configuration (dense and MoE with local experts, device- and host-bound, bf16 and fp32, with and
without activation recompute, micro-batch 1 to 8) it runs, on GPU 0, in the order of the plan:

- ``real``: the training driver (``pretrain_gpt_mini.py``, Megatron's ``pretrain``) as one plain
  process, no prism; its truth is Megatron's own ``elapsed time per iteration (ms)`` at steady state: it
  runs ``--real-extra`` iterations more than ``--iters`` and its last ``--iters`` minus the warm-up are
  measured, after the start-up of inductor's compile workers (docs/measurements.md, "Inductor's compile
  pool"); the emulations run ``--emu-extra`` more (default the same) and are measured over the same
  iterations, past a start-up transient of their own; ``real-threads1`` runs with
  ``TORCHINDUCTOR_COMPILE_THREADS=1`` as prism's ranks do, no pool at all, so it is steady from iteration 3
  and is measured over the emulations' iterations (``--emu-extra`` more than ``--iters``);
- ``emuW`` (W = 1, 2, 4, 8): ``prism-megatron run --prism-emulate --prism-world-size W --prism-devices 0``
  of the same job with W times the global batch (each rank the same micro-batches), replayed with
  free communication; ``emuW-keep`` / ``emuW-teardown`` set ``TEARDOWN_CUPTI`` to 0 / 1 in the
  ranks, ``emuW-off`` runs with ``--prism-gpu-timing off`` (one clock), ``emuW-fold`` with ``--prism-fold on``
  (one live replica stands for the W: Phase 2's answer, which ``auto`` gives only where the W do not fit
  the machine; scored with the plain ``emuW``, the other variants are diagnoses), ``emuW-prof`` runs the launcher
  under cProfile (``trace-NN-emuW-prof.launcher.prof`` beside the trace: where its set-up time goes;
  the ranks start under it with the profiler on, so that step's prediction is shown but not scored), ``emuW-fork``
  forks each rank from the launcher's template (``--prism-rank-start fork``; ``emuW`` and ``emuW-exec`` start each
  as a fresh interpreter, the GPU's default),
  ``emuW-nolive`` with ``--prism-live-prediction off`` (no rank waits for a replay of the trace so far at its log
  line: the live ms column stays empty, the trace's replay is scored), ``emuW-awake`` with every wait for a grant
  spun through instead of slept (``PRISM_SPIN_GRANT_US`` of 10 s, no pinning: the rank's core stays busy through the
  wait for the live prediction, so it tells a slowdown of the sleep from one of the wait);
- ``real-forked``: ``real-threads1``'s run in a child forked from a process that imported torch and Megatron, as
  an emulated rank is (``forked_driver.py``): a diagnosis, listed beside the real runs, not scored against;
  ``real-spans``: ``real-threads1``'s run with each micro-batch's forward and backward timed where a rank's trace
  marks them (``spans_driver.py``): the table splits its iterations, and every emulation's, into forward, backward
  and the rest (a diagnosis, not scored against); ``real-spans-neighbour``: the same beside ``neighbour.py``, a
  process that wakes as an emulation's coordinator does (with ``+times`` set against the first timed real run, as
  an emulation is); ``real-spans-history``, ``-receiver`` and ``-rankenv``: the same with the allocator's history
  recorded as a rank's memory probe records it under a target's cap, with an idle thread blocked in a socket read
  as a rank's receiver is, or in the environment prism's launcher gives its rank; ``real-spans-forked``: in a
  child forked from a process that imported torch and Megatron, as ``real-forked``, and ``-launcher`` with that
  template given the launcher's state at its fork (its imports, signal handlers, a running child, a socket);
  ``launched-spans``: the spans driver as the one rank of ``prism-megatron launch`` (prism's rank process, runtime
  and coordinator, without ``run --prism-emulate``'s Megatron patches, template imports or GPU timing),
  ``launched-spans-exec`` and ``-fork`` the same rank started as a fresh interpreter (the GPU's default) or forked
  from the launcher's template: where between the real program and an emulated rank a slowdown comes in (each set
  against the real run as ``real-spans-neighbour`` is; never scored);
- ``probe``: ``one_gpu_probe.py``, a real run (no compile pool) whose iteration phases test the bias
  candidates (synchronisation at collectives, the allocator's history, sleeping at collectives, the plain
  iterations after a profiled one);
- any step with ``+gc`` (``real+gc``, ``emu1+gc``): the same with every garbage collection of every process
  logged (``gc_census/sitecustomize.py``); the table gives the collector's milliseconds per measured iteration;
  with ``+calls`` (``real-spans+calls``, ``emu1+calls``): every Python and C function called in each forward past
  the warm-up, counted (``forward_probe/sitecustomize.py``; the step's times are a profiler's and not scored): the
  table gives each emulation's calls per forward against the first counted real run's, and where they differ;
  with ``+canary``: at each forward's start, the host cost of a Python call, a CPU and a GPU op in that process
  (not scored either); with ``+times``: the canary, then each function's own time in each forward under
  ``sys.setprofile``: the table sets each emulation's against the first timed real run's, over the forwards whose
  canary found the host at full speed on both sides (not scored).

A config named ``NAME+manual-gc`` is NAME with Megatron's ``--manual-gc`` (the collector off during
training, as NVIDIA's performance recipes run), ``NAME+ompN`` NAME with ``OMP_NUM_THREADS=N`` for the real
runs and the emulations (``omp1``: what torchrun gives each rank of a job of several GPUs per node; an
emulation of one rank otherwise gets every core but one, the real single process every core): a row of its
own, with its own real runs.

Real runs are repeated between the emulations (``real,emu1,real,emu2,real``: the drift of the machine
falls on both sides); a real run's own spread is the spread of its repeats' medians, its drift how far its
measured iterations move (the median of their second half against their first: an MoE job speeds up as its
routing settles); a config is ground truth where both are below 1 %. Iterations 1-2
are warm-up on both sides. The predicted iteration is the replay's (the loop's period, as Megatron times
it: from the last rank's end of the iteration before to its end; ``step`` in the table is the train step
alone, first rank's begin to last rank's end); Megatron's log line under prism shows the live prediction,
also kept.

Writes ``OUT/one-gpu-truth.json`` (every run's per-iteration figures, rewritten after each step), the
table to ``OUT/one-gpu-truth.txt`` and the traces and logs to ``OUT/traces.tar.gz`` (the --work
directory). ``--analyse RUN [RUN ...]`` rebuilds the table on any machine from brought-back OUT
directories or committed results (``bench/gpu/results/*one-gpu-truth*.json``, large ones ``.json.gz``;
traces beside them): several runs make one table and one mean error, each emulation scored against its own
call's real runs.

  python bench/gpu/one_gpu_truth.py --out OUT [--configs a,b] [--plan 'a:real,emu1,...;b:...']
        [--iters N] [--budget S]                     (bench/gpu/one_gpu_truth.sh sets up a GPU machine)
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prism_megatron.megatron.driver import DRIVER_SCRIPT

sys.path.insert(0, str(Path(__file__).resolve().parent))
from forked_driver import LAUNCHER_ENV  # noqa: E402 - bench/gpu/forked_driver.py
from one_gpu_probe import ITERATIONS as PROBE_ITERATIONS  # noqa: E402 - bench/gpu/one_gpu_probe.py
from spans_driver import HISTORY_ENV, RECEIVER_ENV  # noqa: E402 - bench/gpu/spans_driver.py

HERE = Path(__file__).resolve().parent
PY = sys.executable
WARMUP = 2
TRUTH_SPREAD = 1.0  # percent: a config whose real repeats spread and drift less is ground truth (mean error)
#: the forward probes (forward_probe/sitecustomize.py's modes) and, with the collector's (gc_census/), every census a
#: step's ``+NAME`` may load
FORWARD_PROBES = ("calls", "canary", "times")
#: the steps that run the real program under the spans driver (its marker sink is what the forward probes wrap): plain,
#: beside the coordinator-like neighbour, given one thing of a rank's process, and as a launched rank
NEIGHBOURED = "real-spans-neighbour"
#: the real program with one of an emulated rank's differences from a plain process, each what it adds to the
#: spans driver's environment: the allocator's history as the rank's memory probe records it under a target's cap,
#: an idle thread blocked in a socket read as the rank's receiver is (spans_driver's variables), the environment
#: prism's launcher gives its rank (``rank_environment``)
AS_A_RANK = {"real-spans-history": lambda: {HISTORY_ENV: "1"}, "real-spans-receiver": lambda: {RECEIVER_ENV: "1"},
             "real-spans-rankenv": lambda: rank_environment()}
#: the real program under the spans driver in a child forked from a process that imported torch and Megatron, as
#: the launcher's template does (``forked_driver.py``; ``real-forked`` without the spans), and each forked step's
#: environment: ``-launcher`` gives the template the launcher's state at its fork as well (``LAUNCHER_PARTS``)
FORKED_SPANS = "real-spans-forked"
FORKED_STEPS = {FORKED_SPANS: {}, f"{FORKED_SPANS}-launcher": {LAUNCHER_ENV: "all"}}
#: the real program as a rank of ``prism-megatron launch`` runs it: prism's rank process, runtime and coordinator,
#: without ``run --prism-emulate``'s Megatron patches, template imports or GPU timing (its memory probe records no
#: history: no target is named); not a real run (not scored, not pooled), the step between the real program and an
#: emulated rank
LAUNCHED = "launched-spans"
#: each launched step and how its rank starts (``launch --rank-start``, as ``emuW-fork`` / ``emuW-exec``): the
#: launcher's default (a fresh interpreter on a GPU), a fresh interpreter, a fork of the launcher's template
LAUNCH_START = {LAUNCHED: [], f"{LAUNCHED}-exec": ["--rank-start", "exec"],
                f"{LAUNCHED}-fork": ["--rank-start", "fork"]}
SPANNED = ("real-spans", NEIGHBOURED, *AS_A_RANK, *FORKED_STEPS, *LAUNCH_START)
#: the rendezvous a real process of one does itself (``_single``), which the launcher's rank environment points at
#: its own store instead
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "ROLE_RANK",
               "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")
CENSUSES = ("gc", *FORWARD_PROBES)
_PREFIX = re.compile(r"^\[\s*([0-9.]+)s\] ")
_ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+)(?: \(([^|]*)\))? \|"
                   r"(?:.*?lm loss: ([0-9.E+-]+))?")


@dataclass(frozen=True)
class Config:
    name: str
    flags: tuple[str, ...]
    gbs: int
    note: str
    default: bool = True  # run when --configs is not given
    env: tuple[tuple[str, str], ...] = ()  # set for its real runs and emulations alike


def _flags(layers: int, hidden: int, heads: int, seq: int, mbs: int, ffn: int | None = None, *, bf16: bool = True,
           experts: int = 0, moe_ffn: int = 0, recompute: bool = False) -> tuple[str, ...]:
    f = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
         "--ffn-hidden-size", str(ffn or 4 * hidden), "--seq-length", str(seq), "--max-position-embeddings", str(seq),
         "--micro-batch-size", str(mbs), "--lr", "0.0001", "--seed", "1234", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "32000", "--mock-data", "--transformer-impl", "local", "--no-gradient-accumulation-fusion",
         "--no-persist-layer-norm", "--no-rope-fusion", "--log-interval", "1", "--eval-iters", "0",
         "--eval-interval", "1000", "--num-workers", "0"]
    if bf16:
        f += ["--bf16", "--no-masked-softmax-fusion"]
    if experts:
        # no linear biases: megatron-core 0.19.2's expert MLP adds its bias in place on a view of a custom
        # Function's output, which autograd refuses (the run dies in iteration 1 on the real side too)
        f += ["--num-experts", str(experts), "--moe-router-topk", "2", "--moe-ffn-hidden-size", str(moe_ffn),
              "--moe-token-dispatcher-type", "alltoall", "--no-bias-gelu-fusion", "--disable-bias-linear"]
    if recompute:
        f += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return tuple(f)


CONFIGS = {c.name: c for c in (
    Config("dense-bf16-mbs2", _flags(8, 2048, 16, 2048, 2, 5632), 8,
           "issue 21's shape at half depth: GPT h2048 ffn5632 seq2048, 4 micro-batches"),
    Config("dense-bf16-mbs8-dev", _flags(12, 1536, 16, 2048, 8), 16, "device-bound: h1536 seq2048, 2 micro-batches"),
    Config("dense-bf16-mbs1-host", _flags(16, 1024, 16, 1024, 1), 8, "host-bound: h1024 seq1024, 8 micro-batches"),
    Config("dense-fp32-mbs4", _flags(8, 1024, 16, 2048, 4, bf16=False), 16, "fp32: h1024 seq2048, 4 micro-batches"),
    Config("dense-bf16-mbs2-recompute", _flags(8, 2048, 16, 2048, 2, 5632, recompute=True), 8,
           "the first config with full activation recompute (uniform, 1 layer)"),
    Config("moe-bf16-mbs2", _flags(8, 1024, 16, 2048, 2, experts=8, moe_ffn=2816), 8,
           "MoE 8 local experts top-2 (EP1), h1024 seq2048, 4 micro-batches"),
    Config("moe-bf16-mbs8-dev", _flags(6, 1024, 16, 2048, 8, experts=8, moe_ffn=2816), 16,
           "MoE 8 local experts top-2, device-bound, 2 micro-batches"),
    Config("dense-fp32-mbs1-host-recompute", _flags(12, 768, 12, 1024, 1, bf16=False, recompute=True), 8,
           "fp32, host-bound, full recompute, 8 micro-batches"),
    Config("moe-fp32-mbs1-host", _flags(8, 512, 8, 1024, 1, bf16=False, experts=8, moe_ffn=1024), 8,
           "MoE fp32 host-bound, 8 micro-batches"),
    # the H200 machine's host speed moves by several percent within minutes, so a real run's repeats spread
    # below 1 % only where the device time hides the host's: h4096 keeps host time a small share of it; the MoE
    # one was meant to, but its local experts' loop in Python makes it host-bound on an H200 (docs/measurements.md)
    Config("dense-bf16-mbs4-h4096", _flags(4, 4096, 32, 2048, 4), 8,
           "strongly device-bound: h4096 seq2048, 2 micro-batches (~0.3 s of device time per iteration)"),
    Config("moe-bf16-mbs4-h2048", _flags(4, 2048, 16, 2048, 4, experts=8, moe_ffn=5632), 8,
           "MoE 8 local experts top-2, h2048 seq2048, 2 micro-batches (host-bound on an H200)"),
    # an MoE job whose device time hides its experts' loop: experts of h4096 x 8192 run ~2,000 tokens each
    Config("moe-bf16-mbs4-h4096", _flags(2, 4096, 32, 2048, 4, experts=8, moe_ffn=8192), 8,
           "MoE 8 local experts top-2, device-bound: h4096 seq2048, 2 layers, 2 micro-batches"),
    # issue 18's job as one replica (~96 GiB): what its swapped runs predicted (bench/gpu/admission.sh) against
    # the real run and the emulation without swaps; only W = 1 fits the H200, so only by name
    Config("dense-bf16-mbs8-24l", _flags(24, 1536, 12, 2048, 8), 16,
           "issue 18's shape: 24 layers h1536 seq2048, 2 micro-batches (~96 GiB)", default=False),
)}
DEFAULT_STEPS = ("real", "emu1", "real", "emu2", "real")
#: config-name suffix -> (Megatron flags added, environment of its runs)
VARIANTS = {"manual-gc": (("--manual-gc",), ())}
_OMP = re.compile(r"omp([1-9][0-9]*)")


def _variant(name: str) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]] | None:
    """A variant's (Megatron flags, environment), None for an unknown one; ``ompN``: OMP_NUM_THREADS=N."""
    m = _OMP.fullmatch(name)
    return ((), (("OMP_NUM_THREADS", m.group(1)),)) if m else VARIANTS.get(name)


def microbatches(config: Config) -> int:
    """Micro-batches per iteration of one replica: the global batch over the micro-batch."""
    flags = list(config.flags)
    return config.gbs // int(flags[flags.index("--micro-batch-size") + 1])


def config_of(name: str) -> Config:
    """``NAME`` or ``NAME+VARIANT``: a config of CONFIGS, with the variant's flags added."""
    base, _, variant = name.partition("+")
    if base not in CONFIGS or (variant and _variant(variant) is None):
        raise SystemExit(f"no config {name!r}; configs: {', '.join(CONFIGS)}, each optionally "
                         f"+{' / +'.join(VARIANTS)} / +ompN")
    c = CONFIGS[base]
    if not variant:
        return c
    flags, env = _variant(variant)
    return Config(name, c.flags + flags, c.gbs, f"{c.note}; {variant}", False, c.env + env)


# ----------------------------------------------------------------------------- running
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1", NCCL_NVLS_ENABLE="0",
               TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1", WANDB_MODE="disabled")
    env.update(extra)
    return env


def rank_environment() -> dict[str, str]:
    """What prism's launcher gives the one rank of a job of one on GPU 0 (``launcher.rank.rank_env``: its torch
    threads, the visible device, torchrun's and prism's flags; and the launcher's fork-safe CUDA check, which its
    ranks inherit, ``launcher.fork_safe_cuda_checks``), less the rendezvous the real program does itself."""
    from prism_megatron.launcher import FORK_SAFE_CUDA_ENV
    from prism_megatron.launcher.config import LaunchConfig, rank_threads, torchrun_threads
    from prism_megatron.launcher.rank import rank_env

    cfg = LaunchConfig(script=DRIVER_SCRIPT, world_size=1, devices=["0"], gpu_timing=False,
                       threads_per_rank=rank_threads(torchrun_threads(1), 1))
    env = {k: v for k, v in rank_env(cfg, 0, 0).items() if k not in _RENDEZVOUS}
    return {**env, **FORK_SAFE_CUDA_ENV}


def _single(port: int) -> dict[str, str]:
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def parse_log(text: str) -> dict[int, dict[str, Any]]:
    """Megatron's iteration lines: {iteration: {"ms", "note" (prism's, if any), "loss", "at" (seconds since
    the step began, where the log carries it)}}."""
    out = {}
    for line in text.splitlines():
        m = _ITER.search(line)
        if m:
            at = _PREFIX.match(line)
            out[int(m.group(1))] = {"ms": float(m.group(2)), "note": m.group(3), "loss": m.group(4),
                                    "at": float(at.group(1)) if at else None}
    return out


def read_census(path: Path) -> tuple[str, list[tuple[float, ...]]]:
    """A ``gc_census`` file: the process's command and its collections (start, seconds, generation, collected)."""
    lines = path.read_text().splitlines()
    events = [tuple(float(x) for x in ln.split()) for ln in lines[1:] if ln and not ln.startswith("#")]
    return (lines[0][2:] if lines else ""), events


def census_env(census: str, directory: Path, skip: int = 0) -> dict[str, str]:
    """The environment that loads a census into every process of a run, writing into ``directory``: ``gc``
    (``gc_census/``) or a forward probe, ``calls``, ``canary`` or ``times`` (``forward_probe/``, its first ``skip``
    forwards left out)."""
    if census == "gc":
        module, env = "gc_census", {"GC_CENSUS_DIR": str(directory)}
    else:
        module, env = "forward_probe", {"FORWARD_PROBE": census, "FORWARD_PROBE_DIR": str(directory),
                                        "FORWARD_PROBE_SKIP": str(skip)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE / module), os.environ.get("PYTHONPATH")]))
    return env


def read_probe(directory: Path, mode: str) -> dict[str, Any] | None:
    """A forward probe's findings (``forward_probe/sitecustomize.py``), from the process that ran the program's
    forwards (the plain process, or the emulated rank; the launcher ran none), or None: ``forwards`` and, for calls,
    ``per_forward`` (calls per forward by function), for the canary, ``canary`` (each measure's microseconds per
    call, one value per forward), for times, ``forward`` (per forward its canary's Python call, its profiled
    length and each function's own microseconds)."""
    files = [json.loads(f.read_text()) for f in sorted(directory.glob(f"{mode}-*.json"))]
    counted = [f for f in files if f.get("forwards")]
    if not counted:
        return None
    f = max(counted, key=lambda f: f["forwards"])
    if mode == "canary":
        return {"forwards": f["forwards"], "canary": f["canary"]}
    if mode == "times":
        return {"forwards": f["forwards"], "forward": f["forward"], "dynamo": f.get("dynamo") or {},
                "process": f.get("process") or {}, "callers": f.get("callers") or {},
                "mutations": f.get("mutations") or {}}
    return {"forwards": f["forwards"], "per_forward": {k: v / f["forwards"] for k, v in f["calls"].items()}}


def canary_text(canary: dict[str, list[float]]) -> str:
    """The canary's medians: "python 0.030, aten-cpu 1.02, cuda-launch 5.61 us"."""
    return ", ".join(f"{k[:-3].replace('_', '-')} {statistics.median(v):.3f}" for k, v in canary.items() if v) + " us"


def calls_text(real: dict[str, Any], emulated: dict[str, Any], top: int = 8) -> str:
    """Calls per forward on each side (Python functions and C functions apart), and the functions whose counts
    differ most, emulated less real."""
    def totals(per: dict[str, float]) -> tuple[float, float]:
        c = sum(v for k, v in per.items() if k.startswith("c "))
        return sum(per.values()) - c, c

    a, b = real["per_forward"], emulated["per_forward"]
    (pa, ca), (pb, cb) = totals(a), totals(b)
    diff = sorted(((b.get(k, 0.0) - a.get(k, 0.0), k) for k in set(a) | set(b)), key=lambda d: (-abs(d[0]), d[1]))
    shown = ", ".join(f"{d:+.0f} {k}" for d, k in diff[:top] if abs(d) >= 0.5) or "none"
    return (f"calls per forward: real {pa:.0f} Python + {ca:.0f} C, emulated {pb:.0f} + {cb:.0f}; "
            f"most apart: {shown}")


#: a forward whose canary's Python call took more than this times the least of both sides' ran on a slowed host
FULL_SPEED = 1.15


def at_full_speed(python_us: float, floor: float) -> bool:
    """Whether a forward's canary (its Python call, us) found the host at full speed, ``floor`` the least seen."""
    return python_us <= floor * FULL_SPEED


def summed(forwards: list[dict[str, Any]], field: str) -> dict[str, float]:
    """A probed forward's per-function figures (``self_us`` or ``calls``; absent in older probes) summed over
    ``forwards``."""
    out: dict[str, float] = {}
    for f in forwards:
        for k, v in (f.get(field) or {}).items():
            out[k] = out.get(k, 0.0) + v
    return out


def times_text(real: dict[str, Any], emulated: dict[str, Any], top: int = 8) -> str:
    """The forwards at full speed on each side (their canary's Python call within ``FULL_SPEED`` of the least
    seen on either side): their median profiled length, and the functions whose own time per forward differs
    most, emulated less real (the mean over those forwards; real's figure in brackets, with the calls per forward
    and the own time per call on each side where the probe counted them: a slower call told from more calls), and
    the main thread's page faults and context switches in those forwards where the probe took them."""
    floor = min(f["python_us"] for f in real["forward"] + emulated["forward"])

    def fast(side: dict[str, Any]) -> list[dict[str, Any]]:
        return [f for f in side["forward"] if at_full_speed(f["python_us"], floor)]

    a, b = fast(real), fast(emulated)
    # what does not depend on the host's speed: the processes and their waits for the device
    beside = (process_text(real.get("process") or {}, emulated.get("process") or {}) + callers_text(real, emulated)
              + mutations_text(real.get("mutations") or {}, emulated.get("mutations") or {}))
    if not a or not b:
        return f"no forward at full speed on {'both sides' if not a and not b else 'one side'}" + beside

    def own(forwards: list[dict[str, Any]]) -> dict[str, float]:
        """Own milliseconds per forward of each function kept."""
        return {k: us / 1e3 / len(forwards) for k, us in summed(forwards, "self_us").items()}

    def calls(forwards: list[dict[str, Any]]) -> dict[str, float]:
        """Calls per forward of each function kept (probes before the counts were kept: none)."""
        return {k: n / len(forwards) for k, n in summed(forwards, "calls").items()}

    oa, ob = own(a), own(b)
    na, nb = calls(a), calls(b)
    diff = sorted(((ob.get(k, 0.0) - oa.get(k, 0.0), k) for k in set(oa) | set(ob)), key=lambda d: (-abs(d[0]), d[1]))

    def each(k: str) -> str:
        """Calls per forward and own microseconds per call, real -> emulated, where both sides counted them."""
        if not na.get(k) or not nb.get(k):
            return ""
        return f"; {na[k]:.0f} -> {nb[k]:.0f} calls at {oa[k] * 1e3 / na[k]:.1f} -> {ob[k] * 1e3 / nb[k]:.1f} us"

    shown = ", ".join(f"{d:+.2f} {k} ({oa.get(k, 0.0):.2f}{each(k)})" for d, k in diff[:top])
    ma, mb = (statistics.median(f["ms"] for f in side) for side in (a, b))
    text = (f"forwards at full speed: real {len(a)} of {len(real['forward'])}, {ma:.1f} ms profiled; emulated "
            f"{len(b)} of {len(emulated['forward'])}, {mb:.1f} ms; own time most apart, ms per forward: {shown}")
    measures = [k for k in (a[0].get("canary") or {}) if k in (b[0].get("canary") or {})]
    if measures:
        text += "; canary at their start, us per call, real / emulated: " + ", ".join(
            f"{k[:-3].replace('_', '-')} {statistics.median(f['canary'][k] for f in a):.3f} / "
            f"{statistics.median(f['canary'][k] for f in b):.3f}" for k in measures)
    used = [k for k in (a[0].get("usage") or {}) if k in (b[0].get("usage") or {})]
    if used:
        text += "; main thread per forward (medians), real / emulated: " + ", ".join(
            f"{k} {statistics.median(f['usage'][k] for f in a):g} / {statistics.median(f['usage'][k] for f in b):g}"
            for k in used)
    dynamo = dynamo_text(real.get("dynamo") or {}, emulated.get("dynamo") or {}, [k for _, k in diff[:top]])
    return text + dynamo + beside


#: the frames of a call into an Inductor-compiled function that the rank ran slower than the real program
#: (docs/measurements.md, "The bisection"), and one of the many small calls around them, each (file's tail,
#: function; "c" for a C function): their own time per call is set side by side over every probed forward of every
#: timed step, whatever the host's speed
COMPILED_CALL_FRAMES = (("_inductor/output_code.py", "__call__"), ("_inductor/utils.py", "run"),
                        ("_inductor/utils.py", "copy_misaligned_inputs"),
                        ("_dynamo/utils.py", "get_runtime_metrics_context"),
                        ("runtime/static_triton_launcher.py", "run"), ("c", "builtins.isinstance"))


def frames_text(timed: list[tuple[str, dict[str, Any]]]) -> str:
    """Each of ``COMPILED_CALL_FRAMES``' own microseconds per call over all of a step's probed forwards, step by
    step (calls per forward in brackets): the frames a slow rank has slow, compared where no forward ran at full
    speed on some side (the probe's own cost per call is the same on every side)."""
    parts = []
    for where, name in COMPILED_CALL_FRAMES:
        cells = []
        for kind, times in timed:
            own, calls = summed(times["forward"], "self_us"), summed(times["forward"], "calls")
            keys = [k for k in own if k.rpartition(" ")[2] == name
                    and ((file := k.rpartition(" ")[0]).split(":")[0].endswith(where) or file == where)]
            us, n = sum(own[k] for k in keys), sum(calls.get(k, 0) for k in keys)
            if n:
                cells.append(f"{kind.split('+')[0]} {us / n:.1f} ({n / len(times['forward']):.0f})")
        if cells:
            label = name if where == "c" else f"{where.rsplit('/', 1)[-1].split('.')[0]}.{name}"
            parts.append(f"{label} " + ", ".join(cells))
    return ("own us per call over all probed forwards (calls per forward): " + "; ".join(parts)) if parts else \
        "own us per call: no compiled-call frame kept by the probe"


def callers_text(real: dict[str, Any], emulated: dict[str, Any], chains: int = 2) -> str:
    """The host's waits for the device inside the forwards (``forward_probe``'s ``WAITS``) whose calls per
    forward differ between the sides: calls per forward real / emulated, and the side with more's commonest
    caller chains (innermost first)."""
    out = []
    rc, ec = real.get("callers") or {}, emulated.get("callers") or {}
    for k in sorted(set(rc) | set(ec)):
        a = sum(rc.get(k, {}).values()) / max(real["forwards"], 1)
        b = sum(ec.get(k, {}).values()) / max(emulated["forwards"], 1)
        if round(a, 2) == round(b, 2):
            continue
        more = ec if b > a else rc
        top = sorted(more.get(k, {}).items(), key=lambda kv: -kv[1])[:chains]
        out.append(f"{k} {a:.2f} / {b:.2f} per forward, {'emulated' if b > a else 'real'}'s from "
                   + " | ".join(f"{c} ({n})" for c, n in top))
    return "; waits apart: " + ", ".join(out) if out else ""


def mutations_text(real: dict[str, Any], emulated: dict[str, Any], names: int = 8) -> str:
    """The classes and module namespaces each side changed between its forwards (``forward_probe``'s
    ``probe_mutations.py``: a change invalidates the interpreter's cached reads through them), each named with the
    share of censuses it changed in, the most frequent first; empty where neither side took a census."""
    if not real.get("censuses") and not emulated.get("censuses"):
        return ""

    def side(m: dict[str, Any]) -> str:
        if m.get("unreadable"):
            return m["unreadable"]
        n = m.get("censuses", 0)
        parts = []
        for kind in ("classes", "modules"):
            changed = sorted((m.get(kind) or {}).items(), key=lambda kv: (-kv[1], kv[0]))
            shown = " ".join(f"{k} {c}/{n}" for k, c in changed[:names])
            parts.append(f"{len(changed)} {kind}{': ' + shown if shown else ''}")
        return f"over {n} censuses " + ", ".join(parts)

    return f"; changed between forwards: real {side(real)}; emulated {side(emulated)}"


def process_text(real: dict[str, Any], emulated: dict[str, Any], names: int = 12) -> str:
    """Where the two processes' fingerprints (``forward_probe``'s ``process_fingerprint``) differ: each setting
    real / emulated, the environment by variable, and the modules only one side loaded (counted, the first
    ``names`` named)."""
    if not real or not emulated:
        return ""
    apart = []
    for k in sorted(set(real) | set(emulated)):
        if k in ("modules", "env"):
            continue
        a, b = real.get(k, "-"), emulated.get(k, "-")
        if a != b:
            apart.append(f"{k} {a} / {b}")
    ra, rb = real.get("env") or {}, emulated.get("env") or {}
    apart += [f"${k} {ra.get(k, '-')} / {rb.get(k, '-')}" for k in sorted(set(ra) | set(rb)) if ra.get(k) != rb.get(k)]
    out = "; process apart (real / emulated): " + ", ".join(apart) if apart else "; process alike"
    ma, mb = set(real.get("modules") or ()), set(emulated.get("modules") or ())
    for side, only in (("real", sorted(ma - mb)), ("emulated", sorted(mb - ma))):
        if only:
            out += f"; modules only {side}: {len(only)} ({', '.join(only[:names])})"
    return out


def dynamo_text(real: dict[str, Any], emulated: dict[str, Any], functions: list[str]) -> str:
    """Where dynamo's and the interpreter's view of the two processes differs: for the named functions, the frame
    callbacks each was called under, its code's compiled entries and, where recorded, how far its bytecode is
    specialised ("callbacks/entries/specialised of specialisable instructions, those left generic"); and
    dynamo's counters that differ."""
    rf, ef = real.get("functions") or {}, emulated.get("functions") or {}

    def state(f: dict[str, Any], k: str) -> str:
        return "-" if k not in f else "/".join([f"{'+'.join(f[k][0]) or '?'}", str(f[k][1]), *f[k][2:]])

    apart = [f"{k} real {state(rf, k)}, emulated {state(ef, k)}" for k in functions
             if (k in rf or k in ef) and state(rf, k) != state(ef, k)]
    rc, ec = real.get("counters") or {}, emulated.get("counters") or {}
    counted = sorted({(g, n) for side in (rc, ec) for g, c in side.items() for n in c})
    differ = [f"{g}.{n} {rc.get(g, {}).get(n, 0)}/{ec.get(g, {}).get(n, 0)}" for g, n in counted
              if rc.get(g, {}).get(n, 0) != ec.get(g, {}).get(n, 0)]
    out = ""
    if apart:
        out += "; dynamo's callbacks/compiled entries/specialised bytecode apart: " + ", ".join(apart)
    if differ:
        out += "; dynamo counters apart (real/emulated): " + ", ".join(differ[:12])
    return out


def gc_census(directory: Path, t0: float, iterations: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    """Per process of a ``+gc`` step: the collector's milliseconds and collections (all, and generation 2)
    per measured iteration, between the warm-up's last log line and the run's last (the log's times)."""
    ends = sorted((int(k), v["at"]) for k, v in iterations.items() if v.get("at") is not None)
    ends = [(k, t) for k, t in ends if k >= WARMUP]
    if len(ends) < 2:
        return {}
    lo, hi, n = t0 + ends[0][1], t0 + ends[-1][1], len(ends) - 1
    out = {}
    for f in sorted(directory.glob("gc-*.txt")):
        command, events = read_census(f)
        inside = [e for e in events if lo <= e[0] < hi]
        out[f.stem] = {"command": command,
                       "ms_per_iteration": sum(e[1] for e in inside) * 1e3 / n,
                       "collections_per_iteration": len(inside) / n,
                       "gen2_per_iteration": sum(1 for e in inside if e[2] == 2) / n,
                       "gen2_ms_each": [round(e[1] * 1e3, 2) for e in inside if e[2] == 2][:20]}
    return out


def _run(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> str:
    """Run ``cmd`` with its output in ``log``, each line prefixed by the seconds since the start (where the
    step's time goes: set-up, iterations, trace writing)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as f, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                               cwd=log.parent, text=True, errors="replace") as proc:
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            for line in proc.stdout:
                f.write(f"[{time.monotonic() - t0:9.3f}s] {line}")
        finally:
            timer.cancel()
        code = proc.wait()
    text = log.read_text(errors="replace")
    if time.monotonic() - t0 >= timeout:
        raise subprocess.TimeoutExpired(cmd, timeout)
    if code:
        raise RuntimeError(f"exit {code}: {' '.join(cmd[:5])} ...\n{text[-2000:]}")
    return text


def step(kind: str, config: Config, work: Path, iters: int, index: int, timeout: float,
         real_extra: int = 0, emu_extra: int = 0) -> dict[str, Any]:
    """Run one step of the plan; returns what it measured."""
    flags = [*config.flags, "--train-iters", str(iters + emu_extra)]
    name = f"{index:02d}-{kind}"
    kind, census = kind.rsplit("+", 1) if kind.endswith(tuple(f"+{c}" for c in CENSUSES)) else (kind, "")
    if census in FORWARD_PROBES and kind.startswith("real") and kind not in SPANNED:
        raise ValueError(f"step {name!r}: +{census} probes the forwards a marker sink sees; of the real runs only "
                         f"{', '.join(SPANNED)} install one")
    census_dir = work / f"{name}.{census}"
    # a forward probe leaves out the warm-up's forwards: real-spans and the emulations both run emu_extra more
    run_env = {**dict(config.env), **(census_env(census, census_dir, (WARMUP + emu_extra) * microbatches(config))
                                      if census else {})}
    t0 = time.monotonic()

    def counted(result: dict[str, Any]) -> dict[str, Any]:
        if census:
            result["kind"] += f"+{census}"
        if census == "gc":
            result["gc"] = gc_census(census_dir, t0, result["iterations"])
        elif census:
            result[census] = read_probe(census_dir, census)
        return result

    if kind in ("real", "real-threads1", "real-forked", *SPANNED):
        extra = real_extra if kind == "real" else emu_extra  # no pool: the emulations' iterations
        threads = {} if kind == "real" else {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
        spanned = kind in SPANNED
        wrapper = [*([str(HERE / "forked_driver.py")] if kind in ("real-forked", *FORKED_STEPS) else []),
                   *([str(HERE / "spans_driver.py")] if spanned else [])]  # a forked child runs the spans driver
        if kind in LAUNCH_START:  # the launcher gives its rank the torchrun environment itself
            trace = work / f"trace-{name}"
            shutil.rmtree(trace, ignore_errors=True)
            runner, single = [PY, "-m", "prism_megatron", "launch", "--world-size", "1", "--devices", "0",
                              "--gpu-timing", "off", *LAUNCH_START[kind], "--trace-dir", str(trace), "--"], {}
        else:
            runner, single = [PY], _single(_port())
        spans = work / f"{name}.spans.json"
        told = {"SPANS_OUT": str(spans), **(AS_A_RANK[kind]() if kind in AS_A_RANK else {}),
                **FORKED_STEPS.get(kind, {})} if spanned else {}
        # the coordinator's pattern beside the real program: its own process, for the step's length only
        neighbour = subprocess.Popen([PY, str(HERE / "neighbour.py")], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL) if kind == NEIGHBOURED else None
        try:
            text = _run([*runner, *wrapper, str(DRIVER_SCRIPT), *config.flags, "--train-iters", str(iters + extra),
                         "--global-batch-size", str(config.gbs)], work / f"{name}.log",
                        _env(**{**single, **threads, **run_env, **told}), timeout)  # a rank's env the last word
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        result = {"kind": kind, "iterations": parse_log(text), "measured_from": WARMUP + extra + 1}
        if spanned:
            result["spans"] = json.loads(spans.read_text())
        return counted(result)
    if kind == "probe":
        probe_out = work / f"{name}.json"
        _run([PY, str(HERE / "one_gpu_probe.py"), *config.flags, "--train-iters", str(PROBE_ITERATIONS),
              "--global-batch-size", str(config.gbs)], work / f"{name}.log",
             _env(**_single(_port()), PROBE_OUT=str(probe_out), TORCHINDUCTOR_COMPILE_THREADS="1", **run_env),
             timeout)  # no compile pool: its start-up slows the first ~25 s, the whole probe (as real-threads1)
        return {"kind": kind, "rows": json.loads(probe_out.read_text())}
    m = re.fullmatch(r"emu(\d+)(?:-(keep|teardown|off|spin|prof|fold|exec|fork|nolive|awake))?", kind)
    if not m:
        raise ValueError(f"unknown step {kind!r}")
    world, variant = int(m.group(1)), m.group(2) or ""
    trace = work / f"trace-{name}"
    shutil.rmtree(trace, ignore_errors=True)
    extra = {"keep": {"TEARDOWN_CUPTI": "0"}, "teardown": {"TEARDOWN_CUPTI": "1"},
             # each rank on a core of its own, spinning 3 ms for its grant: its core stays awake, as a real rank's
             "spin": {"PRISM_PIN_CORES": "1", "PRISM_SPIN_GRANT_US": "3000"},
             "awake": {"PRISM_SPIN_GRANT_US": "10000000"}}.get(variant, {})  # the whole wait, on whichever core
    prof = ["-m", "cProfile", "-o", f"{trace}.launcher.prof"] if variant == "prof" else []
    cmd = [PY, *prof, "-m", "prism_megatron", "run", "--prism-emulate", "--prism-world-size", str(world),
           "--prism-devices", "0", "--prism-trace-dir", str(trace), "--prism-report", "off",
           *(["--prism-gpu-timing", "off"] if variant == "off" else []),
           *(["--prism-live-prediction", "off"] if variant == "nolive" else []),
           *(["--prism-fold", "on"] if variant == "fold" else []),
           *(["--prism-rank-start", variant] if variant in ("exec", "fork") else []),
           str(DRIVER_SCRIPT), *flags, "--global-batch-size", str(config.gbs * world)]
    text = _run(cmd, work / f"{name}.log", _env(**extra, **run_env), timeout)
    return counted({"kind": kind, "world": world, "variant": variant, "iterations": parse_log(text),
                    "measured_from": WARMUP + emu_extra + 1,
                    "trace": str(trace.relative_to(work.parent))})  # relative to the --work directory


# ----------------------------------------------------------------------------- analysis
def _measured(values: dict[int, float], first: int = WARMUP + 1) -> list[float]:
    """The values of iterations from ``first`` on (after the warm-up; keys are strings once read back from JSON)."""
    return [v for k, v in sorted((int(k), v) for k, v in values.items()) if k >= first]


def step_ms(step: dict[str, Any]) -> list[float]:
    """A step's logged milliseconds over its measured iterations."""
    return _measured({k: v["ms"] for k, v in step["iterations"].items()}, step.get("measured_from", WARMUP + 1))


def unlike(world: int, omp: str | None) -> str | None:
    """Why an emulation of ``world`` ranks is not the job its config's real runs ran, or None. torchrun gives each
    rank of a job of several processes per node one torch thread (OMP_NUM_THREADS=1; launcher.config.
    torchrun_threads), so W > 1 emulates ranks of one thread each, while a real run of one process keeps every
    core: its host work (building each micro-batch's data and mask on the CPU) is another job's. Their truth is
    the same config with ``+omp1``: the real runs and the emulations with one thread."""
    if world > 1 and omp is None:
        return "not like for like: its ranks have 1 torch thread each, as torchrun gives them, the real run every " \
               "core; NAME+omp1 is its truth"
    return None


def is_truth(kind: str) -> bool:
    """Whether a step is a real run the emulations are scored against (``real-forked`` is a diagnosis: the same
    program forked as an emulated rank is; a ``+calls``, ``+canary`` or ``+times`` step probes its forwards)."""
    return kind.split("+")[0] in ("real", "real-threads1") and not untimed(kind)


def untimed(kind: str) -> bool:
    """Whether a step's times say nothing: a ``+calls`` or ``+times`` step runs its forwards under
    ``sys.setprofile``, a ``+canary`` one adds ~1.5 ms of probes to each."""
    return kind.endswith(tuple(f"+{p}" for p in FORWARD_PROBES))


def _drift(values: list[float]) -> float:
    """How far a run's measured iterations move: the median of their second half less that of their first (ms,
    absolute). An MoE job's iterations speed up as its routing settles, so its steady state may lie past the
    measured window; set against iterations of the emulation that are not the same ones, it is no ground truth."""
    half = len(values) // 2
    return abs(statistics.median(values[-half:]) - statistics.median(values[:half]))


def replay_times(trace: Path, resolve: bool = False, **graph_kw: Any) -> dict[str, dict[int, float]]:
    """Per-iteration predicted seconds of a trace, communication free: ``period`` (the prediction: the
    replay's iteration time, the loop's period as Megatron times it) and ``step`` (the train step alone,
    first rank's begin to last rank's end). ``resolve``: its plain host times solved again with the device
    backlog (resolve_backlog.py: traces captured before it)."""
    from dataclasses import replace

    from prism_megatron.replay import graph_from_trace, replay, zero_cost
    from prism_megatron.trace import read_trace

    tr = read_trace(trace)
    if resolve:
        from resolve_backlog import resolved  # bench/gpu/resolve_backlog.py

        tr = replace(tr, gpu=resolved(tr))
    its = replay(graph_from_trace(tr, **graph_kw), zero_cost).iterations()
    return {"period": {it.number: it.time for it in its}, "step": {it.number: it.end - it.start for it in its}}


def analyse_config(steps: list[dict[str, Any]], root: Path, resolve: bool = False,
                   samples: list[tuple[float, float, float]] | None = None,
                   threads: tuple[dict[int, dict[str, Any]], list] | None = None,
                   microbatches: int = 1) -> dict[str, Any]:
    """One config's row: real repeats, each emulation's prediction and live values, the probe, and where the
    host's CPUs and the Python processes' threads were sampled, how busy and how stolen the CPUs were during each
    step and what its busiest threads did per iteration; ``microbatches`` per iteration splits a ``real-spans``
    run's spans into its iterations."""
    reals = [m for s in steps if is_truth(s.get("kind", "")) and "iterations" in s and (m := step_ms(s))]
    medians = [statistics.median(r) for r in reals]
    row: dict[str, Any] = {"real_medians_ms": medians}
    if medians:
        pooled = statistics.median([t for r in reals for t in r])
        row["real_ms"] = pooled
        row["real_spread_pct"] = (max(medians) - min(medians)) / pooled * 100 if len(medians) > 1 else None
        row["real_drift_pct"] = max((_drift(r) for r in reals if len(r) >= 4), default=None)
        if row["real_drift_pct"] is not None:
            row["real_drift_pct"] *= 100 / pooled
        row["real_losses"] = {k: v["loss"] for k, v in next(s for s in steps if is_truth(s.get("kind", "")))
                              ["iterations"].items()}
    row["emulations"] = {}
    for s in steps:
        if not str(s.get("kind", "")).startswith("emu") or "iterations" not in s or untimed(s["kind"]):
            continue
        em: dict[str, Any] = {"live_ms": {k: v["ms"] for k, v in s["iterations"].items()},
                              "live_notes": {k: v["note"] for k, v in s["iterations"].items()},
                              "losses": {k: v["loss"] for k, v in s["iterations"].items()}}
        trace = root / s["trace"]
        if trace.exists():
            try:
                variants = (("", {}), ("one_clock_", {"gpu_times": False}), ("own_host_", {"typical_host": False}))
                for label, kw in variants:
                    times = replay_times(trace, resolve, **kw)
                    for key, per in times.items():
                        em[f"{label}{key}_ms"] = {k: v * 1e3 for k, v in per.items()}
                em["host_device"] = host_device(trace, s.get("measured_from", WARMUP + 1))
                em["waits"] = waits_and_host(trace)  # from the warm-up's end: how the host time moves over the run
                em["plain_excess"] = plain_excess(trace, s.get("measured_from", WARMUP + 1))
                em["spans"] = trace_spans(trace, s.get("measured_from", WARMUP + 1))
            except Exception as e:  # noqa: BLE001 - one broken trace must not hide the others
                em["error"] = f"{type(e).__name__}: {e}"
        first = s.get("measured_from", WARMUP + 1)
        em["measured_from"] = first
        live = _measured(em["live_ms"], first)
        em["live_median_ms"] = statistics.median(live) if live else None
        pred = _measured(em.get("period_ms", {}), first)
        em["predicted_ms"] = statistics.median(pred) if pred else None
        if em["predicted_ms"] is None and not trace.exists() and em["live_median_ms"] is not None:
            # a call whose traces were not kept: Megatron's logged prediction, the report's own figure per iteration
            # (equal to the trace's replay in every run since run 20 that kept both), said in the table
            em["predicted_ms"], em["predicted_from"] = em["live_median_ms"], "live"
        # a profiled launcher's ranks fork with its profiler: their times are no measurement
        if em["predicted_ms"] and row.get("real_ms") and s.get("variant") != "prof":
            em["error_pct"] = (em["predicted_ms"] / row["real_ms"] - 1) * 100
        row["emulations"][s["kind"] + ("" if s["kind"] not in row["emulations"] else f"#{len(row['emulations'])}")] = em
    row["gc"] = [(s["kind"], s["gc"]) for s in steps if s.get("gc")]
    row["calls"] = [(s["kind"], s["calls"]) for s in steps if s.get("calls")]
    row["canary"] = [(s["kind"], s["canary"]) for s in steps if s.get("canary")]
    sung = [s for s in steps if s.get("canary") and ("spans" in s or (root / s.get("trace", "-")).exists())]
    if sung:
        row["canary_forwards"] = canary_split([(s["kind"], s["canary"]["canary"]["python_us"],
                                                forward_lengths(s, root)) for s in sung])
    row["times"] = [(s["kind"], s["times"]) for s in steps if s.get("times")]
    row["spans"] = [(s["kind"], sp) for s in steps if s.get("kind", "").split("+")[0] in SPANNED and "iterations" in s
                    and (sp := real_spans(s, microbatches)) is not None]
    row["forked"] = [statistics.median(m) for s in steps if s.get("kind", "").split("+")[0] == "real-forked"
                     and "iterations" in s and (m := step_ms(s))]
    if samples:
        row["host_cpus"] = [(s["kind"], c) for s in steps if (c := step_cpus(s, samples)) is not None]
    if threads:
        row["threads"] = [(s["kind"], t) for s in steps if (t := step_threads(s, threads)) is not None]
    probes = [s for s in steps if s.get("kind") == "probe" and "rows" in s]
    if probes:
        row["probe"] = summarise_probe(probes[0]["rows"])
    return row


def summarise_probe(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median wall per phase (ms), the wall less the probe's own syncs and sleeps where it added some, and device
    busy / wall of the profiled iterations."""
    phases: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        phases.setdefault(r["phase"], []).append(r)
    out = {p: {"wall_ms": statistics.median(r["wall_ms"] for r in rs), "n": len(rs)} for p, rs in phases.items()}
    for p, rs in phases.items():  # a profile that recorded no device work is lost, not an idle device
        if any(r.get("added_ms") for r in rs):
            out[p]["host_ms"] = statistics.median(r["wall_ms"] - r["added_ms"] for r in rs)
        busy = [r["device_busy_ms"] for r in rs if r.get("device_activities")]
        if busy:
            out[p]["device_busy_ms"] = statistics.median(busy)
        mhz = [r["sm_clock_mhz"] for r in rs if r.get("sm_clock_mhz")]
        if mhz:
            out[p]["sm_clock_mhz"] = statistics.median(mhz)
    return out


def host_cpus(samples: Path) -> list[tuple[float, float, float]]:
    """(epoch seconds, busy %, stolen %) of all the host's CPUs from ``host-cpus.csv`` (host_sampler.py)."""
    with samples.open(newline="") as f:
        return [(float(r["time"]), float(r["busy_pct"]), float(r["steal_pct"])) for r in csv.DictReader(f)
                if r["cpu"] == "all"]


def step_cpus(step: dict[str, Any], samples: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Mean busy and stolen percent of the host's CPUs over a step's run (None: no samples, or a step without its
    start time)."""
    start = step.get("started")
    if start is None or "seconds" not in step:
        return None
    inside = [(b, st) for t, b, st in samples if start < t <= start + step["seconds"]]
    if not inside:
        return None
    return statistics.fmean(b for b, _ in inside), statistics.fmean(st for _, st in inside)


def host_threads(path: Path) -> tuple[dict[int, dict[str, Any]], list[tuple[float, dict[tuple[int, int], list]]]]:
    """``host-threads.jsonl`` (thread_sampler.py): {pid: its first-sight line} and, in time order, (epoch
    seconds, {(pid, tid): [pid, tid, comm, on_cpu_ns, runqueue_ns, voluntary, involuntary, last_cpu]}) of the
    threads whose counters moved."""
    procs: dict[int, dict[str, Any]] = {}
    samples = []
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # the sampler was killed mid-line
                break
            raise SystemExit(f"{path}:{n}: not JSON ({e})") from None
        if "cmd" in d:
            procs[d["pid"]] = d
        else:
            samples.append((d["t"], {(r[0], r[1]): r for r in d["threads"]}))
    return procs, samples


def step_threads(step: dict[str, Any], threads: tuple[dict[int, dict[str, Any]], list], top: int = 3
                 ) -> dict[str, Any] | None:
    """The busiest threads over a step's measured iterations (the warm-up's last log line to the run's last):
    per thread its time on a CPU and runnable but waiting for one (ms per iteration, from the log lines' wall
    time per iteration), its voluntary (it blocked) and involuntary (preempted) switches per iteration and the
    CPUs it was seen on. None where the step has no log times or fewer than two samples fall in the window."""
    procs, samples = threads
    first = step.get("measured_from", WARMUP + 1) - 1
    ats = sorted((int(k), v["at"]) for k, v in (step.get("iterations") or {}).items()
                 if v.get("at") is not None and int(k) >= first)
    if len(ats) < 2 or "started" not in step:
        return None
    lo, hi = step["started"] + ats[0][1], step["started"] + ats[-1][1]
    wall_ms = (ats[-1][1] - ats[0][1]) * 1e3 / (ats[-1][0] - ats[0][0])
    inside = [i for i, (t, _) in enumerate(samples) if lo <= t <= hi]
    if len(inside) < 2:
        return None
    state: dict[tuple[int, int], list] = {}
    for _, rows in samples[:inside[0] + 1]:
        state.update(rows)
    before = dict(state)
    cpus: dict[tuple[int, int], set[int]] = {}
    for _, rows in samples[inside[0] + 1:inside[-1] + 1]:
        state.update(rows)
        for key, r in rows.items():
            cpus.setdefault(key, set()).add(r[7])
    per_it = wall_ms / ((samples[inside[-1]][0] - samples[inside[0]][0]) * 1e3)  # count over the samples -> per it.
    out = []
    for key, r in state.items():
        b = before.get(key, [*r[:3], 0, 0, 0, 0, r[7]])
        on_ms = (r[3] - b[3]) / 1e6 * per_it
        if on_ms <= 0:
            continue
        out.append({"pid": r[0], "tid": r[1], "comm": r[2], "main": r[0] == r[1],
                    "cmd": procs.get(r[0], {}).get("cmd", "")[-60:],
                    "on_cpu_ms": on_ms, "runqueue_ms": (r[4] - b[4]) / 1e6 * per_it if r[4] >= 0 else None,
                    "voluntary": (r[5] - b[5]) * per_it, "involuntary": (r[6] - b[6]) * per_it,
                    "cpus": sorted(cpus.get(key, {r[7]}))})
    out.sort(key=lambda x: -x["on_cpu_ms"])
    return {"wall_ms": wall_ms, "threads": out[:top]}


def _rank0(trace: Path, since: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[tuple[float, float]]]:
    """Rank 0's marks, its GPU-timed segments and its measured iterations (``since`` on) as (begin, end) compute
    clocks."""
    from prism_megatron.trace import read_trace

    tr = read_trace(trace)
    marks = [m for m in tr.marks.to_pylist() if m["rank"] == 0]
    bounds = [m["compute_clock"] for m in marks if m["name"] == "iteration"]
    return marks, [g for g in tr.gpu.to_pylist() if g["rank"] == 0], \
        list(zip(bounds[0::2], bounds[1::2], strict=False))[since - 1:]


def _segments(rows: list[dict[str, Any]], a: float, b: float) -> list[dict[str, Any]]:
    """The GPU-timed segments that end in the compute-clock stretch (a, b]."""
    return [g for g in rows if a + 1e-9 < g["clock_end"] <= b + 1e-9]  # one ending at a is the iteration before's


def host_device(trace: Path, since: int = WARMUP + 1) -> dict[str, float]:
    """Rank 0's median over measured iterations (``since`` on) of compute clock, measured host and device time (ms)."""
    _, rows, iterations = _rank0(trace, since)
    if not iterations:
        return {}
    clocks, hosts, devices = [], [], []
    for a, b in iterations:
        mine = _segments(rows, a, b)
        clocks.append(b - a)
        hosts.append(sum(g["cpu"] for g in mine))
        devices.append(sum(g["gpu"] for g in mine))
    return {"clock_ms": statistics.median(clocks) * 1e3, "host_ms": statistics.median(hosts) * 1e3,
            "device_ms": statistics.median(devices) * 1e3}


def waits_and_host(trace: Path, since: int = WARMUP + 1) -> dict[str, Any] | None:
    """Rank 0's wall time between each measured iteration and the one before it (the log line, with its wait for
    the live prediction) and the host time of the iterations that measured their own (a profiled iteration copies
    a plain one's: equal sums are left out), with their correlation: does a rank's host time rise with the wait
    before it? None without GPU-timed segments."""
    marks, rows, iterations = _rank0(trace, 1)
    ends = [m["t"] for m in marks if m["name"] == "iteration" and m["phase"] == "E"]
    begins = [m["t"] for m in marks if m["name"] == "iteration" and m["phase"] == "B"]
    if not rows:
        return None
    waits, host, last = {}, {}, None
    for k, (a, b) in enumerate(iterations, 1):
        own = sum(g["cpu"] for g in _segments(rows, a, b))
        if k >= since and k >= 2 and k - 1 < len(begins) and own > 0 and own != last:
            waits[k], host[k] = (begins[k - 1] - ends[k - 2]) * 1e3, own * 1e3
        last = own
    if len(waits) < 4:
        return None
    ks = sorted(waits)
    half = len(ks) // 2
    out = {"waits_ms": waits, "host_ms": host, "iterations": (ks[0], ks[-1]),
           "early": (statistics.median(waits[k] for k in ks[:half]), statistics.median(host[k] for k in ks[:half])),
           "late": (statistics.median(waits[k] for k in ks[half:]), statistics.median(host[k] for k in ks[half:]))}
    try:
        out["correlation"] = statistics.correlation([waits[k] for k in ks], [host[k] for k in ks])
    except statistics.StatisticsError:  # constant waits or host times
        out["correlation"] = None
    return out


#: A host-only segment this much longer (ms, median) in the plain iterations than in the profiled ones is named
PLAIN_EXCESS_MS = 0.2


def plain_excess(trace: Path, since: int = WARMUP + 1) -> list[dict[str, Any]] | None:
    """Rank 0's host-only segments (no device work) that take longer on the compute clock in the plain iterations
    than in the profiled ones: the profiler only adds host time, so such a segment carries a cost of GPU timing's own
    into the plain iteration, whose host time both twins take (the first CUDA call after CUPTI's teardown did,
    docs/measurements.md). The plain iterations are those of the parity whose iterations take less clock. None
    without GPU-timed segments or iterations of one shape."""
    _, rows, iterations = _rank0(trace, 1)
    # from the iteration before's end: the segments between two iterations (the log line) are the next one's
    per = [_segments(rows, iterations[k - 1][1], iterations[k][1]) for k in range(max(since, 2) - 1, len(iterations))]
    if len(per) < 4 or not per[0] or len({len(p) for p in per}) != 1:
        return None
    totals = [statistics.median(sum(g["clock_end"] - g["clock_start"] for g in p) for p in per[k::2]) for k in (0, 1)]
    plain, profiled = (per[0::2], per[1::2]) if totals[0] < totals[1] else (per[1::2], per[0::2])
    out = []
    for j in range(len(per[0])):
        if any(p[j]["gpu"] > 0 for p in per):
            continue
        u = statistics.median((p[j]["clock_end"] - p[j]["clock_start"]) * 1e3 for p in plain)
        q = statistics.median((p[j]["clock_end"] - p[j]["clock_start"]) * 1e3 for p in profiled)
        if u - q > PLAIN_EXCESS_MS:
            out.append({"segment": j, "plain_ms": u, "profiled_ms": q})
    return out


def _split(iteration_ms: list[float], forward: list[list[float]], backward: list[list[float]],
           body: list[list[float]] | None = None) -> dict[str, float]:
    """Medians over iterations of the iteration, its forward spans' sum, its backward spans' sum and the rest; with
    ``body``, also the sum of its forwards' bodies (each forward's longest stretch without a collective)."""
    out = {"iteration_ms": statistics.median(iteration_ms), "forward_ms": statistics.median(sum(f) for f in forward),
           "backward_ms": statistics.median(sum(b) for b in backward),
           "rest_ms": statistics.median(t - sum(f) - sum(b) for t, f, b in zip(iteration_ms, forward, backward,
                                                                                 strict=True)),
           "iterations": len(iteration_ms)}
    if body and all(body):
        out["body_ms"] = statistics.median(sum(b) for b in body)
    return out


def _bodies(spans: list[list[Any]]) -> list[float]:
    """Each forward span's body (ms): its longest stretch between its begin, the collectives called inside it and its
    end (spans_driver.py's ``collective`` entries; none: the whole forward)."""
    calls = [t for name, t, _ in spans if name == "collective"]
    out = []
    for name, start, d in spans:
        if name == "forward":
            cuts = [start, *(t for t in calls if start <= t <= start + d), start + d]
            out.append(max(b - a for a, b in zip(cuts, cuts[1:], strict=False)) * 1e3)
    return out


def real_spans(step: dict[str, Any], microbatches: int) -> dict[str, float] | None:
    """A ``real-spans`` run's iteration split into its forward and backward spans (spans_driver.py) and the rest,
    over its measured iterations: each iteration's spans are the next ``microbatches`` of each kind."""
    forward = [d * 1e3 for name, _, d in step.get("spans") or [] if name == "forward"]
    backward = [d * 1e3 for name, _, d in step.get("spans") or [] if name == "backward"]
    its = sorted((int(k), v["ms"]) for k, v in step["iterations"].items() if int(k) >= step["measured_from"])
    its = [(k, ms) for k, ms in its if k * microbatches <= min(len(forward), len(backward))]
    if not its:
        return None
    cut = [slice((k - 1) * microbatches, k * microbatches) for k, _ in its]
    timed = any(name == "collective" for name, _, _ in step.get("spans") or [])
    body = _bodies(step["spans"]) if timed else None
    return _split([ms for _, ms in its], [forward[c] for c in cut], [backward[c] for c in cut],
                  [body[c] for c in cut] if body else None)


def trace_spans(trace: Path, since: int = WARMUP + 1) -> dict[str, float] | None:
    """Rank 0's iterations split as ``real_spans`` splits a real run's, by its forward and backward marks: on the
    compute clock (the program's time, the runtime's own left out, waits for the device in), or where the rank was
    GPU-timed, in measured host time (its segments' ``cpu``: a profiled iteration's clock is no host time)."""
    marks, rows, iterations = _rank0(trace, since)

    def length(a: float, b: float) -> float:  # ms of the program between two clocks
        return sum(g["cpu"] for g in _segments(rows, a, b)) * 1e3 if rows else (b - a) * 1e3

    iteration_ms, forward, backward, body = [], [], [], []
    for a, b in iterations:
        spans: dict[str, list[float]] = {"forward": [], "backward": []}
        bodies: list[float] = []
        begun: dict[str, float] = {}
        for m in marks:
            if m["name"] not in spans or not a <= m["compute_clock"] <= b:
                continue
            if m["phase"] == "B":
                begun[m["name"]] = m["compute_clock"]
            elif m["name"] in begun:
                start = begun.pop(m["name"])
                spans[m["name"]].append(length(start, m["compute_clock"]))
                if m["name"] == "forward" and rows:  # its body: its longest segment (no runtime call inside)
                    bodies.append(max((g["cpu"] for g in _segments(rows, start, m["compute_clock"])), default=0) * 1e3)
        iteration_ms.append(length(a, b))
        forward.append(spans["forward"])
        backward.append(spans["backward"])
        body.append(bodies)
    return _split(iteration_ms, forward, backward, body if rows else None) if iteration_ms else None


def forward_lengths(step: dict[str, Any], root: Path) -> list[float | None]:
    """Each forward's length (ms) in a step's program, in order: a real run's forward spans, an emulated rank's host
    time over each forward (on its compute clock where it was not GPU-timed). None where an emulated forward's
    host time is not its own: a profiled iteration takes the host times of the plain one before it
    (runtime.gpu_timing.pair), so its forwards repeat that iteration's exactly."""
    if "spans" in step:
        return [d * 1e3 for name, _, d in step["spans"] if name == "forward"]
    marks, rows, _ = _rank0(root / step["trace"], 1)
    out: list[float | None] = []
    per_iteration: list[list[float]] = []
    begun = None
    for m in marks:
        if m["name"] == "iteration" and m["phase"] == "B":
            per_iteration.append([])
        elif m["name"] == "forward" and m["phase"] == "B":
            begun = m["compute_clock"]
        elif m["name"] == "forward" and begun is not None:
            mine = _segments(rows, begun, m["compute_clock"])
            ms = sum(g["cpu"] for g in mine) * 1e3 if rows else (m["compute_clock"] - begun) * 1e3
            if per_iteration:
                per_iteration[-1].append(ms)
            begun = None
    for i, its in enumerate(per_iteration):
        copied = i > 0 and rows and len(its) == len(per_iteration[i - 1]) and all(
            math.isclose(a, b, rel_tol=1e-9) for a, b in zip(its, per_iteration[i - 1], strict=True))
        out.extend(None if copied or (rows and ms == 0) else ms for ms in its)
    return out


def canary_split(row_steps: list[tuple[str, list[float], list[float | None]]]) -> list[tuple[str, list[float],
                                                                                               list[float]]]:
    """Per canary step (kind, each probed forward's canary Python call, the step's forward lengths): the forwards
    the host ran at full speed (canary within ``FULL_SPEED`` of the least any step saw) and the slowed ones, their
    lengths (ms) where they are the forward's own."""
    floor = min((p for _, py, _ in row_steps for p in py), default=0.0)
    out = []
    for kind, py, lengths in row_steps:
        mine = lengths[-len(py):] if py else []
        fast = [ms for p, ms in zip(py, mine, strict=False) if ms is not None and at_full_speed(p, floor)]
        slow = [ms for p, ms in zip(py, mine, strict=False) if ms is not None and not at_full_speed(p, floor)]
        out.append((kind, fast, slow))
    return out


def split_text(sp: dict[str, float]) -> str:
    """An iteration's split (``_split``) as "iteration = forward + backward + the rest" in ms."""
    body = f" (body {sp['body_ms']:.1f})" if "body_ms" in sp else ""
    return f"{sp['iteration_ms']:.1f} = {sp['forward_ms']:.1f}{body} + {sp['backward_ms']:.1f} + {sp['rest_ms']:.1f}"


def table(report: dict[str, Any]) -> str:
    """The text table: per config the real median and spread, per emulation the prediction and error."""
    w = max([32, *(len(n) for n in report["rows"])])
    lines = [f"{'config':{w}} {'real ms':>8} {'spread':>7} {'drift':>6}  {'emulation':14} {'pred ms':>8} {'err %':>7} "
             f"{'live ms':>8} {'step':>8} {'1-clock':>8} {'host':>7} {'device':>7}"]
    errors, others = [], []
    for name, row in report["rows"].items():
        real, spread, drift = row.get("real_ms"), row.get("real_spread_pct"), row.get("real_drift_pct")
        first = True
        for kind, em in (row.get("emulations") or {"-": {}}).items():
            hd = em.get("host_device") or {}
            since = em.get("measured_from", WARMUP + 1)
            one = _measured(em.get("one_clock_period_ms", {}), since)
            ee = _measured(em.get("step_ms", {}), since)
            lines.append(
                f"{name if first else '':{w}} {_f(real if first else None, '.1f'):>8} "
                f"{_f(spread if first else None, '.1f'):>7} {_f(drift if first else None, '.1f'):>6}  "
                f"{kind + ('*' if em.get('predicted_from') == 'live' else ''):14} "
                f"{_f(em.get('predicted_ms'), '.1f'):>8} "
                f"{_f(em.get('error_pct'), '+.1f'):>7} {_f(em.get('live_median_ms'), '.1f'):>8} "
                f"{_f(statistics.median(ee) if ee else None, '.1f'):>8} "
                f"{_f(statistics.median(one) if one else None, '.1f'):>8} {_f(hd.get('host_ms'), '.0f'):>7} "
                f"{_f(hd.get('device_ms'), '.0f'):>7}")
            first = False
            scored = re.fullmatch(r"emu(\d+)(-fold)?(#\d+)?", kind)  # a repeat ("emu1#3") is scored as the first
            if em.get("error_pct") is not None and scored:
                why = unlike(int(scored.group(1)), row.get("omp"))
                if why is None and not (spread is not None and spread < TRUTH_SPREAD and (drift or 0.0) < TRUTH_SPREAD):
                    why = f"spread {_f(spread, '.1f')} %, drift {_f(drift, '.1f')} %"
                (others if why else errors).append((name, kind, em["error_pct"], why))
        waited = [(k, em["waits"]) for k, em in (row.get("emulations") or {}).items() if em.get("waits")]
        if waited:
            lines.append(f"{'':{w}} wait before each iteration (the log line and its live prediction) and the "
                         "host time of those that measured their own, ms, medians of the first and the second half: "
                         + "; ".join(f"{k} (iterations {x['iterations'][0]}-{x['iterations'][1]}) wait "
                                     f"{x['early'][0]:.0f} -> {x['late'][0]:.0f}, host {x['early'][1]:.0f} -> "
                                     f"{x['late'][1]:.0f}, correlation {_f(x['correlation'], '.2f')}"
                                     for k, x in waited))
        excess = [(k, em["plain_excess"]) for k, em in (row.get("emulations") or {}).items()
                  if em.get("plain_excess") is not None]
        if excess:
            lines.append(f"{'':{w}} host-only segments longer in the plain iterations than in the profiled ones (GPU "
                         "timing's own cost, in the host time both twins take), ms medians: "
                         + "; ".join(f"{k} " + (", ".join(f"segment {x['segment']} {x['plain_ms']:.2f} against "
                                                           f"{x['profiled_ms']:.2f}" for x in xs) or "none")
                                     for k, xs in excess))
        if row.get("probe"):
            parts = [f"{p} {v['wall_ms']:.1f}" + (f" (less its waits {v['host_ms']:.1f})" if "host_ms" in v else "")
                     + (f" (busy {v['device_busy_ms']:.1f})" if "device_busy_ms" in v else "")
                     + (f" @{v['sm_clock_mhz']:.0f} MHz" if "sm_clock_mhz" in v else "")
                     for p, v in row["probe"].items()]
            lines.append(f"{'':{w}} probe (train_step ms, median per phase): " + ", ".join(parts))
        for kind, census in row.get("gc") or []:
            busiest = sorted(census.values(), key=lambda c: -c["ms_per_iteration"])[:2]
            lines.append(f"{'':{w}} {kind} garbage collection per iteration: " + "; ".join(
                f"{c['ms_per_iteration']:.1f} ms in {c['collections_per_iteration']:.0f} "
                f"({c['gen2_per_iteration']:.1f} full, {c['gen2_ms_each'][:4]} ms) [{c['command'][-40:]}]"
                for c in busiest))
        sung = row.get("canary") or []
        if sung:
            lines.append(f"{'':{w}} canary at each forward's start, us per call (medians): " + "; ".join(
                f"{kind} {canary_text(c['canary'])}" for kind, c in sung))
        if row.get("canary_forwards"):
            lines.append(f"{'':{w}} forwards by the canary, median ms at full speed (how many) / slowed (how many): "
                         + ", ".join(f"{kind} {_f(statistics.median(fast) if fast else None, '.1f')} ({len(fast)}) / "
                                     f"{_f(statistics.median(slow) if slow else None, '.1f')} ({len(slow)})"
                                     for kind, fast, slow in row["canary_forwards"]))
        counted = row.get("calls") or []
        real_calls = next(((k, c) for k, c in counted if k.startswith("real")), None)
        for kind, calls in counted:
            if real_calls and kind.startswith("emu"):
                lines.append(f"{'':{w}} {kind} against {real_calls[0]}, over {calls['forwards']} and "
                             f"{real_calls[1]['forwards']} forwards: {calls_text(real_calls[1], calls)}")
        timed = row.get("times") or []
        if timed:
            lines.append(f"{'':{w}} {frames_text(timed)}")
        real_times = next(((k, t) for k, t in timed if k.split("+")[0] == "real-spans"), None)
        for kind, times in timed:  # each emulation and every other spanned step: a neighbour, a rank's part, launched
            if real_times and kind.split("+")[0] != "real-spans":
                lines.append(f"{'':{w}} {kind} against {real_times[0]}: {times_text(real_times[1], times)}")
        split = [(k, sp) for k, sp in row.get("spans") or []] + [
            (k, em["spans"]) for k, em in (row.get("emulations") or {}).items() if em.get("spans")]
        if split:
            lines.append(f"{'':{w}} per iteration = forward + backward spans + the rest (ms, medians; an emulation's "
                         "on its compute clock, GPU-timed in host time): " + ", ".join(
                             f"{k} {split_text(sp)}" for k, sp in split))
        if row.get("forked"):
            lines.append(f"{'':{w}} real-forked (the driver forked from a template that imported torch and Megatron; "
                         "not scored): " + ", ".join(f"{m:.1f} ms" + (f" ({(m / real - 1) * 100:+.1f} % against real)"
                                                                      if real else "") for m in row["forked"]))
        if row.get("host_cpus"):
            lines.append(f"{'':{w}} host CPUs per step, busy / stolen %: " + ", ".join(
                f"{kind} {busy:.0f} / {steal:.1f}" for kind, (busy, steal) in row["host_cpus"]))
        for kind, t in row.get("threads") or []:
            lines.append(f"{'':{w}} {kind} threads, per iteration of {t['wall_ms']:.1f} ms wall: " + "; ".join(
                f"{x['tid']}{' (main)' if x['main'] else ''} {x['comm']}: on a CPU {x['on_cpu_ms']:.1f} ms, "
                f"runnable {_f(x['runqueue_ms'], '.1f')} ms, {x['voluntary']:.0f} blocked / "
                f"{x['involuntary']:.0f} preempted, CPUs {','.join(map(str, x['cpus']))}" for x in t["threads"]))
        if row.get("error"):
            lines.append(f"{'':{w}} FAILED: {row['error'][:300]}")
    mae = sum(abs(e[2]) for e in errors) / len(errors) if errors else None
    lines.append("")
    lines.append(f"mean absolute error over configs whose real repeats spread and drift < {TRUTH_SPREAD} % "
                 f"({len(errors)} emulations): {_f(mae, '.2f')} %")
    if any(em.get("predicted_from") == "live" for row in report["rows"].values()
           for em in (row.get("emulations") or {}).values()):
        lines.append("  * traces not kept: predicted = Megatron's logged prediction (live ms), not the trace's replay")
    for name, kind, err, why in others:
        lines.append(f"  not ground truth ({why}): {name} {kind} error {err:+.1f} %")
    report["mean_abs_error_pct"] = mae
    return "\n".join(lines)


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def analyse(report: dict[str, Any], root: Path, resolve: bool = False, samples: Path | None = None,
            threads: Path | None = None) -> str:
    """The table of one call's report (``root``: its traces; ``samples``: its host-cpus.csv, ``threads``: its
    host-threads.jsonl, where kept)."""
    report["rows"] = {}
    cpus = host_cpus(samples) if samples is not None and samples.is_file() else None
    tasks = host_threads(threads) if threads is not None and threads.is_file() else None
    for name, steps in report["steps"].items():
        try:
            report["rows"][name] = analyse_config(steps, root, resolve, cpus, tasks, microbatches(config_of(name)))
            report["rows"][name]["omp"] = dict(config_of(name).env).get("OMP_NUM_THREADS")
        except Exception as e:  # noqa: BLE001
            report["rows"][name] = {"error": f"{type(e).__name__}: {e}"}
    return table(report)


def _open_run(run: Path, scratch: Path) -> tuple[dict[str, Any], Path, Path, Path]:
    """(report, root of its traces, its host-cpus.csv, its host-threads.jsonl) of a brought-back OUT directory or
    of a committed ``NAME.json`` whose traces are packed in ``NAME-traces.tar.gz`` beside it (unpacked into
    ``scratch``) and whose host samples are ``NAME-host-cpus.csv`` and ``NAME-host-threads.jsonl``."""
    if run.is_dir():
        path, packed, root = run / "one-gpu-truth.json", run / "traces.tar.gz", run
        samples, threads = run / "host-cpus.csv", run / "host-threads.jsonl"
    else:
        stem = _result_stem(run)
        path, packed, root = run, run.with_name(f"{stem}-traces.tar.gz"), scratch
        samples, threads = run.with_name(f"{stem}-host-cpus.csv"), run.with_name(f"{stem}-host-threads.jsonl")
    if not path.is_file():
        raise SystemExit(f"--analyse {run}: no {path.name} (an OUT directory or a result .json or .json.gz)")
    try:
        text = gzip.decompress(path.read_bytes()).decode() if path.name.endswith(".gz") else path.read_text()
        report = json.loads(text)
    except (json.JSONDecodeError, gzip.BadGzipFile, UnicodeDecodeError) as e:
        raise SystemExit(f"--analyse {path}: not JSON ({e})") from None
    missing = [k for k in ("steps", "configs") if k not in report]
    if missing:
        raise SystemExit(f"--analyse {path}: no field {missing[0]!r} (not a one_gpu_truth.py result)")
    if not (root / "work").exists() and packed.exists():
        with tarfile.open(packed) as tar:
            tar.extractall(root, filter="data")
    return report, root / "work", samples, threads


def _result_stem(path: Path) -> str:
    """``NAME`` of a committed ``NAME.json`` or ``NAME.json.gz`` (large results are committed compressed)."""
    name = path.name
    return name.removesuffix(".gz").removesuffix(".json")


def analyse_runs(runs: list[Path], resolve: bool = False) -> str:
    """The table of one or more runs (device calls). Each config's emulations are scored against the real
    runs of the same call only (the machine's speed drifts between calls); several runs give one table,
    each row named after its run, and one mean absolute error over all of them."""
    import tempfile

    merged: dict[str, Any] = {"steps": {}, "rows": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for i, run in enumerate(runs):
            report, work, samples, threads = _open_run(run, Path(scratch) / str(i))
            text = analyse(report, work, resolve, samples, threads)
            if len(runs) == 1:
                if run.is_dir():
                    (run / "one-gpu-truth-analysed.json").write_text(json.dumps(report, indent=1))
                return text
            label = (run.name if run.is_dir() else _result_stem(run)).rsplit("-", 1)[-1]
            for name, row in report["rows"].items():
                merged["rows"][f"{name} [{label}]"] = row
    return table(merged)


# ----------------------------------------------------------------------------- main
def parse_plan(plan: str, configs: list[str]) -> dict[str, list[str]]:
    if not plan:
        return {c: list(DEFAULT_STEPS) for c in configs}
    out = {}
    for part in plan.split(";"):
        name, _, steps = part.partition(":")
        name = name.strip()
        config_of(name)
        out[name] = [s.strip() for s in steps.split(",") if s.strip()] or list(DEFAULT_STEPS)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("one-gpu-truth"))
    p.add_argument("--work", type=Path, default=Path("/tmp/one-gpu-truth"),
                   help="traces and logs (packed into OUT/traces.tar.gz at the end)")
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS.values() if c.default),
                   help="comma-separated config names")
    p.add_argument("--plan", default="", help="'config:step,step,...;config:...' (steps: real, real-threads1, "
                   "real-forked, real-spans, real-spans-neighbour, launched-spans, probe, "
                   "emuW[-keep|-teardown|-off|-spin|-prof|-fold|-exec|-fork|-nolive|-awake]; "
                   "any +gc, +calls, +canary or +times)")
    p.add_argument("--iters", type=int, default=8, help=f"iterations per run ({WARMUP} of them warm-up)")
    p.add_argument("--real-extra", type=int, default=30,
                   help="iterations a real run makes beyond --iters before the ones measured (steady state)")
    p.add_argument("--emu-extra", type=int, default=None,
                   help="iterations an emulation makes beyond --iters before the ones measured (default: "
                   "--real-extra, so both sides are measured over the same iterations; emulations have a "
                   "start-up transient too)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds after which no step starts")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds one step may take")
    p.add_argument("--analyse", type=Path, nargs="+", default=None, metavar="RUN",
                   help="rebuild the table of brought-back runs: an OUT directory, or a committed result .json "
                   "(its traces in NAME-traces.tar.gz beside it); several: one table, one mean error over all")
    p.add_argument("--resolve-backlog", action="store_true",
                   help="with --analyse: solve the traces' plain host times again with the device backlog")
    args = p.parse_args(argv)
    if args.analyse is not None:
        print(analyse_runs(args.analyse, args.resolve_backlog))
        return 0
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        config_of(c)
    plan = parse_plan(args.plan, configs)
    out = args.out
    work = args.work
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    report: dict[str, Any] = {"iters": args.iters, "warmup": WARMUP, "plan": plan, "steps": {},
                              "configs": {c: {"flags": list(config_of(c).flags), "gbs": config_of(c).gbs,
                                              "note": config_of(c).note} for c in plan}}
    # interleave configs step by step? no: a config's steps run together, so its real runs and emulations
    # see the same state of the machine; the configs run in the plan's order
    for name, steps in plan.items():
        report["steps"][name] = done = []
        for i, kind in enumerate(steps):
            if time.monotonic() > deadline:
                done.append({"kind": kind, "skipped": "budget"})
                continue
            t0, started = time.monotonic(), time.time()
            try:
                result = step(kind, config_of(name), work / name, args.iters, i, args.timeout, args.real_extra,
                              args.real_extra if args.emu_extra is None else args.emu_extra)
            except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
                result = {"kind": kind, "error": str(e)[-1500:]}
            result["seconds"] = time.monotonic() - t0
            result["started"] = started  # epoch seconds: where the step lies in host-cpus.csv and gpu-clocks.csv
            done.append(result)
            brief = result.get("error", "")[-300:] or " ".join(
                f"{k}:{v['ms']:.0f}" for k, v in sorted(result.get("iterations", {}).items())) or \
                " ".join(f"{r['iteration']}:{r['phase']}:{r['wall_ms']:.0f}" for r in result.get("rows", []))
            print(f"{name} {kind} ({result['seconds']:.0f} s): {brief}", flush=True)
            (out / "one-gpu-truth.json").write_text(json.dumps(report, indent=1))
    text = analyse(report, work, samples=out / "host-cpus.csv", threads=out / "host-threads.jsonl")
    print(text, flush=True)
    (out / "one-gpu-truth.json").write_text(json.dumps(report, indent=1))
    (out / "one-gpu-truth.txt").write_text(text + "\n")
    with tarfile.open(out / "traces.tar.gz", "w:gz") as tar:
        tar.add(work, arcname="work", filter=_without_live_snapshots)
    return 0


def _without_live_snapshots(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Leave out the coordinator's live snapshots (``*.logs/live-trace``): each is the run's own trace again, cut at
    its last logged iteration, and they doubled the packed traces a call brings back and the results commit."""
    return None if Path(member.name).name == "live-trace" and Path(member.name).parent.name.endswith(".logs") \
        else member


if __name__ == "__main__":
    sys.exit(main())
