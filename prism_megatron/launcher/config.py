"""Launch options, validated before anything starts: each bad value is one clear error naming it."""

from __future__ import annotations

import atexit
import functools
import ipaddress
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prism_megatron.options import JobOptions, option
from prism_megatron.runtime.hostplan import available_host_memory

_J = JobOptions  # the options' defaults: LaunchConfig built in code defaults as the front ends do


class LaunchError(ValueError):
    """Bad launch input; the message names the option and the value."""


def cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def block_of(index: int, count: int, blocks: int) -> int:
    """The block that item ``index`` of ``count`` falls in when they are cut into ``blocks`` contiguous ones
    (ranks onto devices: neighbours, a TP group, share one)."""
    return index * blocks // count


def torchrun_threads(local_world_size: int) -> int:
    """The torch threads a rank of the target job has: torchrun passes OMP_NUM_THREADS on where it is set and
    sets it to 1 where it starts more than one process per node; a job of one process per node keeps torch's
    default, every core (here: this machine's, which the emulation's one rank per node has to itself)."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return 1 if local_world_size > 1 else cores()


def rank_threads(target: int, computing: int, available: int | None = None) -> int:
    """The torch threads an emulated rank gets by default: the target rank's (``target``), but no more than
    leaves one core beside the ``computing`` ranks for prism's own processes (coordinator, launcher, the
    ranks' runtime threads). A real rank of one process per node has its cores to itself; an emulated one
    whose intra-op threads fill every core has one of them preempted whenever the coordinator answers, and
    a parallel region waits for its slowest thread (docs/measurements.md, "Both sides at steady state")."""
    n = cores() if available is None else available
    return max(1, min(target, (n - 1) // max(computing, 1)))


@dataclass
class LaunchConfig:
    """A launch, resolved and validated: what the launcher, the coordinator and the ranks are given.

    The front ends build it from their options with :meth:`from_options`; code that launches
    directly (calibration's slice runs, tests) builds it here, with the options' defaults.
    """

    script: Path
    script_args: list[str] = field(default_factory=list)
    world_size: int = 1
    devices: list[str] = field(default_factory=lambda: ["cpu"])  # "cpu" or CUDA indices as strings
    slots_per_device: int = _J.slots_per_device
    hang_timeout: float = _J.hang_timeout
    trace_dir: Path = Path(_J.trace_dir)
    gpus_per_node: int = _J.gpus_per_node
    log_ranks: list[int] | None = None  # ranks whose output goes to the terminal; None: the options' default
    threads_per_rank: int | None = _J.threads_per_rank  # None: torchrun's rule (rank_threads), set by validate()
    target_threads: int | None = None  # the target rank's threads where validate() chose threads_per_rank
    preload: list[str] = field(default_factory=list)  # modules the template imports before forking
    rank_setup: list[str] = field(default_factory=list)  # "module:function" run in each rank before the script
    # JobOptions.swap's choices; budget and budget-auto are checkpoint and auto with a stand-in swapper that
    # enforces --device-memory without a GPU (tests, bench/swap_policy.py)
    swap: str = _J.swap
    device_memory_gib: float | None = _J.device_memory  # capacity per device; default: the GPU's total memory
    device_memory: list[int] = field(default_factory=list)  # resolved by validate(), bytes per device
    device_names: list[str] = field(default_factory=list)  # resolved by validate(): each GPU's name (none on CPU)
    host_memory_gib: float | None = _J.host_memory  # host RAM checkpointed GPU state may take; default: 90%
    host_memory: int | None = None  # resolved by validate(), bytes (None: not limited)
    # the coordinator's host region for in-process swaps (runtime.swap_space), where swaps may happen
    swap_region: str | None = None
    target_gpu: dict | None = None  # TargetGPU.as_dict(): each rank's allocator is capped at its 'usable'
    expected_iterations: int | None = None  # per rank, for the progress estimate (Megatron's --train-iters)
    progress_every: float = 10.0  # seconds between progress lines
    predictor: str | None = None  # "module:function" answering ranks' live predictions (see runtime.live)
    predictor_options: dict = field(default_factory=dict)
    track_memory: bool | None = None  # per-rank memory marks; None: on GPU always, on CPU when capped
    gpu_timing: bool | None = None  # host and device time per compute segment (runtime.gpu_timing); None: on GPU
    # auto: GPU ranks page-lock their staging memory (runtime.shm); pageable: never (slower copies, for
    # comparison: bench/gpu/staging_bench.py)
    staging: str = _J.staging
    rank_start: str = _J.rank_start  # JobOptions.rank_start's choices; starts_fresh resolves auto
    listen: str = _J.listen  # the coordinator's and TCPStore's address (loopback unless asked)
    # per-rank overrides (calibration's slice runs): these ranks run another program, or sit on another
    # device (an index into `devices`), than the contiguous default
    rank_scripts: dict[int, tuple[Path, list[str]]] = field(default_factory=dict)
    rank_devices: dict[int, int] = field(default_factory=dict)
    # rank -> class label: a rank not yet through an iteration is admitted to a shared device by its class's
    # measured peak (runtime.peaks); ranks not named are each their own class
    memory_classes: dict[int, str] = field(default_factory=dict)
    # rank -> prism's estimate of its class's peak (bytes; memory.estimate, from the fold plan): the room a
    # rank is admitted with before anything of it or its class is measured (ranks not named: the device)
    memory_estimates: dict[int, int] = field(default_factory=dict)
    # a folded run (Phase 2): the fold plan's JSON (``trace.fold`` reads it: world_size, live, rep,
    # gpus_per_node, classes, class_of). Only its live ranks are forked; every other rank is virtual and
    # the coordinator answers for it (nccl_prune). None: every rank runs.
    fold: dict | None = None
    job_extra: dict = field(default_factory=dict)  # keys added to the trace's job (a recipe's substitutions)

    @classmethod
    def from_options(cls, options: JobOptions, script: Path, script_args: list[str], **fixed: Any) -> LaunchConfig:
        """The launch that ``options`` ask for (both front ends' one mapping; validate() checks it).

        ``fixed`` sets the fields no option has (preload, rank_setup, predictor, ...).
        """
        from prism_megatron.memory.targets import TargetError, resolve_target

        o = options
        if o.world_size is None:
            raise LaunchError("--world-size is required: the number of ranks of the target job")
        target = None
        if o.target_gpu is not None:
            try:
                target = resolve_target(o.target_gpu, o.target_context).as_dict()
            except TargetError as e:
                raise LaunchError(str(e)) from None
        elif o.target_context is not None:
            raise LaunchError("--target-context needs --target-gpu")
        tri = {"auto": None, "on": True, "off": False}
        return cls(
            script=Path(script), script_args=list(script_args), world_size=o.world_size,
            devices=parse_devices(o.devices), slots_per_device=o.slots_per_device, hang_timeout=o.hang_timeout,
            trace_dir=Path(o.trace_dir), gpus_per_node=o.gpus_per_node,
            log_ranks=parse_ranks(o.log_ranks, max(o.world_size, 1)), threads_per_rank=o.threads_per_rank,
            swap=o.swap, device_memory_gib=o.device_memory, host_memory_gib=o.host_memory, target_gpu=target,
            track_memory=tri[o.track_memory], gpu_timing=tri[o.gpu_timing], staging=o.staging, listen=o.listen,
            rank_start=o.rank_start,
            **fixed,
        )

    @property
    def memory_cap(self) -> int | None:
        return None if self.target_gpu is None else int(self.target_gpu["usable"])

    @property
    def tracks_memory(self) -> bool:
        if self.track_memory is not None:
            return self.track_memory
        return self.on_gpu or self.target_gpu is not None

    @property
    def times_gpu(self) -> bool:
        """GPU timing is off while the driver's checkpoint swaps (`--swap checkpoint`): it refuses to lock a
        process that the CUDA profiler has run in (CUDA_ERROR_NOT_SUPPORTED; bench/gpu/swap_bench.py's
        lock probes). Under `auto` with that swapper the coordinator lets a device's ranks start it once
        they are known not to need swaps (runtime.memory.timing_verdict). In-process swaps leave it be."""
        if self.swap_mode == "checkpoint" and not self.swaps_in_process:
            return False
        return self.on_gpu if self.gpu_timing is None else self.gpu_timing and self.on_gpu

    @property
    def page_locks(self) -> bool:
        """GPU ranks page-lock their staging memory (--staging auto; CPU tensors are host memory already)."""
        return self.on_gpu and self.staging == "auto"

    @property
    def starts_fresh(self) -> bool:
        """Each rank a fresh interpreter (--rank-start exec; auto: GPU ranks), not a fork of the template."""
        return self.rank_start == "exec" or (self.rank_start == "auto" and self.on_gpu)

    @property
    def template_preloads_on_gpu(self) -> bool:
        """GPU ranks fork from a template that imports a preload: whether that import starts CUDA must be known
        before the fork (launch.start_cuda_import_check)."""
        return bool(self.preload) and self.on_gpu and not self.starts_fresh

    @property
    def echoed_ranks(self) -> list[int]:
        """Ranks whose output reaches the terminal: log_ranks, or the options' default."""
        if self.log_ranks is not None:
            ranks = self.log_ranks
        else:
            ranks = parse_ranks(_J.log_ranks, max(self.world_size, 1))
        if self.fold is None:
            return ranks
        rep = self.fold["rep"]  # a virtual rank has no output: the live rank it mirrors echoes for it
        return sorted({rep[r] for r in ranks})

    @property
    def connect_address(self) -> str:
        """Where ranks reach the coordinator and the TCPStore (MASTER_ADDR)."""
        return "127.0.0.1" if ipaddress.ip_address(self.listen).is_unspecified else self.listen

    @property
    def on_gpu(self) -> bool:
        return self.devices != ["cpu"]

    @property
    def log_dir(self) -> Path:
        return self.trace_dir.with_name(self.trace_dir.name + ".logs")

    @property
    def live_ranks(self) -> list[int]:
        """The ranks that run as processes: the fold's live ranks, or every rank."""
        return list(self.fold["live"]) if self.fold is not None else list(range(self.world_size))

    def device_of(self, rank: int) -> int:
        """Contiguous blocks of (live) ranks per device, so neighbours (a TP group) share one; or rank_devices."""
        if rank in self.rank_devices:
            return self.rank_devices[rank]
        if self.fold is None:
            return block_of(rank, self.world_size, len(self.devices))
        import bisect

        live = self.fold["live"]
        return block_of(bisect.bisect_left(live, rank), len(live), len(self.devices))

    def script_for(self, rank: int) -> tuple[Path, list[str]]:
        """The program `rank` runs and its arguments: `rank_scripts` or else `script`."""
        return self.rank_scripts.get(rank, (self.script, self.script_args))

    def check_trace_dir(self) -> None:
        """The trace directory can be made where asked: it is a directory or absent, and its parent is a
        directory this process may write in, made here where missing (as ``mkdir -p``; the launcher would make
        it). Cheap, so a run checks it before its planning, not minutes later at the launch."""
        if self.trace_dir.exists() and not self.trace_dir.is_dir():
            raise LaunchError(f"--trace-dir {str(self.trace_dir)!r} exists and is not a directory")
        parent = self.trace_dir.resolve().parent
        blocking = next((p for p in (parent, *parent.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise LaunchError(f"--trace-dir {str(self.trace_dir)!r}: {str(blocking)!r} is a file, not a directory")
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LaunchError(f"--trace-dir {str(self.trace_dir)!r}: cannot create {str(parent)!r} "
                              f"({e.strerror or e})") from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise LaunchError(f"--trace-dir {str(self.trace_dir)!r}: cannot write in {str(parent)!r} (read-only)")

    def validate(self) -> LaunchConfig:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise LaunchError(f"--world-size must be a positive integer, got {self.world_size!r}")
        if self.world_size > 65536:
            raise LaunchError(f"--world-size {self.world_size} is above the supported 65536")
        if not self.devices:
            raise LaunchError("--devices is empty: give 'cpu' or CUDA device indices such as '0' or '0,1'")
        if "cpu" in self.devices and len(self.devices) > 1:
            raise LaunchError(f"--devices {','.join(self.devices)}: 'cpu' cannot be mixed with GPU indices")
        for d in self.devices:
            if d != "cpu" and not d.isdigit():
                raise LaunchError(f"--devices: {d!r} is neither 'cpu' nor a CUDA device index")
        if len(set(self.devices)) != len(self.devices):
            raise LaunchError(f"--devices {','.join(self.devices)} names a device twice")
        if not isinstance(self.slots_per_device, int) or self.slots_per_device < 1:
            raise LaunchError(f"--slots-per-device must be a positive integer, got {self.slots_per_device!r}")
        if not self.hang_timeout > 0:
            raise LaunchError(f"--hang-timeout must be a positive number of seconds, got {self.hang_timeout!r}")
        if self.gpus_per_node < 1:
            raise LaunchError(f"--gpus-per-node must be a positive integer, got {self.gpus_per_node!r}")
        if self.threads_per_rank is None:
            self.target_threads = torchrun_threads(min(self.gpus_per_node, self.world_size))
            self.threads_per_rank = rank_threads(self.target_threads, len(self.devices) * self.slots_per_device)
        if not isinstance(self.threads_per_rank, int) or self.threads_per_rank < 1:
            raise LaunchError(f"--threads-per-rank must be a positive integer, got {self.threads_per_rank!r}")
        if not self.script.is_file():
            raise LaunchError(f"script {str(self.script)!r} does not exist or is not a file")
        for r, (script, args) in self.rank_scripts.items():
            if not isinstance(r, int) or not 0 <= r < self.world_size:
                raise LaunchError(f"rank_scripts: rank {r!r} is outside 0..{self.world_size - 1}")
            if not Path(script).is_file():
                raise LaunchError(f"rank_scripts: rank {r}'s script {str(script)!r} does not exist or is not a file")
            if not all(isinstance(a, str) for a in args):
                raise LaunchError(f"rank_scripts: rank {r}'s arguments {args!r} are not all strings")
        for r, d in self.rank_devices.items():
            if not isinstance(r, int) or not 0 <= r < self.world_size:
                raise LaunchError(f"rank_devices: rank {r!r} is outside 0..{self.world_size - 1}")
            if not isinstance(d, int) or not 0 <= d < len(self.devices):
                raise LaunchError(f"rank_devices: rank {r}'s device {d!r} is not an index into --devices "
                                  f"{','.join(self.devices)}")
        for r in self.log_ranks or []:
            if not 0 <= r < self.world_size:
                raise LaunchError(f"--log-ranks: rank {r} is outside 0..{self.world_size - 1}")
        if self.fold is not None:
            from prism_megatron.trace.fold import parse_fold
            from prism_megatron.trace.schema import TraceFormatError

            try:
                parse_fold(self.fold, self.world_size, "fold plan")
            except TraceFormatError as e:
                raise LaunchError(f"the fold plan does not fit this launch: {e}") from None
            if self.rank_scripts or self.rank_devices:
                raise LaunchError("a folded launch takes no per-rank scripts or devices (calibration's slice runs "
                                  "are not folded)")
            self.gpus_per_node = int(self.fold["gpus_per_node"])
        self.check_trace_dir()
        try:
            ipaddress.ip_address(self.listen)
        except ValueError:
            raise LaunchError(f"--listen {self.listen!r} is not an IP address (127.0.0.1 loopback, 0.0.0.0 every "
                              "interface, or one of this host's addresses)") from None
        for name in ("swap", "staging", "rank_start"):
            choices = option(JobOptions, name).choices or ()
            if getattr(self, name) not in choices:
                listed = ", ".join(choices[:-1]) + f" or {choices[-1]}"
                raise LaunchError(f"--{name.replace('_', '-')} must be {listed}, got {getattr(self, name)!r}")
        if self.device_memory_gib is not None and not self.device_memory_gib > 0:
            raise LaunchError(f"--device-memory must be a positive number of GiB, got {self.device_memory_gib!r}")
        if self.host_memory_gib is not None and not self.host_memory_gib > 0:
            raise LaunchError(f"--host-memory must be a positive number of GiB, got {self.host_memory_gib!r}")
        if self.swap in ("checkpoint", "inprocess") and not self.on_gpu:
            raise LaunchError(f"--swap {self.swap} needs GPU --devices: CPU ranks have no device state to swap")
        if self.swap == "inprocess" and not inprocess_available():
            raise LaunchError("--swap inprocess needs torch's MemPool with a custom allocator (torch 2.6 or "
                              "later, a CUDA build) and the cuda-bindings package (cuda.bindings.driver); "
                              "use --swap checkpoint or --swap none")
        if self.swap == "checkpoint" and self.gpu_timing:
            raise LaunchError("--swap checkpoint and GPU timing exclude each other: the CUDA driver cannot "
                              "checkpoint a process the CUDA profiler has run in (CUDA_ERROR_NOT_SUPPORTED); "
                              "drop the GPU timing option (it is then off, and compute is replayed on one clock) "
                              "or use --swap none")
        if self.swapper.startswith("budget") and self.device_memory_gib is None:
            raise LaunchError(f"--swap {self.swap} needs --device-memory GiB")
        totals = _check_gpus(self.devices) if self.on_gpu else []
        self.device_names = _gpu_names(self.devices) if self.on_gpu else []
        if self.device_memory_gib is not None:
            self.device_memory = [int(self.device_memory_gib * 2**30)] * len(self.devices)
        else:
            self.device_memory = totals or [0] * len(self.devices)
        if self.host_memory_gib is not None:
            self.host_memory = int(self.host_memory_gib * 2**30)
        elif self.swap_mode != "none" and self.swapper in ("cuda", "inprocess"):
            self.host_memory = int(0.9 * available_host_memory())
        return self

    @property
    def swap_mode(self) -> str:
        """The coordinator's runtime.governor.SwapMode: none, checkpoint (swap blocked ranks out whenever a
        device's ranks outgrow it) or auto (so until iteration 1 ends, then GPU timing or swaps: the
        driver's checkpoint and the CUDA profiler exclude each other). CPU ranks have nothing to swap, so
        auto is none there unless a stand-in plays the device."""
        if self.swap in ("budget", "budget-inprocess", "inprocess", "checkpoint"):
            return "checkpoint"
        if self.swap == "budget-auto":
            return "auto"
        if self.swap == "auto" and self.on_gpu:
            return "checkpoint" if self.swapper == "inprocess" else "auto"
        return "none"

    @property
    def swapper(self) -> str:
        return swapper_for(self.swap, self.on_gpu)

    @property
    def swaps_in_process(self) -> bool:
        return self.swapper in IN_PROCESS_SWAPPERS


#: Swappers whose ranks move only their allocator's blocks in use; the others move all a rank holds.
IN_PROCESS_SWAPPERS = ("inprocess", "budget-inprocess")


def swapper_for(swap: str, on_gpu: bool) -> str:
    """Who moves ranks' state under ``--swap swap``: inprocess (the rank moves its allocator's segments,
    runtime.vmm), cuda (the driver's process checkpoint API), or a stand-in of either (budget-inprocess,
    budget). auto takes inprocess where this torch and cuda-bindings offer it."""
    if swap.startswith("budget"):
        return "budget-inprocess" if swap == "budget-inprocess" else "budget"
    if swap == "inprocess" or (swap == "auto" and on_gpu and inprocess_available()):
        return "inprocess"
    return "cuda"


@functools.lru_cache(maxsize=1)
def inprocess_available() -> bool:
    """Whether in-process swaps (runtime.vmm) can run here; asked without starting CUDA."""
    import importlib.util

    import torch

    try:
        bindings = importlib.util.find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        bindings = False
    return (bindings and torch.version.cuda is not None and hasattr(torch.cuda, "MemPool")
            and all(hasattr(torch._C, n) for n in ("_cuda_customAllocator", "_cuda_beginAllocateToPool")))


#: the code a child runs to list the CUDA devices it sees: (total memory in bytes, name) per device, as JSON
_GPU_QUERY = ("import json, torch; n = torch.cuda.device_count() if torch.cuda.is_available() else 0; "
              "print(json.dumps([[torch.cuda.get_device_properties(i).total_memory, torch.cuda.get_device_name(i)] "
              "for i in range(n)]))")

_gpu_queries: dict[str | None, subprocess.Popen] = {}  # CUDA_VISIBLE_DEVICES -> its query's child, started early
_gpu_answers: dict[str | None, tuple[tuple[int, str], ...]] = {}  # CUDA_VISIBLE_DEVICES -> the devices it shows


def _query_child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _GPU_QUERY], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)


def start_gpu_query() -> None:
    """Start now the child that ``_gpus_seen`` reads for this CUDA_VISIBLE_DEVICES: it imports torch and starts
    CUDA (seconds on a GPU host), so a caller with planning of its own to do (the run command) starts it first
    and finds its answer ready where the plan asks for the device's memory."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible in _gpu_queries or visible in _gpu_answers:
        return
    _gpu_queries[visible] = child = _query_child()
    atexit.register(lambda: child.poll() is None and child.kill())  # a run that ends before reading it


def _gpus_seen(visible: str | None) -> tuple[tuple[int, str], ...]:
    """Every CUDA device's (total memory in bytes, name) as a child process sees them with ``visible`` as
    CUDA_VISIBLE_DEVICES (this process's); asked once per process (a child importing torch takes seconds), of
    the child ``start_gpu_query`` started where it did."""
    if visible in _gpu_answers:
        return _gpu_answers[visible]
    child = _gpu_queries.pop(visible, None) or _query_child()
    try:
        out, _ = child.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise LaunchError("listing this machine's CUDA devices (a child process importing torch) took over 120 s: "
                          "the GPU or its driver does not answer") from None
    _gpu_answers[visible] = tuple((int(t), str(n)) for t, n in json.loads(out.strip() or "[]"))
    return _gpu_answers[visible]


def _check_gpus(devices: list[str]) -> list[int]:
    """Ask a child process (never this one: it must fork before CUDA starts) which GPUs exist.

    Returns each named device's total memory in bytes.
    """
    seen = _gpus_seen(os.environ.get("CUDA_VISIBLE_DEVICES"))
    bad = [d for d in devices if int(d) >= len(seen)]
    if bad:
        raise LaunchError(f"--devices {','.join(devices)}: this machine has {len(seen)} CUDA device(s); "
                          f"no device {','.join(bad)}")
    return [seen[int(d)][0] for d in devices]


def _gpu_names(devices: list[str]) -> list[str]:
    """Each named device's name (``_check_gpus`` checked they exist)."""
    seen = _gpus_seen(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return [seen[int(d)][1] for d in devices]


def cpu_model() -> str:
    """This machine's CPU model as the OS names it (Linux: /proc/cpuinfo's "model name"), else the platform's
    word for it: host-bound compute is timed on it."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def parse_devices(text: str) -> list[str]:
    return [d.strip() for d in text.split(",") if d.strip()]


def parse_ranks(text: str, world_size: int) -> list[int]:
    """'0,3,last' / 'all' / 'none' -> rank list."""
    text = text.strip()
    if text == "all":
        return list(range(world_size))
    if text in ("none", ""):
        return []
    out = []
    for part in text.split(","):
        part = part.strip()
        if part == "last":
            out.append(world_size - 1)
        elif "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        else:
            try:
                out.append(int(part))
            except ValueError:
                raise LaunchError(
                    f"--log-ranks: {part!r} is not a rank, a range a-b, 'last', 'all' or 'none'") from None
    return out
