"""Host cost of issuing GPU work alone on a GPU vs beside another process's idle CUDA context.

An emulated rank shares its GPU with the other logical ranks' processes (each has a context; while
one computes the others wait in the runtime). If a second context made kernel launches dearer, an
emulated rank's host time would exceed the real rank's for that reason alone. Prints, per case, the
host microseconds per launch of a small elementwise op and per small matmul (queue never full), and
the same with a sync after every op.

  python bench/gpu/launch_probe.py [N]
"""

from __future__ import annotations

import multiprocessing as mp
import sys
import time


def _holder(ready: mp.Event, done: mp.Event, busy: bool) -> None:
    import torch

    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    ready.set()
    while not done.is_set():
        if busy:
            x = x @ x / 64
            torch.cuda.synchronize()
        else:
            time.sleep(0.01)


def _measure(n: int) -> dict[str, float]:
    import torch

    a = torch.randn(256, device="cuda")
    m = torch.randn(512, 512, device="cuda")
    out = {}
    for name, fn in (("add", lambda: a.add_(1.0)), ("mm", lambda: m @ m)):
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out[f"{name}_us"] = (time.perf_counter() - t) / n * 1e6
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n // 4):
            fn()
            torch.cuda.synchronize()
        out[f"{name}_sync_us"] = (time.perf_counter() - t) / (n // 4) * 1e6
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    ctx = mp.get_context("spawn")
    rows = []
    for case in ("alone", "beside-idle-context", "beside-busy-context"):
        holder = done = None
        if case != "alone":
            ready, done = ctx.Event(), ctx.Event()
            holder = ctx.Process(target=_holder, args=(ready, done, case == "beside-busy-context"))
            holder.start()
            ready.wait(120)
        with ctx.Pool(1) as pool:  # a fresh process: its own context, like a rank
            r = pool.apply(_measure, (n,))
        rows.append((case, r))
        if holder is not None:
            done.set()
            holder.join()
    keys = list(rows[0][1])
    print(f"{'case':24}" + "".join(f"{k:>12}" for k in keys))
    for case, r in rows:
        print(f"{case:24}" + "".join(f"{r[k]:12.2f}" for k in keys))


if __name__ == "__main__":
    main()
