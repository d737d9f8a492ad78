"""Prediction accuracy: the real job's iteration time next to the time replay predicts from its emulation.

  python bench/accuracy/run.py [--cpu] [--gpu] [--iters N] [--out DIR] [--work DIR] [--only A,B] [--budget S]

Every config runs side by side in this invocation: the real job (``torchrun`` with one process per
rank, each on a core or GPU of its own) and the same job emulated by prism (``prism-megatron run
--prism-emulate``), whose PrismTrace is replayed (``replay(graph_from_trace(read_trace(D)), cost)``).
Both run the core GPT driver with the same flags; ``N`` iterations are measured after ``WARMUP``
warm-up iterations, and each side reports the median. An iteration is timed the same way on both
sides: from the first rank's begin of the ``iteration`` span to the last rank's end
(``timed_driver.py`` stamps the real one, the replay's ``ReplayResult.iterations()`` the predicted
one). On CPU the real job runs twice, before and after the emulation: this machine is shared, and
the two real medians show the run-to-run noise the error has to be read against. A real CPU run
during which other processes kept more than ``QUIET_LOAD`` cores busy is left out of the real
median (a rank then had no core of its own); a row with no such quiet run is marked as no ground
truth and left out of the mean error.

Diagnostics printed with the table, to tell what limits the accuracy: how much two single-thread
processes slow each other down on this machine (``contention_probe.py``: the real W = 2 run computes
on both cores at once, the 1-slot emulation on one), and the emulation's own cost per op
(``op_overhead.py``: slot-holding time that the bare trace counts as compute), multiplied per row by
the ops an iteration issues.

CPU (``--cpu``, the default; this 2-core machine). A real run is ground truth only where every rank
has a core of its own, one torch thread each, as on the target: W = 2 (TP2, PP2, DP2, EP2), two gloo
processes with ``OMP_NUM_THREADS=1`` against two logical ranks on one slot with
``--prism-threads-per-rank 1``. Communication in the prediction is costed by a profile of the real
link, gloo over loopback, fitted in the same invocation (``gloo_probe.py``; see :class:`GlooCost`):
free communication would leave out what the real job pays for it (TP2 all-reduces 18 activations
per iteration, ~0.5-1 ms each here), and the replay is the place where link costs come in. The
free-communication prediction is shown in the notes, so the share of the fit is visible. Larger W
cannot be ground truth here (8 ranks on 2 cores share cores), so W = 8 checks consistency instead: the
prediction from one slot and from two slots must agree (communication free on both sides: the check
is on the measured compute and the graph, not on a link model).

GPU (``--gpu``, on an ``nvidia-h200-x2``; ``bench/gpu/accuracy.sh``): real 2-GPU runs with NCCL of
a GPT of about 1B parameters (TP2, PP2, DP2; EP2 with a MoE of about 1B), predicted from the same
job emulated on GPU 0, communication costed by the cluster profile ``h200-nvlink-ib400``. bf16
where the core driver accepts ``--bf16``, else fp32 (the notes say which). Target: mean absolute
error <= 1 %.

Output: a table (rich), ``DIR/accuracy.txt`` (what was printed) and ``DIR/accuracy.json`` (rows,
per-iteration times, the probes, the load other processes put on the machine during each run;
rewritten after every row, so a run cut short keeps what it measured); traces and logs stay under
``--work`` (a temporary directory by default). ``--budget S`` skips the configs that would start
after S seconds (the GPU script keeps to its device time with it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prism_megatron.megatron.driver import CORE_DRIVER_SCRIPT

HERE = Path(__file__).resolve().parent
PY = sys.executable
WARMUP = 2  # first iterations left out: allocator, autotuning and lazy initialisation
GPU_CLUSTER = "h200-nvlink-ib400"
GPU_TARGET_MAE = 1.0  # percent
QUIET_LOAD = 0.25  # cores other processes may keep busy during a real CPU run that still counts as ground truth
CPU_OP_BYTES = 512 << 10  # the CPU TP2 row's activations (micro-batch 2 x seq 256 x hidden 256, fp32)
GPU_OP_ELEMENTS = 1024 * 2048  # elements of the GPU TP2 row's activations (micro-batch 1 x seq 1024 x hidden 2048)


class RunFailed(RuntimeError):
    """A real or emulated run exited non-zero; the message ends with the tail of its log."""


# ----------------------------------------------------------------------------- configs
@dataclass
class Case:
    """One job: its core-driver flags and its world size."""

    name: str
    flags: list[str]
    world: int = 2
    consistency: bool = False  # W > cores: compare 1-slot and 2-slot predictions instead of a real run
    note: str = ""


def gpt_flags(*, layers: int, hidden: int, heads: int, seq: int, vocab: int, mbs: int, gbs: int, iters: int,
              tp: int = 1, pp: int = 1, ep: int = 1, experts: int = 0, moe_ffn: int = 0,
              extra: tuple[str, ...] = ()) -> list[str]:
    """Core-driver flags of a GPT job (the shape of what ``recipe show`` renders)."""
    flags = [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq),
        "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab), "--mock-data",
        "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), "--train-iters", str(iters),
        "--lr", "0.0001", "--seed", "1234", "--optimizer", "adam",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--expert-model-parallel-size", str(ep),
        "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
        "--log-interval", "1", "--eval-iters", "0",
    ]
    if experts:
        # 0.16.1's fused bias-GeLU refuses MoE's per-token probabilities (as the moe-ep2 recipe)
        flags += ["--num-experts", str(experts), "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
                  "--moe-ffn-hidden-size", str(moe_ffn), "--no-bias-gelu-fusion"]
    return flags + list(extra)


def cpu_cases(iters: int) -> list[Case]:
    """W = 2 ground truth (a rank per core) and W = 8 consistency; ~100-500 ms of compute per rank."""
    n = iters + WARMUP
    # 4 layers, hidden 256, seq 256: forward + backward of a micro-batch of 2 is ~0.4 s for the whole
    # model on one core, so each row below computes ~250-500 ms per rank and iteration
    base = dict(layers=4, hidden=256, heads=8, seq=256, vocab=1024, mbs=2, iters=n)
    from prism_megatron.recipe import load_recipe, render_args

    recipe = render_args(load_recipe("mini-dense-tp2pp2dp2")) + ["--train-iters", str(n)]
    return [
        Case("cpu-tp2", gpt_flags(**base, gbs=2, tp=2), note="1 microbatch"),
        Case("cpu-pp2", gpt_flags(**(base | {"mbs": 1}), gbs=4, pp=2), note="4 microbatches, 1F1B"),
        Case("cpu-dp2", gpt_flags(**base, gbs=4), note="1 microbatch per DP rank"),
        Case("cpu-ep2", gpt_flags(**base, gbs=4, ep=2, experts=4, moe_ffn=512), note="MoE 4 experts top-2, DP2"),
        Case("cpu-w8-mini-dense-tp2pp2dp2", recipe, world=8, consistency=True, note="recipe as shipped"),
        Case("cpu-w8-tp2pp2dp2", gpt_flags(**(base | {"mbs": 1}), gbs=4, tp=2, pp=2), world=8, consistency=True,
             note="the W=2 rows' model"),
    ]


def gpu_cases(iters: int, precision: str, mbs: int = 1) -> list[Case]:
    """2-GPU layouts of a ~1B-parameter GPT (dense ~1.08B; MoE ~1.2B, 8 experts).

    With micro-batch 1 these jobs are host-bound on an H200 (device busy 72-141 ms of 175-340 ms per
    iteration, bench/gpu/results/2026-11-30-accuracy-bf16-two-clock-h200x2.txt); ``mbs`` 8 makes the
    device the bottleneck, as in most jobs users tune (not yet measured).
    """
    n = iters + WARMUP
    # without apex's fused softmax kernel, bf16 needs Megatron's unfused softmax (as on the H200 machine)
    extra = ("--bf16", "--no-masked-softmax-fusion") if precision == "bf16" else ()
    dense = dict(layers=20, hidden=2048, heads=16, seq=1024, vocab=32000, mbs=mbs, iters=n, extra=extra)
    moe = dict(layers=16, hidden=1024, heads=16, seq=1024, vocab=32000, mbs=mbs, iters=n, extra=extra)
    tag = "" if mbs == 1 else f"-mbs{mbs}"
    return [
        Case(f"gpu-tp2{tag}", gpt_flags(**dense, gbs=4 * mbs, tp=2), note="dense 1.08B, 4 microbatches"),
        Case(f"gpu-pp2{tag}", gpt_flags(**dense, gbs=8 * mbs, pp=2), note="dense 1.08B, 8 microbatches, 1F1B"),
        Case(f"gpu-dp2{tag}", gpt_flags(**dense, gbs=4 * mbs), note="dense 1.08B, 2 microbatches per DP rank"),
        Case(f"gpu-ep2{tag}", gpt_flags(**moe, gbs=4 * mbs, ep=2, experts=8, moe_ffn=4096),
             note="MoE 1.2B, 8 experts top-2, alltoall, DP2"),
    ]


def driver_precision() -> str:
    """'bf16' if the core driver accepts ``--bf16`` (checked by parsing, in a child process), else 'fp32'."""
    probe = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('core_gpt', {str(CORE_DRIVER_SCRIPT)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "m.parse_args(['--num-layers', '1', '--hidden-size', '8', '--num-attention-heads', '1', '--seq-length', '8',"
        " '--vocab-size', '8', '--micro-batch-size', '1', '--train-iters', '1', '--lr', '0.1', '--mock-data',"
        " '--bf16', '--no-masked-softmax-fusion'])\n"
    )
    proc = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=300)
    return "bf16" if proc.returncode == 0 else "fp32"


# ----------------------------------------------------------------------------- measurement helpers
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measured(times: dict[int, float]) -> list[float]:
    """The iterations after the warm-up ones."""
    measured = [t for k, t in sorted(times.items()) if k > WARMUP]
    if not measured:
        raise RunFailed(f"no iteration after the {WARMUP} warm-up ones (got {sorted(times)})")
    return measured


def _median(times: dict[int, float]) -> float:
    return statistics.median(_measured(times))


class ForeignLoad:
    """CPU cores that *other* processes kept busy while a run ran (this machine is shared).

    /proc/stat's busy time minus the CPU time of our own (reaped) children, over the wall time.
    A real W = 2 run needs both cores: every core another process takes shows up in its time.
    """

    def __enter__(self) -> ForeignLoad:
        self.t0, self.busy0, self.own0 = time.monotonic(), self._busy(), self._own()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.monotonic() - self.t0
        self.cores = max((self._busy() - self.busy0) - (self._own() - self.own0), 0.0) / wall if wall else 0.0

    @staticmethod
    def _busy() -> float:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except OSError:
            return 0.0
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.children_user + t.children_system + t.user + t.system


def _run(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> float:
    """Run ``cmd`` with output to ``log``; returns the load of other processes meanwhile (cores)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f, ForeignLoad() as load:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent, timeout=timeout)
    if proc.returncode:
        tail = log.read_text(errors="replace")[-2500:]
        raise RunFailed(f"exit {proc.returncode}: {' '.join(cmd[:6])} ... (log {log})\n{tail}")
    return load.cores


def _fresh(path: Path) -> Path:
    """``path``, emptied: a reused --work must not mix an earlier run's stamps or trace into this one."""
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path.with_name(path.name + ".logs"), ignore_errors=True)
    return path


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    env.update(extra)
    return env


def real_run(case: Case, work: Path, timeout: float) -> tuple[dict[int, float], float]:
    """The job as ``case.world`` torchrun processes; per-iteration times from the ranks' stamps."""
    stamps = _fresh(work / "real-stamps")
    stamps.mkdir(parents=True)
    cmd = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={case.world}", f"--master-port={_port()}",
           str(HERE / "timed_driver.py"), *case.flags]
    load = _run(cmd, work / "real.log", _env(ACCURACY_TIMES=str(stamps)), timeout)
    begin: dict[int, float] = {}
    end: dict[int, float] = {}
    for path in stamps.glob("rank-*.json"):
        for it, phase, t in json.loads(path.read_text()):
            if phase == "B":
                begin[it] = min(begin.get(it, t), t)
            else:
                end[it] = max(end.get(it, t), t)
    ranks = len(list(stamps.glob("rank-*.json")))
    if ranks != case.world:
        raise RunFailed(f"{ranks} of {case.world} ranks wrote their iteration stamps ({stamps})")
    return {k: end[k] - begin[k] for k in begin if k in end}, load


def emulated_run(case: Case, work: Path, devices: str, slots: int, timeout: float) -> tuple[Path, float]:
    """The job as ``case.world`` logical ranks through prism; returns the trace directory."""
    trace = _fresh(work / f"trace-{slots}slot")
    cmd = [PY, "-m", "prism_megatron", "run", "--prism-emulate", "--prism-world-size", str(case.world),
           "--prism-devices", devices, "--prism-slots-per-device", str(slots), "--prism-threads-per-rank", "1",
           "--prism-report", "off", "--prism-log-ranks", "none", "--prism-trace-dir", str(trace),
           str(CORE_DRIVER_SCRIPT), *case.flags]
    load = _run(cmd, work / f"emulated-{slots}slot.log", _env(), timeout)
    return trace, load


def predict(trace: Path, cost: Callable, gpu_times: bool = True) -> dict[int, float]:
    """Per-iteration predicted times of a trace's replay under ``cost``; ``gpu_times=False`` ignores the
    measured host/device split (one clock per rank, as before GPU timing)."""
    from prism_megatron.replay import graph_from_trace, replay
    from prism_megatron.trace import read_trace

    result = replay(graph_from_trace(read_trace(trace), gpu_times=gpu_times), cost)
    return {it.number: it.time for it in result.iterations()}


def gpu_rows(trace: Path) -> int:
    """Compute segments with measured host/device times in a trace (0: one clock)."""
    from prism_megatron.trace import read_trace

    return read_trace(trace).gpu.num_rows


def host_device_per_iteration(trace: Path, skip: int = WARMUP) -> dict[int, dict[str, float]]:
    """Per rank, the median over iterations (after ``skip``) of its compute clock, measured host time and
    device busy time, in ms: whether the job is host- or device-bound, and what the emulation measured."""
    from prism_megatron.trace import read_trace

    tr = read_trace(trace)
    out: dict[int, dict[str, float]] = {}
    gpu = tr.gpu.num_rows > 0
    rows_of: dict[int, list[dict]] = {}
    for g in tr.gpu.to_pylist():
        rows_of.setdefault(g["rank"], []).append(g)
    marks = [m for m in tr.marks.to_pylist() if m["name"] == "iteration"]
    for rank in range(tr.world_size):
        bounds = [m["compute_clock"] for m in marks if m["rank"] == rank]
        clocks, hosts, devices = [], [], []
        for a, b in list(zip(bounds[0::2], bounds[1::2], strict=False))[skip:]:
            rows = [g for g in rows_of.get(rank, []) if a - 1e-9 < g["clock_end"] <= b + 1e-9]
            clocks.append(b - a)
            hosts.append(sum(g["cpu"] for g in rows))
            devices.append(sum(g["gpu"] for g in rows))
        if clocks:
            out[rank] = {"clock_ms": statistics.median(clocks) * 1e3,
                         "host_ms": statistics.median(hosts) * 1e3 if gpu else math.nan,
                         "device_ms": statistics.median(devices) * 1e3 if gpu else math.nan}
    return out


# ----------------------------------------------------------------------------- communication costs
class GlooCost:
    """The link of the CPU ground truth (gloo, 2 processes, loopback) as a replay cost function.

    ``gloo_probe.py`` times all_reduce, all_gather, broadcast, all_to_all and send/recv at 4 B-32 MiB; each kind
    gets its own latency + size/bandwidth line, fitted to minimise the *relative* error (small ops
    are the many, large ones the long). Per kind rather than the NCCL ring formulas of
    ``CollectiveCostModel``: gloo's algorithms are not NCCL's, and the ground-truth groups all have
    two members, so no formula has to extrapolate in n. Kinds the probe does not time (reduce,
    reduce_scatter) take the all_reduce line: an upper bound for a 2-member group.
    """

    def __init__(self, points: dict[str, list[tuple[int, float]]]) -> None:
        self.points = points
        self.fit = {family: self._fit(p) for family, p in points.items()}

    @staticmethod
    def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
        """(alpha s, beta s/byte) minimising sum(((alpha + beta*S) / t - 1)^2), both clamped to >= 0."""
        a11 = sum(1 / t**2 for _, t in points)
        a12 = sum(s / t**2 for s, t in points)
        a22 = sum(s * s / t**2 for s, t in points)
        b1 = sum(1 / t for _, t in points)
        b2 = sum(s / t for s, t in points)
        det = a11 * a22 - a12 * a12
        alpha, beta = (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det
        return max(alpha, 0.0), max(beta, 0.0)

    def __call__(self, spec) -> float:
        from prism_megatron.calibration.costmodel import KIND_FAMILY

        if len(set(spec.ranks)) <= 1:
            return 0.0
        family = KIND_FAMILY.get(spec.kind, "all_reduce")
        alpha, beta = self.fit.get(family, self.fit["all_reduce"])
        return alpha + beta * spec.nbytes

    def describe(self) -> str:
        return "; ".join(f"{k} {a * 1e6:.0f} us + {1e-9 / b if b else float('inf'):.2f} GB/s"
                         for k, (a, b) in self.fit.items())


def gloo_cost(work: Path) -> GlooCost:
    out = work / "gloo-probe.json"
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", f"--master-port={_port()}",
           str(HERE / "gloo_probe.py"), str(out)]
    _run(cmd, work / "gloo-probe.log", _env(), 300)
    return GlooCost({k: [tuple(p) for p in v] for k, v in json.loads(out.read_text()).items()})


def zero_cost(spec) -> float:
    return 0.0


# ----------------------------------------------------------------------------- emulation's own cost per op
def op_overhead(work: Path, devices: str, nbytes: int, dtype: str = "float32") -> float:
    """Median seconds of slot-holding time one synchronous all_reduce adds to an emulated rank.

    The bare trace counts it as compute (``op_overhead.py`` says why); with the ops per iteration of
    a row it estimates how much of that row's prediction is the emulation's own work.
    """
    from prism_megatron.trace import read_trace

    trace = _fresh(work / "op-overhead")
    cmd = [PY, "-m", "prism_megatron", "launch", "-w", "2", "--devices", devices, "--slots-per-device", "1",
           "--log-ranks", "none", "--trace-dir", str(trace), str(HERE / "op_overhead.py"),
           "cpu" if devices == "cpu" else "cuda", str(nbytes), dtype]
    _run(cmd, work / "op-overhead.log", _env(), 300)
    t = read_trace(trace)
    gaps = [op["compute_before"] for r in range(t.world_size) for op in t.ops_for_rank(r)
            if op["kind"] == "all_reduce"][20:]  # past the start-up
    return statistics.median(gaps)


def ops_per_iteration(trace: Path) -> float:
    """Ops the busiest rank issues per measured iteration (inside the iteration spans)."""
    from prism_megatron.trace import read_trace

    t = read_trace(trace)
    spans: dict[int, list[tuple[float, float]]] = {}
    for m in t.marks.to_pylist():
        if m["name"] == "iteration" and m["phase"] in ("B", "E"):
            spans.setdefault(m["rank"], []).append((m["phase"], m["t"]))
    best = 0.0
    for rank, seq in spans.items():
        windows = [(b, e) for (pb, b), (pe, e) in zip(seq[::2], seq[1::2], strict=False) if pb == "B" and pe == "E"]
        windows = windows[WARMUP:]
        if windows:
            n = sum(1 for op in t.ops_for_rank(rank) if any(b <= op["t_issue"] <= e for b, e in windows))
            best = max(best, n / len(windows))
    return best


# ----------------------------------------------------------------------------- CPU contention
def contention(rounds: int = 3) -> tuple[float, float]:
    """Median step (ms) of ``contention_probe.py`` alone and with a second copy computing at once."""
    def probe(copies: int) -> list[float]:
        start = f"{time.time() + 4:.3f}"  # after both have imported torch
        procs = [subprocess.Popen([PY, str(HERE / "contention_probe.py"), start], stdout=subprocess.PIPE,
                                  text=True, env=_env()) for _ in range(copies)]
        return [float(p.communicate(timeout=120)[0]) for p in procs]

    solo: list[float] = []
    pair: list[float] = []
    for _ in range(rounds):
        solo += probe(1)
        pair += probe(2)
    return statistics.median(solo), statistics.median(pair)


# ----------------------------------------------------------------------------- rows
@dataclass
class Row:
    config: str
    ground_truth: str  # "yes", or "consistency" (the real column is then the 1-slot prediction)
    real_ms: float | None = None
    predicted_ms: float | None = None
    error_pct: float | None = None
    notes: str = ""
    detail: dict = field(default_factory=dict)


def _ms(times: dict[int, float]) -> dict[int, float]:
    return {k: round(v * 1e3, 3) for k, v in sorted(times.items())}


def _spread(times: dict[int, float]) -> str:
    """(max - min) / median of the measured iterations, in percent: the noise the median sits in."""
    measured = _measured(times)
    return f"{(max(measured) - min(measured)) / statistics.median(measured) * 100:.0f}%"


def ground_truth_row(case: Case, work: Path, devices: str, cost: Callable, cost_name: str, timeout: float,
                     real_repeats: int, overhead: float) -> Row:
    """Real run, emulated run on one slot (replayed), and on CPU a second real run; error = predicted / real - 1.

    The second real run comes after the emulation, so slow drift of a shared machine falls on both
    sides; its median next to the first one's is the run-to-run noise the error has to be read in.
    """
    reals, loads = [], []
    trace = emu_load = None
    for i in range(real_repeats):
        times, load = real_run(case, work / f"real-{i + 1}", timeout)
        reals.append(times)
        loads.append(load)
        if trace is None:
            trace, emu_load = emulated_run(case, work, devices, 1, timeout)
    pred, free = predict(trace, cost), predict(trace, zero_cost)
    # ground truth needs a core per rank: a CPU run that other processes took cores from is not one
    quiet = [t for t, load in zip(reals, loads, strict=True) if devices != "cpu" or load <= QUIET_LOAD]
    r = statistics.median([t for times in (quiet or reals) for t in _measured(times)])
    p, f = _median(pred), _median(free)
    notes = [case.note]
    if real_repeats > 1:
        used = "" if len(quiet) == len(reals) else \
            f" (used: {'/'.join(f'{_median(t) * 1e3:.0f}' for t in quiet) or 'none quiet, all'})"
        notes.append("real runs " + "/".join(f"{_median(times) * 1e3:.0f}" for times in reals) + used)
    ops = ops_per_iteration(trace)
    segments = gpu_rows(trace)
    one_clock = _median(predict(trace, cost, gpu_times=False)) if segments else None
    per_rank = host_device_per_iteration(trace) if segments else {}
    if one_clock is not None:
        notes.append(f"{segments} GPU-timed segments; one clock would say {one_clock * 1e3:.0f} "
                     f"({(one_clock / r - 1) * 100:+.1f}%)")
    if per_rank:
        host = max(v["host_ms"] for v in per_rank.values())
        device = max(v["device_ms"] for v in per_rank.values())
        notes.append(f"per iteration, busiest rank: host {host:.0f}, device {device:.0f}")
    notes += [f"free comm {f * 1e3:.0f}", f"{ops:.0f} ops/iter: ~{ops * overhead * 1e3:.0f} of emulation cost",
              f"spread {'/'.join(_spread(t) for t in [*reals, pred])}"]
    if devices == "cpu":
        notes.append(f"other load {'/'.join(f'{x:.2f}' for x in [*loads, emu_load])} cores")
    truth = "yes" if quiet else f"no: other load > {QUIET_LOAD} cores in every real run"
    return Row(case.name, truth, r * 1e3, p * 1e3, (p / r - 1) * 100, "; ".join(n for n in notes if n),
               {"real_ms": [_ms(t) for t in reals], "predicted_ms": _ms(pred), "predicted_free_comm_ms": _ms(free),
                "cost": cost_name, "other_load_cores": {"real": loads, "emulated": emu_load},
                "ops_per_iteration": ops, "emulation_cost_ms": ops * overhead * 1e3, "gpu_timed_segments": segments,
                "predicted_one_clock_ms": None if one_clock is None else one_clock * 1e3,
                "host_device_per_iteration": per_rank,
                "flags": case.flags, "world": case.world})


def consistency_row(case: Case, work: Path, devices: str, timeout: float) -> Row:
    """The same job emulated on one slot and on two; both replayed with free communication."""
    one, load1 = emulated_run(case, work, devices, 1, timeout)
    two, load2 = emulated_run(case, work, devices, 2, timeout)
    p1, p2 = predict(one, zero_cost), predict(two, zero_cost)
    m1, m2 = _median(p1), _median(p2)
    notes = (f"W={case.world}: real column = 1-slot prediction, predicted = 2 slots, error = their difference; "
             f"{case.note}; free comm; spread {_spread(p1)}/{_spread(p2)}; other load {load1:.2f}/{load2:.2f} cores")
    return Row(case.name, "consistency", m1 * 1e3, m2 * 1e3, (m2 / m1 - 1) * 100, notes,
               {"predicted_1slot_ms": _ms(p1), "predicted_2slot_ms": _ms(p2), "flags": case.flags,
                "world": case.world, "other_load_cores": {"1slot": load1, "2slot": load2}})


@dataclass
class Session:
    """What every config needs besides itself, and where the report goes after each row."""

    work: Path
    console: Console
    report: dict
    out: Path | None
    deadline: float  # time.monotonic() after which no config starts
    only: list[str]

    def save(self) -> None:
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "accuracy.json").write_text(json.dumps(_finite(self.report), indent=1))
            (self.out / "accuracy.txt").write_text(self.console.export_text(clear=False))


def _finite(x):
    """The report with NaN/inf as null (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def run_cases(session: Session, section: str, cases: list[Case], devices: str, cost: Callable, cost_name: str,
              timeout: float, real_repeats: int, overhead: float) -> list[Row]:
    """Each case's row, in order; a failed or skipped case gets a row that says so. Saves after each."""
    rows: list[Row] = []
    session.report["sections"][section]["rows"] = rows_out = []
    for case in cases:
        if session.only and case.name not in session.only:
            continue
        kind = "consistency" if case.consistency else "yes"
        t0 = time.monotonic()
        if t0 > session.deadline:
            row = Row(case.name, kind, notes="skipped: --budget spent")
        else:
            session.console.print(f"[bold]{case.name}[/]: W={case.world} ...", end=" ")
            work = session.work / section / case.name
            try:
                if case.consistency:
                    row = consistency_row(case, work, devices, timeout)
                else:
                    row = ground_truth_row(case, work, devices, cost, cost_name, timeout, real_repeats, overhead)
            except (RunFailed, subprocess.TimeoutExpired, ValueError, KeyError) as e:
                row = Row(case.name, kind, notes=f"FAILED: {str(e)[:300]}", detail={"error": str(e)})
                session.console.print(f"[red]failed[/] ({time.monotonic() - t0:.0f} s)\n{e}")
            else:
                session.console.print(f"{row.real_ms:.1f} vs {row.predicted_ms:.1f} ms "
                                      f"({time.monotonic() - t0:.0f} s)")
        rows.append(row)
        rows_out.append(asdict(row))
        session.save()
    return rows


# ----------------------------------------------------------------------------- output
def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[Row], title: str) -> Table:
    t = Table(title=title, show_lines=False)
    for name, justify in (("config", "left"), ("ground truth?", "left"), ("real median (ms)", "right"),
                          ("predicted median (ms)", "right"), ("error %", "right"), ("notes", "left")):
        t.add_column(name, justify=justify, overflow="fold")
    for r in rows:
        t.add_row(r.config, r.ground_truth, _num(r.real_ms, ".1f"), _num(r.predicted_ms, ".1f"),
                  _num(r.error_pct, "+.1f"), r.notes)
    return t


LEGEND = ("notes (ms unless said): real runs = median of each real run (on CPU one before and one after the "
          f"emulation; the real column pools the runs that other processes left a core per rank: other load <= "
          f"{QUIET_LOAD} cores, else the row is no ground truth); free comm = the prediction with communication free; "
          "N ops/iter: ~X of emulation cost = ops the busiest rank issues per iteration x the emulation cost per op "
          "above (slot time the bare trace counts as compute); spread = (max - min) / median of the measured "
          "iterations of each real run and of the prediction; other load = cores that other processes kept busy "
          "during each run (real runs, then the emulation)")


def mean_abs_error(rows: list[Row]) -> float | None:
    """Over ground-truth rows only."""
    errors = [abs(r.error_pct) for r in rows if r.ground_truth == "yes" and r.error_pct is not None]
    return sum(errors) / len(errors) if errors else None


def cpu_section(session: Session, iters: int) -> None:
    """Probes (contention, gloo link, emulation cost per op), then the CPU rows and their table."""
    console, section = session.console, session.report["sections"].setdefault("cpu", {})
    console.print(f"[bold]CPU[/]: {os.cpu_count()} cores; contention, gloo and emulation-cost probes ...")
    solo, pair = contention()
    console.print(f"compute contention: an MLP step on one thread takes {solo:.2f} ms alone, {pair:.2f} ms "
                  f"while a second copy computes on the other core ({(pair / solo - 1) * 100:+.0f}%)")
    with ForeignLoad() as load:
        cost = gloo_cost(session.work)
    console.print(f"gloo fit (2 processes, loopback; other load {load.cores:.2f} cores): {cost.describe()}")
    overhead = op_overhead(session.work, "cpu", CPU_OP_BYTES)
    console.print(f"emulation cost per op (slot-holding time of a {CPU_OP_BYTES >> 10} KiB all_reduce with no "
                  f"compute around it, counted as compute by the bare trace): {overhead * 1e3:.2f} ms")
    section.update({"contention_ms": {"alone": solo, "two_at_once": pair}, "emulation_cost_per_op_ms": overhead * 1e3,
                    "gloo_fit": {k: {"alpha_s": a, "beta_s_per_byte": b} for k, (a, b) in cost.fit.items()},
                    "gloo_points": cost.points})
    rows = run_cases(session, "cpu", cpu_cases(iters), "cpu", cost, "gloo fit", 900, 2, overhead)
    mae = mean_abs_error(rows)
    section["mean_abs_error_pct"] = mae
    console.print(table(rows, f"CPU: predicted vs real iteration time (median of {iters} after {WARMUP} warm-up; "
                              "comm costed by the gloo fit)"))
    console.print(LEGEND)
    console.print(f"CPU mean absolute error over ground-truth rows: {_num(mae, '.1f')} %")
    session.save()


def gpu_section(session: Session, iters: int, mbs: int = 1, real_repeats: int = 1) -> bool:
    """The GPU rows (real 2-GPU NCCL runs vs one-GPU emulation); True when the target is met."""
    from prism_megatron.calibration.costmodel import CollectiveCostModel
    from prism_megatron.calibration.profiles import load_profile

    console, section = session.console, session.report["sections"].setdefault("gpu", {})
    precision = driver_precision()
    verb = "accepts" if precision == "bf16" else "refuses"
    console.print(f"[bold]GPU[/]: {precision} (the core driver {verb} --bf16); comm costed by {GPU_CLUSTER}")
    cost = CollectiveCostModel(load_profile(GPU_CLUSTER))
    dtype = "bfloat16" if precision == "bf16" else "float32"
    nbytes = GPU_OP_ELEMENTS * (2 if precision == "bf16" else 4)
    try:
        overhead = op_overhead(session.work, "0", nbytes, dtype)
    except (RunFailed, subprocess.TimeoutExpired) as e:
        console.print(f"[red]emulation-cost probe failed[/]: {e}")
        overhead = math.nan
    console.print(f"emulation cost per op (slot-holding time of a {nbytes >> 20} MiB {dtype} CUDA all_reduce with no "
                  f"compute around it, counted as compute by the bare trace): {overhead * 1e3:.2f} ms")
    section.update({"precision": precision, "cluster": GPU_CLUSTER, "emulation_cost_per_op_ms": overhead * 1e3})
    rows = run_cases(session, "gpu", gpu_cases(iters, precision, mbs), "0", cost, GPU_CLUSTER, 300, real_repeats,
                     overhead)
    for r in rows:
        r.notes = f"{precision}; {r.notes}"
    mae = mean_abs_error(rows)
    ok = mae is not None and mae <= GPU_TARGET_MAE and all(r.error_pct is not None for r in rows)
    section.update({"rows": [asdict(r) for r in rows], "mean_abs_error_pct": mae, "target_met": ok})
    console.print(table(rows, f"GPU: predicted vs real iteration time (median of {iters} after {WARMUP} warm-up; "
                              f"comm costed by {GPU_CLUSTER})"))
    console.print(LEGEND)
    console.print(f"GPU mean absolute error: {_num(mae, '.2f')} % (target <= {GPU_TARGET_MAE} %): "
                  f"{'met' if ok else 'NOT met'}")
    session.save()
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="CPU configs (default when neither is given)")
    parser.add_argument("--gpu", action="store_true", help="GPU configs (an nvidia-h200-x2 machine)")
    parser.add_argument("--iters", type=int, default=6, help=f"measured iterations (after {WARMUP} warm-up ones)")
    parser.add_argument("--out", type=Path, default=None, help="where accuracy.json and accuracy.txt go")
    parser.add_argument("--work", type=Path, default=None, help="traces and logs (default: a temporary directory)")
    parser.add_argument("--only", default="", help="comma-separated config names to run (default: all)")
    parser.add_argument("--gpu-mbs", type=int, default=1,
                        help="micro-batch size of the GPU jobs (1: host-bound on an H200; 8: device-bound)")
    parser.add_argument("--budget", type=float, default=math.inf, help="seconds after which no config starts")
    parser.add_argument("--gpu-real-repeats", type=int, default=1,
                        help="real runs per GPU config: 2 runs one before and one after the emulation (the "
                             "H200 machine's real runs moved by up to 40%% between runs)")
    args = parser.parse_args(argv)
    names = {c.name for c in cpu_cases(args.iters)} | {c.name for c in gpu_cases(args.iters, "bf16", args.gpu_mbs)}
    unknown = [n for n in args.only.split(",") if n and n not in names]
    if unknown:
        parser.error(f"--only: no config named {', '.join(map(repr, unknown))} (with --gpu-mbs {args.gpu_mbs}); "
                     f"configs: {', '.join(sorted(names))}")
    if args.gpu_real_repeats < 1:
        parser.error(f"--gpu-real-repeats must be at least 1, got {args.gpu_real_repeats}")
    if not (args.cpu or args.gpu):
        args.cpu = True
    work = args.work or Path(tempfile.mkdtemp(prefix="prism-accuracy-"))
    work.mkdir(parents=True, exist_ok=True)
    session = Session(work, Console(record=True, width=200),
                      {"host": platform.node(), "python": platform.python_version(), "iters": args.iters,
                       "warmup": WARMUP, "sections": {}},
                      args.out, time.monotonic() + args.budget, [n for n in args.only.split(",") if n])
    session.console.print(f"work directory (traces, logs): {work}")
    ok = True
    if args.cpu:
        cpu_section(session, args.iters)
    if args.gpu:
        ok = gpu_section(session, args.iters, args.gpu_mbs, args.gpu_real_repeats)
    if args.out is not None:
        session.console.print(f"wrote {args.out / 'accuracy.json'} and accuracy.txt")
        session.save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
