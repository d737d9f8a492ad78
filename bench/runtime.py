"""Phase-1 runtime benchmarks, each measured side by side in one run; prints a table of figures and ratios.

  python bench/runtime.py [allreduce] [smallops] [memory] [startup] [reduce] [solo]

- allreduce: 64 MiB all_reduce over 8 ranks, prism (1 device, 2 slots) vs gloo with 8 real processes
  (target: prism/gloo throughput >= 1.0)
- smallops: 8-byte all_reduce across 64 ranks: ops/s through the coordinator
- memory: PSS per idle logical rank, prism's fork from a torch-imported template vs gloo's plain spawn
  (target <= 150 MB)
- startup: wall time to start 64 and 256 ranks and pass a barrier (target: 256 in < 60 s)
- reduce: the coordinator's element-wise sum of 2 x 512 MiB with 1 thread and with every core
- solo: 256 MiB all_reduce over groups of one (2 ranks, 1 slot): computed by the rank itself vs staged
  through the coordinator as before (PRISM_STAGE_GROUPS_OF_ONE=1)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent / "programs"
PY = sys.executable


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prism(world: int, script: str, *args: str, slots: int = 2, tmp: Path, env: dict | None = None) -> float:
    t0 = time.perf_counter()
    p = subprocess.run([PY, "-m", "prism_megatron", "launch", "-w", str(world), "--slots-per-device", str(slots),
                        "--log-ranks", "none", "--trace-dir", str(tmp / f"trace-{world}"), str(HERE / script), *args],
                       capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    if p.returncode:
        raise SystemExit(f"prism run failed:\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def gloo(world: int, script: str, *args: str) -> float:
    t0 = time.perf_counter()
    p = subprocess.run([PY, "-m", "torch.distributed.run", f"--nproc-per-node={world}", f"--master-port={_port()}",
                        str(HERE / script), *args], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if p.returncode:
        raise SystemExit(f"gloo run failed:\n{p.stderr[-3000:]}")
    return time.perf_counter() - t0


def bench_allreduce(tmp: Path) -> list[tuple[str, str]]:
    nbytes, iters = 64 << 20, 10
    prism(8, "allreduce.py", str(tmp / "p.json"), str(nbytes), str(iters), tmp=tmp)
    gloo(8, "allreduce.py", str(tmp / "g.json"), str(nbytes), str(iters))
    p, g = (json.loads((tmp / f).read_text()) for f in ("p.json", "g.json"))
    bw = lambda r: r["bytes"] * r["iters"] / r["seconds"] / 2**30  # noqa: E731
    return [("64 MiB all_reduce x8 ranks: prism", f"{bw(p):.2f} GiB/s ({p['seconds'] / iters * 1e3:.0f} ms/op)"),
            ("64 MiB all_reduce x8 ranks: gloo", f"{bw(g):.2f} GiB/s ({g['seconds'] / iters * 1e3:.0f} ms/op)"),
            ("throughput ratio prism/gloo (target >= 1.0)", f"{bw(p) / bw(g):.2f}")]


def bench_smallops(tmp: Path) -> list[tuple[str, str]]:
    iters = 200
    prism(64, "allreduce.py", str(tmp / "s.json"), "8", str(iters), tmp=tmp)
    r = json.loads((tmp / "s.json").read_text())
    return [("8-byte all_reduce x64 ranks (2 slots)", f"{iters / r['seconds']:.0f} ops/s")]


def bench_memory(tmp: Path) -> list[tuple[str, str]]:
    prism(16, "idle.py", str(tmp / "pss-prism"), tmp=tmp)
    gloo(8, "idle.py", str(tmp / "pss-gloo"))
    p = float((tmp / "pss-prism").read_text()) / 1024
    g = float((tmp / "pss-gloo").read_text()) / 1024
    return [("PSS per idle rank, prism fork (16 ranks)", f"{p:.0f} MB (target <= 150)"),
            ("PSS per idle rank, plain spawn (gloo, 8 ranks)", f"{g:.0f} MB"),
            ("ratio spawn/fork", f"{g / p:.1f}x")]


def bench_startup(tmp: Path) -> list[tuple[str, str]]:
    rows = []
    for w in (64, 256):
        dt = prism(w, "idle.py", "-", tmp=tmp)
        rows.append((f"start {w} ranks + barrier + exit", f"{dt:.1f} s" + (" (target < 60)" if w == 256 else "")))
    return rows


def bench_reduce(tmp: Path) -> list[tuple[str, str]]:
    """The coordinator's sum of two 512 MiB float32 inputs with 1 thread and with all cores (it uses
    the cores no rank computes on: launch.coordinator_threads)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from prism_megatron.runtime.collectives import reduce

    a, b = torch.rand(1 << 27), torch.rand(1 << 27)
    rows, before = [], torch.get_num_threads()
    for n in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(n)
        reduce([a, b], "sum")  # warm
        t0 = time.perf_counter()
        for _ in range(5):
            reduce([a, b], "sum")
        dt = (time.perf_counter() - t0) / 5
        moved = 3 * a.nbytes / dt / 2**30  # two inputs read, one output written
        rows.append((f"reduce 2 x 512 MiB float32, {n} thread(s)", f"{dt * 1e3:.0f} ms ({moved:.1f} GiB/s moved)"))
    torch.set_num_threads(before)
    return rows


def bench_solo(tmp: Path) -> list[tuple[str, str]]:
    nbytes, iters, ms = 256 << 20, 20, {}  # the timed loop ends with a barrier: enough ops to outweigh it
    for how, env in (("staged", {"PRISM_STAGE_GROUPS_OF_ONE": "1"}), ("local", {})):
        prism(2, "allreduce.py", str(tmp / f"{how}.json"), str(nbytes), str(iters), "solo", slots=1, tmp=tmp, env=env)
        r = json.loads((tmp / f"{how}.json").read_text())
        ms[how] = r["seconds"] / r["iters"] * 1e3
    return [("256 MiB all_reduce, group of one: staged vs local",
             f"{ms['staged']:.1f} vs {ms['local']:.2f} ms per op ({ms['staged'] / ms['local']:.0f}x)")]


def main() -> None:
    which = sys.argv[1:] or ["allreduce", "smallops", "memory", "startup", "reduce", "solo"]
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as d:
        for name in which:
            rows += globals()[f"bench_{name}"](Path(d))
    width = max(len(k) for k, _ in rows)
    print(f"machine: {os.cpu_count()} cores; python {sys.version.split()[0]}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
