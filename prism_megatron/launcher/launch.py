"""Run W logical ranks of an unmodified torch.distributed program through prism.

Order of events: check the destination and the host (launcher.preflight), start the coordinator (a
sidecar process that also hosts the TCPStore), import torch (and any preload modules) here once, fork
every rank from this template — pages are shared, so a rank costs little memory and starts in
milliseconds; GPU ranks instead exec a fresh interpreter each (``--rank-start``) — then watch. Every
way a job ends takes one path (``launch``'s ``finally``): a clean end, a failed rank, a hang, stall or
mismatch, Ctrl-C, SIGTERM or SIGHUP. It writes the trace (partial ones marked incomplete, with why),
ends every rank with its children (each leads its own process group), the coordinator and the shared
memory, and its last line says what happened and where the logs are. If the launcher itself is killed
(SIGKILL, the OOM killer), ranks die with it (parent-death signal) and the coordinator does the rest; a
later job sweeps any shared memory left.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import ipaddress
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client
from pathlib import Path

from prism_megatron.launcher import coordinator_ahead as ahead
from prism_megatron.launcher import fork_safe_cuda_checks
from prism_megatron.launcher.config import LaunchConfig, LaunchError, cores, cpu_model
from prism_megatron.launcher.exit_codes import BAD_INPUT
from prism_megatron.launcher.exit_codes import DEVICE_OOM as EXIT_DEVICE_OOM
from prism_megatron.launcher.exit_codes import HANG as EXIT_HANG
from prism_megatron.launcher.exit_codes import MISMATCH as EXIT_MISMATCH
from prism_megatron.launcher.exit_codes import OOM as EXIT_OOM
from prism_megatron.launcher.exit_codes import RANK_FAILED as EXIT_RANK_FAILED
from prism_megatron.launcher.progress import Progress
from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.config import CoordinatorConfig
from prism_megatron.runtime.reaper import kill_rank
from prism_megatron.runtime.shm import job_prefix, remove_job_segments, sweep_stale_segments
from prism_megatron.trace.schema import stopped_reason

#: what an exec'd rank runs: its module path, then its arguments, from the file descriptor in its argv
_EXEC_CODE = ("import pickle, sys\n"
              "with open(int(sys.argv[1]), 'rb') as f:\n"
              "    sys.path[:] = pickle.load(f)\n"
              "    args = pickle.load(f)\n"
              "from prism_megatron.launcher.rank import run_rank\n"
              "run_rank(*args)\n")


def _exec_rank(cfg: LaunchConfig, rank: int, address: tuple[str, int], authkey: bytes, store_port: int,
               prefix: str, launched: float) -> None:
    """Replace the forked child by a fresh interpreter running the rank (``LaunchConfig.starts_fresh``): it imports
    torch and the program itself, as a process of torchrun does. It gets the launcher's interpreter flags and
    module path, so it finds what a forked rank would.

    Its arguments go through an unlinked file it inherits, not its argv: a large job's config (a fold plan's rank
    maps) exceeds what one argument may hold (128 KiB on Linux)."""
    import pickle
    import tempfile

    with tempfile.TemporaryFile() as f:  # unlinked at once: nothing is left behind, whatever ends the rank
        pickle.dump(list(sys.path), f)  # first: the rank needs it to unpickle the rest
        pickle.dump((cfg, rank, address, authkey, store_port, prefix, [], launched), f)
        f.seek(0)  # flushes what was written; the rank reads from the start
        os.set_inheritable(f.fileno(), True)
        os.execv(sys.executable, [sys.executable, *subprocess._args_from_interpreter_flags(), "-c", _EXEC_CODE,
                                  str(f.fileno())])


def _ranks_time_gpu(cfg: LaunchConfig) -> bool:
    """Whether ranks time GPU segments: the launcher sets PRISM_GPU_TIMING for them, or it was set already."""
    return cfg.times_gpu or os.environ.get("PRISM_GPU_TIMING") == "1"


def _say(msg: str) -> None:
    print(f"prism: {msg}", file=sys.stderr, flush=True)


class _Signalled(Exception):
    """SIGTERM or SIGHUP reached the launcher: the job ends on the one shutdown path."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_signalled(signum: int, _frame) -> None:
    raise _Signalled(signum)


def coordinator_config(cfg: LaunchConfig, prefix: str = "") -> CoordinatorConfig:
    """What the coordinator process is started with (its one JSON argument: ``to_json``)."""
    return CoordinatorConfig(
        world_size=cfg.world_size,
        devices=[d if d == "cpu" else f"cuda:{d}" for d in cfg.devices],
        slots_per_device=cfg.slots_per_device,
        device_of={r: cfg.device_of(r) for r in cfg.live_ranks},
        hang_timeout=cfg.hang_timeout,
        threads=coordinator_threads(cfg, cores()),
        swap=cfg.swap_mode, swapper=cfg.swapper, gpu_timing=_ranks_time_gpu(cfg),
        device_memory=list(cfg.device_memory),
        host_memory=cfg.host_memory,
        swap_policy=os.environ.get("PRISM_SWAP_POLICY", "resident-first"),
        memory_classes=dict(cfg.memory_classes), rank_cap=cfg.memory_cap,
        memory_estimates=dict(cfg.memory_estimates),
        predictor=cfg.predictor, predictor_options=dict(cfg.predictor_options),
        live_trace=str(cfg.log_dir / "live-trace"),
        host=cfg.listen, launcher_pid=os.getpid(), segment_prefix=prefix, fold=cfg.fold,
    )


class _Job:
    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self.cuda_check: _CudaImportCheck | None = None
        self.job_id = secrets.token_hex(4)
        self.prefix = job_prefix(os.getpid(), self.job_id)
        self.authkey = secrets.token_bytes(16)
        self.pids: dict[int, int] = {}  # pid -> rank, while it runs
        self.started: dict[int, int] = {}  # pid -> rank, every rank forked (their process groups)
        self.exit_codes: dict[int, int] = {}
        self.coord: subprocess.Popen | None = None
        self.control = None
        self.t0 = time.perf_counter()
        self.ended_by: str | None = None  # the kind of the coordinator's FATAL report that ended the job
        self.why: str | None = None  # what ended the job early (the trace's 'incomplete'); None: it ran to its end
        self.lock_fd: int | None = None  # the trace directory's lock, shared with the coordinator

    # ---- start -----------------------------------------------------------------------------------
    def start_coordinator(self) -> tuple[tuple[str, int], int]:
        cfg = self.cfg
        conf = coordinator_config(cfg, self.prefix)
        log_path = cfg.log_dir / "coordinator.log"
        spare = ahead.take()  # one the launch before started for this one (a serial capture's next)
        if spare is not None:
            try:
                ahead.adopt(spare, dataclasses.replace(conf, log_path=str(log_path)).to_json(), str(log_path),
                            self.lock_fd)
                self.coord, self.authkey = spare.proc, spare.authkey
            except OSError:  # it died meanwhile: start one
                ahead.abandon(spare)
                spare = None
        if spare is None:
            self._start_coordinator_process(conf, log_path)
        line = self.coord.stdout.readline()
        if not line:
            self.coord.wait()
            raise _StartFailed(f"the prism coordinator failed to start ({_how(self.coord.returncode)}); "
                               f"see {cfg.log_dir / 'coordinator.log'}")
        info = json.loads(line)
        cfg.swap_region = info.get("swap_region")
        for note in info.get("notes", []):
            _say(note)
        address = (info["address"][0], int(info["address"][1]))
        self.control = Client(address, authkey=self.authkey)
        self.control.send({"t": P.CONTROL, "trace_dir": str(cfg.trace_dir.resolve()), "job": self.job_meta()})
        return address, int(info["store_port"])

    def _start_coordinator_process(self, conf: CoordinatorConfig, log_path: Path) -> None:
        env = dict(os.environ, PRISM_AUTHKEY=self.authkey.hex())
        log = open(log_path, "wb")  # noqa: SIM115 - kept by the child
        try:  # the config on stdin: a large job's (a rank map) exceeds what one argument may hold
            self.coord = subprocess.Popen(
                ahead.COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, text=True,
                pass_fds=() if self.lock_fd is None else (self.lock_fd,),  # it may write the trace after us
            )
            self.coord.stdin.write(conf.to_json())
            self.coord.stdin.close()
        except OSError as e:
            raise _StartFailed(f"could not start the prism coordinator: {e.strerror or e}") from None
        finally:
            log.close()

    def fork_ranks(self, address: tuple[str, int], store_port: int) -> None:
        fresh = self.cfg.starts_fresh  # each rank execs a fresh interpreter: nothing to import here for them
        if not fresh:
            self._prepare_template()
        from prism_megatron.launcher.rank import run_rank

        close = [self.control.fileno(), self.coord.stdout.fileno(),
                 *([self.lock_fd] if self.lock_fd is not None else [])]
        sys.stdout.flush()
        sys.stderr.flush()
        for r in self.cfg.live_ranks:  # a folded job: virtual ranks have no process
            try:
                pid = os.fork()
            except OSError as e:
                raise _StartFailed(f"could not start rank {r} of {self.cfg.world_size} (fork: {e.strerror}); "
                                   f"{r} rank(s) were started — the host's process or memory limits are "
                                   "reached: run fewer ranks") from None
            if pid == 0:
                if fresh:
                    try:
                        _exec_rank(self.cfg, r, address, self.authkey, store_port, self.prefix, self.t0)
                    except BaseException as e:  # noqa: BLE001 - the child must not return into the launcher
                        print(f"prism: rank {r}: could not start a fresh interpreter ({sys.executable}): {e}",
                              file=sys.stderr, flush=True)
                        os._exit(1)
                run_rank(self.cfg, r, address, self.authkey, store_port, self.prefix, close, self.t0)
            try:
                os.setpgid(pid, pid)  # the rank leads its own group (it does so too: whoever runs first)
            except OSError:
                pass  # it already exec'd or exited: its own setpgid applies
            self.pids[pid] = self.started[pid] = r

    def _prepare_template(self) -> None:
        """Import torch and the preload once here, so that every forked rank shares them."""
        import torch

        preload = self.cfg.preload
        if self.cfg.template_preloads_on_gpu and self.cuda_check is not None and self.cuda_check.result():
            # CUDA cannot be used in a child forked after it started (megatron-core 0.19.2's imports
            # start it): each rank imports those modules itself instead
            _say(f"--preload {','.join(preload)} starts CUDA when imported ({self.cuda_check.why}); "
                 "ranks import it after the fork")
            preload = []
        for mod in preload:
            importlib.import_module(mod)
        if self.cfg.on_gpu and torch.cuda.is_initialized():
            raise RuntimeError("CUDA was initialized in the launcher before forking ranks; ranks could not use it")

    # ---- watch -----------------------------------------------------------------------------------
    def watch(self) -> int:
        last_note = time.perf_counter()
        n = len(self.cfg.live_ranks)
        progress = Progress(n, self.cfg.expected_iterations)
        while len(self.exit_codes) < n:
            while self.pids:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                rank = self.pids.pop(pid, None)
                if rank is None:
                    continue
                code = os.waitstatus_to_exitcode(status)
                self.exit_codes[rank] = code
                self._tell({"t": P.EXITED, "rank": rank, "code": code})
                if code != 0:
                    return self._rank_failed(rank, code)
            if self.coord.poll() is not None:
                self.why = f"the coordinator exited unexpectedly ({_how(self.coord.returncode)})"
                _say(f"{self.why}; see {self.cfg.log_dir / 'coordinator.log'}")
                return EXIT_RANK_FAILED
            try:
                msg = self.control.recv() if self.control.poll(0.05) else None
            except (EOFError, OSError):
                self.coord.wait()
                self.why = f"lost the coordinator ({_how(self.coord.returncode)})"
                _say(f"{self.why}; see {self.cfg.log_dir / 'coordinator.log'}")
                return EXIT_RANK_FAILED
            if msg is not None:
                if msg["t"] == P.FATAL:
                    return self._fatal(msg)
                if msg["t"] == P.PROGRESS:
                    progress.update(msg["connected"], msg["finished"], msg.get("iterations", 0))
            if time.perf_counter() - last_note > self.cfg.progress_every:
                last_note = time.perf_counter()
                _say(progress.line())
        return 0

    def _tell(self, msg: dict) -> None:
        try:
            self.control.send(msg)
        except (OSError, AttributeError):
            pass  # the coordinator is gone: the loop says so

    def _rank_failed(self, rank: int, code: int) -> int:
        # a rank the coordinator failed (a mismatch, a fold that cannot answer, a device OOM) exits after
        # the coordinator sent its report: that report, not the exit, says what ended the job
        try:
            while self.control.poll(10 if code == EXIT_DEVICE_OOM else 1):
                msg = self.control.recv()
                if msg["t"] == P.FATAL:
                    return self._fatal(msg)
        except (EOFError, OSError):
            pass
        self.why = f"rank {rank} {_how(code)}"
        if code == EXIT_OOM:
            self.why = f"rank {rank} ran out of memory under the target's cap (predicted OOM)"
            _say(f"rank {rank} ran out of memory under the target's cap: predicted OOM; ending the job "
                 "(the trace and the report keep the verdict)")
            return EXIT_OOM
        how = _how(code)
        tb_file = self.cfg.log_dir / f"rank-{rank}.traceback"
        log_file = self.cfg.log_dir / f"rank-{rank}.log"
        _say(f"rank {rank} {how}; ending the job")
        echoed = rank in self.cfg.echoed_ranks
        if echoed:
            pass  # its traceback is already on the terminal
        elif tb_file.exists():
            sys.stderr.write(f"---- rank {rank} traceback ----\n{tb_file.read_text()}")
        elif log_file.exists() and log_file.stat().st_size:
            tail = log_file.read_bytes()[-4000:].decode(errors="replace")
            sys.stderr.write(f"---- rank {rank} output (last lines, {log_file}) ----\n{tail}\n")
        return EXIT_RANK_FAILED

    def _fatal(self, msg: dict) -> int:
        kind = self.ended_by = msg["kind"]
        report_file = self.cfg.log_dir / f"{kind}-report.txt"
        report_file.write_text(msg["report"] + "\n")
        sys.stderr.write(msg["report"] + "\n")
        _say(f"{kind} report written to {report_file}; ending the job")
        self.why = f"{kind} (report in {report_file.name})"
        if kind == "fold":  # the program does something the fold cannot answer for: a wrong fold, bad input
            return BAD_INPUT
        return {"hang": EXIT_HANG, "stall": EXIT_HANG, "mismatch": EXIT_MISMATCH,
                "device-oom": EXIT_DEVICE_OOM}.get(kind, EXIT_RANK_FAILED)

    # ---- end -------------------------------------------------------------------------------------
    def finish(self, status: str) -> tuple[str | None, str | None]:
        """Ask the coordinator to write the trace — complete, or (``self.why``) the trace so far marked
        incomplete — and stop. Returns (path, None) or (None, why not): a failed write is said at once."""
        if self.control is None or self.coord is None or self.coord.poll() is not None:
            return None, "the coordinator, which holds the job's records, is gone"
        try:
            self.control.send({"t": P.FINISH, "status": status, "trace_dir": str(self.cfg.trace_dir.resolve()),
                               "job": self.job_meta(), "incomplete": self.why,
                               "exit_codes": {str(k): v for k, v in self.exit_codes.items()}})
            while self.control.poll(600):
                msg = self.control.recv()
                if msg["t"] == P.WRITTEN:
                    if msg.get("note"):
                        _say(msg["note"])
                    return msg["path"], msg.get("error")
                if msg["t"] == P.FATAL and msg["kind"] == "internal":  # the write itself failed in the coordinator
                    return None, msg["report"].strip().splitlines()[-1]
            return None, "the coordinator did not answer in 600 s"
        except (EOFError, OSError):
            self.coord.wait()
            return None, f"the coordinator ended while writing it ({_how(self.coord.returncode)})"

    def job_meta(self) -> dict:
        return {**job_record(self.cfg), "job_id": self.job_id, "wall_time_s": time.perf_counter() - self.t0}

    def cleanup(self) -> None:
        """Leave nothing behind: ranks and the processes they started, coordinator, shared-memory segments."""
        for pid in list(self.pids) + [p for p, r in self.started.items() if r in self.exit_codes]:
            kill_rank(pid)  # its process group: children of exited ranks too
        for pid in list(self.pids):
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.pids.clear()
        if self.control is not None:
            self.control.close()
        if self.coord is not None and self.coord.poll() is None:
            self.coord.terminate()
            try:
                self.coord.wait(10)
            except subprocess.TimeoutExpired:
                self.coord.kill()
                self.coord.wait()
        remove_job_segments(self.prefix)


def job_record(cfg: LaunchConfig) -> dict:
    """The trace's ``job``: what ``cfg`` runs and where (the run's own id and wall time are added to it), and
    what this machine and software are, since the trace's times and peaks are theirs."""
    from importlib import metadata

    return {"script": str(cfg.script), "args": cfg.script_args, "argv": [str(cfg.script), *cfg.script_args],
            "world_size": cfg.world_size,
            "devices": cfg.devices, "slots_per_device": cfg.slots_per_device,
            "gpus_per_node": cfg.gpus_per_node,
            "machine": {"gpus": list(cfg.device_names), "cpu": cpu_model(), "cores": cores()},
            "stack": {"python": sys.version.split()[0], "torch": metadata.version("torch")},
            **({"rank_scripts": {str(r): [str(p), *a] for r, (p, a) in sorted(cfg.rank_scripts.items())}}
               if cfg.rank_scripts else {}),
            **({"target_gpu": cfg.target_gpu} if cfg.target_gpu is not None else {}),
            # what the report weighs a class that ran out of memory under the cap by (report.margin)
            **({"memory_estimates": {str(r): int(b) for r, b in sorted(cfg.memory_estimates.items())}}
               if cfg.memory_estimates else {}),
            **cfg.job_extra,
            **({"staging_by_device": {f"cuda:{d}": "page-locked" if cfg.page_locks else "pageable"
                                      for d in cfg.devices}} if cfg.on_gpu else {})}


def _keep_snapshots(log_dir: Path, trace_dir: Path) -> None:
    """OOM memory snapshots go into the trace, whose ``oom`` marks name them."""
    import shutil

    for f in log_dir.glob("oom-rank-*.pickle"):
        shutil.copy2(f, trace_dir / f.name)


#: Run by the check's interpreter: imports the modules with torch.cuda._lazy_init watched (every reference
#: torch keeps; C++ looks it up on torch.cuda at each call), then prints whether CUDA started and the first
#: call's frames outside torch and importlib: which import started it.
_CHECK_CODE = """
import importlib, json, sys, traceback, torch, torch.cuda
first, real = [], torch.cuda._lazy_init
def watched():
    if not first:
        first.append([f"{f.filename}:{f.lineno} ({f.name})" for f in traceback.extract_stack()[:-1]
                      if "/torch/" not in f.filename and "importlib" not in f.filename and f.filename != "<string>"])
    return real()
for name, mod in list(sys.modules.items()):
    if name.startswith("torch.cuda") and getattr(mod, "_lazy_init", None) is real:
        mod._lazy_init = watched
for m in json.loads(sys.argv[1]):
    importlib.import_module(m)
print(json.dumps({"initialized": torch.cuda.is_initialized(), "first": first[0][-3:] if first else None}))
"""


class _CudaImportCheck:
    """Whether importing `modules` starts CUDA, asked of a throwaway interpreter (never this one), started
    early so that its imports (seconds for Megatron's) overlap other work; asked once per process. Ranks
    import such modules after the fork, seconds each, so the answer says why: where CUDA started, or
    that the import failed (not known: the safe answer)."""

    def __init__(self, modules: list[str]) -> None:
        self._p = subprocess.Popen([sys.executable, "-c", _CHECK_CODE, json.dumps(modules)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._answer: bool | None = None
        self.why = ""

    def stop(self) -> None:
        if self._answer is None and self._p.poll() is None:
            self._p.kill()
            self._p.communicate()

    def result(self) -> bool:
        if self._answer is None:
            try:
                out, err = self._p.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                self._p.kill()
                self._p.communicate()
                self._answer, self.why = True, "not known: the check took over 600 s"
                return True
            self._answer, self.why = self._read(out, err)
        return self._answer

    def _read(self, out: str, err: str) -> tuple[bool, str]:
        try:
            answer = json.loads(out.strip().splitlines()[-1]) if self._p.returncode == 0 else None
        except (IndexError, ValueError):
            answer = None
        if not isinstance(answer, dict):
            tail = [line for line in err.strip().splitlines() if line.strip()][-1:] or ["no message"]
            return True, f"not known: the check's import failed ({_how(self._p.returncode)}: {tail[0][:300]})"
        if not answer.get("initialized"):
            return False, ""
        where = answer.get("first")
        return True, ("started by " + " < ".join(reversed(where))) if where else "started outside torch.cuda's init"


_import_checks: dict[tuple[str, ...], _CudaImportCheck] = {}


def start_cuda_import_check(modules: list[str]) -> _CudaImportCheck:
    """The check for ``modules``, started at the first call in this process: a caller with work of its own
    before the launch (the run command parses Megatron's args in a child, tens of seconds on a cold host)
    starts it first so that both children run at once, and every launch of the process reads one answer."""
    key = tuple(modules)
    if key not in _import_checks:
        _import_checks[key] = _CudaImportCheck(list(key))
        atexit.register(_import_checks[key].stop)  # a run that ends before its launch leaves no child behind
    return _import_checks[key]


def coordinator_threads(cfg: LaunchConfig, cores: int) -> int:
    """Threads for the coordinator's reductions and copies: the cores no computing rank can use (one
    left for the launcher and the ranks' runtime threads), at most 8 (memory bandwidth saturates).

    Element-wise, so the result does not depend on it; and only spare cores, so a rank computing
    beside an async op's reduction is not slowed (its measured compute would grow). On a GPU host a
    rank holding a slot keeps one core busy issuing work, and a large gradient all-reduce on one
    coordinator thread took seconds of each iteration's capture (docs/history.md)."""
    busy = len(cfg.devices) * cfg.slots_per_device * cfg.threads_per_rank
    return max(1, min(8, cores - busy - 1))


def launch(cfg: LaunchConfig) -> int:
    """Run the job; returns the process exit code (0 ok, 1 a rank failed, 2 a fold that cannot answer the
    program, 3 hang or stall, 4 mismatch, 5 predicted OOM, 6 the physical device ran out of memory, 128+N
    ended by signal N). Bad input found before the start raises LaunchError."""
    from prism_megatron.launcher import preflight

    fork_safe_cuda_checks()
    cuda_check = start_cuda_import_check(cfg.preload) if cfg.template_preloads_on_gpu else None
    cfg.validate()
    if not cfg.on_gpu:
        preflight.check_host_memory(cfg)
    preflight.check_trace_destination(cfg)
    job = _Job(cfg)
    job.cuda_check = cuda_check
    try:
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        job.lock_fd = preflight.lock_trace_dir(cfg.log_dir)
        for stale in cfg.log_dir.glob("rank-*.traceback"):
            stale.unlink()
    except OSError as e:
        raise LaunchError(f"the log directory {str(cfg.log_dir)!r}: {e.strerror}") from None
    swept, swept_bytes = sweep_stale_segments()
    if swept:
        _say(f"removed {swept} shared-memory segment(s) ({swept_bytes / 2**20:.0f} MiB) that killed jobs left")
    _notes(cfg)
    code = EXIT_RANK_FAILED
    ours = threading.current_thread() is threading.main_thread()  # only there can signals be caught
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)} if ours else {}
    for sig in (signal.SIGTERM, signal.SIGHUP) if ours else ():
        if old[sig] != signal.SIG_IGN:  # nohup's ignored hangup stays ignored
            signal.signal(sig, _raise_signalled)
    try:
        address, store_port = job.start_coordinator()
        where = "loopback only" if ipaddress.ip_address(cfg.listen).is_loopback else "reachable from the network"
        folded = f" ({len(cfg.live_ranks)} live, {cfg.world_size - len(cfg.live_ranks)} virtual)" if cfg.fold else ""
        _say(f"job {job.prefix.removeprefix('prism-')}: starting {cfg.world_size} logical ranks{folded} on "
             f"{','.join(cfg.devices)} ({cfg.slots_per_device} slot(s) per device); coordinator and TCPStore "
             f"listen on {cfg.listen} ({where}; --listen); logs in {cfg.log_dir}")
        job.fork_ranks(address, store_port)
        ahead.start_next()  # after the fork: the ranks inherit none of its pipes
        code = job.watch()
    except KeyboardInterrupt:
        code, job.why = 128 + signal.SIGINT, stopped_reason(signal.SIGINT.name)
        _say(f"{job.why}; ending the job")
    except _Signalled as e:
        code, job.why = 128 + e.signum, stopped_reason(signal.Signals(e.signum).name)
        _say(f"{job.why}; ending the job")
    except _StartFailed as e:
        code, job.why = EXIT_RANK_FAILED, str(e)
        _say(f"{job.why}; ending the job")
    finally:
        for sig in old:  # nothing interrupts the ending
            signal.signal(sig, signal.SIG_IGN)
        try:
            code = _end(job, code)
        finally:
            job.cleanup()
            os.close(job.lock_fd)
            for sig, handler in old.items():
                signal.signal(sig, handler)
    return code


def _end(job: _Job, code: int) -> int:
    """Write the trace (partial ones say why) and say, last, what happened and where everything is."""
    cfg = job.cfg
    path, error = job.finish("ok" if code == 0 else "oom" if code == EXIT_OOM else job.ended_by or "failed")
    if code == EXIT_OOM and path is not None:
        _keep_snapshots(cfg.log_dir, Path(path))
    took = f"{time.perf_counter() - job.t0:.1f} s"
    if path is None:
        _say(f"the trace could not be written to {cfg.trace_dir}: {error}")
        if code == 0:
            code = EXIT_RANK_FAILED
    if code == 0:
        _say(f"done in {took}; trace written to {path}; logs in {cfg.log_dir}")
    else:
        what = job.why or ("a rank ran out of memory under the target's cap (predicted OOM)" if code == EXIT_OOM
                           else "the trace could not be written")
        kept = (f"trace so far written to {path} (marked incomplete)" if path is not None and job.why
                else f"trace written to {path}" if path is not None else "no trace")
        _say(f"job ended after {took} (exit {code}): {what}; {kept}; logs in {cfg.log_dir}")
    return code


def _notes(cfg: LaunchConfig) -> None:
    n = cores()
    if cfg.target_threads is not None and cfg.threads_per_rank < cfg.target_threads:
        _say(f"each rank gets {cfg.threads_per_rank} torch thread(s) where the target's has {cfg.target_threads}: "
             "one core is left to prism's coordinator and launcher (a rank's parallel regions stall on a "
             "preempted thread); --threads-per-rank overrides")
    if not cfg.on_gpu and cfg.slots_per_device * cfg.threads_per_rank >= n:
        _say(f"{cfg.slots_per_device} slot(s) x {cfg.threads_per_rank} thread(s) use all {n} cores: the "
             "coordinator shares them with computing ranks, which inflates measured compute "
             "(bench/accuracy: +4% to +56% with 2 slots on 2 cores); leave a core free for timing runs")
    if cfg.on_gpu and cfg.swap_mode != "none" and cfg.swapper == "inprocess":
        _say(f"--swap {cfg.swap}: a blocked rank moves its GPU state to host memory itself when its device fills "
             "up (runtime.vmm); GPU timing runs throughout")
    elif cfg.on_gpu and cfg.swap_mode == "checkpoint":
        _say("--swap checkpoint: GPU timing is off (the driver cannot checkpoint a process the CUDA profiler "
             "ran in), so each compute segment is replayed on one clock, host and device not separated")
    elif cfg.swap_mode == "auto" and _ranks_time_gpu(cfg):
        _say("--swap auto: blocked ranks are swapped to host memory if a device fills up before all of its "
             "ranks ended iteration 1; a device that needed no swap is then timed (host and device time from "
             "iteration 3) and swaps no more, any other keeps swapping on one clock (the verdict is printed)")


def _how(code: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code is None:
        return "still running"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class _StartFailed(RuntimeError):
    """The job could not start all of its ranks."""


__all__ = ["launch", "LaunchConfig", "LaunchError", "Path"]
