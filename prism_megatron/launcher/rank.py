"""A logical rank's process: forked from the launcher, set up as the target job's rank, runs the script.

The script is run unmodified with `runpy`; it sees the environment torchrun would give it on the
target cluster (RANK, WORLD_SIZE, LOCAL_RANK, ...) and every process group it creates is a prism
group. The process ends with `os._exit` so nothing inherited from the launcher runs twice.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import os
import runpy
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from prism_megatron.launcher.config import LaunchConfig
from prism_megatron.launcher.exit_codes import DEVICE_OOM as EXIT_DEVICE_OOM
from prism_megatron.launcher.exit_codes import OOM as EXIT_OOM


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the launcher dies, so no rank outlives its job."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


#: Inductor's compile workers: one rank compiles in its own process unless the user's environment says otherwise.
#: By default each process that first runs ``torch.compile`` (Megatron's fused bias-dropout-add, for one) starts a
#: pool of as many workers as the machine has cores, and their start-up keeps those cores busy for seconds
#: (docs/measurements.md, "Inductor's compile pool"): the real job's first iterations are slower while it lasts,
#: its later ones are not. The iterations an emulation measures fall inside that start-up, and W ranks on one
#: machine would start W pools; compiling in-process makes the same kernels with neither.
COMPILE_THREADS_ENV = "TORCHINDUCTOR_COMPILE_THREADS"

#: ``PRISM_PROFILE_RANKS=PREFIX``: each rank runs its script under cProfile and writes PREFIX-rankR.prof (also when
#: the script fails): where an emulated rank's time goes between its compute (the runtime's ops, GPU timing, the
#: coordinator's answers), which no trace segment times.
PROFILE_ENV = "PRISM_PROFILE_RANKS"


def rank_env(cfg: LaunchConfig, rank: int, store_port: int) -> dict[str, str]:
    """The environment torchrun gives a rank of the target job, and what prism's capture needs of it."""
    local_ws = min(cfg.gpus_per_node, cfg.world_size)
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(cfg.world_size),
        "LOCAL_RANK": str(rank % local_ws),
        "LOCAL_WORLD_SIZE": str(local_ws),
        "GROUP_RANK": str(rank // local_ws),
        "NODE_RANK": str(rank // local_ws),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(cfg.world_size),
        "MASTER_ADDR": cfg.connect_address,
        "MASTER_PORT": str(store_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCH_DIST_INIT_BARRIER": "0",
        "OMP_NUM_THREADS": str(cfg.threads_per_rank),
        "PRISM_EMULATED": "1",
    }
    if COMPILE_THREADS_ENV not in os.environ:
        env[COMPILE_THREADS_ENV] = "1"
    if cfg.on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = cfg.devices[cfg.device_of(rank)]
    if cfg.times_gpu:
        from prism_megatron.runtime.gpu_timing import cupti_teardown_env

        env["PRISM_GPU_TIMING"] = "1"
        env.update(cupti_teardown_env(cfg.script_for(rank)[1], dict(os.environ)))
    if cfg.page_locks:
        env["PRISM_PAGE_LOCK"] = "1"
    if cfg.swap_region is not None:
        from prism_megatron.runtime.client import SWAP_REGION_ENV

        env[SWAP_REGION_ENV] = cfg.swap_region
    if cfg.fold is not None and (cfg.fold.get("capture") or {}).get("mode") == "serial":
        from prism_megatron.launcher.serial import CAPTURE_ENV

        env[CAPTURE_ENV] = "serial"
    return env


def _compile_threads_from_env() -> None:
    """Inductor reads its workers' number when its config is imported: where the template imported it before
    the fork, the rank's environment has to be told to it again."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None and os.environ.get(COMPILE_THREADS_ENV, "").isdigit():
        config.compile_threads = int(os.environ[COMPILE_THREADS_ENV])


def _siblings(cpu: int) -> frozenset[int]:
    """The logical CPUs that share ``cpu``'s physical core (itself alone where the kernel does not say)."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return frozenset({cpu})
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(out)


def pin_plan(cores: list[int], processes: int, siblings=_siblings) -> list[int] | None:
    """The logical CPU of each rank process: one physical core each, the first physical core (all its logical
    CPUs) left to the coordinator and launcher; logical CPUs 1.. where there are fewer physical cores
    than processes + 1 but more logical ones; None where not even those suffice."""
    first_of_core: dict[frozenset[int], int] = {}
    for c in sorted(cores):
        first_of_core.setdefault(siblings(c) & set(cores) or frozenset({c}), c)
    physical = sorted(first_of_core.values())
    if len(physical) > processes:
        return physical[1:1 + processes]
    if len(cores) > processes:
        return sorted(cores)[1:1 + processes]
    return None


def _pin(cfg: LaunchConfig, rank: int) -> None:
    """A core of its own for each rank where there are enough (PRISM_PIN_CORES=1): a rank that
    resumes on whatever core is free starts with cold caches, and one whose hyperthread sibling
    computes (another rank, or the coordinator answering its ops) runs slower; its measured host time
    shows both."""
    if os.environ.get("PRISM_PIN_CORES") != "1" or not hasattr(os, "sched_setaffinity"):
        return
    live = cfg.live_ranks  # the processes (a fold forks only its live ranks)
    plan = pin_plan(sorted(os.sched_getaffinity(0)), len(live))
    if plan is not None:
        os.sched_setaffinity(0, {plan[live.index(rank)]})


class StartUp:
    """When a rank's start-up phases ended, said in one line as its first iteration begins: where the seconds
    before a run's (or a serial capture's) first iteration go. ``time.perf_counter`` is one clock across the
    fork, so the launcher's own start counts from its job's start."""

    def __init__(self, rank: int, launched: float) -> None:
        self.rank, self._last = rank, launched
        self.phases: list[tuple[str, float]] = []

    def end(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases.append((phase, now - self._last))
        self._last = now

    def line(self) -> str:
        """The start-up as said: the phases, with the script's own set-up ended now."""
        self.end("script")
        parts = ", ".join(f"{phase} {s:.1f} s" for phase, s in self.phases)
        total = sum(s for _, s in self.phases)
        return f"prism: rank {self.rank}: first iteration began {total:.1f} s after the launch: {parts}"


def run_rank(cfg: LaunchConfig, rank: int, address: tuple[str, int], authkey: bytes, store_port: int,
             segment_prefix: str, close_fds: list[int], launched: float | None = None) -> None:
    """Never returns. ``launched``: the job's start (``time.perf_counter``), from which the rank's start-up
    line counts."""
    code = 1
    startup = StartUp(rank, time.perf_counter() if launched is None else launched)
    startup.end("coordinator and exec" if cfg.starts_fresh else "coordinator and fork")
    try:
        try:
            os.setpgid(0, 0)  # its own process group: ending the rank ends what it started (reaper.kill_rank)
        except OSError:
            pass
        _die_with_parent()
        for fd in close_fds:
            try:
                os.close(fd)
            except OSError:
                pass
        echo = rank in cfg.echoed_ranks
        log = open(cfg.log_dir / f"rank-{rank}.log", "wb", buffering=0)  # noqa: SIM115 - lives until _exit
        if not echo:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        os.environ.update(rank_env(cfg, rank, store_port))
        _pin(cfg, rank)
        import faulthandler

        faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)  # stacks on demand (hang reports)
        faulthandler.enable(file=log, all_threads=True)  # and where a fatal signal (SIGSEGV, SIGABRT) struck
        import torch

        torch.set_num_threads(cfg.threads_per_rank)
        _compile_threads_from_env()
        if cfg.on_gpu:
            _map_local_devices(torch)
        from prism_megatron.runtime.backend import install
        from prism_megatron.runtime.client import RankClient
        from prism_megatron.runtime.folding import untranslation
        from prism_megatron.trace import markers

        segments = _swappable_segments(cfg, rank)
        client = RankClient(address, authkey, rank, cfg.world_size, f"{segment_prefix}-r{rank}")
        client.segments = segments
        if segments is not None:  # a full device: other ranks swapped out, the allocation retried
            segments.on_no_room = client.ask_room
        part = ((cfg.fold or {}).get("capture") or {}).get("part") or {}
        install(client, rep=cfg.fold["rep"] if cfg.fold is not None else None, untranslate=untranslation(cfg.fold),
                class_rep=part.get("class_rep"))
        probe = None
        if cfg.tracks_memory:
            from prism_megatron.memory import MemoryProbe

            probe = MemoryProbe(rank, cfg.on_gpu, cfg.memory_cap, cfg.log_dir)
        markers.set_sink(_MarkSink(client, probe, startup))
        startup.end("rank set-up")
        client.acquire()
        startup.end("slot wait")
        for spec in cfg.rank_setup:  # e.g. the Megatron integration's CPU mode and patches
            module, _, func = spec.partition(":")
            getattr(importlib.import_module(module), func)()
        if cfg.rank_setup:
            startup.end("patches and imports")
        if probe is not None:
            probe.install()  # after the setup: CPU mode decides where tensors live
            if probe.note:
                print(f"prism: rank {rank}: {probe.note}", file=sys.stderr, flush=True)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    code = _run_script(cfg, rank, probe, client)
    _join_program_threads()
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    client.close(code)
    os._exit(code)


def _join_program_threads() -> None:
    """Wait for the script's non-daemon threads, as Python does before it exits (and before atexit):
    `os._exit` would cut them short, and what they still do (a timer, a writer, an exit code of their
    own) is part of the program's behaviour under torchrun."""
    while True:
        alive = [t for t in threading.enumerate() if t is not threading.current_thread() and not t.daemon]
        if not alive:
            return
        for t in alive:
            t.join()


def _run_script(cfg: LaunchConfig, rank: int, probe=None, client=None) -> int:
    prefix = os.environ.get(PROFILE_ENV)
    if not prefix:
        return _run_script_plain(cfg, rank, probe, client)
    import cProfile

    profile = cProfile.Profile()
    try:
        return profile.runcall(_run_script_plain, cfg, rank, probe, client)
    finally:
        out = f"{prefix}-rank{rank}.prof"
        try:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            profile.dump_stats(out)
            print(f"prism: rank {rank}: profile in {out}", file=sys.stderr, flush=True)
        except OSError as e:
            print(f"prism: rank {rank}: cannot write its profile {out!r}: {e}", file=sys.stderr, flush=True)


def _run_script_plain(cfg: LaunchConfig, rank: int, probe=None, client=None) -> int:
    path, args = cfg.script_for(rank)
    script = str(Path(path).resolve())
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
        if probe is not None:
            probe.record(None)
        return 0
    except SystemExit as e:
        if probe is not None:
            probe.record(None)
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        tb = traceback.format_exc()
        (cfg.log_dir / f"rank-{rank}.traceback").write_text(tb)
        physical = _physical_oom(e, probe, rank) if _is_oom(e) else None
        if physical is not None:  # the shared physical device was full: an emulation failure, not a verdict
            report = client.device_oom(physical) if client is not None else ""
            sys.stderr.write(tb + (report or f"prism: rank {rank}: the physical device ran out of memory while "
                                   f"this rank held {physical['held'] / 2**30:.2f} GiB") + "\n")
            return EXIT_DEVICE_OOM
        if probe is not None and _is_oom(e):
            oom = probe.out_of_memory(e)
            sys.stderr.write(f"prism: rank {rank} ran out of memory under the target's cap "
                             f"({oom['message']}); this is a prediction, traceback in rank-{rank}.traceback\n")
            return EXIT_OOM
        sys.stderr.write(tb)
        return 1


def _physical_oom(error: BaseException, probe, rank: int) -> dict | None:
    """Figures of an out-of-memory of the physical device (or of the CPU tests' stand-in device), not
    of the target's cap: None for the target's."""
    seen = error
    while seen is not None:
        figures = getattr(seen, "figures", None)  # runtime.fake_device.DeviceFull
        if figures is not None:
            return figures
        seen = seen.__cause__ or seen.__context__
    return probe.physical(error) if probe is not None else None


def _is_oom(error: BaseException) -> bool:
    """torch's OOM, also when a caller wrapped it (Megatron re-raises some errors as RuntimeError)."""
    from prism_megatron.memory.probe import oom_of

    return oom_of(error) is not None


def _swappable_segments(cfg: LaunchConfig, rank: int):
    """Where swaps may happen in process, what this rank's swaps move: its GPU's allocator segments, from
    here on in a pool of CUDA virtual memory (runtime.vmm), or the stand-in device's bytes; else None."""
    if cfg.swap_region is None:
        return None
    if cfg.swapper == "budget-inprocess":
        from prism_megatron.runtime.fake_device import StandInSegments

        return StandInSegments(rank)
    from prism_megatron.runtime.vmm import VmmSegments

    segments = VmmSegments(0)
    segments.pool = segments.install()  # before the program allocates on the device
    return segments


def _map_local_devices(torch) -> None:
    """The rank sees one GPU (CUDA_VISIBLE_DEVICES); the target job calls set_device(LOCAL_RANK).

    Any index of the target node's devices means this rank's GPU, index 0; an index beyond the
    target node still fails as it would there.
    """
    real = torch.cuda.set_device
    local_ws = int(os.environ["LOCAL_WORLD_SIZE"])

    def set_device(device) -> None:
        index = device.index if isinstance(device, torch.device) else device
        if isinstance(index, int) and 0 <= index < local_ws:
            return real(0)
        return real(device)

    torch.cuda.set_device = set_device


class _MarkSink:
    """Routes `prism_megatron.trace.mark` calls to the coordinator, which timestamps them."""

    def __init__(self, client, probe=None, startup: StartUp | None = None) -> None:
        self._client = client
        self._probe = probe
        self._startup = startup
        self._iteration: int | None = None

    def record_mark(self, name: str, phase: str, attrs: dict) -> None:
        self._client.mark(name, phase, attrs)
        if name == "iteration" and phase == "B" and self._startup is not None:  # said once: the first iteration
            print(self._startup.line(), file=sys.stderr, flush=True)
            self._startup = None
        if name == "iteration" and self._probe is not None:  # memory after every iteration
            if phase == "B":
                self._iteration = attrs.get("iteration")
            elif phase == "E":
                self._probe.record(self._iteration)
