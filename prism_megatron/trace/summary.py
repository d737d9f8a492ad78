"""A terminal summary of a PrismTrace: what ran, how much it moved, how long ranks computed."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from pathlib import Path

from prism_megatron.trace.reader import read_trace


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def _spread(values: list[float], what: str) -> str:
    top = max(range(len(values)), key=values.__getitem__)
    return (f"  {what}: min {min(values):.3f} s, median {statistics.median(values):.3f} s, max {values[top]:.3f} s "
            f"(rank {top})")


def summarize(path: str | Path) -> str:
    """Text summary: job, groups, ops per kind with bytes, per-rank compute time (the rank's own clock)
    and, for a trace captured on GPUs, the measured host and device time."""
    t = read_trace(path)
    m = t.manifest
    ops = t.ops.to_pydict()
    kinds = Counter(ops["kind"])
    by_kind_bytes: dict[str, int] = defaultdict(int)
    for k, b in zip(ops["kind"], ops["bytes"], strict=True):
        by_kind_bytes[k] += b
    compute: dict[int, float] = defaultdict(float)  # the clock's last value: the rank's compute in all
    for s in t.slots.to_pylist():
        compute[s["rank"]] = max(compute[s["rank"]], s["compute_clock"])
    job = m.get("job", {})
    lines = [f"PrismTrace v{m['version']} at {t.path}",
             f"  world size {t.world_size}; devices {job.get('devices', '?')} x {job.get('slots_per_device', '?')} "
             f"slot(s); script {job.get('script', '?')}; wall {job.get('wall_time_s', float('nan')):.1f} s",
             f"  {len(m['groups'])} process groups; {len(ops['kind'])} ops; {t.marks.num_rows} markers", "",
             f"  {'op':<22}{'count':>8}{'bytes':>14}"]
    for k, n in kinds.most_common():
        lines.append(f"  {k:<22}{n:>8}{_fmt_bytes(by_kind_bytes[k]):>14}")
    if compute:
        lines += ["", _spread([compute.get(r, 0.0) for r in range(t.world_size)], "compute time per rank")]
    if t.gpu.num_rows:
        host: dict[int, float] = defaultdict(float)
        device: dict[int, float] = defaultdict(float)
        for row in t.gpu.to_pylist():
            host[row["rank"]] += row["cpu"]
            device[row["rank"]] += row["gpu"]
        lines += [f"  measured on GPUs ({t.gpu.num_rows} segments):",
                  _spread([host.get(r, 0.0) for r in range(t.world_size)], "  host time per rank"),
                  _spread([device.get(r, 0.0) for r in range(t.world_size)], "  device busy time per rank")]
    return "\n".join(lines)
