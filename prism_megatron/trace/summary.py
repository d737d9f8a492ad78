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


def summarize(path: str | Path) -> str:
    """Text summary: job, groups, ops per kind with bytes, per-rank compute time (the rank's own clock)."""
    t = read_trace(path)
    m = t.manifest
    ops = t.ops.to_pydict()
    kinds = Counter(ops["kind"])
    by_kind_bytes: dict[str, int] = defaultdict(int)
    for k, b in zip(ops["kind"], ops["bytes"], strict=True):
        by_kind_bytes[k] += b
    compute: dict[int, float] = defaultdict(float)
    for s in t.slots.to_pylist():
        compute[s["rank"]] += s["t_release"] - s["t_grant"]
    job = m.get("job", {})
    lines = [f"PrismTrace v{m['version']} at {t.path}",
             f"  world size {t.world_size}; devices {job.get('devices', '?')} x {job.get('slots_per_device', '?')} "
             f"slot(s); script {job.get('script', '?')}; wall {job.get('wall_time_s', float('nan')):.1f} s",
             f"  {len(m['groups'])} process groups; {len(ops['kind'])} ops; {t.marks.num_rows} markers", "",
             f"  {'op':<22}{'count':>8}{'bytes':>14}"]
    for k, n in kinds.most_common():
        lines.append(f"  {k:<22}{n:>8}{_fmt_bytes(by_kind_bytes[k]):>14}")
    if compute:
        vals = [compute.get(r, 0.0) for r in range(t.world_size)]
        lines += ["", f"  compute time per rank: min {min(vals):.3f} s, median "
                      f"{statistics.median(vals):.3f} s, max {max(vals):.3f} s (rank {vals.index(max(vals))})"]
    return "\n".join(lines)
