"""`prism-megatron report`: what a trace says about the target job, for people and programs.

report.json (the figures, versioned: ``schema``), report.html (a page to look at) and
timeline.json (the predicted timeline for Perfetto). Works from trace files alone: imports
neither the runtime nor Megatron.
"""

from __future__ import annotations

import json
from pathlib import Path

from prism_megatron.trace.writer import atomic_write_text

from .build import assemble, build_report, verdict
from .classify import rank_class
from .html import render_html
from .schema import FORMAT, REPORT_FILE, VERSION, ReportFormatError, read_report, write_report
from .terminal import print_summary, summary_text

HTML_FILE = "report.html"
TIMELINE_FILE = "timeline.json"

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
                cluster: str | None = None, calibrated: str | Path | None = None) -> dict[str, Path]:
    """Write report.json, report.html and timeline.json into ``out_dir`` (default: the trace dir).

    Returns {"report", "html", "timeline"} -> path; "timeline" is absent when the replay failed
    (there is no predicted timeline then; the report says why, and an older timeline.json there is
    removed). Each file is written atomically.
    """
    from prism_megatron.replay.export import to_chrome

    report, result = assemble(trace_dir, cluster, calibrated)
    out = Path(trace_dir if out_dir is None else out_dir)
    paths = {"report": write_report(report, out / REPORT_FILE),
             "html": atomic_write_text(out / HTML_FILE, render_html(report))}
    if result is not None:
        meta = {"trace": str(trace_dir), "cluster": report["prediction"]["cluster"],
                "provenance": report["prediction"]["provenance"]}
        paths["timeline"] = atomic_write_text(out / TIMELINE_FILE, json.dumps(to_chrome(result, meta)) + "\n")
    else:
        (out / TIMELINE_FILE).unlink(missing_ok=True)  # an older run's timeline would contradict the report
    return paths
