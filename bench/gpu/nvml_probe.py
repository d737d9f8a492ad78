"""What NVML sees of processes sharing one GPU, against what each process's caching allocator reports.

Issue 4 asks for each rank's footprint (allocator reserved + context) to be cross-checked with NVML.
This answers the two facts that check rests on, on the machine at hand: whether NVML's per-process
list names our processes by the PIDs we know (it does not inside some containers), and how much a
process holds beyond `torch.cuda.memory_reserved()` (the CUDA context, cuBLAS workspace, ...), which
`prism_megatron.runtime.staging.CONTEXT_BYTES` estimates.

  python3 bench/gpu/nvml_probe.py            # device nvidia-h200, ~30 s; needs nvidia-ml-py (pynvml)
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time


def child(gib: float, matmul: bool, q: mp.Queue, stop: mp.Event) -> None:
    import torch

    x = torch.empty(int(gib * 2**30), dtype=torch.uint8, device="cuda")
    if matmul:  # cuBLAS handle and workspace, as a training step has them
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        (a @ a).sum().item()
    torch.cuda.synchronize()
    q.put((os.getpid(), gib, matmul, torch.cuda.memory_reserved(), torch.cuda.memory_allocated()))
    stop.wait()
    del x


def main() -> None:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    base = pynvml.nvmlDeviceGetMemoryInfo(h).used
    print(f"driver {pynvml.nvmlSystemGetDriverVersion()}, device used before: {base / 2**20:.0f} MiB")
    ctx = mp.get_context("spawn")
    q, stop = ctx.Queue(), ctx.Event()
    shapes = [(1.0, False), (3.0, True), (8.0, True)]
    procs = [ctx.Process(target=child, args=(g, m, q, stop)) for g, m in shapes]
    for p in procs:
        p.start()
    reports = {}
    for _ in procs:
        pid, gib, mm, reserved, allocated = q.get(timeout=120)
        reports[pid] = (gib, mm, reserved, allocated)
    time.sleep(0.5)
    t0 = time.perf_counter()
    listed = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
    t_list = time.perf_counter() - t0
    t0 = time.perf_counter()
    used = pynvml.nvmlDeviceGetMemoryInfo(h).used
    t_info = time.perf_counter() - t0
    print(f"our pids: {sorted(reports)}; NVML lists: {[(p.pid, p.usedGpuMemory) for p in listed]}")
    print(f"query cost: process list {t_list * 1e3:.2f} ms, memory info {t_info * 1e3:.2f} ms")
    by_pid = {p.pid: p.usedGpuMemory for p in listed}
    for pid, (gib, mm, reserved, _allocated) in sorted(reports.items()):
        nv = by_pid.get(pid)
        extra = f"{(nv - reserved) / 2**20:.0f} MiB beyond reserved" if nv else "not listed under our pid"
        print(f"pid {pid}: {gib} GiB tensor, matmul {mm}: reserved {reserved / 2**20:.0f} MiB, "
              f"NVML {None if nv is None else round(nv / 2**20)} MiB, {extra}")
    total_reserved = sum(r[2] for r in reports.values())
    print(f"device used {used / 2**20:.0f} MiB, minus before {(used - base) / 2**20:.0f} MiB, sum reserved "
          f"{total_reserved / 2**20:.0f} MiB: {(used - base - total_reserved) / len(reports) / 2**20:.0f} MiB "
          f"per process beyond reserved")
    stop.set()
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
