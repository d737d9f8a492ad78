"""What a fork template's state does to its child's host speed on the GPU (issue 21, bench only).

A rank forked from prism's launcher template runs Inductor's ``output_code.__call__`` frame 3x slower per call than the
same program started as a fresh interpreter (``--rank-start exec``) or forked from a template of the bench's own
(docs/measurements.md, "The fork from the launcher's template"). The launcher's template differs from the bench's by
what it imported before the fork: prism's trace modules bring pyarrow, whose bundled jemalloc starts a background
thread, and ``import torch`` starts a pool of threads; neither thread survives the fork. This runs one small host-bound
CUDA workload in a child of templates that imported one of them each, beside a fresh interpreter, interleaved; the
``launch-*`` variants run it as the rank of a one-rank ``launch`` job instead, forked from the launcher or exec'd:

  python bench/gpu/fork_template_probe.py [--rounds 2] [--variants fresh,fork-torch,...] [--out FILE.json]

Per variant and round: microseconds per call of a compiled function (with and without autograd), of an eager CUDA add,
of a CUDA tensor's allocation and free, of ``isinstance``; cProfile's own time per call of ``output_code.__call__``; the
child's OS threads and their names.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

#: each variant: the modules its template imports before the fork (None: a fresh interpreter, no fork)
VARIANTS: dict[str, tuple[str, ...] | None] = {
    "fresh": None,
    "fork-bare": (),
    "fork-torch": ("torch",),
    "fork-pyarrow": ("pyarrow",),
    "fork-torch-pyarrow": ("torch", "pyarrow"),
    "fork-launcher": ("torch", "prism_megatron.launcher.launch"),
}
#: the workload as the script of a one-rank ``prism_megatron launch`` job, its rank started each way (``--rank-start``):
#: the forked launched rank is the one with the slow frames in the Megatron program, where these templates' children
#: are not (docs/measurements.md, run 61)
LAUNCHED = {"launch-fork": "fork", "launch-exec": "exec"}
#: where a launched rank writes what it found (its stdout is the job's)
OUT_ENV = "FORK_PROBE_OUT"
BLOCKS, CALLS = 5, 200


def _per_call_us(step, calls: int = CALLS, blocks: int = BLOCKS) -> float:
    """Median over blocks of one call's microseconds (the device synchronised at each block's end)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    out = []
    for _ in range(blocks):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        sync()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return round(statistics.median(out), 2)


def _own_us(step, calls: int = 300) -> dict[str, float]:
    """cProfile's own time per call of the compiled call's Python frames (Inductor's and the generated code's)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(lambda: [step() for _ in range(calls)])
    stats = pstats.Stats(prof).stats
    out = {}
    for (path, line, name), (_cc, nc, tt, _ct, _callers) in stats.items():
        if nc >= calls and ("_inductor" in path or "_functorch" in path or "torchinductor" in path):
            out[f"{os.path.basename(path)}:{line} {name}"] = round(tt / nc * 1e6, 2)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


def workload() -> dict:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))  # as the launcher sets a rank's (one core left over)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: only to check the script off the GPU machine
    x = torch.randn(256, 256, device=dev)
    w = torch.randn(256, 256, device=dev, requires_grad=True)

    @torch.compile
    def f(a, b):
        return torch.nn.functional.gelu(a @ b) * 2 + 1

    with torch.no_grad():
        for _ in range(20):
            f(x, w)
    for _ in range(20):
        f(x, w)

    def nograd():
        with torch.no_grad():
            f(x, w)

    def grad():
        f(x, w)  # its autograd graph and saved tensors freed at once

    def alloc():
        torch.empty(4096, device=dev)

    def eager():
        torch.add(x, 1)

    def isinst():
        isinstance(x, torch.Tensor)

    host = torch.randn(1 << 20)

    def pinned_then_compiled():  # a forward's shape: a parallel region on the CPU (its workers spin after), then graphs
        if dev == "cuda":
            host.pin_memory()
        for _ in range(36):
            f(x, w)

    found = {"compiled_nograd_us": _per_call_us(nograd), "compiled_grad_us": _per_call_us(grad),
             "eager_add_us": _per_call_us(eager), "alloc_free_us": _per_call_us(alloc),
             "isinstance_us": _per_call_us(isinst, calls=20000),
             "pinned_then_36_compiled_us": _per_call_us(pinned_then_compiled, calls=20), "own_grad_us": _own_us(grad)}
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:
            pass
    found["os_threads"] = len(names)
    found["thread_names"] = sorted(set(names))
    return found


def child(modules: tuple[str, ...] | None) -> None:
    """Run in a subprocess: import ``modules`` as a template would, fork, and run the workload in the child."""
    if modules is None:
        print(json.dumps(workload()), flush=True)
        return
    import importlib

    for m in modules:
        importlib.import_module(m)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            data = json.dumps(workload()).encode()
        except BaseException as e:  # noqa: BLE001 - the child reports, never returns into the template
            data = json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()
        os.write(w, data)
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 1 << 16)
        if not b:
            break
        chunks.append(b)
    os.waitpid(pid, 0)
    print(b"".join(chunks).decode(), flush=True)


def launched(mode: str) -> dict:
    """Run the workload as a launched rank started by ``mode``; what it found, or the job's error."""
    import tempfile

    import torch

    devices = "0" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "found.json")
        cmd = [sys.executable, "-m", "prism_megatron", "launch", "--world-size", "1", "--devices", devices,
               "--rank-start", mode, "--gpu-timing", "off", "--trace-dir", os.path.join(tmp, "trace"), "--",
               __file__, "--as-rank"]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, OUT_ENV: out})
        try:
            with open(out) as fh:
                return json.load(fh)
        except (OSError, json.JSONDecodeError):
            return {"error": f"exit {p.returncode}: {(p.stderr or p.stdout)[-2000:]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join([*VARIANTS, *LAUNCHED]))
    ap.add_argument("--out", default=None, help="where the JSON of every run goes")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--as-rank", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.as_rank:
        found = workload()
        found["rank"] = os.environ.get("RANK")  # set by the launched rank, not by this script's caller
        found["launcher_loaded"] = "prism_megatron.launcher.launch" in sys.modules  # forked from the launcher
        with open(os.environ[OUT_ENV], "w") as fh:
            json.dump(found, fh)
        return 0
    if a.child is not None:
        child(VARIANTS[a.child])
        return 0
    names = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS and v not in LAUNCHED]
    if bad:
        ap.error(f"--variants: unknown {', '.join(bad)} (known: {', '.join([*VARIANTS, *LAUNCHED])})")
    runs = []
    for rnd in range(a.rounds):
        for v in names:
            t0 = time.time()
            if v in LAUNCHED:
                found = launched(LAUNCHED[v])
            else:
                p = subprocess.run([sys.executable, __file__, "--child", v], capture_output=True, text=True,
                                   timeout=300)
                line = (p.stdout.strip().splitlines() or ["{}"])[-1]
                try:
                    found = json.loads(line)
                except json.JSONDecodeError:
                    found = {"error": (p.stderr or p.stdout)[-2000:]}
            found.update(variant=v, round=rnd, seconds=round(time.time() - t0, 1))
            runs.append(found)
            keys = ("compiled_nograd_us", "compiled_grad_us", "pinned_then_36_compiled_us", "eager_add_us",
                    "alloc_free_us", "isinstance_us", "os_threads")
            print(v, rnd, {k: found.get(k) for k in keys}, found.get("error", "")[-300:], flush=True)
            print("   own:", found.get("own_grad_us"), "threads:", found.get("thread_names"), flush=True)
            if a.out:  # after every run: a call's time limit that stops the rounds keeps what ran
                tmp = a.out + ".tmp"
                with open(tmp, "w") as fh:
                    json.dump(runs, fh, indent=1)
                os.replace(tmp, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
