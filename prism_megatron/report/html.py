"""The report as one self-contained HTML page: verdict, timeline, memory chart, OOM table.

People would rather look than read, so the page leads with pictures drawn as inline SVG by
hand. It loads nothing (no scripts, fonts or stylesheets from elsewhere): a report is often
opened from a cluster's file system or an e-mail, without network. Tooltips are SVG <title>s.
"""

from __future__ import annotations

import json
import math
import re
from html import escape
from typing import Any

from .runs import merge_narrow, parts
from .terminal import anchor_lines, class_time_columns, host_bound_line
from .units import GIB, fmt_bytes, fmt_rate, fmt_seconds, rank_ranges

COLOURS = {"compute": "#3b82f6", "exposed_comm": "#f59e0b", "bubble": "#e5e7eb"}
LABELS = {"compute": "compute", "exposed_comm": "exposed communication", "bubble": "bubble (waiting)"}
#: Beyond this many ranks the memory chart has one bar per class.
MAX_MEMORY_BARS = 128
WIDTH = 1100

CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;color:#111827;margin:24px auto;
max-width:1140px;padding:0 16px}
h1{font-size:20px;margin:0}h2{font-size:16px;margin:28px 0 8px}
.sub,.prov,.note{color:#6b7280;font-size:12.5px}
.verdict{font-size:18px;font-weight:600;padding:12px 16px;border-radius:8px;margin:16px 0}
.good{background:#dcfce7;color:#14532d}.bad{background:#fee2e2;color:#7f1d1d}.neutral{background:#f3f4f6}
.cards{display:flex;gap:12px;flex-wrap:wrap}
.card{border:1px solid #e5e7eb;border-radius:8px;padding:10px 14px;min-width:160px}
.card b{display:block;font-size:20px}.card span{color:#6b7280;font-size:12px}
table{border-collapse:collapse;font-size:13px}td,th{padding:4px 10px;border-bottom:1px solid #e5e7eb;text-align:left}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}tr.oom td{color:#b91c1c}
.legend span{display:inline-block;margin-right:16px;font-size:12.5px}
.legend i{display:inline-block;width:12px;height:12px;border-radius:2px;margin-right:5px;vertical-align:-1px}
svg text{font:11px system-ui,sans-serif;fill:#374151}
pre{background:#f9fafb;padding:8px;overflow:auto;font-size:12px}.err{white-space:pre-wrap}
"""


def _e(x: Any) -> str:
    return escape(str(x), quote=True)


def _nice_step(span: float, ticks: int = 6) -> float:
    """A 1/2/5 x 10^k step giving about ``ticks`` ticks over ``span``."""
    if span <= 0:
        return 1.0
    raw = span / ticks
    mag = 10 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)


def _legend(kinds: list[str]) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{COLOURS[k]}"></i>{_e(LABELS[k])}</span>' for k in kinds) + "</div>"


def timeline_svg(timeline: dict[str, Any]) -> str:
    """One row per rank of the predicted median iteration; segments coloured by kind."""
    rows = timeline["rows"]
    span = max(timeline["end_s"] - timeline["start_s"], 1e-12)
    longest = max((len(r["class"]) for r in rows), default=0)
    label_w, right, top = min(80 + 6 * longest, 360), 16, 26  # room for 'rank N' and the class
    row_h = 16 if len(rows) <= 32 else 10
    plot_w = WIDTH - label_w - right
    height = top + row_h * len(rows) + 8
    x = lambda t: label_w + plot_w * t / span
    out = [f'<svg width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" '
           f'aria-label="predicted timeline">']
    step = _nice_step(span)
    k = 0
    while k * step <= span * (1 + 1e-9):
        tx, tick = x(k * step), fmt_seconds(k * step) if k else "0"
        out.append(f'<line x1="{tx:.1f}" y1="{top - 4}" x2="{tx:.1f}" y2="{height - 8}" stroke="#f3f4f6"/>'
                   f'<text x="{tx:.1f}" y="{top - 8}" text-anchor="middle">{_e(tick)}</text>')
        k += 1
    prev_stage = None
    for i, row in enumerate(rows):
        y = top + i * row_h
        stage = row["class"].split(" · ")[0]  # a line between pipeline stages (expert ranks interleave)
        if prev_stage is not None and stage != prev_stage:
            out.append(f'<line x1="0" y1="{y}" x2="{WIDTH - right}" y2="{y}" stroke="#9ca3af" stroke-width="0.6"/>')
        prev_stage = stage
        if row_h >= 14 or i % 2 == 0 or row["class"] != (rows[i - 1]["class"] if i else None):
            out.append(f'<text x="4" y="{y + row_h * 0.72:.1f}">rank {row["rank"]}</text>'
                       f'<text x="70" y="{y + row_h * 0.72:.1f}" style="fill:#6b7280">{_e(row["class"])}</text>')
        for kind, s, e, tip in drawn_segments(row["segments"], span / plot_w):
            w = max(x(e) - x(s), 0.4)
            out.append(f'<rect x="{x(s):.2f}" y="{y + 1}" width="{w:.2f}" height="{row_h - 2}" '
                       f'fill="{COLOURS.get(kind, "#9ca3af")}"><title>rank {row["rank"]}: {_e(tip)}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def drawn_segments(segments: list[list[Any]], pixel_s: float) -> list[tuple[str, float, float, str]]:
    """A row's segments as drawn, (kind, start, end, tooltip): a segment a pixel wide or more as it is; runs of
    narrower ones (an MoE layer's many short waits) as one rect per pixel or so, coloured by the kind that takes
    most of its time, its tooltip giving every kind's share (``runs.merge_narrow``): a pixel cannot show more,
    and a rect per segment would cost a thousand-rank job's page hundreds of thousands of rects."""
    out: list[tuple[str, float, float, str]] = []
    for entry in merge_narrow(segments, pixel_s):
        kind, s, e, count, share = parts(entry)
        if count == 1:
            out.append((kind, s, e, f"{LABELS.get(kind, kind)} {fmt_seconds(e - s)} (at {fmt_seconds(s)})"))
            continue
        busy = sum(share.values()) or 1.0
        shares = ", ".join(f"{LABELS.get(k, k)} {v / busy:.0%}"
                           for k, v in sorted(share.items(), key=lambda kv: -kv[1]))
        out.append((kind, s, e, f"{count} segments in {fmt_seconds(e - s)} (at {fmt_seconds(s)}): {shares}"))
    return out


def _memory_bars(memory: dict[str, Any]) -> list[dict[str, Any]]:
    if len(memory["ranks"]) <= MAX_MEMORY_BARS:
        return [dict(e, label=str(e["rank"]), name=f"rank {e['rank']} ({e['class']})") for e in memory["ranks"]]
    by_rank = {e["rank"]: e for e in memory["ranks"]}
    bars = []
    for c in memory["classes"]:
        members = [by_rank[r] for r in c["ranks"]]
        caps = [m["cap"] for m in members if m["cap"] is not None]
        short = re.sub(r"stage (\d+) of \d+( \((first|last)\))?", r"stage \1", c["class"])
        bars.append({"label": short.replace("expert rank ", "ep "),
                     "name": f"{c['class']} (ranks {rank_ranges(c['ranks'])})",
                     "max_allocated": c["max_allocated"], "max_reserved": c["max_reserved"],
                     "cap": min(caps) if caps else None, "oom": any(m["oom"] for m in members)})
    return bars


def memory_svg(memory: dict[str, Any], oom: list[dict[str, Any]] = ()) -> str:
    """Max reserved (light) and max allocated (dark) per rank, the cap as a dashed line; OOM in red.

    Above an OOM rank's bar, a dashed box shows what it asked for on top of what it had reserved:
    the part above the cap line is what was missing.
    """
    bars = _memory_bars(memory)
    if not bars:
        return ""
    asks = {e["rank"]: e for e in oom if e["requested"] is not None}
    if len(bars) != len(memory["ranks"]):
        asks = {}  # bars are classes: no single rank to draw
    left, bottom, top, height = 64, 36, 18, 280
    plot_h = height - top - bottom
    plot_w = WIDTH - left - 16
    peak = max([b["max_reserved"] for b in bars] + [b["cap"] or 0 for b in bars] + [1]
               + [e["reserved"] + e["requested"] for e in asks.values()])
    step = _nice_step(peak / GIB * 1.08, 5) * GIB
    ymax = step * math.ceil(peak * 1.08 / step)
    y = lambda v: top + plot_h * (1 - v / ymax)
    slot = plot_w / len(bars)
    out = [f'<svg width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" role="img" '
           f'aria-label="memory per rank">']
    v = 0.0
    while v <= ymax * (1 + 1e-9):
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{WIDTH - 16}" y2="{y(v):.1f}" stroke="#f3f4f6"/>'
                   f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{_e(fmt_bytes(v) if v else "0")}</text>')
        v += step
    every = max(1, math.ceil(len(bars) / 32))
    lines: list[str] = []
    for i, b in enumerate(bars):
        x0 = left + i * slot
        over = b["oom"] or (b["cap"] is not None and b["max_reserved"] > b["cap"])
        light, dark = ("#fca5a5", "#dc2626") if over else ("#bfdbfe", "#2563eb")
        tip = (f"{b['name']}: max allocated {fmt_bytes(b['max_allocated'])}, max reserved "
               f"{fmt_bytes(b['max_reserved'])}, cap {fmt_bytes(b['cap'])}" + (" - OUT OF MEMORY" if b["oom"] else ""))
        pad = slot * 0.12
        out.append(f'<g><title>{_e(tip)}</title>'
                   f'<rect x="{x0 + pad:.2f}" y="{y(b["max_reserved"]):.2f}" width="{slot - 2 * pad:.2f}" '
                   f'height="{y(0) - y(b["max_reserved"]):.2f}" fill="{light}"/>'
                   f'<rect x="{x0 + slot * 0.3:.2f}" y="{y(b["max_allocated"]):.2f}" width="{slot * 0.4:.2f}" '
                   f'height="{y(0) - y(b["max_allocated"]):.2f}" fill="{dark}"/></g>')
        if b["cap"] is not None:  # drawn last, over the bars
            lines.append(f'<line x1="{x0:.2f}" y1="{y(b["cap"]):.2f}" x2="{x0 + slot:.2f}" y2="{y(b["cap"]):.2f}" '
                       f'stroke="#dc2626" stroke-width="1.5" stroke-dasharray="5 3"/>')
        ask = asks.get(b.get("rank"))
        top_v = b["max_reserved"]
        if ask is not None:
            lo, hi = ask["reserved"], ask["reserved"] + ask["requested"]
            top_v = max(top_v, hi)
            out.append(f'<rect x="{x0 + pad:.2f}" y="{y(hi):.2f}" width="{slot - 2 * pad:.2f}" '
                       f'height="{y(lo) - y(hi):.2f}" fill="#fee2e2" fill-opacity="0.6" stroke="#dc2626" '
                       f'stroke-dasharray="3 2"><title>{_e(b["name"])}: asked for {_e(fmt_bytes(ask["requested"]))} '
                       f'with {_e(fmt_bytes(lo))} reserved</title></rect>')
        if b["oom"]:
            out.append(f'<text x="{x0 + slot / 2:.2f}" y="{y(top_v) - 4:.2f}" text-anchor="middle" '
                       f'style="fill:#b91c1c;font-weight:600">OOM</text>')
        if i % every == 0:
            out.append(f'<text x="{x0 + slot / 2:.2f}" y="{height - bottom + 14}" text-anchor="middle">'
                       f'{_e(b["label"][:max(int(slot * every / 6.5), 3)])}</text>')
    out += lines
    caps = [b["cap"] for b in bars if b["cap"] is not None]
    if caps:
        out.append(f'<text x="{left + 4}" y="{y(max(caps)) - 5:.1f}" style="fill:#b91c1c;paint-order:stroke;'
                   f'stroke:#fff;stroke-width:3px">cap {_e(fmt_bytes(max(caps)))}</text>')
    axis = "rank" if len(bars) == len(memory["ranks"]) else "class"
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 4}" text-anchor="middle">{axis}</text></svg>')
    return "".join(out)


def _table(head: list[str], rows: list[list[Any]], numeric: set[int], classes: list[str] | None = None) -> str:
    cells = "".join(f'<th{" class=n" if i in numeric else ""}>{_e(h)}</th>' for i, h in enumerate(head))
    body = []
    for j, row in enumerate(rows):
        cls = f' class="{classes[j]}"' if classes and classes[j] else ""
        body.append(f"<tr{cls}>" + "".join(f'<td{" class=n" if i in numeric else ""}>{_e(c)}</td>'
                                           for i, c in enumerate(row)) + "</tr>")
    return f"<table><tr>{cells}</tr>{''.join(body)}</table>"


def _cards(report: dict[str, Any]) -> str:
    pred, mem = report["prediction"], report["memory"]
    cards = []
    if pred is not None:
        cards.append((fmt_seconds(pred["iteration_time_s"]), "predicted iteration (median)"))
        if pred["tokens_per_s"] is not None:
            cards.append((fmt_rate(pred["tokens_per_s"], "tokens/s"), "predicted throughput"))
        if pred["tflops_per_gpu"] is not None:
            cards.append((f"{pred['tflops_per_gpu']:.3g} TFLOP/s", "model FLOPs per GPU"))
    rooms = [c["headroom"] for c in mem["classes"] if c["headroom"] is not None]
    dead = {e["rank"] for e in report["oom"]} | {e["rank"] for e in mem["ranks"] if e["oom"]}
    if dead:
        cards.append((f"{len(dead)} rank{'s' if len(dead) > 1 else ''}", "out of memory"))
    elif rooms:
        cards.append((fmt_bytes(min(rooms)), "smallest memory headroom"))
    elif mem["ranks"]:
        cards.append((fmt_bytes(max(e["max_reserved"] for e in mem["ranks"])), "peak reserved memory"))
    cards.append((str(report["job"]["world_size"]), "ranks"))
    return '<div class="cards">' + "".join(f"<div class=card><b>{_e(v)}</b><span>{_e(k)}</span></div>"
                                           for v, k in cards) + "</div>"


def _critical_path(cp: dict[str, Any]) -> str:
    total = sum(cp["by_kind_s"].values())
    if total <= 0:
        return ""
    palette = ["#3b82f6", "#f59e0b", "#10b981", "#8b5cf6", "#ef4444", "#6b7280"]
    colour = {k: palette[i % len(palette)] for i, k in enumerate(cp["by_kind_s"])}
    x, parts = 0.0, []
    for k, v in cp["by_kind_s"].items():
        w = (WIDTH - 20) * v / total
        parts.append(f'<rect x="{x:.2f}" y="0" width="{w:.2f}" height="18" fill="{colour[k]}">'
                     f'<title>{_e(k)}: {_e(fmt_seconds(v))}</title></rect>')
        x += w
    legend = "".join(f'<span><i style="background:{colour[k]}"></i>{_e(k)} {_e(fmt_seconds(v))}</span>'
                     for k, v in cp["by_kind_s"].items())
    steps = _table(["kind", "ranks", "start", "duration", "label"],
                   [[s["kind"], s["ranks"], fmt_seconds(s["start_s"]), fmt_seconds(s["end_s"] - s["start_s"]),
                     s["label"]] for s in cp["steps"]], {2, 3})
    return (f'<svg width="{WIDTH - 20}" height="18">{"".join(parts)}</svg><div class="legend">{legend}</div>'
            f'<details><summary>{len(cp["steps"])} longest of {cp["total_steps"]} steps</summary>{steps}</details>')


def render_html(report: dict[str, Any]) -> str:
    """The whole page, from the report dict alone (so it can be remade from report.json)."""
    pred, mem, target = report["prediction"], report["memory"], report["target"]
    verdict = report["verdict"]
    tone = "good" if verdict.startswith("fits") else "bad" if verdict.startswith(("OOM", "does not fit")) \
        else "neutral"
    sub = f"{report['job']['world_size']} ranks · trace {report['trace']} · made {report['created'][:19]}"
    if target["gpu"]:
        sub += f" · target {target['gpu']}, {fmt_bytes(target['usable_bytes'])} usable per rank"
        sub += f" ({target['source']})" if target["source"] else ""
    parts = [f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>prism-megatron report: '
             f'{_e(report["trace"])}</title><style>{CSS}</style></head><body>',
             f'<h1>prism-megatron report</h1><div class="sub">{_e(sub)}</div>',
             f'<div class="verdict {tone}">{_e(verdict)}</div>', _cards(report)]
    bound = host_bound_line(report)
    if bound:  # the prediction rests on the emulating machine's host time: say so beside the headline
        parts.append(f'<p class="prov"><b>{_e(bound)}</b></p>')
    fold = report.get("fold")
    if fold:
        live, w = len(fold["live"]), fold["world_size"]
        keys, cols = class_time_columns(fold["classes"])
        parts += [f"<h2>Rank classes: {live} of {w} ranks ran, {w - live} virtual</h2>",
                  _table(["class", "role", "ranks", "sandbox", "max allocated", *cols],
                         [[c["name"], c["role"], c["count"], rank_ranges(c["sandbox"]), fmt_bytes(c["max_allocated"]),
                           *(fmt_seconds(c[k]) for k in keys)]
                          for c in fold["classes"]], {2, 4, *range(5, 5 + len(keys))}),
                  '<p class="note">Time: the median iteration, mean over the class\'s sandbox ranks.</p>']
    if pred is not None:
        tl = pred["timeline"]
        which = f"iteration {tl['iteration']}" if tl["iteration"] is not None else "the whole run"
        parts += [f'<p class="prov">Predicted: {_e(pred["provenance"])}. These are not measurements.</p>',
                  f"<h2>Predicted timeline of the median iteration ({_e(which)}, "
                  f"{_e(fmt_seconds(tl['end_s'] - tl['start_s']))})</h2>",
                  _legend(["compute", "exposed_comm", "bubble"]), timeline_svg(tl)]
        if tl["note"]:
            parts.append(f'<p class="note">Showing {_e(tl["note"])}.</p>')
    else:
        why = " because the job did not run to its end (out of memory)" if report["oom"] else ""
        parts.append(f'<p class="prov">No prediction{why}: <span class="err">'
                     f'{_e(report["prediction_error"] or "unknown reason")}</span></p>')
    if mem["ranks"]:
        parts += [f"<h2>Memory per rank ({_e(mem['source'] or 'unknown source')})</h2>",
                  '<div class="legend"><span><i style="background:#bfdbfe"></i>max reserved</span>'
                  '<span><i style="background:#2563eb"></i>max allocated</span>'
                  '<span><i style="background:#dc2626"></i>out of memory / cap (dashed)</span>'
                  '<span><i style="border:1px dashed #dc2626;background:#fee2e2"></i>asked for at the OOM</span>'
                  '</div>', memory_svg(mem, report["oom"])]
        parts.append(_table(["class", "ranks", "max allocated", "max reserved", "headroom"],
                            [[c["class"], rank_ranges(c["ranks"]), fmt_bytes(c["max_allocated"]),
                              fmt_bytes(c["max_reserved"]), fmt_bytes(c["headroom"])] for c in mem["classes"]],
                            {2, 3, 4},
                            ["oom" if c["headroom"] is not None and c["headroom"] < 0 else "" for c in mem["classes"]]))
        parts += [f'<p class="prov">{_e(line.plain)}</p>' for line in anchor_lines(report)]
    if report["oom"]:
        parts += ["<h2>Out of memory</h2>",
                  _table(["rank", "class", "requested", "allocated", "reserved", "cap", "asked for at", "snapshot",
                          "message"],
                         [[e["rank"], e["class"], fmt_bytes(e["requested"]), fmt_bytes(e["allocated"]),
                           fmt_bytes(e["reserved"]), fmt_bytes(e["cap"]),
                           " <- ".join(reversed(e.get("where") or [])) or "-", e["snapshot"] or "-", e["message"]]
                          for e in report["oom"]], {0, 2, 3, 4, 5}, ["oom"] * len(report["oom"]))]
    if pred is not None and pred["critical_path"]["total_steps"]:
        parts += ["<h2>Critical path of the median iteration</h2>", _critical_path(pred["critical_path"])]
    extra = []
    if pred is not None and pred["notes"]:
        extra.append(f"<details><summary>{len(pred['notes'])} note(s) from building the replay graph</summary>"
                     f"<pre>{_e(chr(10).join(pred['notes']))}</pre></details>")
    if report["swap"]:
        extra.append(f"<details><summary>swap</summary><pre>{_e(json.dumps(report['swap'], indent=1))}</pre>"
                     "</details>")
    extra.append(f"<details><summary>job</summary><pre>{_e(json.dumps(report['job'], indent=1))}</pre></details>")
    parts += ["<h2>Details</h2>", *extra,
              '<p class="note">report.json holds these figures; timeline.json is the predicted timeline of every '
              "rank as Chrome trace-event JSON (open it in Perfetto or chrome://tracing).</p></body></html>"]
    return "\n".join(parts)
