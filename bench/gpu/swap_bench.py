"""Issue 4 on the GPU: CUDA process checkpoint/restore bandwidth, and a job that only fits with swaps.

  python3 bench/gpu/swap_bench.py OUT_DIR [sizes GiB, default 1 8 40 | job | probes]

A. For each size: a child process fills N GiB on the GPU; this process (driver API only, no
   context of its own on that memory) checkpoints it, reads the GPU's used memory, restores it, and
   the child verifies its data. Prints GB/s each way.
C. The driver on processes in states a rank can be in (no CUDA yet; CUDA; CUDA after the CUDA
   profiler ran, as GPU timing does): what lock/checkpoint/restore/unlock answer.
   SWAP_JOB_GPU_TIMING=0 runs B with --gpu-timing off.
B. 8 logical ranks of tests/programs/ring.py, each holding 20 GiB of ballast (8 x ~20.6 GiB > one
   H200), with --swap checkpoint, against the same job without ballast: results equal, swaps counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from prism_megatron.runtime.swap import CudaCheckpointSwapper  # noqa: E402

CHILD = r"""
import sys, torch
n = int(float(sys.argv[1]) * 2**30)
x = torch.full((n,), 7, dtype=torch.uint8, device="cuda")  # no temporaries: the process holds n bytes
x[::4099] = 3
chk = lambda: sum(int(c.sum(dtype=torch.int64)) for c in x.split(1 << 26))  # small temporaries
want = chk(); torch.cuda.synchronize(); torch.cuda.empty_cache()
print("ready", flush=True); sys.stdin.readline()
got = chk()
print("ok" if got == want else f"CORRUPT {got} != {want}", flush=True)
"""


def gpu_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def bench_sizes(sizes: list[float]) -> list[dict]:
    sw = CudaCheckpointSwapper()
    rows = []
    for gib in sizes:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(gib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        assert child.stdout.readline().strip() == "ready"
        before = gpu_used_mib()
        t0 = time.perf_counter()
        sw.checkpoint(0, child.pid)
        t_out = time.perf_counter() - t0
        during = gpu_used_mib()
        t0 = time.perf_counter()
        sw.restore(0, child.pid)
        t_in = time.perf_counter() - t0
        child.stdin.write("\n")
        child.stdin.flush()
        verdict = child.stdout.readline().strip()
        child.wait()
        moved = (before - during) * 2**20  # what the process really held on the GPU (context included)
        row = {"gib": gib, "checkpoint_s": round(t_out, 2), "restore_s": round(t_in, 2),
               "checkpoint_GBps": round(moved / t_out / 1e9, 2), "restore_GBps": round(moved / t_in / 1e9, 2),
               "gpu_used_mib_before": before, "gpu_used_mib_checkpointed": during, "data": verdict}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


LOCK_PROBES = {  # what a rank process may have done before the coordinator swaps it
    "no_cuda_context": "import torch",
    "cuda_1gib": "import torch; x = torch.ones(2**30, dtype=torch.uint8, device='cuda'); torch.cuda.synchronize()",
    "cuda_after_profiler": (
        "import torch; from torch.profiler import profile, ProfilerActivity\n"
        "x = torch.ones(2**30, dtype=torch.uint8, device='cuda')\n"
        "p = profile(activities=[ProfilerActivity.CUDA]); p.start(); y = x + 1; torch.cuda.synchronize(); p.stop()"),
    # page-locked staging (runtime.shm, --staging auto): host memory registered with cudaHostRegister
    "cuda_host_registered": (
        "import mmap, torch\n"
        "x = torch.arange(2**28, dtype=torch.int32, device='cuda')\n"
        "m = mmap.mmap(-1, 2**30); h = torch.frombuffer(m, dtype=torch.int32)\n"
        "assert int(torch.cuda.cudart().cudaHostRegister(h.data_ptr(), 2**30, 1)) == 0 and h.is_pinned()\n"
        "h.copy_(x); torch.cuda.synchronize()"),
}
AFTER = {  # run by the probe's process once the parent is done with it: does it still work?
    "cuda_host_registered": (
        "y = torch.empty_like(x); y.copy_(h, non_blocking=True); torch.cuda.synchronize()\n"
        "print('after: registered copy', 'ok' if torch.equal(y, x) and h.is_pinned() else 'WRONG', flush=True)"),
}


def lock_probes() -> dict:
    """cuCheckpointProcessLock (then Checkpoint and Restore where it locks) on live processes in the
    states of LOCK_PROBES: which of them the driver can swap."""
    from cuda.bindings import driver

    driver.cuInit(0)
    rows = {}
    for name, setup in LOCK_PROBES.items():
        code = (setup + "\nimport sys; print('ready', flush=True); sys.stdin.readline()\n"
                + AFTER.get(name, ""))
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        steps = []
        for call in (driver.cuCheckpointProcessLock, driver.cuCheckpointProcessCheckpoint,
                     driver.cuCheckpointProcessRestore, driver.cuCheckpointProcessUnlock):
            err = call(child.pid, None)[0]
            steps.append(f"{call.__name__.removeprefix('cuCheckpointProcess')}: {getattr(err, 'name', err)}")
            if int(err) != 0:
                break
        child.stdin.write("\n")
        child.stdin.flush()
        steps += [line.strip() for line in child.stdout if line.strip()]
        steps.append(f"exit {child.wait()}")
        rows[name] = steps
        print(json.dumps({name: steps}), flush=True)
    return rows


def swap_job(out: Path) -> dict:
    res = {}
    timing = [] if os.environ.get("SWAP_JOB_GPU_TIMING", "1") == "1" else ["--gpu-timing", "off"]
    for mode, ballast in (("none", "0"), ("checkpoint", "20")):
        ring_out = out / f"ring-{mode}"
        ring_out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, RING_OUT=str(ring_out), RING_BALLAST_GIB=ballast)
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "prism_megatron", "launch", "-w", "8", "--devices", "0",
                            "--slots-per-device", "2", *timing, "--swap", mode, "--log-ranks", "none",
                            "--hang-timeout", "300",
                            "--trace-dir", str(out / f"trace-{mode}"), "tests/programs/ring.py", "2"],
                           capture_output=True, text=True, env=env)
        res[mode] = {"exit": p.returncode, "wall_s": round(time.perf_counter() - t0, 1), "stderr": p.stderr[-1500:]}
        for report in (out / f"trace-{mode}.logs").glob("*.txt"):  # swap/hang reports, one level up to come back
            res[mode][report.name] = report.read_text()[-3000:]
        if p.returncode == 0:
            from prism_megatron.trace import read_trace

            swap = read_trace(out / f"trace-{mode}").manifest["job"].get("swap", {})
            res[mode]["swaps_out"] = sum(s["swaps_out"] for s in swap.values())
            res[mode]["swaps_in"] = sum(s["swaps_in"] for s in swap.values())
            res[mode]["swap_seconds"] = round(sum(s["seconds"] for s in swap.values()), 1)
    if res["none"]["exit"] == 0 and res["checkpoint"]["exit"] == 0:
        import torch

        same = all(torch.equal(torch.load(out / "ring-none" / f"rank-{r}.pt"),
                               torch.load(out / "ring-checkpoint" / f"rank-{r}.pt")) for r in range(8))
        res["results_equal"] = same
    print(json.dumps(res, indent=1), flush=True)
    return res


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    if sys.argv[2:] == ["probes"]:  # the lock probes alone
        result = {"lock_probes": lock_probes()}
    else:
        only_job = sys.argv[2:] == ["job"]
        sizes = [] if only_job else [float(x) for x in sys.argv[2:]] or [1, 8, 40]
        result = {"sizes": bench_sizes(sizes), "lock_probes": lock_probes(), "job": swap_job(out / "work")}
    (out / "swap_bench.json").write_text(json.dumps(result, indent=1))
