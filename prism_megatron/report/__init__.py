"""`prism-megatron report`: what a trace says about the target job, for people and programs.

report.json (the figures, versioned: ``schema``), report.html (a page to look at) and
timeline.json (the predicted timeline for Perfetto). Works from trace files alone: imports
neither the runtime nor Megatron.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from prism_megatron.options import RunOnlyOptions, option
from prism_megatron.replay.collector import paused
from prism_megatron.trace.writer import atomic_write_text

from .build import assemble, build_report, verdict
from .classify import rank_class
from .html import render_html
from .schema import FORMAT, REPORT_FILE, VERSION, ReportFormatError, read_report, write_report
from .terminal import print_summary, summary_text
from .units import fmt_bytes

if TYPE_CHECKING:
    from prism_megatron.replay.engine import ReplayResult

HTML_FILE = "report.html"
TIMELINE_FILE = "timeline.json"
TIMELINE_SPANS = option(RunOnlyOptions, "timeline").choices

__all__ = [
    "FORMAT",
    "VERSION",
    "ReportFormatError",
    "build_report",
    "make_report",
    "print_summary",
    "rank_class",
    "read_report",
    "render_html",
    "summary_text",
    "verdict",
    "write_report",
]


def make_report(trace_dir: str | Path, out_dir: str | Path | None = None,
                cluster: str | None = None, calibrated: str | Path | None = None,
                timeline: str = "iteration", say: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Write report.json, report.html and timeline.json into ``out_dir`` (default: the trace dir).

    Returns {"report", "html", "timeline"} -> path; "timeline" is absent when the replay failed
    (there is no predicted timeline then; the report says why, and an older timeline.json there is
    removed). ``timeline``: 'iteration' (the headline's median iteration) or 'all' (RunOnlyOptions.timeline).
    Each file is written atomically. ``say``: told what each step took as it ends (a thousand-rank job's replay
    takes minutes).
    """
    if timeline not in TIMELINE_SPANS:
        raise ValueError(f"timeline {timeline!r}: one of {', '.join(TIMELINE_SPANS)}")
    with paused():
        return _make_report(trace_dir, out_dir, cluster, calibrated, timeline, say or (lambda _: None))


def _make_report(trace_dir: str | Path, out_dir: str | Path | None, cluster: str | None,
                 calibrated: str | Path | None, timeline: str, tell: Callable[[str], None]) -> dict[str, Path]:
    from prism_megatron.replay.export import write_chrome

    started = time.monotonic()
    tell(f"replaying the trace and building the report of {trace_dir}")
    report, result = assemble(trace_dir, cluster, calibrated)
    tell(f"replayed and built in {time.monotonic() - started:.1f} s")
    out = Path(trace_dir if out_dir is None else out_dir)
    step = time.monotonic()
    paths = {"report": write_report(report, out / REPORT_FILE),
             "html": atomic_write_text(out / HTML_FILE, render_html(report))}
    tell(f"{REPORT_FILE} and {HTML_FILE} written in {time.monotonic() - step:.1f} s")
    if result is not None:
        step = time.monotonic()
        meta = {"trace": str(trace_dir), "cluster": report["prediction"]["cluster"],
                "provenance": report["prediction"]["provenance"]}
        number = report["prediction"]["timeline"]["iteration"] if timeline == "iteration" else None
        window = timeline_window(result, number)
        paths["timeline"] = write_chrome(result, out / TIMELINE_FILE, meta, window, number)
        size = fmt_bytes(paths["timeline"].stat().st_size)
        tell(f"{TIMELINE_FILE} ({size}) written in {time.monotonic() - step:.1f} s")
    else:
        (out / TIMELINE_FILE).unlink(missing_ok=True)  # an older run's timeline would contradict the report
    return paths


def timeline_window(result: ReplayResult, number: int | None) -> tuple[float, float] | None:
    """Iteration ``number``'s span for the timeline: from its first rank's begin, or the iteration before's end
    where that is earlier (the loop's time its figure counts), to its last rank's end; None (all) without it."""
    it = next((it for it in result.iterations() if it.number == number), None) if number is not None else None
    return None if it is None else (min(it.start, it.window[0]), it.end)
