"""What each thread of the Python processes did while a one-GPU truth call ran: time on a CPU, time runnable
but waiting for one, and how often it gave its CPU up (blocked) or had it taken.

An emulated rank's program runs ~5 % slower than the same program in a process of its own on host-bound
configurations, GPU timing on or off (docs/measurements.md, runs 32-34), and per-CPU busy shares
(``host_sampler.py``) cannot say whether its main thread computes longer (more on-CPU time per iteration: the
code itself is slower there) or waits longer (blocked on a lock, the GIL or the device: more voluntary
switches; or runnable behind another thread: run-queue time). The kernel keeps both per thread. Every
``--interval`` seconds this writes one JSON line: ``{"t": epoch, "threads": [[pid, tid, comm, on_cpu_ns,
runqueue_ns, voluntary, involuntary, last_cpu], ...]}`` for each thread of a Python process (its
executable named ``python...``; not this one) whose counters moved since the last line; a process seen for the first
time gets a line ``{"t", "pid", "ppid", "cmd"}`` first. Counters are cumulative (``/proc/PID/task/TID/
schedstat`` and ``status``; where schedstat is missing, ``stat``'s utime + stime in clock ticks, and no
run-queue time).

  python bench/gpu/thread_sampler.py OUT.jsonl [--interval 1.0]      (runs until killed; each line flushed)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_sampler import sampler_args  # noqa: E402 - bench/gpu/host_sampler.py: the samplers' one command line

_TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 1e7


def parse_stat(text: str) -> tuple[str, int, int, int]:
    """(comm, ppid, utime + stime in ns, last CPU) from a ``stat`` line; comm may hold spaces and parentheses."""
    head, _, rest = text.rpartition(")")
    comm = head.partition("(")[2]
    f = rest.split()  # f[0] is field 3 (state)
    return comm, int(f[1]), int((int(f[11]) + int(f[12])) * _TICK_NS), int(f[36])


def parse_switches(text: str) -> tuple[int, int]:
    """(voluntary, involuntary) context switches from a ``status`` file."""
    vol = invol = 0
    for line in text.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            vol = int(line.split()[1])
        elif line.startswith("nonvoluntary_ctxt_switches:"):
            invol = int(line.split()[1])
    return vol, invol


def read_thread(task: Path) -> tuple[str, int, int, int, int, int, int] | None:
    """(comm, ppid, on_cpu_ns, runqueue_ns, voluntary, involuntary, last_cpu) of one task; None where it ended."""
    try:
        comm, ppid, ticks_ns, cpu = parse_stat((task / "stat").read_text())
        vol, invol = parse_switches((task / "status").read_text())
        try:
            on_cpu, runqueue, _ = ((task / "schedstat").read_text().split() + ["0", "0", "0"])[:3]
            on_cpu_ns, runqueue_ns = int(on_cpu), int(runqueue)
        except (OSError, ValueError):
            on_cpu_ns, runqueue_ns = ticks_ns, -1
    except (OSError, ValueError, IndexError):
        return None
    return comm, ppid, on_cpu_ns, runqueue_ns, vol, invol, cpu


def is_python(argv: list[str]) -> bool:
    """Whether a command line runs a Python interpreter (not a shell whose script mentions one)."""
    return bool(argv) and Path(argv[0]).name.startswith("python")


def python_pids(proc: Path = Path("/proc"), me: int | None = None) -> dict[int, str]:
    """{pid: command line} of the Python processes (not ``me``)."""
    me = os.getpid() if me is None else me
    out = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if is_python(argv):
            out[int(entry.name)] = " ".join(a for a in argv if a)
    return out


def main(argv: list[str] | None = None) -> int:
    a = sampler_args("thread_sampler.py", __doc__, "the JSON-lines file to write", argv)
    proc = Path("/proc")
    seen_pids: set[int] = set()
    last: dict[tuple[int, int], tuple] = {}
    with a.out.open("w") as f:
        while True:
            now = time.time()
            rows = []
            for pid, cmd in python_pids(proc).items():
                tasks = proc / str(pid) / "task"
                try:
                    tids = [int(t.name) for t in tasks.iterdir()]
                except OSError:
                    continue
                for tid in tids:
                    r = read_thread(tasks / str(tid))
                    if r is None:
                        continue
                    comm, ppid, *counters = r
                    if pid not in seen_pids:
                        seen_pids.add(pid)
                        f.write(json.dumps({"t": round(now, 3), "pid": pid, "ppid": ppid, "cmd": cmd[:300]}) + "\n")
                    if last.get((pid, tid)) != tuple(counters[:4]):
                        last[(pid, tid)] = tuple(counters[:4])
                        rows.append([pid, tid, comm, *counters])
            if rows:
                f.write(json.dumps({"t": round(now, 3), "threads": rows}) + "\n")
                f.flush()
            time.sleep(max(0.0, a.interval - (time.time() - now)))


if __name__ == "__main__":
    sys.exit(main())
