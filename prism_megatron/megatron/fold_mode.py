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
refused (``fold.check_class_members``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prism_megatron.megatron.fold import FoldDepthError, FoldError

__all__ = ["FoldModeError", "choose_fold", "full_job_fits", "check_trace_classes", "class_lines"]


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

    The Megatron args are the ranks' own command line (``cfg.script_args``) parsed by Megatron's parser."""
    from prism_megatron.megatron.megatron_args import ArgsError
    from prism_megatron.megatron.plan import make_plan

    try:
        plan = make_plan(cfg.script, list(cfg.script_args), cfg.world_size, list(cfg.devices),
                         gpus_per_node=cfg.gpus_per_node, device_gib=cfg.device_memory_gib,
                         host_gib=cfg.host_memory_gib, swap=cfg.swap, env=env, source=str(cfg.script),
                         fold_depth=depth, capture=capture)
    except FoldDepthError as e:
        raise FoldModeError(f"--prism-fold-depth {depth}: {e}") from None
    except (FoldError, ArgsError) as e:
        if mode == "auto":  # no plan, no fold: the full capture is what a run without folding gives
            say(f"fold auto: full capture, every rank runs (no fold plan: {e})")
            return None
        raise FoldModeError(f"--prism-fold {mode}: {e}") from None
    fold = plan.fold
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
    naming the class, the two ranks and the first difference)."""
    from prism_megatron.megatron.fold import FoldPlan, check_class_members
    from prism_megatron.trace import read_trace

    trace = read_trace(trace_dir)
    doc = dict(trace.manifest["job"]["fold"])
    doc.pop("contributions", None)
    plan = FoldPlan.from_json(doc, f"{trace_dir}/manifest.json job.fold")
    sizes = {g["id"]: len(g["ranks"]) for g in trace.manifest["groups"]}
    observed: dict[int, list[tuple]] = {}
    cols = trace.ops.select(["rank", "kind", "bytes", "dtype", "group"]).to_pydict()
    for rank, kind, nbytes, dtype, group in zip(cols["rank"], cols["kind"], cols["bytes"], cols["dtype"],
                                                cols["group"], strict=True):
        observed.setdefault(rank, []).append((kind, nbytes, dtype, sizes.get(group)))
    try:
        check_class_members(plan, observed, "ops (kind, bytes, dtype, group size)")
    except FoldError as e:
        raise FoldModeError(f"the folded capture is refused: {e}") from None
