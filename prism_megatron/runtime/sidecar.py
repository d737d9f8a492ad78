"""The coordinator's process: read its config, start the TCPStore on the job's address, set up the
memory governor and the live predictor, die with the launcher, then serve (runtime.coordinator).

Started by the launcher as ``python -m prism_megatron.runtime.sidecar -`` with the config
(runtime.config.CoordinatorConfig's JSON) on stdin.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import socket
import sys
from pathlib import Path

import torch

from prism_megatron.runtime.config import LOCK_SOCKET_ENV, CoordinatorConfig
from prism_megatron.runtime.coordinator import Coordinator
from prism_megatron.runtime.fake_device import FakeDevice
from prism_megatron.runtime.governor import ADMISSION_MARGIN, SwapMode, SwapPolicy
from prism_megatron.runtime.nvml import FootprintCheck, NvmlUnavailable, nvml_process_memory
from prism_megatron.runtime.staging import CONTEXT_BYTES
from prism_megatron.runtime.swap import BudgetSwapper, CudaCheckpointSwapper, InProcessSwapper, SwapUnavailable
from prism_megatron.runtime.swap_space import SwapSpace, SwapSpaceError
from prism_megatron.trace.schema import stopped_reason


def _die_with_launcher(launcher_pid: int) -> None:
    """Get SIGTERM when the launcher dies (Linux parent-death signal); the loop then ends the job."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the loop notices a new parent instead


def _receive_lock() -> list[int]:
    """A coordinator started ahead of its job gets the job's trace-directory lock over a socket pair
    (``launcher.coordinator_ahead``); one started for its job inherits it instead. The descriptor shares the
    launcher's lock, so the lock outlives the launcher while this process writes the trace."""
    fd = os.environ.pop(LOCK_SOCKET_ENV, None)
    if fd is None:
        return []
    with socket.socket(fileno=int(fd)) as s:
        _, fds, _, _ = socket.recv_fds(s, 1, 1)
    return fds


def main(argv: list[str] | None = None) -> None:
    """Entry of the sidecar process: `python -m prism_megatron.runtime.coordinator CONFIG_JSON` (``-``: read
    it from stdin).

    Prints one JSON line {"address": [host, port], "store_port": port} once it listens.
    """
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    text = ap.parse_args(argv).config
    cfg = CoordinatorConfig.from_json(sys.stdin.read() if text == "-" else text)
    if cfg.log_path:  # started ahead of its job: what it says from now on goes to the job's log
        fd = os.open(cfg.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        print("prism coordinator: started ahead of its job (its imports ran while the run planned or the launch "
              "before it ran)", file=sys.stderr, flush=True)
    lock = _receive_lock()  # noqa: F841 - held open while this process lives
    launcher_pid = cfg.launcher_pid
    if launcher_pid:
        _die_with_launcher(launcher_pid)
        if os.getppid() != launcher_pid:
            print("prism coordinator: the launcher died before the coordinator started", file=sys.stderr)
            return
    authkey = bytes.fromhex(os.environ.pop("PRISM_AUTHKEY"))
    torch.set_num_threads(max(1, cfg.threads))
    coord = Coordinator(
        world_size=cfg.world_size, num_devices=len(cfg.devices), slots_per_device=cfg.slots_per_device,
        device_of=cfg.device_of, device_names=cfg.devices,
        hang_timeout=cfg.hang_timeout, authkey=authkey, host=cfg.host,
        fold=cfg.fold,
    )
    coord.watch.launcher_pid, coord.segment_prefix = launcher_pid, cfg.segment_prefix

    def on_signal(signum: int, _frame) -> None:
        coord.watch.signalled(stopped_reason(signal.Signals(signum).name) + (
            " (the launcher died)" if launcher_pid and os.getppid() != launcher_pid else ""))

    signal.signal(signal.SIGTERM, on_signal)  # the parent-death signal, or a stop of every process of the job
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's Ctrl-C or hangup: the launcher ends the job
        signal.signal(sig, signal.SIG_IGN)
    governor = coord.governor
    governor.times_gpu = cfg.gpu_timing
    notes = []  # said by the launcher
    swapper = None
    swap = SwapMode(cfg.swap)
    if swap != SwapMode.NONE:
        caps = list(cfg.device_memory)
        try:
            if cfg.swapper in ("inprocess", "budget-inprocess"):
                stand_in = cfg.swapper == "budget-inprocess"
                space = SwapSpace(cfg.host_memory or sum(caps) * max(1, coord.n_live))  # sparse: pages as used
                swapper = InProcessSwapper(space, coord.exchange, context=0 if stand_in else CONTEXT_BYTES)
            elif cfg.swapper == "budget":
                swapper = BudgetSwapper(caps[0], FakeDevice.from_env())
            else:
                swapper = CudaCheckpointSwapper()
        except (SwapUnavailable, SwapSpaceError) as e:
            if swap != SwapMode.AUTO:
                raise
            swapper = None
            notes.append(f"--swap auto: ranks share each GPU without swaps ({e})")
        if swapper is not None and not cfg.swapper.startswith("budget"):
            try:
                governor.footprint_check = FootprintCheck(nvml_process_memory())
            except NvmlUnavailable as e:
                notes.append(f"ranks' GPU footprints are not cross-checked with NVML ({e}): swaps plan with "
                             "allocator reserved + a context estimate")
        if swapper is not None:
            governor.enable_swap(swapper, caps, SwapPolicy(cfg.swap_policy),
                                 cfg.host_memory, gate_timing=swap == SwapMode.AUTO and governor.times_gpu,
                                 margin=0 if cfg.swapper.startswith("budget") else ADMISSION_MARGIN)
    governor.configure_admission(cfg.memory_classes, cfg.rank_cap, cfg.memory_estimates)
    notes += governor.say_host_need()
    # ranks move their own state only where a swap may happen: elsewhere their allocator stays as it is
    region = None
    if isinstance(swapper, InProcessSwapper) and (expected := governor.swap_out_bound()) > 0:
        region = swapper.space.path_for_ranks
        if not cfg.swapper.startswith("budget"):
            coord.prefault = swapper.space.prefault(expected)
            notes.append(f"host memory for swaps: {min(expected, swapper.space.capacity) / 2**30:.1f} GiB made "
                         "ready in the background (the host's first touch is slower than the copies; what the peaks "
                         "measured by iteration 1 do not need goes back then)")
    if cfg.predictor:
        module, _, func = cfg.predictor.partition(":")
        coord.predictor.set(getattr(importlib.import_module(module), func), Path(cfg.live_trace),
                            cfg.predictor_options)
    from torch.distributed import TCPStore

    listen = _listening_socket(cfg.host)  # torch's own binds every interface
    store = TCPStore(cfg.host, listen.getsockname()[1], cfg.world_size, is_master=True,
                     wait_for_workers=False, multi_tenant=False, master_listen_fd=listen.fileno())
    print(json.dumps({"address": list(coord.address), "store_port": store.port, "notes": notes,
                      "swap_region": region}), flush=True)
    coord.serve()
    del store


def _listening_socket(host: str):
    """A TCP socket listening on ``host`` only, for the TCPStore."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(4096)
    return sock


if __name__ == "__main__":
    main()
