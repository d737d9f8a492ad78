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


def _spread(values: list[float], what: str, ranks: list[int] | None = None) -> str:
    top = max(range(len(values)), key=values.__getitem__)
    return (f"  {what}: min {min(values):.3f} s, median {statistics.median(values):.3f} s, max {values[top]:.3f} s "
            f"(rank {top if ranks is None else ranks[top]})")


def parallel_capacity(manifest: dict) -> int:
    """How many ranks the machine can compute at once: one per GPU (ranks sharing a GPU share its
    time), one per slot on CPU (each slot is a core)."""
    job = manifest.get("job", {})
    devices = job.get("devices") or ["cpu"]
    return int(job.get("slots_per_device", 1)) if devices == ["cpu"] else len(devices)


def capture_efficiency(trace) -> list[tuple[int, float, float]]:
    """Per iteration after the first that every rank ended: (iteration, capture wall seconds, physical
    limit seconds). Wall is from the last rank's previous iteration end to the last rank's end of this
    one; the limit is the compute all ranks did between those ends of their own, summed, over
    `parallel_capacity`: what the machine needs at the least, with the emulation costing nothing."""
    cap = parallel_capacity(trace.manifest)
    return [(k, t1 - t0, compute / cap) for k, t0, t1, compute in _iteration_windows(trace)]


def _iteration_windows(trace) -> list[tuple[int, float, float, float]]:
    """(iteration, start, end, compute of all ranks) per iteration after the first that every rank
    ended: from the last rank's previous iteration end to the last rank's end of this one."""
    ends: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for m in trace.marks.to_pylist():
        if m["name"] == "iteration" and m["phase"] == "E":
            ends[m["rank"]].append((m["t"], m["compute_clock"]))
    if len(ends) < len(trace.real_ranks):
        return []
    return [(k + 1, max(v[k - 1][0] for v in ends.values()), max(v[k][0] for v in ends.values()),
             sum(v[k][1] - v[k - 1][1] for v in ends.values())) for k in range(1, min(len(v) for v in ends.values()))]


def _fold_lines(trace) -> list[str]:
    """What a folded trace's fold says: which ranks ran, how the others' contributions were made."""
    fold = trace.fold
    if fold is None:
        return []
    live = list(fold.live)
    shown = ",".join(map(str, live[:16])) + (f",... ({len(live)})" if len(live) > 16 else "")
    ways = ", ".join(f"{way} {n}" for way, n in fold.contribution_counts().items())
    part = fold.capture.get("part")
    serial = "" if fold.capture_mode != "serial" else (
        f", capture {part['index'] + 1} of {part['of']} of a serial run" if part else
        f", captured serially ({len(fold.capture['captures'])} captures: one live rank each)")
    return [f"  folded: {len(live)} of {fold.world_size} ranks ran (ranks {shown}){serial}, {len(fold.classes)} rank "
            f"class(es), {fold.gpus_per_node} GPUs per node; virtual contributions: {ways}"]


def slot_time(trace) -> list[tuple[int, float, float, float]]:
    """Per window of :func:`capture_efficiency`: (iteration, computing, runtime work, idle) as shares
    of the slots' time (wall x slots). Computing is the ranks' compute clocks; runtime work is the rest
    of the time ranks held slots as the coordinator saw it (staging inputs, writing results, the GPU
    timer, messages, a granted rank waking up); idle is slot time nobody held (every rank waited: on
    the coordinator, on each other, on swaps)."""
    job = trace.manifest.get("job", {})
    slots_total = int(job.get("slots_per_device", 1)) * len(job.get("devices") or ["cpu"])
    turns = trace.slots.to_pylist()
    rows = []
    for k, t0, t1, compute in _iteration_windows(trace):
        total = (t1 - t0) * slots_total
        if total <= 0:
            continue
        held = sum(max(0.0, min(s["t_release"], t1) - max(s["t_grant"], t0)) for s in turns)
        rows.append((k, compute / total, max(held - compute, 0.0) / total, max(total - held, 0.0) / total))
    return rows


def swap_summary(swap: dict, swapper: str | None = None, copied: dict | None = None,
                 split: dict | None = None) -> str | None:
    """One line on state preservation (the manifest's job.swap: per rank swaps, bytes, seconds; job.swapper
    and, for in-process swaps, job.swap_copied: the bytes of blocks in use actually copied, and job.swap_split:
    the seconds spent copying, mapping and page-locking the host region)."""
    stats = [s for s in swap.values() if isinstance(s, dict)]
    if not stats:
        return None
    out, into = sum(s.get("swaps_out", 0) for s in stats), sum(s.get("swaps_in", 0) for s in stats)
    moved = sum(s.get("bytes_out", 0) + s.get("bytes_in", 0) for s in stats)
    busiest = max(swap, key=lambda r: swap[r].get("seconds", 0.0) if isinstance(swap[r], dict) else 0.0)
    how = ""
    if copied:
        spent = ""
        if split:
            pin = sum(x.get("pin_s", 0.0) for x in split.values())
            spent = (f"; {sum(x.get('copy_s', 0.0) for x in split.values()):.1f} s copying, "
                     f"{sum(x.get('map_s', 0.0) for x in split.values()):.1f} s mapping"
                     + (f", {pin:.1f} s page-locking" if pin else ""))
        how = f" ({swapper}: {sum(copied.values()) / 2**30:.1f} GiB copied, the blocks in use{spent})"
    return (f"swaps{how}: {out} out, {into} in, {moved / 2**30:.1f} GiB moved, "
            f"{sum(s.get('seconds', 0.0) for s in stats):.1f} s swapping (most: rank {busiest}, "
            f"{swap[busiest].get('seconds', 0.0):.1f} s)")


def _device_lines(job: dict) -> list[str]:
    """What the run did with the devices: swaps, GPU timing verdicts, staging memory, the NVML check."""
    lines: list[str] = []
    swapped = swap_summary(job.get("swap") or {}, job.get("swapper"), job.get("swap_copied"), job.get("swap_split"))
    if swapped:
        lines.append(f"  {swapped}")
    if job.get("swap_page_lock_error"):
        lines.append(f"  swap region not page-locked, copies pageable: {job['swap_page_lock_error']}")
    compacted = job.get("swap_region_compacted") or []
    if compacted:
        lines.append(f"  host region for swaps compacted {len(compacted)} time(s): "
                     f"{sum(c['bytes'] for c in compacted) / 2**30:.1f} GiB moved in "
                     f"{sum(c['seconds'] for c in compacted):.1f} s (first fit left no gap large enough)")
    full = job.get("full_device_allocations") or {}
    if full:
        lines.append(f"  allocations that found the device full mid-turn: {full.get('retried', 0)} retried after "
                     f"swapping blocked ranks out, {full.get('failed', 0)} failed (no blocked rank could go)")
    for device, verdict in (job.get("gpu_timing_by_device") or {}).items():
        lines.append(f"  {device}: {verdict.get('why', '')}")
    staging = job.get("staging_by_device") or {}
    if staging:
        lines.append("  staging memory: " + ", ".join(f"{d} {how}" for d, how in staging.items()))
    check = job.get("footprint_check") or {}
    if check.get("ranks_checked"):
        lines.append(f"  footprints cross-checked with NVML ({check['samples']} samples, {check['ranks_checked']} "
                     f"ranks): NVML minus report median {check['gap_gib_median']:+.2f} GiB, worst "
                     f"{check['gap_gib_worst']:+.2f} GiB (rank {check['rank_of_worst']}); swaps planned with NVML's")
    elif check.get("samples"):
        lines.append(f"  footprints not cross-checked: NVML listed none of the ranks' PIDs in {check['samples']} "
                     "samples (a PID namespace apart from the driver's?); swaps planned with the ranks' reports")
    if check.get("failed"):
        lines.append(f"  NVML stopped answering mid-run ({check['failed']}); the reports alone planned from there")
    return lines


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
             f"  {len(m['groups'])} process groups; {len(ops['kind'])} ops; {t.marks.num_rows} markers",
             *_fold_lines(t), *([f"  incomplete: {t.incomplete}"] if t.incomplete else []), "",
             f"  {'op':<22}{'count':>8}{'bytes':>14}"]
    for k, n in kinds.most_common():
        lines.append(f"  {k:<22}{n:>8}{_fmt_bytes(by_kind_bytes[k]):>14}")
    if compute:
        lines += ["", _spread([compute.get(r, 0.0) for r in t.real_ranks], "compute time per rank",
                                 list(t.real_ranks))]
    eff = capture_efficiency(t)
    if eff:
        wall = statistics.median(w for _, w, _ in eff)
        limit = statistics.median(lim for _, _, lim in eff)
        lines.append(f"  capture per iteration (median of {len(eff)}): wall {wall:.3f} s, physical limit {limit:.3f} s "
                     f"(compute of all ranks / {parallel_capacity(m)}), ratio {wall / limit:.2f}"
                     if limit > 0 else f"  capture per iteration (median of {len(eff)}): wall {wall:.3f} s")
    shares = slot_time(t)
    if shares:
        c, r, i = (statistics.median(x[j] for x in shares) for j in (1, 2, 3))
        lines.append(f"  slot time per iteration (median): {c:.0%} computing, {r:.0%} runtime in turns (staging, "
                     f"results, messages, waking up), {i:.0%} idle (no rank could run)")
    lines += _device_lines(job)
    work = {e["rank"]: e["runtime_s"] for e in m["ranks"] if e.get("runtime_s")}
    if work:
        lines.append("  runtime work per rank over the run (staging inputs / writing results / GPU timer):")
        for key in ("stage", "results", "gpu_timer"):
            values = [work.get(r, {}).get(key, 0.0) for r in t.real_ranks]
            if any(values):  # no GPU timer without GPU timing
                lines.append(_spread(values, f"  {key}"))
    if t.gpu.num_rows:
        host: dict[int, float] = defaultdict(float)
        device: dict[int, float] = defaultdict(float)
        for row in t.gpu.to_pylist():
            host[row["rank"]] += row["cpu"]
            device[row["rank"]] += row["gpu"]
        lines += [f"  measured on GPUs ({t.gpu.num_rows} segments):",
                  _spread([host.get(r, 0.0) for r in t.real_ranks], "  host time per rank"),
                  _spread([device.get(r, 0.0) for r in t.real_ranks], "  device busy time per rank")]
    return "\n".join(lines)
