"""The plan's report-step term against the report steps that ran (issue 20: the plan's expected time counted
the captures only; DeepSeek-V3's report step was 73 s of its 480 s on the GPU machine).

For each run folder of ``bench/targets/smoke_cpu.sh`` (OUT/smoke-NAME, with its ``flags.txt`` and ``run.log``)
this prints the step the run timed (``prism: report: replayed and built in N s``, report.json and report.html,
timeline.json: the three lines ``report.make_report`` says) beside the plan's figure for the same command
(``prism-megatron plan --json``: ``time.report_s`` and the ops it counts, ``time.report_ops``), their ratio,
the step's seconds per op the plan counts, and the ops the run's trace holds per layer and captured micro-batch
on each live rank (what the plan's table of ops per layer stands for). The shrunk runs keep the targets'
layouts, micro-batches and layer counts, so their replays walk the GPU runs' op counts (their widths do not
matter to the step).

    python bench/targets/report_step_model.py OUT/smoke-NAME [...]    (a Python with megatron-core; the
    smoke run's MEGATRON_LM_PATH set)
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

STEP = re.compile(r"^prism: report: (?:replayed and built|report\.json and report\.html written|timeline\.json "
                  r"\([^)]*\) written) in ([0-9.]+) s$", re.M)


def measured(run_dir: Path) -> float | None:
    """The report step's seconds as the run said them (None: the run did not reach it)."""
    times = [float(t) for t in STEP.findall((run_dir / "run.log").read_text(errors="replace"))]
    return sum(times) if len(times) == 3 else None


def trace_ops_per_layer(run_dir: Path) -> list[float]:
    """Each live rank's ops in the trace per iteration, captured micro-batch and layer of its stage."""
    from prism_megatron.trace import read_trace

    trace = read_trace(run_dir / "trace")
    args = trace.manifest["job"]["args"]

    def arg(name: str, default: int) -> int:
        return int(args[args.index(name) + 1]) if name in args else default

    layers, pp = arg("--num-layers", 1), arg("--pipeline-model-parallel-size", 1)
    dp = trace.world_size // (arg("--tensor-model-parallel-size", 1) * pp * arg("--context-parallel-size", 1))
    captured = (trace.microbatches.captured if trace.microbatches is not None
                else arg("--global-batch-size", 1) // (arg("--micro-batch-size", 1) * dp))
    ranks = trace.ops.column("rank").value_counts().to_pylist()
    return [r["counts"] / arg("--train-iters", 1) / captured / (layers / pp) for r in ranks]


def planned(run_dir: Path) -> dict:
    """``plan --json`` of the run's own flags: its ``time`` record."""
    flags = (run_dir / "flags.txt").read_text().split()
    done = subprocess.run([sys.executable, "-m", "prism_megatron", "plan", "--json", *flags],
                          capture_output=True, text=True)
    if done.returncode not in (0, 1):
        sys.exit(f"{run_dir}: plan failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)["time"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path, help="smoke_cpu.sh run folders (OUT/smoke-NAME)")
    a = ap.parse_args()
    print(f"{'run':<46} {'step s':>7} {'plan s':>7} {'plan/step':>9} {'ops (plan)':>11} {'s per op':>9}  "
          "trace ops per layer and micro-batch, each live rank")
    ratios = []
    for run_dir in a.runs:
        step = measured(run_dir)
        if step is None:
            print(f"{run_dir.name:<46} (no report step in run.log)")
            continue
        t = planned(run_dir)
        if "report_s" not in t:
            sys.exit(f"{run_dir}: the plan has no report term (time: {sorted(t)})")
        ratio = t["report_s"] / step if step else float("nan")
        ratios.append(ratio)
        per_op = step / t["report_ops"] if t["report_ops"] else float("nan")
        per_layer = " ".join(f"{x:.1f}" for x in trace_ops_per_layer(run_dir))
        print(f"{run_dir.name:<46} {step:7.1f} {t['report_s']:7.1f} {ratio:9.2f} {t['report_ops']:11,} "
              f"{per_op * 1e6:7.1f} us  {per_layer}")
    if ratios:
        print(f"plan/step over {len(ratios)} run(s): median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
