"""Fault injection: every way a job can end badly, and what it leaves. Prints one table row per case and
checkout: exit code, time to end, the last message, processes and /dev/shm left, and the trace's state.

  python bench/faults.py [--checkout DIR[=LABEL] ...] [--cap SECONDS] [case ...]

Each --checkout is a prism-megatron source tree run as ``PYTHONPATH=DIR python -m prism_megatron``
(default: this one), so an older commit checked out elsewhere gives the "before" column. A case
that runs past --cap seconds (default 40) is killed and reported as "(cap)": the job was still waiting.
"shm left" counts the job's own segments where their names carry the launcher's pid; with older names
it counts new segments that stayed, which may include another job's running on the machine meanwhile.
Also prints the measured host memory (PSS) of a running CPU rank, the figure the launcher's memory
check assumes (launcher.preflight.RANK_FOOTPRINT).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PY = sys.executable
SHM = Path("/dev/shm")

PROGRAMS = {
    "ok.py": """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        x = torch.ones(1 << 18)
        for _ in range(3):
            dist.all_reduce(x)
        """,
    "crash.py": """
        import subprocess, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)  # FAULTS-CHILD"])
        dist.all_reduce(torch.ones(1 << 18))
        if dist.get_rank() == 2:
            raise ValueError("boom")
        dist.barrier()
        """,
    # runs until someone ends it: each rank starts a child, moves 1 MiB through shared memory, then waits
    "blocks.py": """
        import os, subprocess, sys, time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)  # FAULTS-CHILD"])
        dist.all_reduce(torch.ones(1 << 18))
        open(os.path.join(os.environ["OUT"], f"up-{dist.get_rank()}"), "w").write(os.environ["MASTER_PORT"])
        if dist.get_rank() == 0:
            time.sleep(300)
        dist.barrier()
        """,
    "sleeps.py": """
        import os, time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        dist.all_reduce(torch.ones(4))
        time.sleep(float(os.environ.get("SLEEP", "6")))
        dist.all_reduce(torch.ones(4))
        """,
    "stall.py": """
        import os, signal, time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 1:
            if os.environ["STALL"] == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            t = time.time()
            while time.time() - t < 300:
                pass
        dist.all_reduce(torch.ones(4))
        """,
    "group_timeout.py": """
        import datetime, sys, time, torch, torch.distributed as dist
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
        if dist.get_rank() == 1:
            time.sleep(8)
        try:
            dist.all_reduce(torch.ones(4))
        except Exception as e:
            print(f"rank {dist.get_rank()} raised {type(e).__name__} at the group timeout", file=sys.stderr)
            sys.exit(7)
        """,
    "early_exit.py": """
        import sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        dist.all_reduce(torch.ones(3))
        if dist.get_rank() == 1:
            sys.exit(0)
        dist.all_reduce(torch.ones(3))
        """,
    "sparse.py": """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        r = dist.get_rank()
        t = torch.sparse_coo_tensor(torch.tensor([[r, 3]]), torch.tensor([1.0, 2.0]), (4,))
        dist.all_reduce(t)
        """,
    "footprint.py": """
        import os, time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        x = torch.randn(256, 256)
        for _ in range(5):
            x = torch.tanh(x @ x)
            dist.all_reduce(x)
        open(os.path.join(os.environ["OUT"], f"up-{dist.get_rank()}"), "w").write(str(os.getpid()))
        while not os.path.exists(os.path.join(os.environ["OUT"], "go")):
            time.sleep(0.05)
        """,
}


@dataclass
class Result:
    rc: int | str = "-"
    seconds: float = 0.0
    message: str = ""
    procs: int = 0
    shm_bytes: int = 0
    shm_files: int = 0
    trace: str = "none"
    job: str = ""  # the job's id as the launcher printed it: its segments are prism-<id>*
    notes: list[str] = field(default_factory=list)


class Run:
    """One case on one checkout: a scratch directory, the command, and what it left."""

    def __init__(self, checkout: Path, cap: float) -> None:
        self.checkout, self.cap = checkout, cap
        self.tmp = Path(tempfile.mkdtemp(prefix="prism-faults-"))
        for name, text in PROGRAMS.items():
            (self.tmp / name).write_text(textwrap.dedent(text))
        self.shm_before = _shm()
        # segment names carry the launcher's pid from the version that sweeps them: count exactly those
        self.pid_names = "def job_prefix" in (checkout / "prism_megatron/runtime/shm.py").read_text()
        self.launched: list[subprocess.Popen] = []
        self.jobs: list[str] = []  # job ids the launchers printed

    def env(self, **extra: str) -> dict:
        return dict(os.environ, PYTHONPATH=str(self.checkout), PYTHONUNBUFFERED="1", OUT=str(self.tmp), **extra)

    def launch(self, program: str, *opts: str, world: int = 4, trace: str = "trace", env: dict | None = None,
               args: tuple[str, ...] = ()) -> subprocess.Popen:
        cmd = [PY, "-m", "prism_megatron", "launch", "-w", str(world), "--trace-dir", str(self.tmp / trace),
               "--log-ranks", "none", *opts, str(self.tmp / program), *args]
        self.launched.append(subprocess.Popen(cmd, cwd=self.tmp, env=env or self.env(), stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, preexec_fn=_as_in_a_terminal))
        return self.launched[-1]

    def wait_up(self, world: int, timeout: float = 60) -> bool:
        t = time.monotonic()
        while time.monotonic() - t < timeout:
            if all((self.tmp / f"up-{r}").exists() for r in range(world)):
                time.sleep(0.5)
                return True
            time.sleep(0.1)
        return False

    def finish(self, p: subprocess.Popen, t0: float, r: Result | None = None, trace: str = "trace") -> Result:
        r = r or Result()
        try:
            _, err = p.communicate(timeout=max(1.0, self.cap - (time.monotonic() - t0)))
            r.rc = p.returncode
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)
            _, err = p.communicate()
            r.rc = "(cap)"
        r.seconds = time.monotonic() - t0
        found = re.search(r"prism: job ([\w-]+):", err or "")
        r.job = found.group(1) if found else ""
        if r.job:
            self.jobs.append(r.job)
        lines = [line for line in (err or "").strip().splitlines() if line.strip()]
        r.message = lines[-1].strip() if lines else ""
        if r.rc == "(cap)":
            r.message = f"still waiting at {self.cap:.0f} s; last line: {r.message}"
        self.left(r, trace)
        return r

    def left(self, r: Result, trace: str = "trace") -> None:
        time.sleep(1.5)  # what exits on its own has time to
        r.procs = len(self.procs())
        if r.job:  # the job's own segments
            new = list(SHM.glob(f"prism-{r.job}*"))
        elif self.pid_names:  # named by the launcher's pid
            new = self.own_segments()
        else:  # older names: new ones that stay (other jobs' segments come and go; some may be counted)
            new = [p for p in _shm() - self.shm_before if re.match(r"prism-[0-9a-f]{8}-r", p.name)]
            time.sleep(0.5)
            new = [p for p in new if p.exists()]
        r.shm_files, r.shm_bytes = len(new), sum(_size(p) for p in new)
        r.trace = trace_state(self.tmp / trace)

    def own_segments(self) -> list[Path]:
        """This case's segments: named by its launchers' pids, or (older names) by the job ids they printed.
        An older job that printed no id before it was killed leaves its segments (its id is unknown)."""
        prefixes = tuple(f"prism-{p.pid}-" for p in self.launched) + tuple(f"prism-{j}" for j in self.jobs)
        return [p for p in _shm() if prefixes and p.name.startswith(prefixes)]

    def procs(self) -> list[int]:
        """Processes of this case: their command line or environment names its scratch directory."""
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                blob = (d / "cmdline").read_bytes() + (d / "environ").read_bytes()
                state = (d / "stat").read_text().rsplit(") ", 1)[1][0]
            except OSError:
                continue
            if str(self.tmp).encode() in blob and state != "Z":
                out.append(int(d.name))
        return out

    def cleanup(self) -> None:
        for pid in self.procs():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # only this case's segments: other prism jobs on the machine (a test suite, another bench) keep
        # theirs; removing every new prism-* file ended them with a vanished staging segment
        for p in self.own_segments():
            p.unlink(missing_ok=True)
        shutil.rmtree(self.tmp, ignore_errors=True)


def _as_in_a_terminal() -> None:
    """A job started from a terminal: Ctrl-C and hangups act (this script may run under nohup or in the
    background, which ignore them, and children inherit that)."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _shm() -> set[Path]:
    return set(SHM.glob("prism-*")) if SHM.is_dir() else set()


def _size(p: Path) -> int:
    try:
        return p.stat().st_blocks * 512
    except OSError:
        return 0


def trace_state(path: Path) -> str:
    try:
        m = json.loads((path / "manifest.json").read_text())
    except OSError:
        return "none"
    except ValueError:
        return "unreadable"
    if m.get("complete") is True:
        return "complete"
    return f"incomplete: {m.get('incomplete')}"


# ---- the cases ---------------------------------------------------------------------------------------
def case_ok(run: Run) -> Result:
    t0 = time.monotonic()
    return run.finish(run.launch("ok.py"), t0)


def case_rank_fails(run: Run) -> Result:
    t0 = time.monotonic()
    return run.finish(run.launch("crash.py", "--hang-timeout", "60"), t0)


def _signal_case(sig: int) -> Callable[[Run], Result]:
    def case(run: Run) -> Result:
        p = run.launch("blocks.py", "--slots-per-device", "4")
        if not run.wait_up(4):
            return run.finish(p, time.monotonic(), Result(notes=["never started"]))
        t0 = time.monotonic()
        p.send_signal(sig)
        return run.finish(p, t0)
    return case


def case_launcher_killed(run: Run) -> Result:
    """SIGKILL, as the kernel's OOM killer ends the launcher."""
    p = run.launch("blocks.py", "--slots-per-device", "4")
    if not run.wait_up(4):
        return run.finish(p, time.monotonic(), Result(notes=["never started"]))
    t0 = time.monotonic()
    p.kill()
    r = run.finish(p, t0)
    r.message = "(the launcher is killed: it says nothing)"
    deadline = time.monotonic() + 10  # the coordinator may still be ending the job
    while run.procs() and time.monotonic() < deadline:
        time.sleep(0.2)
    run.left(r)
    return r


def case_launcher_dies_starting(run: Run) -> Result:
    p = run.launch("blocks.py", "--slots-per-device", "4")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(  # the coordinator is starting: kill the launcher then
            b"runtime.sidecar" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in run.procs()):
        time.sleep(0.02)
    t0 = time.monotonic()
    p.kill()
    r = run.finish(p, t0)
    r.message = "(the launcher is killed during start-up)"
    time.sleep(5)
    run.left(r)
    return r


def case_coordinator_killed(run: Run) -> Result:
    p = run.launch("blocks.py", "--slots-per-device", "4")
    if not run.wait_up(4):
        return run.finish(p, time.monotonic(), Result(notes=["never started"]))
    coord = [pid for pid in run.procs() if b"runtime.sidecar" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    t0 = time.monotonic()
    for pid in coord:
        os.kill(pid, signal.SIGKILL)
    return run.finish(p, t0)


def case_trace_dir_not_a_trace(run: Run) -> Result:
    (run.tmp / "notrace").mkdir()
    (run.tmp / "notrace" / "notes.txt").write_text("my notes\n")
    t0 = time.monotonic()
    r = run.finish(run.launch("ok.py", trace="notrace"), t0, trace="notrace")
    r.trace = "notes kept" if (run.tmp / "notrace" / "notes.txt").exists() else "notes LOST"
    return r


def case_shared_trace_dir(run: Run) -> Result:
    a = run.launch("sleeps.py", world=2, env=run.env(SLEEP="8"))
    time.sleep(3)
    t0 = time.monotonic()
    r = run.finish(run.launch("ok.py", world=2), t0)
    _, err = a.communicate(timeout=120)
    run.left(r)  # once both ended; the trace is the one that is left
    last = [line for line in err.strip().splitlines() if line.strip()][-1:]
    r.notes.append(f"first job: rc {a.returncode}, {' '.join(last)[:160]}")
    return r


def case_stall(how: str) -> Callable[[Run], Result]:
    def case(run: Run) -> Result:
        t0 = time.monotonic()
        return run.finish(run.launch("stall.py", "--hang-timeout", "3", "--slots-per-device", "2", world=3,
                                     env=run.env(STALL=how)), t0)
    return case


def case_group_timeout(run: Run) -> Result:
    t0 = time.monotonic()
    r = run.finish(run.launch("group_timeout.py", "--slots-per-device", "3", world=3), t0)
    r.notes.append("torchrun + gloo: ranks 0 and 2 raise RuntimeError at 2.0 s")
    return r


def case_early_exit(run: Run) -> Result:
    t0 = time.monotonic()
    p = run.launch("early_exit.py", "--hang-timeout", "30", world=3)
    r = run.finish(p, t0)
    report = run.tmp / "trace.logs" / "hang-report.txt"
    if report.exists():
        r.notes += [line.strip() for line in report.read_text().splitlines() if "exited" in line][:1]
    return r


def case_world_too_big(run: Run) -> Result:
    t0 = time.monotonic()
    return run.finish(run.launch("ok.py", world=65536), t0)


def case_logs_is_a_file(run: Run) -> Result:
    (run.tmp / "trace.logs").write_text("x")
    t0 = time.monotonic()
    return run.finish(run.launch("ok.py"), t0)


def case_sparse(run: Run) -> Result:
    t0 = time.monotonic()
    p = run.launch("sparse.py", world=2)
    r = run.finish(p, t0)
    log = run.tmp / "trace.logs" / "rank-0.log"
    if log.exists():
        errs = [line for line in log.read_text().splitlines() if "Error" in line]
        r.notes += errs[-1:]
    return r


def case_listen(run: Run) -> Result:
    p = run.launch("blocks.py", "--slots-per-device", "4")
    if run.wait_up(4):
        port = (run.tmp / "up-0").read_text().strip()
        ss = subprocess.run(["ss", "-ltn"], capture_output=True, text=True).stdout
        where = [line.split()[3] for line in ss.splitlines() if line.split()[3:4] and
                 line.split()[3].endswith(f":{port}")]
        note = f"TCPStore (port {port}) listens on {', '.join(where) or '?'}"
    else:
        note = "never started"
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    r = run.finish(p, t0)
    r.notes.append(note)
    return r


CASES: dict[str, Callable[[Run], Result]] = {
    "success": case_ok,
    "rank fails (child running)": case_rank_fails,
    "SIGINT to launcher": _signal_case(signal.SIGINT),
    "SIGTERM to launcher": _signal_case(signal.SIGTERM),
    "SIGHUP to launcher": _signal_case(signal.SIGHUP),
    "launcher SIGKILL/OOM-kill": case_launcher_killed,
    "launcher dies in start-up": case_launcher_dies_starting,
    "coordinator killed": case_coordinator_killed,
    "trace-dir not a trace": case_trace_dir_not_a_trace,
    "2 jobs, 1 trace-dir": case_shared_trace_dir,
    "rank stopped (SIGSTOP)": case_stall("stop"),
    "rank computing forever": case_stall("compute"),
    "group timeout=2s": case_group_timeout,
    "rank exits early (code 0)": case_early_exit,
    "world size 65536": case_world_too_big,
    "TRACE.logs is a file": case_logs_is_a_file,
    "sparse all_reduce": case_sparse,
    "listen address": case_listen,
}


def footprint(checkout: Path, world: int = 8) -> str:
    """PSS of a running CPU rank (torch imported, collectives done), mean over ``world`` ranks."""
    run = Run(checkout, 120)
    try:
        p = run.launch("footprint.py", "--slots-per-device", str(world), world=world)
        if not run.wait_up(world, 120):
            return "ranks did not start"
        pss = []
        for r in range(world):
            pid = int((run.tmp / f"up-{r}").read_text())
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
            pss.append(int(re.search(r"^Pss:\s+(\d+) kB", text, re.M).group(1)) * 1024)
        (run.tmp / "go").write_text("")
        p.communicate(timeout=120)
        return (f"PSS of a running CPU rank ({world} ranks): mean {sum(pss) / len(pss) / 2**20:.0f} MiB, "
                f"max {max(pss) / 2**20:.0f} MiB")
    finally:
        run.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", action="append", default=[],
                    help="DIR[=LABEL]: a source tree to run (repeatable; default: this one, 'after')")
    ap.add_argument("--cap", type=float, default=40.0)
    ap.add_argument("cases", nargs="*", help=f"cases to run (default all): {', '.join(CASES)}")
    a = ap.parse_args()
    here = Path(__file__).resolve().parents[1]
    checkouts = [(Path(c.split("=", 1)[0]).resolve(), c.split("=", 1)[1] if "=" in c else Path(c).name)
                 for c in a.checkout] or [(here, "after")]
    chosen = [c for c in CASES if not a.cases or any(k.lower() in c.lower() for k in a.cases)]
    width = max(len(c) for c in chosen)
    print(f"{'case':<{width}}  {'run':<7} {'rc':>5} {'time':>7}  {'procs':>5} {'shm left':>9}  trace / message")
    for case in chosen:
        for path, label in checkouts:
            run = Run(path, a.cap)
            try:
                r = CASES[case](run)
            except Exception as e:  # noqa: BLE001 - a case that breaks is a row that says so
                r = Result(rc="err", message=f"{type(e).__name__}: {e}")
            finally:
                run.cleanup()
            shm = f"{r.shm_files}/{r.shm_bytes / 2**20:.1f}M" if r.shm_files else "0"
            print(f"{case:<{width}}  {label:<7} {r.rc!s:>5} {r.seconds:>6.1f}s  {r.procs:>5} {shm:>9}  "
                  f"trace: {r.trace}", flush=True)
            print(f"{'':<{width}}  {'':<7} {'':>5} {'':>7}  {'':>5} {'':>9}  msg: {r.message[:220]}", flush=True)
            for note in r.notes:
                print(f"{'':<{width}}  {'':<7} {'':>5} {'':>7}  {'':>5} {'':>9}  note: {note[:220]}", flush=True)
    for path, label in checkouts:
        print(f"{label}: {footprint(path)}")


if __name__ == "__main__":
    main()
