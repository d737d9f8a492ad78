"""``--prism-fold``: whether ``run`` folds a Megatron job, with which plan, and the check of its classes.

'off' runs every rank; 'on' folds (``fold.build_fold_plan`` at ``--prism-fold-depth``: one live rank
per class for dense layouts, one model replica for MoE, by default); 'auto' folds when the full job
does not fit this machine. The rule, stated once: the full job fits
when the sum over rank classes of (ranks x prism's estimate for the class, ``memory.estimate``) + W x
``RANK_PROCESS_HOST_BYTES`` fits in the devices' memory plus ``HOST_SHARE`` of the available host RAM
(on CPU: the host RAM alone; a rank's state is host memory there). Megatron's formula is not used: it
misses the unfused attention's s x s probabilities and counts sequence-parallel activations
unsharded. Where prism's estimate is unavailable (a vocabulary only a tokenizer knows) the state
counts as 0, and that is said; a command the plan cannot read (not a Megatron command, a layout that
does not fold) is run in full under 'auto', saying why, and refused under 'on'; a depth the layout
cannot take (class depth for a MoE layout whose expert axis is not a shift of the dense grid) is
refused under both. Under ``--prism-fold-capture serial`` the
sandbox must fit one live rank at a time (``one_rank_fits``), and what no rule answers one capture at a
time is refused by name (``plan.serial_refusal``: a MoE layout other than at class depth, a dispatcher
not covered, per-token loss over a pipeline); ``auto`` depth takes class depth for a MoE layout
captured serially when its replica does not fit here together. After a folded capture, the live ranks of
each class must have issued the same ops (kinds, sizes, group sizes); a class whose members differ is
refused (``fold.check_class_members``). What is compared is the stage-independent part of a rank's
program (``op_sections``): the ops of each scheduling unit in order, the pipeline p2p ops of each
stream in order, and the other ops in order. Members of one class on different pipeline stages run
their units and p2p calls in their own stage's order: each stage's warm-up count, and under the
interleaved schedule with overlapped p2p Megatron's unbatched ``_p2p_ops`` posts a call's send first on
even stages and its receive first on odd ones. That order is the schedule's, not the class's: replay
takes it from each live rank's own trace (replica depth) or rebuilds it for each folded stage from the
plan's schedule (class depth, ``replay.stage_schedule.restage``, which posts in the stage's own parity),
so it is not compared.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prism_megatron.megatron.fold import FoldDepthError, FoldError

__all__ = ["FoldModeError", "admission_estimates", "choose_fold", "full_job_fits", "check_trace_classes", "class_lines",
           "op_sections"]


class FoldModeError(ValueError):
    """The fold asked for cannot run (a sandbox that does not fit, a layout that does not fold)."""


def full_job_fits(plan: Any, world_size: int, live_only: bool = False) -> tuple[bool, str]:
    """Whether every rank of the job (``live_only``: the sandbox's) fits here as a process, by prism's
    estimate per class, and the figures that say so."""
    from prism_megatron.megatron.plan import RANK_PROCESS_HOST_BYTES, GiB

    m, fold = plan.memory, plan.fold
    classes = m.get("classes")
    if live_only:
        counts = {c.name: len(c.sandbox) for c in fold.classes}
        ranks = len(fold.live)
    else:
        counts = {c.name: c.count for c in fold.classes}
        ranks = world_size
    state = sum(counts[name] * classes[name]["total"] for name in counts) if classes else 0
    host = m["host_available"]
    have = host if plan.devices == ["cpu"] else host + (m.get("devices_total") or 0)
    need = state + ranks * RANK_PROCESS_HOST_BYTES
    source = ("prism's estimate per class" if classes
              else f"process memory only: prism's memory estimate is unavailable ({m.get('why')})")
    why = (f"{ranks} ranks: {state / GiB:.2f} GiB state + {ranks} x {RANK_PROCESS_HOST_BYTES / GiB:.0f} GiB process "
           f"= {need / GiB:.1f} GiB against {have / GiB:.1f} GiB here ({source})")
    return need <= have, why


def admission_estimates(plan: Any, ranks: Iterable[int]) -> dict[int, int]:
    """Rank -> prism's estimate of its class's peak (bytes) for ``ranks`` (those that run): the room the
    memory governor admits a rank with before anything of it or its class is measured. Empty where there
    is no estimate."""
    classes = plan.memory.get("classes")
    if not classes:
        return {}
    fold = plan.fold
    out = {}
    for r in ranks:
        total = classes[fold.class_name(r)].get("total")
        if total:
            out[r] = int(total)
    return out


def class_lines(fold: Any, limit: int = 12) -> list[str]:
    """The fold's class table, short: one line per class (name, ranks it stands for, live ranks, role)."""
    from prism_megatron.megatron.plan import _class_rows
    from prism_megatron.report.units import rank_ranges

    rows = _class_rows(fold)
    out = [f"  {name:<12} {count:>7,} ranks  live {rank_ranges(sandbox)[:40]:<16} {role}"
           for name, role, count, sandbox in rows[:limit]]
    if len(rows) > limit:
        out.append(f"  ... {len(rows) - limit} more classes (prism-megatron plan shows them all)")
    return out


def choose_fold(mode: str, cfg: Any, env: dict[str, str] | None = None,
                say: Callable[[str], None] = print, depth: str = "auto", capture: str = "together") -> dict | None:
    """The fold plan's JSON for the launch ``cfg`` under ``--prism-fold mode`` and ``--prism-fold-depth
    depth``, or None (every rank runs). ``capture`` serial: the sandbox must fit one live rank at a time
    (``one_rank_fits``), not all together.

    The Megatron args are the ranks' own command line (``cfg.script_args``) parsed by Megatron's parser.
    Sets ``cfg.memory_estimates`` for the ranks that will run (``admission_estimates``)."""
    from prism_megatron.megatron.megatron_args import ArgsError
    from prism_megatron.megatron.plan import make_plan

    try:
        plan = make_plan(cfg.script, list(cfg.script_args), cfg.world_size, list(cfg.devices),
                         gpus_per_node=cfg.gpus_per_node, device_gib=cfg.device_memory_gib,
                         host_gib=cfg.host_memory_gib, swap=cfg.swap, env=env, source=str(cfg.script),
                         fold_depth=depth, capture=capture, target=cfg.target_gpu)
    except FoldDepthError as e:
        raise FoldModeError(f"--prism-fold-depth {depth}: {e}") from None
    except (FoldError, ArgsError) as e:
        if mode == "auto":  # no plan, no fold: the full capture is what a run without folding gives
            say(f"fold auto: full capture, every rank runs (no fold plan: {e})")
            return None
        raise FoldModeError(f"--prism-fold {mode}: {e}") from None
    fold = plan.fold
    cfg.memory_estimates = admission_estimates(plan, range(cfg.world_size))  # a full capture: every rank runs
    if mode == "auto":
        fits, why = full_job_fits(plan, cfg.world_size)
        if fits:
            say(f"fold auto: full capture, every rank runs ({why})")
            return None
        say(f"fold auto: the full job does not fit here ({why}); folding")
    if capture == "serial" and plan.capture.get("refused"):
        raise FoldModeError(f"--prism-fold-capture serial: {plan.layout.describe()}: {plan.capture['why']}")
    if fold.virtual_count == 0:
        say(f"fold {mode}: the sandbox is the whole job ({cfg.world_size} ranks): full capture")
        return None
    if capture == "serial":
        fits, why = plan.capture["fits"], plan.capture["why"]  # one_rank_fits, and how expert peers are answered
        if fits is False:
            raise FoldModeError(f"--prism-fold {mode} --prism-fold-capture serial: the sandbox does not fit here one "
                                f"rank at a time: {why}")
        say(f"fold capture serial: {len(fold.live)} capture(s), one live rank each ({why})")
    elif plan.memory.get("fits") is False:
        raise FoldModeError(f"--prism-fold {mode}: the sandbox does not fit here: {plan.memory['why']}"
                            + _serial_hint(plan, cfg))
    if plan.memory.get("fits") is None:  # no estimate: the sandbox's processes alone must fit (same rule)
        fits, why = full_job_fits(plan, 1) if capture == "serial" else full_job_fits(plan, len(fold.live),
                                                                                      live_only=True)
        if not fits:
            raise FoldModeError(f"--prism-fold {mode}: the sandbox does not fit here: {why}; give more host "
                                "memory (--prism-host-memory) or run on GPUs (--prism-devices)"
                                + ("" if capture == "serial" else _serial_hint(plan, cfg)))
    how = ("each does its class's live rank's work, translated to its own position" if fold.depth == "class"
           else "each mirrors the live rank of its replica position")
    say(f"fold: {plan.layout.describe()} -> {len(fold.live)} live rank(s), {fold.virtual_count:,} virtual "
        f"({how}); depth {fold.depth} ({plan.depth_note}); classes:")
    for line in class_lines(fold):
        say(line)
    cfg.memory_estimates = admission_estimates(plan, fold.live)
    return fold.to_json()


def _serial_hint(plan: Any, cfg: Any) -> str:
    """What a serial capture would need, for a together sandbox of several live ranks that does not fit."""
    if len(plan.fold.live) < 2:
        return ""
    from prism_megatron.megatron.plan import one_rank_fits

    fits, why = one_rank_fits(plan)
    if fits is None:
        why = full_job_fits(plan, 1)[1]
    return f"; a serial capture (--prism-fold-capture serial) runs one live rank at a time: {why}"


def check_trace_classes(trace_dir: Path) -> None:
    """Refuse a folded capture whose live ranks of one class issued different ops (FoldModeError
    naming the class, the two ranks, the part of their programs and the first difference there)."""
    from prism_megatron.megatron.fold import FoldPlan, check_class_members
    from prism_megatron.trace import read_trace

    trace = read_trace(trace_dir)
    doc = dict(trace.manifest["job"]["fold"])
    doc.pop("contributions", None)
    plan = FoldPlan.from_json(doc, f"{trace_dir}/manifest.json job.fold")
    sizes = {g["id"]: len(g["ranks"]) for g in trace.manifest["groups"]}
    ops: dict[int, list[dict]] = {}
    for op in trace.ops.select(["rank", "index", "kind", "bytes", "dtype", "group", "peer", "t_issue"]).to_pylist():
        ops.setdefault(op["rank"], []).append(op)
    marks: dict[int, list[dict]] = {}
    for m in trace.marks.select(["rank", "name", "phase", "t", "attrs"]).to_pylist():
        marks.setdefault(m["rank"], []).append(m)
    pp_axis = plan.axes.index("pp")
    stages = plan.sizes[pp_axis] if plan.coords else 0
    stage = (lambda r: plan.coords[r][pp_axis]) if plan.coords else None
    observed = {r: op_sections(sorted(rows, key=lambda o: o["index"]), marks.get(r, []), sizes, stage, stages)
                for r, rows in ops.items()}
    try:
        check_class_members(plan, observed, "ops (kind, bytes, dtype, group size)")
    except FoldError as e:
        raise FoldModeError(f"the folded capture is refused: {e}") from None


def op_sections(ops: Sequence[Mapping[str, Any]], marks: Sequence[Mapping[str, Any]], sizes: Mapping[int, int],
                stage: Callable[[int], int] | None = None, stages: int = 0) -> dict[str, list[tuple]]:
    """One rank's ops (trace rows in order of issue) as (kind, bytes, dtype, group size), by the part of its
    program they belong to, each part in order of issue: each scheduling unit (``forward``/``backward``
    marker span: iteration, microbatch, chunk), each pipeline p2p stream outside units (kind and the peer's
    stage relative to this rank's: ``stage`` gives a rank's stage, ``stages`` their count; without them,
    by kind), and the other ops. Two ranks of one class run the same parts whatever their stage's order of
    units and p2p calls (the module docstring says why that order is not compared)."""
    from prism_megatron.ops import P2P_KINDS
    from prism_megatron.replay.stage_schedule import UNITS

    out: dict[str, list[tuple]] = {}
    spans = sorted((m for m in marks if m["name"] in UNITS and m["phase"] in ("B", "E")), key=lambda m: m["t"])
    seen: Counter = Counter()
    open_units: list[str] = []  # the unit spans open here, outermost first: the ops go with the outermost
    at = 0
    for op in ops:
        while at < len(spans) and spans[at]["t"] < op["t_issue"]:
            m = spans[at]
            at += 1
            if m["phase"] == "E":
                if open_units:
                    open_units.pop()
                continue
            attrs = m["attrs"] if isinstance(m["attrs"], Mapping) else json.loads(m["attrs"] or "{}")
            key = (m["name"], attrs.get("iteration"), attrs.get("microbatch"), attrs.get("chunk") or 0,
                   bool(attrs.get("eval")))
            seen[key] += 1
            open_units.append(f"{key[0]} unit (iteration {key[1]}, microbatch {key[2]}, chunk {key[3]}"
                              f"{', eval' if key[4] else ''}{f', #{seen[key]}' if seen[key] > 1 else ''})")
        entry = (op["kind"], op["bytes"], op["dtype"], sizes.get(op["group"]))
        if open_units:
            part = open_units[0]
        elif op["kind"] in P2P_KINDS:
            where = ""
            if stage is not None and stages > 2 and op["peer"] >= 0:
                d = (stage(op["peer"]) - stage(op["rank"])) % stages
                where = (" with the next stage" if d == 1 else " with the previous stage" if d == stages - 1
                         else f" with stage +{d}")
            part = f"p2p {op['kind']}s{where} outside scheduling units"
        else:
            part = "other ops outside scheduling units"
        out.setdefault(part, []).append(entry)
    return out
