"""One rank of a job alone under Megatron's ``--fake-process-group``, building the program prism's ranks build.

``python -m prism_megatron.megatron.fake_pg_child SCRIPT ARGS...`` (RANK / WORLD_SIZE of the target in the
environment, ``--fake-process-group`` among ARGS) runs SCRIPT as ``python SCRIPT ARGS`` after installing
prism's rendering seams only (``emulate.install_rendering_patches``: torch norms under sequence parallelism,
the MLA core attention, ``--prism-attention sdpa``, ``--prism-experts grouped``, ``--prism-optimizer fused``,
as the environment asks), so that its model is the one prism's ranks ran; none of prism's runtime runs.
Without them Megatron's figure would be another program's (an unfused attention's s x s probabilities, the
per-expert loop's memory).

One change to Megatron's fake-process-group run: a rank that builds no dataset (a middle pipeline stage)
trains, as rank 0's broadcast tells it to in the real job; the fake broadcast does nothing, so Megatron alone
would skip its training and report only weights and optimizer state (``FAKE_PG_BROADCAST=off`` keeps that).
Megatron's own change under the flag stays: it turns ``check_for_nan_in_loss_and_grad`` off (its receives
return uninitialised buffers), where prism's ranks run the job's setting.

The child prints one line, ``MARK`` and a JSON object: the seams it installed, the iterations Megatron
completed, and on a GPU torch's max allocated / reserved bytes and the device (or the out-of-memory error at
the failing allocation, exit ``OOM_EXIT``). Used by ``--prism-anchor-fake-pg`` (``megatron.anchors``) and
``bench/targets/fake_pg_peak.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from prism_megatron.megatron.versions import checked_versions

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table

MARK = "PRISM-FAKE-PG "  # the child's one result line (JSON after it)
OOM_EXIT = 3  # the child ran out of device memory (its result line says where)
CAP_ENV = "FAKE_PG_CAP_BYTES"  # set: the rank's allocator capped as prism caps an emulated rank (memory.probe)
BROADCAST_ENV = "FAKE_PG_BROADCAST"  # off: ranks that build no dataset do not train (train_as_broadcast)

__all__ = ["BROADCAST_ENV", "CAP_ENV", "MARK", "OOM_EXIT", "command", "rank_env", "read_result", "run_child",
           "train_as_broadcast"]


def command(script: Path, argv: list[str]) -> list[str]:
    """The child's command line: ``script`` with ``argv`` (``--fake-process-group`` among them)."""
    return [sys.executable, "-m", "prism_megatron.megatron.fake_pg_child", str(script), *argv]


def rank_env(world: int, rank: int) -> dict[str, str]:
    """The torchrun variables of ``rank`` of a ``world``-rank job, alone on this host (a free port)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def read_result(output: str) -> dict[str, Any] | None:
    """The child's result line in its output (the last), or None where it printed none."""
    line = next((x for x in reversed(output.splitlines()) if x.startswith(MARK)), None)
    return None if line is None else json.loads(line[len(MARK):])


def train_as_broadcast() -> None:
    """Every rank trains, as rank 0's broadcast tells it to in the real job.

    Megatron decides ``args.do_train`` on the ranks that build a dataset and broadcasts it from rank 0;
    a rank that builds none (a middle pipeline stage) takes the broadcast's value. Under the fake process
    group the broadcast does nothing, so such a rank would skip training. Set where rank 0 would have sent
    it (mock data: train_iters > 0)."""
    from megatron.training import training

    from prism_megatron.patches import seam

    original = seam(training, "build_train_valid_test_data_loaders", CHECKED)

    def loaders(*a: Any, **k: Any) -> Any:
        out = original(*a, **k)
        args = training.get_args()
        args.do_train = bool(args.do_train) or (args.train_iters or 0) > 0
        return out

    training.build_train_valid_test_data_loaders = loaders


def _setup() -> list[str]:
    """CPU mode where there is no GPU, the trainer's set-up where the script uses it, the rendering seams;
    the names of the seams installed."""
    from prism_megatron.megatron import cpu_mode
    from prism_megatron.megatron.emulate import install_rendering_patches, uses_training

    if not cpu_mode.cpu_mode_active() and not cpu_mode._gpu_present():
        cpu_mode.enable_cpu_mode()
    if uses_training():
        from prism_megatron.megatron.megatron_lm import ensure_megatron_training
        from prism_megatron.patches import dataset_helpers

        ensure_megatron_training()
        dataset_helpers.install()  # the wheel's prebuilt dataset helpers (no `make` at start-up); no model change
        if cpu_mode.cpu_mode_active():
            from prism_megatron.patches import cpu_trainer

            cpu_trainer.install()  # what prism's training driver installs on CPU
        if os.environ.get(BROADCAST_ENV) != "off":
            train_as_broadcast()
    return install_rendering_patches()


def _cap() -> None:
    import torch

    from prism_megatron.megatron import cpu_mode

    cap = int(os.environ.get(CAP_ENV) or 0)
    if cap and torch.cuda.is_available() and not cpu_mode.cpu_mode_active():
        total = torch.cuda.get_device_properties(0).total_memory
        if cap > total:
            raise SystemExit(f"prism: {CAP_ENV}={cap} B exceeds this GPU's {total} B")
        torch.cuda.set_per_process_memory_fraction(cap / total, 0)


def run_child(script: Path, argv: list[str]) -> int:
    """In the rank's own process: the set-up, then ``script`` as ``python SCRIPT ARGS``; prints the result line
    and returns the exit code (``OOM_EXIT`` where the device ran out of memory)."""
    import runpy

    rendered = _setup()
    import torch

    from prism_megatron.megatron import cpu_mode
    from prism_megatron.megatron.emulate import uses_training

    _cap()
    sys.argv = [str(script), *argv]
    sys.path.insert(0, str(Path(script).parent))  # pretrain_gpt.py imports gpt_builders, model_provider beside it
    result: dict[str, Any] = {"oom": False, "rendered": rendered}
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except torch.OutOfMemoryError as e:
        result.update(oom=True, error=" ".join(str(e).split())[:600])
        code = OOM_EXIT
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception as e:  # noqa: BLE001 - said below with the peaks reached so far, and the traceback
        import traceback

        traceback.print_exc()
        said = " ".join(f"{type(e).__name__}: {e}".split())[:600]
        oom = "out of memory" in said.lower()  # a CUDA OOM raised as a plain RuntimeError by a C++ path
        result.update(oom=oom, error=said)
        code = OOM_EXIT if oom else 1
    result.update(iterations=None, train_iters=None)
    if uses_training():  # the iterations Megatron completed (its own count of samples consumed)
        try:
            from megatron.training.global_vars import get_args

            margs = get_args()
            result.update(iterations=margs.consumed_train_samples // margs.global_batch_size,
                          train_iters=margs.train_iters)
        except Exception:  # noqa: BLE001 - Megatron stopped before parsing its arguments: the status says so
            pass
    gpu = torch.cuda.is_available() and not cpu_mode.cpu_mode_active()
    result.update(device=torch.cuda.get_device_name() if gpu else "cpu",
                  max_allocated=torch.cuda.max_memory_allocated() if gpu else None,
                  max_reserved=torch.cuda.max_memory_reserved() if gpu else None,
                  total=torch.cuda.get_device_properties(0).total_memory if gpu else None)
    print(MARK + json.dumps(result), flush=True)
    return code


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m prism_megatron.megatron.fake_pg_child SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script = Path(argv[0])
    if not script.is_file():
        print(f"prism: fake-process-group child: script {str(script)!r} is not a file", file=sys.stderr)
        return 2
    return run_child(script, argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
