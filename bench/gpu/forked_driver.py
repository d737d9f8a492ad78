"""The training driver as a plain process would run it, but in a child forked from a process that imported torch and
Megatron first, as prism's launcher template does (``prism_megatron.megatron.preload``, without its patches).

An emulated rank's program ran ~5 % slower than the same program in a process of its own on host-bound configs, with
GPU timing on or off (docs/measurements.md, runs 32-34). A forked rank's memory was laid out by another process (the
template's imports, then copy-on-write pages); this tells whether that alone slows the program (``one_gpu_truth.py``'s
``real-forked`` step, beside ``real-threads1``). No CUDA is started before the fork, as in the template. Given the
spans driver as its script, the child runs the driver under it (``real-spans-forked``). ``FORKED_AS_LAUNCHER``
(a comma list of ``LAUNCHER_PARTS``, or ``all``) makes the template more like prism's launcher before its fork
(``real-spans-forked-launcher``): a rank forked from the launcher ran its forward slower where this template's child
did not (docs/measurements.md, runs 57-59).

  python bench/gpu/forked_driver.py DRIVER_SCRIPT DRIVER-FLAGS...
  SPANS_OUT=spans.json python bench/gpu/forked_driver.py bench/gpu/spans_driver.py DRIVER_SCRIPT DRIVER-FLAGS...
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import signal
import socket
import subprocess
import sys

from prism_megatron.launcher import fork_safe_cuda_checks


def as_the_template() -> None:
    """Import torch and Megatron as the launcher's template does before it forks (the driver runs Megatron-LM's
    trainer); here, not at import, so that a reader of this module's names starts nothing."""
    fork_safe_cuda_checks()  # as the launcher does: the imports below must start no CUDA, or the fork cannot use it
    import torch  # noqa: F401 - imported before the fork, as the template does

    from prism_megatron.megatron.emulate import TEMPLATE_IMPORTS, TEMPLATE_TRAINING_IMPORTS
    from prism_megatron.megatron.megatron_lm import ensure_megatron_training

    ensure_megatron_training()
    for module in (*TEMPLATE_IMPORTS, *TEMPLATE_TRAINING_IMPORTS):
        importlib.import_module(module)


#: what the launcher holds at its fork that this template does not, each added by ``FORKED_AS_LAUNCHER``: the
#: launcher's own imports (click, pyarrow through the trace's schema, multiprocessing's connections), its Python
#: handlers of SIGTERM and SIGHUP, a running child process (its coordinator), a connected socket (the control
#: connection, which the rank closes)
LAUNCHER_PARTS = ("imports", "signals", "child", "socket")
LAUNCHER_ENV = "FORKED_AS_LAUNCHER"


def as_the_launcher(parts: list[str]) -> tuple[list, list[int]]:
    """Add ``parts`` of the launcher's state to this template; returns what must outlive the fork (the parent's
    children and sockets) and the file descriptors the child closes, as the launcher's rank does."""
    bad = [p for p in parts if p not in LAUNCHER_PARTS]
    if bad:
        raise SystemExit(f"{LAUNCHER_ENV}: unknown {', '.join(bad)} (known: {', '.join(LAUNCHER_PARTS)}, all)")
    held: list = []
    close: list[int] = []
    if "imports" in parts:
        importlib.import_module("prism_megatron.cli")
        importlib.import_module("prism_megatron.launcher.launch")
    if "signals" in parts:
        def _raise(signum, _frame):
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _raise)
    if "child" in parts:
        held.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1e6)"]))
    if "socket" in parts:
        a, b = socket.socketpair()
        held += [a, b]
        close.append(a.fileno())
    return held, close


def fork_and_run(driver: str, flags: list[str], close: tuple[int, ...] = ()) -> int:
    """Run ``driver`` in a forked child to its end, its exit functions too (as a plain process and the launcher's
    rank run them: the spans driver writes its spans in one); returns the child's exit code."""
    pid = os.fork()
    if pid == 0:
        for fd in close:
            os.close(fd)
        code = 0
        try:
            sys.argv = [driver, *flags]
            runpy.run_path(driver, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:  # noqa: BLE001 - the child must not return into the parent's code
            import traceback

            traceback.print_exc()
            code = 1
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: forked_driver.py DRIVER_SCRIPT [FLAGS...]", file=sys.stderr)
        return 2
    as_the_template()
    told = os.environ.get(LAUNCHER_ENV, "")
    parts = list(LAUNCHER_PARTS) if told == "all" else [p for p in told.split(",") if p]
    held, close = as_the_launcher(parts)
    try:
        return fork_and_run(sys.argv[1], sys.argv[2:], tuple(close))
    finally:
        for h in held:
            if isinstance(h, subprocess.Popen):
                h.kill()
                h.wait()
            else:
                h.close()


if __name__ == "__main__":
    sys.exit(main())
