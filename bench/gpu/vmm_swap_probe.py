"""In-process swapping on one GPU (runtime.vmm): does the caching allocator decide the same with its
segments from CUDA virtual memory, and how fast does a rank's state move out and back in?

  python3 bench/gpu/vmm_swap_probe.py --out DIR [--gib 24]

Part 1 (fidelity): the same small training loop (a stack of Linear layers, Adam, 3 iterations, backward
on autograd's device thread) in two fresh processes, with and without the pool; the allocator's figures
(max allocated, max reserved, segments, retries) of both, and whether every segment came from the pool.
Part 2 (edges): where a routed pool may differ from the default one (a block freed with a use on
another stream; an allocation that fits only once every cached block is freed), each allocator in a
fresh process. Part 3 (speed): GIB of tensors in the pool, swapped out to and in from the job's host
region (runtime.swap_space) fresh, touched, first touched by 8 threads, page-locked; NVML's view of
the process between; the data checked after each; then a second process page-locks the same pages
(what page-locking the region in every rank would do) and copies from them.
Writes DIR/vmm-swap-probe.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GIB = 2**30


def _nvml_used(pid: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
            if p.pid == pid:
                return int(p.usedGpuMemory or 0)
    except Exception:  # noqa: BLE001 - a probe: report what is there
        return None
    return 0


def train(pool: bool) -> dict:
    import torch

    segs = None
    if pool:
        from prism_megatron.runtime.vmm import VmmSegments

        segs = VmmSegments(0)
        keep = segs.install()  # noqa: F841 - the pool lives as long as the process
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8192, 8192, device="cuda") for _ in range(8)]
    model = torch.nn.Sequential(*[m for lay in layers for m in (lay, torch.nn.GELU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(3):
        for _mb in range(2):
            x = torch.randn(4096, 8192, device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x).float().pow(2).mean()
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    st = torch.cuda.memory_stats()
    out = {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
           "reserved": torch.cuda.memory_reserved(), "segments_peak": st.get("segment.all.peak"),
           "alloc_retries": st.get("num_alloc_retries"), "losses": losses}
    if segs is not None:
        out["pool_segment_bytes"] = sum(s.size for s in segs.segments.values())
        out["pool_mapped_bytes"] = sum(s.mapped for s in segs.segments.values())
    return out


def edges(pool: bool) -> dict:
    """Where a routed pool may differ: reuse of a block freed with a use on another stream, and an
    allocation that fits only once every cached block is freed."""
    import torch

    if pool:
        from prism_megatron.runtime.vmm import VmmSegments

        keep = VmmSegments(0).install()  # noqa: F841

    mib = 2**20
    side = torch.cuda.Stream()
    before = torch.cuda.memory_reserved()
    x = torch.empty(64 * mib, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        x.add_(1)
    x.record_stream(side)
    del x
    side.synchronize()
    y = torch.empty(64 * mib, dtype=torch.uint8, device="cuda")
    cross_stream_growth = torch.cuda.memory_reserved() - before
    del y
    # cached small-pool blocks (2 MiB segments) that only a full release returns; then a cap that needs them
    small = [torch.empty(1 * mib - 512, dtype=torch.uint8, device="cuda") for _ in range(256)]
    del small
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((reserved + 8 * mib) / total)
    try:
        z = torch.empty(256 * mib, dtype=torch.uint8, device="cuda")
        fits = True
        del z
    except torch.OutOfMemoryError:
        fits = False
    torch.cuda.set_per_process_memory_fraction(1.0)
    return {"cross_stream_reserved_growth": cross_stream_growth, "alloc_after_full_release_fits": fits,
            "reserved_before_cap": reserved}


def _touch(address: int, nbytes: int, threads: int) -> float:
    """First-touch ``nbytes`` at ``address`` with ``threads`` threads (ctypes releases the GIL)."""
    import ctypes
    import threading

    t0 = time.perf_counter()
    step = -(-nbytes // threads)
    ts = [threading.Thread(target=ctypes.memset, args=(address + i * step, 0, max(0, min(step, nbytes - i * step))))
          for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


def speed(gib: float) -> list[dict]:
    import torch

    from prism_megatron.runtime.swap_space import HostRegion, SwapSpace
    from prism_megatron.runtime.vmm import VmmSegments

    segs = VmmSegments(0)
    keep = segs.install()  # noqa: F841
    n = int(gib * GIB) // 8 // 3
    ts = [torch.arange(n, device="cuda", dtype=torch.int64) * (i + 1) for i in range(3)]
    sums = [int(t.sum(dtype=torch.int64)) for t in ts]
    torch.cuda.synchronize()
    size = segs.mapped_bytes()
    space = SwapSpace(3 * size)
    region = HostRegion(space.path_for_ranks)
    pid = os.getpid()
    rows = []
    extents = [space.take(size) for _ in range(3)]
    touch_s = _touch(region.address(extents[1], size), size, 8)
    print(json.dumps({"touch_8_threads_s": touch_s, "bytes": size}), flush=True)
    reg_s = None
    for label, ext in (("fresh region", extents[0]), ("touched region", extents[0]),
                       ("pre-touched by 8 threads", extents[1]), ("page-locked", extents[2])):
        addr = region.address(ext, size)
        if label == "page-locked":
            _touch(addr, size, 8)
            t0 = time.perf_counter()
            rc = torch.cuda.cudart().cudaHostRegister(addr, size, 0)
            reg_s = time.perf_counter() - t0
            if int(rc) != 0:
                print("cudaHostRegister failed", rc, flush=True)
        before = _nvml_used(pid)
        o = segs.swap_out(addr, size)
        between = _nvml_used(pid)
        i = segs.swap_in(addr)
        ok = [int(t.sum(dtype=torch.int64)) for t in ts] == sums
        rows.append({"host": label, "bytes": o.nbytes, "out_copy_s": o.copy_s, "out_unmap_s": o.map_s,
                     "in_map_s": i.map_s, "in_copy_s": i.copy_s, "register_s": reg_s if label == "page-locked" else 0,
                     "touch_s": touch_s if label.startswith("pre-touched") else 0,
                     "nvml_before": before, "nvml_swapped": between, "nvml_after": _nvml_used(pid),
                     "data_ok": ok, "segments": len(segs.segments)})
        print(json.dumps(rows[-1]), flush=True)
    rows.append(_second_process_pins(space.path_for_ranks, extents[2], size))
    print(json.dumps(rows[-1]), flush=True)
    return rows


_PIN_CHILD = """
import ctypes, json, sys, time, torch
from prism_megatron.runtime.swap_space import HostRegion
region = HostRegion(sys.argv[1])
addr, n = region.address(int(sys.argv[2]), int(sys.argv[3])), int(sys.argv[3])
torch.cuda.init()
t0 = time.perf_counter()
rc = int(torch.cuda.cudart().cudaHostRegister(addr, n, 0))
reg = time.perf_counter() - t0
dev = torch.empty(n // 2, dtype=torch.uint8, device="cuda")
host = (ctypes.c_uint8 * (n // 2)).from_address(addr)
t0 = time.perf_counter()
dev.copy_(torch.frombuffer(host, dtype=torch.uint8), non_blocking=False)
torch.cuda.synchronize()
h2d = time.perf_counter() - t0
print(json.dumps({"register_rc": rc, "register_s": reg, "h2d_bytes": n // 2, "h2d_s": h2d}))
"""


def _second_process_pins(path: str, offset: int, size: int) -> dict:
    """A second process registers the extent this one holds page-locked (two ranks' mappings of one region's
    pages, as page-locking the job's host region per rank would do) and copies half of it to its GPU."""
    p = subprocess.run([sys.executable, "-c", _PIN_CHILD, path, str(offset), str(size)], capture_output=True,
                       text=True, timeout=300)
    line = p.stdout.strip().splitlines()[-1:] or ["{}"]
    try:
        out = json.loads(line[0])
    except json.JSONDecodeError:
        out = {}
    return {"host": "second process pins the same pages", "rc": p.returncode, **out,
            **({"stderr": p.stderr[-1500:]} if p.returncode else {})}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=24.0)
    ap.add_argument("--part", choices=["train-default", "train-pool", "edges-default", "edges-pool", "speed"],
                    default=None)
    a = ap.parse_args()
    if a.part is not None:  # a child: one part in a fresh process
        pool = a.part.endswith("-pool")
        res = train(pool) if a.part.startswith("train") else edges(pool) if a.part.startswith("edges") else speed(a.gib)
        print("RESULT " + json.dumps(res), flush=True)
        return
    result = {}
    for part in ("train-default", "train-pool", "edges-default", "edges-pool", "speed"):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, __file__, "--out", a.out, "--gib", str(a.gib), "--part", part],
                           capture_output=True, text=True, timeout=400)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        result[part] = json.loads(line[-1][7:]) if line else {"rc": p.returncode, "stderr": p.stderr[-3000:]}
        result[part + "_wall_s"] = time.perf_counter() - t0
        print(part, json.dumps(result[part])[:3000], flush=True)
    d, q = result["train-default"], result["train-pool"]
    if "max_allocated" in d and "max_allocated" in q:
        for k in ("max_allocated", "max_reserved", "reserved", "segments_peak", "alloc_retries"):
            print(f"{k:16} default {d[k]}  pool {q[k]}  {'same' if d[k] == q[k] else 'DIFFERENT'}")
        print("losses", "same" if d["losses"] == q["losses"] else "DIFFERENT")
    d, q = result["edges-default"], result["edges-pool"]
    for k in ("cross_stream_reserved_growth", "alloc_after_full_release_fits", "reserved_before_cap"):
        print(f"{k:30} default {d.get(k)}  pool {q.get(k)}")
    for r in result.get("speed", []) if isinstance(result.get("speed"), list) else []:
        if "bytes" not in r:  # the second process's registration
            gbs = r.get("h2d_bytes", 0) / 1e9 / max(r.get("h2d_s", 0.0), 1e-9)
            print(f"{r['host']}: rc {r['rc']}, cudaHostRegister rc {r.get('register_rc')} in "
                  f"{r.get('register_s', 0.0):.2f} s, then {gbs:.2f} GB/s host to device")
            continue
        gb = r["bytes"] / 1e9
        print(f"{r['host']:26} {gb:6.1f} GB  out {gb / max(r['out_copy_s'], 1e-9):6.2f} GB/s "
              f"(copy {r['out_copy_s']:.2f} s, unmap {r['out_unmap_s']:.2f} s, touch {r['touch_s']:.2f} s, "
              f"register {r['register_s']:.2f} s)  "
              f"in {gb / max(r['in_copy_s'], 1e-9):6.2f} GB/s (map {r['in_map_s']:.2f} s)  "
              f"NVML {r['nvml_before']} -> {r['nvml_swapped']} -> {r['nvml_after']}  "
              f"data {'ok' if r['data_ok'] else 'BAD'}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "vmm-swap-probe.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
