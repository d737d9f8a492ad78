"""The training driver as a plain process would run it, but in a child forked from a process that imported torch and
Megatron first, as prism's launcher template does (``prism_megatron.megatron.preload``, without its patches).

An emulated rank's program ran ~5 % slower than the same program in a process of its own on host-bound configs, with
GPU timing on or off (docs/measurements.md, runs 32-34). A forked rank's memory was laid out by another process (the
template's imports, then copy-on-write pages); this tells whether that alone slows the program (``one_gpu_truth.py``'s
``real-forked`` step, beside ``real-threads1``). No CUDA is started before the fork, as in the template. Given the
spans driver as its script, the child runs the driver under it (``real-spans-forked``).

  python bench/gpu/forked_driver.py DRIVER_SCRIPT DRIVER-FLAGS...
  SPANS_OUT=spans.json python bench/gpu/forked_driver.py bench/gpu/spans_driver.py DRIVER_SCRIPT DRIVER-FLAGS...
"""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import sys

from prism_megatron.launcher import fork_safe_cuda_checks

fork_safe_cuda_checks()  # as the launcher does: the imports below must start no CUDA, or the fork cannot use it

import torch  # noqa: E402, F401 - imported before the fork, as the template does


def as_the_template() -> None:
    """Import Megatron as the launcher's template does before it forks (the driver runs Megatron-LM's trainer)."""
    from prism_megatron.megatron.emulate import TEMPLATE_IMPORTS, TEMPLATE_TRAINING_IMPORTS
    from prism_megatron.megatron.megatron_lm import ensure_megatron_training

    ensure_megatron_training()
    for module in (*TEMPLATE_IMPORTS, *TEMPLATE_TRAINING_IMPORTS):
        importlib.import_module(module)


def fork_and_run(driver: str, flags: list[str]) -> int:
    """Run ``driver`` in a forked child to its end, its exit functions too (as a plain process and the launcher's
    rank run them: the spans driver writes its spans in one); returns the child's exit code."""
    pid = os.fork()
    if pid == 0:
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
    return fork_and_run(sys.argv[1], sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
