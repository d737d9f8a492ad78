"""Megatron's own one-GPU memory estimate, beside ours: ``--fake-process-group`` per rank class.

Megatron-LM can run one rank of the target job alone with a fake process group (RANK/WORLD_SIZE of
the target, every collective skipped) and prints that rank's memory after iterations 1 and 2 on
data-parallel rank 0 (``report_memory``). Users already have this tool, so the report shows its
figure next to the emulated one (``--prism-anchor-fake-pg``) for each class's representative rank, run
with the arguments prism's ranks ran (micro-batches as folded) and prism's rendering seams
(``megatron.fake_pg_child``): the same program, so a difference is the emulation's, not a rendering's,
but for what Megatron itself changes under the flag: it turns ``check_for_nan_in_loss_and_grad`` off
(megatron/training/arguments.py), where prism's ranks keep the job's setting, so the anchor lacks the NaN
check's grad norm of each bucket (a scalar per bucket and iteration) and its host synchronisations. And a
receive there returns the uninitialised buffer it allocated, so a stage that receives gradients computes
on garbage: where the grad norm comes out NaN it never clips (a NaN coefficient is not below 1) and its step
is not the target's. So it anchors max allocated where the peak comes before the step, not max reserved,
which also moves between runs of one command (docs/measurements.md, "Target recipes"). Where they differ (MoE routing
fed by all-to-alls that do nothing there, communication buffers), ours is the one measured with real data.
On CPU the core driver prints the same line from a byte accountant (``PRISM_CPU_BYTE_ACCOUNTANT``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from prism_megatron.megatron.fake_pg_child import command, rank_env, read_result
from prism_megatron.trace import read_trace
from prism_megatron.trace.writer import atomic_write_text

ANCHOR_FILE = "fake-pg-anchor.json"
FORMAT, VERSION = "prismanchor", 1
_LINE = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| "
                   r"max allocated: ([0-9.]+) \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)")
MiB = 1 << 20


def parse_memory_lines(text: str, rank: int) -> dict[str, int] | None:
    """The last ``report_memory`` line of ``rank`` in Megatron's output, in bytes."""
    found = None
    for m in _LINE.finditer(text):
        if int(m.group(1)) == rank:
            found = {"iteration": int(m.group(2)), "max_allocated": int(float(m.group(4)) * MiB),
                     "max_reserved": int(float(m.group(6)) * MiB)}
    return found


def representatives(trace_dir: Path) -> dict[int, dict[str, Any]]:
    """One rank per class (pipeline stage, expert rank): the lowest with data-parallel rank 0, which is
    where Megatron prints its memory report."""
    from prism_megatron.report.classify import rank_class

    reps: dict[str, int] = {}
    layouts = {}
    for m in read_trace(trace_dir).marks.to_pylist():
        if m["name"] == "layout":
            layouts[m["rank"]] = json.loads(m["attrs"])
    for rank in sorted(layouts):
        a = layouts[rank]
        if a.get("dp", 0) == 0:
            reps.setdefault(rank_class(a), rank)
    return {rank: {"class": cls} for cls, rank in reps.items()}


def fake_pg_peak(script: Path, script_args: list[str], world: int, rank: int, *, on_cpu: bool,
                 timeout: float = 900.0) -> dict[str, Any]:
    """Run ``rank`` of the job alone with ``--fake-process-group``; its peak figures or why there are none."""
    env = {**os.environ, **rank_env(world, rank)}
    env.pop("PRISM_MEGATRON_METRICS", None)
    if on_cpu:
        env["PRISM_CPU_BYTE_ACCOUNTANT"] = "1"
    try:
        p = subprocess.run(command(script, [*script_args, "--fake-process-group"]), capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"rank": rank, "error": f"timed out after {timeout:.0f} s"}
    out = p.stdout + p.stderr
    child = read_result(out) or {}
    rendered = {"rendered": child["rendered"]} if "rendered" in child else {}
    figures = parse_memory_lines(out, rank)
    if figures is None:
        tail = child.get("error") or ((p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"])[0]
        return {"rank": rank, "error": f"no memory report (exit {p.returncode}): {tail[:300]}", **rendered}
    return {"rank": rank, **figures, **rendered}


def run_fake_pg_anchor(trace_dir: Path, script: Path, script_args: list[str], *, on_cpu: bool) -> Path:
    """Measure every class's representative rank under Megatron's fake process group; writes
    ``fake-pg-anchor.json`` into the trace (read by the report)."""
    trace_dir = Path(trace_dir)
    world = read_trace(trace_dir).world_size
    reps = representatives(trace_dir)
    results = []
    for i, (rank, info) in enumerate(sorted(reps.items()), start=1):
        print(f"prism: fake-process-group anchor {i}/{len(reps)}: rank {rank} ({info['class']})", file=sys.stderr,
              flush=True)
        results.append({**fake_pg_peak(script, script_args, world, rank, on_cpu=on_cpu), "class": info["class"]})
    doc = {"format": FORMAT, "version": VERSION,
           "source": "Megatron --fake-process-group, one rank alone, with prism's rendering seams", "ranks": results}
    return atomic_write_text(trace_dir / ANCHOR_FILE, json.dumps(doc, indent=1) + "\n")
