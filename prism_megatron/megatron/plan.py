"""``prism-megatron plan``: the fold of a job (classes, sandbox, virtual ranks), what the sandbox
needs here, roughly how long it takes, and a refusal that says what would fit.

Memory per sandbox rank is Megatron's own theoretical formula for the most loaded shard
(``megatron.training.theoretical_memory_usage``; the report shows the same figure beside measured
peaks), so the sandbox's sum is an upper bound. The time is a stated rough model, not a prediction.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from prism_megatron.megatron.fold import FoldPlan, TargetLayout, build_fold_plan, layout_from_args, resolve_depth
from prism_megatron.megatron.megatron_args import ESTIMATE_KEY, parse_megatron_args

__all__ = ["PLAN_JSON_VERSION", "PlanError", "Plan", "make_plan", "plan_json", "render_plan", "ROUGH_TIME_MODEL"]

PLAN_JSON_VERSION = 2  # 2: microbatches (the micro-batch fold's record, or null)
GiB = 1 << 30
#: Host memory of one live rank's process besides its GPU state (Python, torch, Megatron, the
#: runtime's buffers); rough, and on CPU devices added to the rank's state.
RANK_PROCESS_HOST_BYTES = 1 * GiB
#: Share of the available host RAM the plan lets the sandbox take (the launcher's swap default too).
HOST_SHARE = 0.9
#: The rough time model: start-up, then each iteration's model FLOPs of the sandbox at a sustained rate.
ROUGH_TIME_MODEL = {
    "startup_s": 5.0,  # template, Megatron import and set-up
    "startup_per_rank_s": 0.5,  # each rank's initialisation and group creation, serialised
    "cpu_flops_per_core": 20e9,  # fp32 torch matmuls on one core, sustained
    "gpu_flops": 150e12,  # one H200-class GPU on small emulated shapes, sustained
    "overhead_per_rank_iteration_s": 0.1,  # coordinator turns and slot switches per rank and iteration
}


class PlanError(ValueError):
    """A plan that cannot run here; the message says what would."""


@dataclass
class Plan:
    layout: TargetLayout
    fold: FoldPlan
    iterations: int | None
    devices: list[str]
    memory: dict[str, Any] = field(default_factory=dict)
    time: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    depth_note: str = ""  # why the fold has its depth (fold.resolve_depth)


def _host_available() -> int:
    from prism_megatron.launcher.config import _available_host_memory

    return _available_host_memory()


def _gpu_totals(devices: list[str]) -> list[int]:
    from prism_megatron.launcher.config import _check_gpus

    return _check_gpus(devices)


def _memory(fold: FoldPlan, estimate: dict[str, Any], devices: list[str], device_gib: float | None,
            host_gib: float | None, swap: str) -> dict[str, Any]:
    """What the sandbox needs against what is here; ``fits`` None when Megatron's formula is unavailable."""
    n = len(fold.live)
    host = int(host_gib * GiB) if host_gib is not None else int(_host_available() * HOST_SHARE)
    out: dict[str, Any] = {"sandbox_ranks": n, "host_available": host, "source": estimate.get("source"),
                           "host_per_rank_process": RANK_PROCESS_HOST_BYTES}
    per_rank = estimate.get("total")
    if per_rank is None:
        out.update(per_rank=None, fits=None, why=f"Megatron's formula is unavailable: {estimate.get('error')}")
        return out
    out["per_rank"] = per_rank
    out["weight_and_optimizer"] = estimate.get("weight_and_optimizer")
    out["activation"] = estimate.get("activation")
    on_cpu = devices == ["cpu"]
    if on_cpu:
        need_host = n * (per_rank + RANK_PROCESS_HOST_BYTES)
        out.update(gpu_needed=0, host_needed=need_host, devices_total=0, fits=need_host <= host)
        if not out["fits"]:
            out["why"] = (f"the sandbox's {n} ranks need {need_host / GiB:.1f} GiB of host RAM (Megatron's formula "
                          f"{per_rank / GiB:.2f} GiB + {RANK_PROCESS_HOST_BYTES / GiB:.0f} GiB process each); "
                          f"{host / GiB:.1f} GiB may be used here: run on GPUs (--prism-devices) or on a machine "
                          f"with at least {need_host / HOST_SHARE / GiB:.0f} GiB available")
        return out
    per_device = int(device_gib * GiB) if device_gib is not None else min(_gpu_totals(devices))
    gpu_need = n * per_rank
    gpu_have = per_device * len(devices)
    spill = max(0, gpu_need - gpu_have)
    swap_room = host - n * RANK_PROCESS_HOST_BYTES if swap != "none" else 0
    need_host = n * RANK_PROCESS_HOST_BYTES + spill
    fits = per_rank <= per_device and spill <= max(0, swap_room)
    out.update(gpu_needed=gpu_need, devices_total=gpu_have, per_device=per_device, host_needed=need_host, fits=fits)
    if per_rank > per_device:
        out["why"] = (f"one sandbox rank needs {per_rank / GiB:.1f} GiB (Megatron's formula, most loaded shard) "
                      f"but a device holds {per_device / GiB:.1f} GiB: use GPUs with at least that much memory "
                      "(or a layout with smaller shards: more TP/PP)")
    elif not fits:
        devices_needed = math.ceil(max(0, gpu_need - max(0, swap_room)) / per_device)
        out["why"] = (f"the sandbox's {n} ranks need {gpu_need / GiB:.1f} GiB of GPU memory; {len(devices)} device(s) "
                      f"hold {gpu_have / GiB:.1f} GiB and host RAM {max(0, swap_room) / GiB:.1f} GiB more"
                      f"{'' if swap != 'none' else ' (swap is off)'}: use at least {devices_needed} device(s) of "
                      f"{per_device / GiB:.0f} GiB (--prism-devices)")
    return out


def _time(fold: FoldPlan, args: Any, vocab: int | None, iterations: int | None, devices: list[str]) -> dict[str, Any]:
    """Rough emulation time: start-up plus each iteration's sandbox FLOPs at an assumed sustained rate."""
    from prism_megatron.megatron.workload import flops_per_iteration

    m = ROUGH_TIME_MODEL
    n = len(fold.live)
    iters = iterations or 1
    try:
        flops = flops_per_iteration(args, vocab) * n / fold.world_size if vocab else None
    except (AttributeError, TypeError, ZeroDivisionError):
        flops = None
    if devices == ["cpu"]:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        rate, where = m["cpu_flops_per_core"] * cores, f"{cores} CPU core(s)"
    else:
        rate, where = m["gpu_flops"] * len(devices), f"{len(devices)} GPU(s)"
    compute = (flops or 0.0) / rate
    per_iter = compute + m["overhead_per_rank_iteration_s"] * n
    total = m["startup_s"] + m["startup_per_rank_s"] * n + iters * per_iter
    return {"seconds": total, "per_iteration_s": per_iter, "iterations": iters, "sandbox_flops_per_iteration": flops,
            "model": (f"rough: {m['startup_s']:.0f} s + {m['startup_per_rank_s']} s per rank to start, then per "
                      f"iteration the sandbox's model FLOPs at {rate / 1e12:.2f} TFLOP/s on {where} + "
                      f"{m['overhead_per_rank_iteration_s']} s per rank; easily off by 3x")}


def make_plan(script: Any, script_args: list[str], world_size: int, devices: list[str], gpus_per_node: int = 8,
              device_gib: float | None = None, host_gib: float | None = None, swap: str = "auto",
              env: dict[str, str] | None = None, source: str = "", fold_depth: str = "auto") -> Plan:
    """Parse the command with Megatron's parser, fold it (``fold_depth``: auto, replica or class), and
    cost the sandbox here."""
    args = parse_megatron_args(script, script_args, world_size, env)
    layout = layout_from_args(args, world_size, gpus_per_node)
    depth, depth_note = resolve_depth(layout, fold_depth)
    estimate = getattr(args, ESTIMATE_KEY, None) or {"error": "not computed"}
    fold = build_fold_plan(layout, depth)
    memory = _memory(fold, estimate, list(devices), device_gib, host_gib, swap)
    if fold_depth == "auto" and depth == "class":
        # Fold no deeper than needed: a replica keeps every TP/CP partial and every stage real (values
        # and schedules exact), while class depth stands in for them; take class only when a replica
        # does not fit here.
        replica = build_fold_plan(layout, "replica")
        replica_memory = _memory(replica, estimate, list(devices), device_gib, host_gib, swap)
        if replica_memory.get("fits") is not False:
            fold, memory = replica, replica_memory
            depth_note = ("auto: replica (one model replica fits here; class depth, which stands in for TP/CP "
                          "peers' partial sums and middle stages, is taken only when it does not)"
                          if replica_memory.get("fits") else
                          "auto: replica (Megatron's memory formula is unavailable to say that class depth is needed)")
        else:
            depth_note = f"auto: class (one model replica does not fit here: {replica_memory.get('why')})"
    iterations = getattr(args, "train_iters", None)
    plan = Plan(layout=layout, fold=fold, iterations=iterations, devices=list(devices), source=source,
                depth_note=depth_note)
    plan.memory = memory
    plan.time = _time(fold, args, estimate.get("vocab"), iterations, plan.devices)
    return plan


def plan_json(plan: Plan, microbatches: dict | None = None) -> dict[str, Any]:
    """The plan for programs (``plan --json``); ``fold`` is ``FoldPlan.to_json()``, ``microbatches`` the
    trace's ``job.microbatches`` record the run would write (None: every micro-batch runs)."""
    return {"version": PLAN_JSON_VERSION, "source": plan.source, "layout": plan.layout.describe(),
            "devices": plan.devices, "iterations": plan.iterations, "memory": plan.memory, "time": plan.time,
            "fold_depth": plan.depth_note, "fold": plan.fold.to_json(), "microbatches": microbatches}


def _ranks(ranks: list[int], limit: int = 12) -> str:
    from prism_megatron.report.units import rank_ranges

    text = rank_ranges(ranks)
    return text if len(text) <= 60 else f"{', '.join(map(str, ranks[:limit]))}, … ({len(ranks)} ranks)"


def _gib(n: int | None) -> str:
    from prism_megatron.report.units import fmt_bytes

    return "unknown" if n is None else fmt_bytes(n)


#: Beyond this many classes, a stage's expert-rank classes share one row.
CLASS_ROWS_LIMIT = 24


def _class_rows(fold: FoldPlan) -> list[tuple[str, str, int, list[int]]]:
    """(name, role, ranks, sandbox) per class, or per stage group when expert ranks make too many rows."""
    rows = [(c.name, c.role, c.count, c.sandbox) for c in fold.classes]
    if len(rows) <= CLASS_ROWS_LIMIT:
        return rows
    merged: dict[str, list] = {}
    for c in fold.classes:
        stage, _, _ = c.name.partition("/")
        row = merged.setdefault(stage, [f"{stage}/ep*", c.role.rpartition(", expert rank")[0], 0, [], 0])
        row[2] += c.count
        row[3] += c.sandbox
        row[4] += 1
    return [(name, f"{role}; {n} expert ranks, one class each", count, sorted(sandbox))
            for name, role, count, sandbox, n in merged.values()]


def render_plan(plan: Plan, console: Any) -> None:
    """The plan as rich tables: classes, sandbox and virtual ranks, memory here, rough time."""
    from rich.table import Table

    f, m, t = plan.fold, plan.memory, plan.time
    console.print(f"[bold]plan[/bold] {plan.source}: {plan.layout.describe()} "
                  f"({plan.layout.gpus_per_node} GPUs per node)")
    console.print(f"fold depth: {f.depth} ({plan.depth_note})" if plan.depth_note else f"fold depth: {f.depth}")
    per_rank = m.get("per_rank")
    table = Table(title="rank classes")
    for col in ("class", "role", "ranks", "sandbox (live)", "live memory"):
        table.add_column(col, justify="right" if col in ("ranks", "live memory") else "left")
    for name, role, count, sandbox in _class_rows(f):
        table.add_row(name, role, f"{count:,}", _ranks(sandbox),
                      _gib(None if per_rank is None else per_rank * len(sandbox)))
    console.print(table)
    if f.depth == "class":
        console.print(f"sandbox: {len(f.live)} live rank(s) run the real program: {_ranks(f.live)} (one per class: "
                      "tp = cp = 0, DP index 0, the lowest pipeline stage of its class)")
        console.print(f"virtual: {f.virtual_count:,} rank(s) without a process, each doing its class's live rank's "
                      "work translated to its own position (its TP/CP/DP coordinates and pipeline stage)")
    else:
        several = [c.name for c in f.classes if len(c.sandbox) > 1]
        console.print(f"sandbox: {len(f.live)} live rank(s) run the real program: {_ranks(f.live)} "
                      f"(one model replica: DP index {'0' if f.k == 1 else f'0-{f.k - 1}'})")
        if several:
            console.print(f"  classes with more than one live rank (replica depth keeps a whole replica): "
                          f"{', '.join(several)}")
        console.print(f"virtual: {f.virtual_count:,} rank(s) without a process, each mirroring the live rank of its "
                      f"replica position (same TP/CP/PP coordinates, DP index mod {f.k})")
    mem = Table(title=f"memory here (devices: {','.join(plan.devices)})")
    mem.add_column("what")
    mem.add_column("needed", justify="right")
    mem.add_column("here", justify="right")
    mem.add_row("per sandbox rank (Megatron's formula, most loaded shard: a bound for every class)",
                _gib(m.get("per_rank")), "")
    if plan.devices != ["cpu"]:
        mem.add_row("GPU, sandbox", _gib(m.get("gpu_needed")), _gib(m.get("devices_total")))
    mem.add_row("host RAM", _gib(m.get("host_needed")), _gib(m.get("host_available")))
    console.print(mem)
    verdict = {True: "[bold green]fits[/bold green]", False: "[bold red]does not fit[/bold red]",
               None: "[bold yellow]not checked[/bold yellow]"}[m.get("fits")]
    console.print(f"memory: {verdict}" + (f" — {m['why']}" if m.get("why") else ""))
    console.print(f"expected emulation time: ~{t['seconds'] / 60:.1f} min for {t['iterations']} iteration(s) "
                  f"({t['model']})")
