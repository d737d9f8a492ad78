"""The report as a terminal summary (rich tables): verdict first, then the figures behind it.

Large jobs have thousands of ranks; the tables show classes (pipeline stage, expert rank), and
single ranks only when there are few or when one stands out, so the summary fits a screen.
"""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ..trace.summary import swap_summary
from .classify import class_order
from .live import basis
from .margin import WITHIN_MARGIN
from .units import fmt_bytes, fmt_rate, fmt_seconds, rank_ranges

#: Up to this many ranks the breakdown has one row per rank, beyond it one row per class.
PER_RANK_LIMIT = 16


def _ranks_cell(ranks: list[int]) -> str:
    """'0-7', or for a strided set (expert ranks) '128: 0,4,8,...' rather than a screenful."""
    text = rank_ranges(ranks)
    return text if len(text) <= 24 else f"{len(ranks)}: {','.join(map(str, ranks[:3]))},…"


def _verdict_style(verdict: str) -> str:
    return "bold green" if verdict.startswith("fits") else "bold red" if verdict.startswith(
        ("OOM", "does not fit")) else "bold yellow"


#: From this share of the headline compute host-bound on, the report says whose host measured it: a host-bound
#: rank's time moves with the emulating machine's host (docs/measurements.md, "Target recipes").
HOST_BOUND_SAYS_MACHINE = 0.10


def host_bound_share(report: dict[str, Any]) -> float | None:
    """The share of the headline compute the GPU waited for its host; None without GPU times."""
    hb = (report.get("prediction") or {}).get("host_bound")
    return hb["host_bound_s"] / hb["compute_s"] if hb and hb["compute_s"] > 0 else None


def machine_name(report: dict[str, Any]) -> str | None:
    """The emulating machine's CPU and cores as its trace recorded them, e.g. "AMD EPYC 9654, 16 cores"."""
    m = (report.get("job") or {}).get("machine")
    if not m or not m.get("cpu"):
        return None
    return m["cpu"] + (f", {m['cores']} cores" if m.get("cores") else "")


def host_bound_line(report: dict[str, Any]) -> str | None:
    """The headline compute on two clocks, e.g. "compute host-bound: 80 % of 105 s (...); the device was busy
    20.4 s (...)", and where much of it is host-bound, whose host that is; None without GPU times (or without
    a prediction)."""
    share = host_bound_share(report)
    if share is None:
        return None
    hb = report["prediction"]["host_bound"]
    machine = machine_name(report) if share >= HOST_BOUND_SAYS_MACHINE else None
    return (f"compute host-bound: {100 * share:.0f} % of {fmt_seconds(hb['compute_s'])} "
            f"(rank {hb['rank']}, {hb['class']}: the GPU waited for its host to issue work); the device was busy "
            f"{fmt_seconds(hb['device_busy_s'])} (what the GPU alone needs: a floor, not a prediction)"
            + (f"; that host time is the emulating machine's ({machine}): another host moves it" if machine else ""))


def _prediction(report: dict[str, Any]) -> list[Any]:
    pred = report["prediction"]
    if pred is None:
        lines = (report["prediction_error"] or "unknown reason").splitlines()
        more = " (more in report.json)" if len(lines) > 1 else ""
        return [Text(f"no prediction: {lines[0]}{more}", style="yellow")]
    times = pred["iteration_times_s"]
    lines = Text()
    lines.append("predicted iteration ")
    lines.append(fmt_seconds(pred["iteration_time_s"]), style="bold")
    timed = sum(b == basis(True) for b in pred.get("iteration_bases") or ())  # the headline's iterations
    if timed and timed < len(times):  # the warm-up iterations before GPU timing are not in the median
        lines.append(f" (median of {timed} timed on host and GPU; all {len(times)}: {fmt_seconds(min(times))} - "
                     f"{fmt_seconds(max(times))})")
    elif len(times) > 1:
        lines.append(f" (median of {len(times)}; {fmt_seconds(min(times))} - {fmt_seconds(max(times))})")
    if pred["tokens_per_s"] is not None:
        lines.append(f"  ·  {fmt_rate(pred['tokens_per_s'], 'tokens/s')}")
    if pred["tflops_per_gpu"] is not None:
        lines.append(f"  ·  {pred['tflops_per_gpu']:.3g} TFLOP/s per GPU")
    out: list[Any] = [lines]
    bound = host_bound_line(report)
    if bound:
        out.append(Text(f"  {bound}", style="yellow"))
    out.append(Text(f"  provenance: {pred['provenance']}", style="dim"))
    live = pred.get("live_predictions")
    if live and live["logged"]:
        if not live["differ"]:
            out.append(Text(f"  Megatron's log line: {live['logged']} live prediction(s), each equal to this "
                            "report's figure for its iteration", style="dim"))
        else:
            shown = ", ".join(f"{d['iteration']} ({fmt_seconds(d['logged_s']) if d['logged_s'] is not None else 'none'}"
                              f" logged, {fmt_seconds(d['report_s']) if d['report_s'] is not None else 'none'} here)"
                              for d in live["differ"][:5])
            more = f" and {len(live['differ']) - 5} more" if len(live["differ"]) > 5 else ""
            out.append(Text(f"  Megatron's log line: {len(live['differ'])} of {live['logged']} live predictions "
                            f"differ from this report's: iterations {shown}{more} (an iteration whose GPU times came "
                            "with the next was predicted live on one clock)", style="yellow"))
    for sub in report.get("substitutions") or ():  # what ran instead of the target's setting
        out.append(Text(f"  substituted {sub['setting']}: {sub['published']} -> {sub['rendered']} "
                        f"(affects {sub['affects']})", style="yellow"))
    path = pred["critical_path"]["by_kind_s"]
    if path:
        parts = ", ".join(f"{k} {fmt_seconds(v)}" for k, v in list(path.items())[:5])
        out.append(Text(f"  critical path (median iteration): {parts}", style="dim"))
    return out


def _memory(report: dict[str, Any]) -> Table | None:
    mem = report["memory"]
    if not mem["classes"]:
        return None
    t = Table(title=f"memory per class ({mem['source'] or 'unknown source'})", title_justify="left")
    for col in ("class", "ranks", "max allocated", "max reserved", "peak by", "headroom", "verdict"):
        t.add_column(col, justify="left" if col in ("class", "ranks", "verdict") else "right")
    oom_ranks = {e["rank"] for e in mem["ranks"] if e["oom"]}
    for c in mem["classes"]:
        room, said = c["headroom"], c.get("verdict")  # verdict: absent in reports written before it
        style = "yellow" if said == WITHIN_MARGIN else "red" if (room is not None and room < 0) or oom_ranks & set(
            c["ranks"]) else ""
        at = "-" if c["peak_iteration"] is None else f"it. {c['peak_iteration']}"
        at += " rising" if c["peak_rising"] else ""
        t.add_row(c["class"], _ranks_cell(c["ranks"]), fmt_bytes(c["max_allocated"]), fmt_bytes(c["max_reserved"]),
                  at, fmt_bytes(room), said or "-", style=style)
    rising = [c["class"] for c in mem["classes"] if c["peak_rising"]]
    if rising:
        t.caption = (f"rising: {', '.join(rising)} reserved more in the last captured iteration than before it; a "
                     "longer run may peak higher (--train-iters)")
    return t


def _oom(report: dict[str, Any]) -> Table | None:
    if not report["oom"]:
        return None
    t = Table(title="out of memory", title_justify="left", title_style="bold red")
    for col in ("rank", "class", "requested", "reserved", "cap", "asked for at"):
        t.add_column(col, justify="right" if col in ("rank", "requested", "reserved", "cap") else "left",
                     no_wrap=col != "asked for at", overflow="fold")
    for e in report["oom"][:10]:
        # the site says where in the program; the message only repeats the figures beside it
        where = e.get("where") or []
        msg = e["message"].strip().splitlines()[0] if e["message"].strip() else ""
        t.add_row(str(e["rank"]), e["class"], fmt_bytes(e["requested"]), fmt_bytes(e["reserved"]),
                  fmt_bytes(e["cap"]), where[-1] if where else msg[:80])
    if len(report["oom"]) > 10:
        t.caption = f"... and {len(report['oom']) - 10} more"
    return t


def _classes(report: dict[str, Any]) -> Table | None:
    """A folded job's rank classes: what each stands for, its sandbox ranks, peak memory and time."""
    fold = report.get("fold")
    if not fold:
        return None
    live, w = len(fold["live"]), fold["world_size"]
    t = Table(title=f"rank classes: {live} of {w} ranks ran, {w - live} virtual (median iteration, mean over "
                    "sandbox ranks)", title_justify="left")
    keys, cols = class_time_columns(fold["classes"])
    for col in ("class", "role", "ranks", "sandbox", "max allocated", *cols):
        t.add_column(col, justify="left" if col in ("class", "role", "sandbox") else "right")
    for c in fold["classes"]:
        t.add_row(c["name"], c["role"], str(c["count"]), _ranks_cell(c["sandbox"]), fmt_bytes(c["max_allocated"]),
                  *(fmt_seconds(c[k]) for k in keys))
    return t


#: The two parts of compute on a trace measured on GPUs (host-bound: the GPU waited for its host): key -> head.
_CLOCK_COLUMNS = {"host_bound_s": "host-bound", "device_busy_s": "device busy"}


def class_time_columns(rows: list[dict[str, Any]]) -> tuple[tuple[str, ...], list[str]]:
    """The time columns of a class or rank table (report keys, heads): compute, exposed comm, bubble, and
    the compute's two parts where any row has them (a trace measured on GPUs)."""
    keys, cols = ("compute_s", "exposed_comm_s", "bubble_s"), ["compute", "exposed comm", "bubble"]
    clocks = tuple(k for k in _CLOCK_COLUMNS if any(r.get(k) is not None for r in rows))
    return (*keys, *clocks), [*cols, *(_CLOCK_COLUMNS[k] for k in clocks)]


def _breakdown(report: dict[str, Any]) -> Table | None:
    pred = report["prediction"]
    if pred is None or not pred["breakdown"] or report.get("fold"):  # a folded job: the classes table
        return None
    rows = pred["breakdown"]
    keys, cols = class_time_columns(rows)
    t = Table(title="median iteration per " + ("rank" if len(rows) <= PER_RANK_LIMIT else "class (mean)"),
              title_justify="left")
    t.add_column("class")
    t.add_column("rank" if len(rows) <= PER_RANK_LIMIT else "ranks")
    for col in cols:
        t.add_column(col, justify="right")
    if len(rows) <= PER_RANK_LIMIT:
        for b in rows:
            t.add_row(b["class"], str(b["rank"]), *(fmt_seconds(b[k]) for k in keys))
        return t
    by_class: dict[str, list[dict]] = defaultdict(list)
    for b in rows:
        by_class[b["class"]].append(b)
    for name, members in sorted(by_class.items(), key=lambda kv: class_order(kv[0])):
        t.add_row(name, _ranks_cell([b["rank"] for b in members]),
                  *(fmt_seconds(_mean([b[k] for b in members])) for k in keys))
    worst = max(rows, key=lambda b: b["bubble_s"])
    t.caption = f"most bubble: rank {worst['rank']} ({worst['class']}) {fmt_seconds(worst['bubble_s'])}"
    return t


def _mean(values: list[float | None]) -> float | None:
    """The mean, or None where a member has no figure (a rank without GPU times among timed ones)."""
    return None if any(v is None for v in values) else sum(values) / len(values)


def _fake_pg_lines(anchors: dict[str, Any]) -> list[Any]:
    out = []
    for a in anchors.get("fake_pg") or []:
        head = f"Megatron --fake-process-group, rank {a['rank']} ({a.get('class', '?')}): "
        if "error" in a:
            out.append(Text(head + f"not available ({a['error']})", style="dim"))
            continue
        line = head + f"max allocated {fmt_bytes(a['max_allocated'])}"
        ours = a.get("measured_max_allocated")
        if ours:
            line += f" vs measured {fmt_bytes(ours)} ({100 * (a['max_allocated'] - ours) / ours:+.1f}%)"
        out.append(Text(line))
    return out


def anchor_lines(report: dict[str, Any]) -> list[Any]:
    anchors = report.get("anchors") or {}
    formula, measured = anchors.get("megatron_formula"), anchors.get("measured_max_allocated")
    if formula is None:
        return _fake_pg_lines(anchors)
    if "error" in formula:
        return [Text(f"Megatron's memory formula: not available ({formula['error']})", style="dim"),
                *_fake_pg_lines(anchors)]
    line = (f"Megatron's memory formula (most loaded shard): {fmt_bytes(formula['total'])} "
            f"(weights+optimizer {fmt_bytes(formula['weight_and_optimizer'])}, activations "
            f"{fmt_bytes(formula['activation'])})")
    if measured is not None and measured["class"] in {e["class"] for e in report["oom"]}:
        # an OOM capture stops at its failing allocation: its peak is a floor of the class's need
        line += (f" vs measured max allocated {fmt_bytes(measured['bytes'])} ({measured['class']}, up to its OOM: "
                 "a floor of its need, so no difference is given)")
    elif measured is not None:
        line += (f" vs measured max allocated {fmt_bytes(measured['bytes'])} ({measured['class']}, "
                 f"{100 * (formula['total'] - measured['bytes']) / measured['bytes']:+.1f}%)")
    return [Text(line), *_fake_pg_lines(anchors)]


def renderables(report: dict[str, Any]) -> list[Any]:
    """The summary as rich renderables, in reading order."""
    job = report["job"]
    target = report["target"]
    head = f"prism-megatron report of {report['trace']}: {job['world_size']} ranks"
    if report.get("fold"):
        head += f" ({len(report['fold']['live'])} real, the others virtual)"
    if target["gpu"]:
        head += f", target {target['gpu']} (cap {fmt_bytes(target['usable_bytes'])} per rank)"
    out: list[Any] = [Text(head, style="dim"), Text(report["verdict"], style=_verdict_style(report["verdict"]))]
    out += _prediction(report)
    out += [t for t in (_classes(report), _memory(report), _oom(report), _breakdown(report)) if t is not None]
    out += anchor_lines(report)
    swapped = swap_summary(report["swap"] or {})
    if swapped:
        out.append(Text(f"state preservation during the capture: {swapped}", style="dim"))
    if report["prediction"] and report["prediction"]["notes"]:
        out.append(Text(f"{len(report['prediction']['notes'])} note(s) from building the replay graph; "
                        "see report.json", style="dim"))
    return out


def print_summary(report: dict[str, Any], console: Console | None = None) -> None:
    """Print the summary (in colour on a terminal)."""
    console = console or Console()
    for item in renderables(report):
        console.print(item, soft_wrap=isinstance(item, Text))  # long lines stay whole: paths, verdict


def summary_text(report: dict[str, Any], width: int = 110) -> str:
    """The summary as plain text (for tests, logs, and anything that is not a terminal)."""
    buf = io.StringIO()
    print_summary(report, Console(file=buf, width=width, color_system=None, force_terminal=False))
    return buf.getvalue()
