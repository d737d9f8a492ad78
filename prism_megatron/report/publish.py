"""After an emulated run: the report files, the terminal summary, and W&B — ours and Megatron's.

What ``prism-megatron run`` calls once the trace is written (also after a predicted OOM, which is
a result). W&B gets the figures twice when the Megatron command had ``--wandb-project``: in a prism
run (always; offline unless the user configured W&B) and in Megatron's own run, whose id the last
rank recorded as a ``wandb_run`` mark (its writer lives there; the figures exist only after the
capture, so they are logged into that run by resuming it).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

from prism_megatron.trace import read_trace


def megatron_wandb_run(trace_dir: Path) -> dict | None:
    """The ``wandb_run`` mark's attrs (id, project, entity, dir) if Megatron's writer ran."""
    for m in read_trace(trace_dir).marks.to_pylist():
        if m["name"] == "wandb_run":
            return json.loads(m["attrs"])
    return None


def publish(trace_dir: Path, *, cluster: str | None, config: dict[str, Any], wandb_project: str,
            wandb_mode: str | None = None, calibrated: Path | None = None,
            timeline: str = "iteration") -> dict[str, Any]:
    """Write and print the report, log it to W&B; returns {"paths", "report", "wandb": [LoggedRun...]}.

    ``calibrated``: a calibrated graph of the trace; the prediction then comes from it. ``timeline``: what
    timeline.json holds (RunOnlyOptions.timeline)."""
    from prism_megatron.report import make_report, print_summary, read_report

    paths = make_report(trace_dir, cluster=cluster, calibrated=calibrated, timeline=timeline,
                        say=lambda m: print(f"prism: report: {m}", file=sys.stderr, flush=True))
    report = read_report(paths["report"])
    print_summary(report)
    for kind, path in paths.items():
        print(f"prism: {kind}: {path}", file=sys.stderr)
    logged: list[Any] = []
    if importlib.util.find_spec("wandb") is None:  # e.g. a GPU machine without it: say so, the files stand
        print("prism: W&B: not logged (wandb is not installed)", file=sys.stderr)
        return {"paths": paths, "report": report, "wandb": logged}
    from prism_megatron.report.wandb_log import log_report

    timeline = paths.get("timeline")
    theirs = megatron_wandb_run(trace_dir)
    targets = [dict(run_dir=Path(trace_dir).parent, project=wandb_project, name=Path(trace_dir).name)]
    if theirs is not None:
        targets.append(dict(run_dir=Path(theirs["dir"]), project=theirs["project"], entity=theirs.get("entity"),
                            resume_id=theirs["id"]))
    for target in targets:
        try:
            logged.append(log_report(report, timeline=timeline, config=config, mode=wandb_mode, **target))
        except Exception as e:  # W&B trouble must not cost the run its result: the report files stand
            print(f"prism: W&B: not logged into {target['project']} ({type(e).__name__}: {e})", file=sys.stderr)
    for run in logged:
        print(f"prism: {run.describe()}", file=sys.stderr)
    return {"paths": paths, "report": report, "wandb": logged}
