"""Layouts side by side: several reports (or traces) of one model, sorted by predicted iteration time.

Each entry is a ``report.json`` (or the directory holding one) or a trace directory, reported here
with the given cluster profile. The comparison reads only PrismReport fields, so it works long after
the runs and never needs the traces of report files. W&B gets one run per layout in one group, so
the group's table in W&B sorts and charts them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .margin import WITHIN_MARGIN, class_caps, class_needs, oom_classes
from .schema import REPORT_FILE, ReportFormatError, read_report
from .terminal import HOST_BOUND_SAYS_MACHINE, host_bound_share, machine_name
from .units import fmt_bytes, fmt_rate, fmt_seconds


@dataclass(frozen=True)
class Layout:
    """One report's figures for the comparison; None where the report has none."""

    label: str
    source: str
    world_size: int
    iteration_time_s: float | None
    tokens_per_s_per_gpu: float | None
    tflops_per_gpu: float | None
    oom: bool
    verdict: str
    #: class -> smallest headroom of its ranks (bytes; negative: over the cap; None: no cap known)
    headroom: dict[str, int | None] = field(default_factory=dict)
    #: class -> bytes by which a class that ran out of memory needs more than its cap (``margin.class_needs``:
    #: prism's estimate of its peak where the report has one and it is the larger, else what its failing request
    #: would have reserved); only such classes with a recorded request and cap. An OOM capture stops at its
    #: failing allocation, so such a class's headroom is what it had then, not what it needs.
    excess: dict[str, int] = field(default_factory=dict)
    #: the classes of ``excess`` whose figure is prism's estimate
    estimated: frozenset[str] = frozenset()
    #: settings the emulation could not run (setting, published, rendered, affects), from the report
    #: or the recipe named for the entry
    substitutions: tuple[dict[str, str], ...] = ()
    report: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def _is_report(path: Path) -> bool:
    return path.is_file() or (path / REPORT_FILE).is_file()


def load_report(path: str | Path, cluster: str | None = None) -> dict[str, Any]:
    """A report from ``report.json``, a directory holding one, or a trace directory (built here).

    A directory holding both a trace and a report is read as the report: it is what the user saw.
    """
    path = Path(path)
    if _is_report(path):
        return read_report(path)
    if not path.exists():
        raise ReportFormatError(path, "file", "is missing (expected report.json or a trace directory)")
    from .build import build_report

    return build_report(path, cluster)


def layout_of(report: dict[str, Any], label: str, source: str,
              substitutions: list[dict[str, str]] | None = None) -> Layout:
    """The comparison row of one report; ``substitutions`` (a recipe's) replace the report's own."""
    pred = report.get("prediction") or {}
    world = report["job"]["world_size"]
    tokens = pred.get("tokens_per_s")
    ranks = report["memory"]["ranks"]
    return Layout(
        label=label,
        source=source,
        world_size=world,
        iteration_time_s=pred.get("iteration_time_s"),
        tokens_per_s_per_gpu=tokens / world if tokens is not None and world else None,
        tflops_per_gpu=pred.get("tflops_per_gpu"),
        oom=(bool(report["oom"]) or any(r["oom"] for r in ranks)
             or report["verdict"].startswith(("OOM", "does not fit"))),
        verdict=report["verdict"],
        headroom={c["class"]: c["headroom"] for c in report["memory"]["classes"]},
        **_excess(report),
        substitutions=tuple(substitutions if substitutions is not None else report.get("substitutions") or ()),
        report=report,
    )


def _excess(report: dict[str, Any]) -> dict[str, Any]:
    """``excess`` and ``estimated`` of a report's Layout: its OOM classes' needs past their caps."""
    memory, oom = report["memory"], report["oom"]
    estimates = {c["class"]: c["estimate"] for c in memory["classes"] if c.get("estimate") is not None}
    needs, caps = class_needs(memory, oom, estimates), class_caps(memory, oom)
    asked = {e["class"] for e in oom if e["requested"] is not None}
    excess = {name: needs[name] - caps[name] for name in sorted(oom_classes(memory, oom) & asked)
              if needs.get(name) is not None and name in caps}
    estimated = frozenset(name for name in excess if estimates.get(name, -1) >= needs[name])
    return {"excess": excess, "estimated": estimated}


def _memory_cell(r: Layout) -> str:
    """The table's memory column: an OOM layout's class that needs the most past its cap (a headroom there is
    the failing capture's moment, not a margin), else the smallest headroom."""
    if r.oom:
        if not r.excess:
            return "OOM"
        cls, short = max(r.excess.items(), key=lambda kv: kv[1])
        if short <= 0:
            return f"OOM ({cls}: fragmentation)"
        near = "; within the TE-substitution margin" if _class_verdict(r, cls) == WITHIN_MARGIN else ""
        if cls in r.estimated:
            return f"OOM, needs ~{fmt_bytes(short)} more ({cls}, prism's estimate{near})"
        return f"OOM, failing request {fmt_bytes(short)} past the cap ({cls}{near})"
    tight = [h for h in r.headroom.values() if h is not None]
    return "fits" + (f", min headroom {fmt_bytes(min(tight))}" if tight else "")


def _class_verdict(r: Layout, cls: str) -> str | None:
    """The report's verdict of class ``cls`` (``memory.classes[].verdict``; None where it has none)."""
    return next((c.get("verdict") for c in r.report.get("memory", {}).get("classes", ()) if c["class"] == cls), None)


def _labels(paths: list[Path]) -> list[str]:
    """Short distinct names: a report file's own name where it is not ``report.json`` (results kept side by
    side in one folder), else its directory's, or the trace directory's."""
    names = [Path(p.name.removesuffix(".gz")).stem if p.is_file() and p.name != REPORT_FILE
             else (p.parent if p.is_file() else p).resolve().name or str(p) for p in paths]
    if len(set(names)) == len(names):
        return names
    return [str(p) for p in paths]  # two runs named alike: their paths tell them apart


def compare(paths: list[str | Path], cluster: str | None = None, labels: list[str] | None = None,
            recipes: list[str] | None = None) -> list[Layout]:
    """Rows for ``paths``, fastest first; layouts without a prediction last, in the order given.

    ``recipes``: the recipe each entry ran (name or file), in order: its substitutions go beside the
    entry's figures, and its name is the default label.
    """
    if not paths:
        raise ValueError("compare needs at least one report or trace")
    ps = [Path(p) for p in paths]
    for what, given in (("label", labels), ("recipe", recipes)):
        if given is not None and len(given) != len(ps):
            raise ValueError(f"{len(given)} {what}(s) for {len(ps)} report(s)")
    subs: list[list[dict[str, str]] | None] = [None] * len(ps)
    names = labels or _labels(ps)
    if recipes is not None:
        from dataclasses import asdict

        from prism_megatron.recipe import load_recipe

        loaded = [load_recipe(r) for r in recipes]
        subs = [[asdict(x) for x in r.substitutions] for r in loaded]
        names = labels or [r.name for r in loaded]
    rows = [layout_of(load_report(p, cluster), name, str(p), sub)
            for p, name, sub in zip(ps, names, subs, strict=True)]
    order = {id(r): i for i, r in enumerate(rows)}
    return sorted(rows, key=lambda r: (r.iteration_time_s is None, r.iteration_time_s or 0.0, order[id(r)]))


def comparison_text(rows: list[Layout]) -> str:
    """The table ``prism-megatron compare`` prints, then each layout's headroom per rank class."""
    head = ("#", "layout", "GPUs", "iteration", "tokens/s/GPU", "model TFLOP/s/GPU", "memory")
    body = []
    for i, r in enumerate(rows, start=1):
        mem = _memory_cell(r)
        body.append((str(i), r.label, f"{r.world_size:,}", fmt_seconds(r.iteration_time_s),
                     fmt_rate(r.tokens_per_s_per_gpu, "tok/s"),
                     "-" if r.tflops_per_gpu is None else f"{r.tflops_per_gpu:.1f}", mem))
    widths = [max(len(row[c]) for row in (head, *body)) for c in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in (head, *body)]
    timed = [r for r in rows if r.iteration_time_s is not None]
    machines = {r.label: machine_name(r.report) for r in timed}
    if (any((host_bound_share(r.report) or 0) >= HOST_BOUND_SAYS_MACHINE for r in timed)
            and (len(set(machines.values())) > 1 or None in machines.values())):
        lines.append("note: host-bound times here come from different or unrecorded emulating machines ("
                     + "; ".join(f"{k}: {v or 'not recorded'}" for k, v in machines.items())
                     + "): a host-bound time is its emulating host's, so the order may be the machines'")
    for i, r in enumerate(rows, start=1):
        lines.append(f"{i}. {r.label}: {r.verdict}")
        for cls, h in r.headroom.items():
            short = r.excess.get(cls)
            if short is None:
                lines.append(f"     {cls}: headroom {fmt_bytes(h)}")
            elif short > 0 and cls in r.estimated:
                lines.append(f"     {cls}: out of memory, needs ~{fmt_bytes(short)} more than its cap (prism's "
                             "estimate of its peak: its capture stopped at its first failing request)")
            elif short > 0:
                lines.append(f"     {cls}: out of memory, its failing request {fmt_bytes(short)} past its cap (its "
                             "capture stopped there: the least it needs)")
            else:
                lines.append(f"     {cls}: out of memory with {fmt_bytes(-short)} of its cap free in total "
                             "(fragmentation)")
        for sub in r.substitutions:
            lines.append(f"     substituted {sub['setting']}: {sub['published']} -> {sub['rendered']} "
                         f"(affects {sub['affects']})")
    return "\n".join(lines)


def log_comparison(rows: list[Layout], group: str, *, run_dir: Path, project: str | None = None,
                   entity: str | None = None, mode: str | None = None) -> list[Any]:
    """One W&B run per layout, all in ``group`` (offline unless W&B is configured); returns LoggedRuns."""
    from .wandb_log import log_report

    out = []
    for rank, r in enumerate(rows, start=1):
        config = {"layout": r.label, "source": r.source, "world_size": r.world_size, "comparison_rank": rank,
                  "comparison_group": group, "memory": _memory_cell(r), "substitutions": list(r.substitutions)}
        out.append(log_report(r.report, timeline=None, config=config, run_dir=run_dir, project=project,
                              entity=entity, name=r.label, mode=mode, group=group))
    return out
