"""The plan's time model for serial captures on one GPU, read off the target recipes' device runs.

A serial run's wall is a fixed cost per run, then per capture a fixed cost and the iterations its live rank
runs (one that runs out of memory under the target's cap ends early), then the report step. This reads each
run's summary from the committed results (run_target.sh's lines: every capture's start, its iterations' walls,
its end, "wall s per capture", the report's lines, the exit line) and each recipe's plan (`prism-megatron plan
--json`), derives every constant of `plan.SERIAL_GPU_TIME_MODEL` from the parts of the walls it stands for, and
prints the plan's expected time against each measured wall, and against the constants in plan.py.

    python bench/targets/capture_time_model.py --plans DIR RESULTS.txt [RESULTS.txt ...]

DIR holds NAME.json, each `prism-megatron plan --json --recipe targets-NAME --prism-devices 0
--prism-device-memory 139.8 --prism-host-memory 128` with run_target.sh's flags.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO))

EXIT = re.compile(r"^== (\S+): exit (\d+) in (\d+) s")
TAKE = re.compile(r"^prism: serial capture (\d+)/(\d+)( again)?: rank (\d+) \(class ([^)]+)\)")
ITER = re.compile(r"iteration +\d+/ +\d+ \|.*elapsed time per iteration \(ms\): ([\d.]+)")
WALLS = re.compile(r"wall s per capture: ([\d., ]+)(?:; again: ([\d., ]+))?\)")
REPORT = re.compile(r"^prism: report: (?:replayed and built|report\.json and report\.html written|timeline\.json .*"
                    r"written) in ([\d.]+) s")


@dataclass
class Take:
    cls: str
    again: bool
    iterations: list[float] = field(default_factory=list)  # s, Megatron's elapsed time per iteration
    end: str = "cut"  # done, oom, cut
    wall: float | None = None


@dataclass
class Run:
    name: str
    wall: float
    takes: list[Take]
    report: float
    source: str


def read_runs(path: Path) -> list[Run]:
    """Every run in a results file that was not cut by its time limit."""
    runs, lines = [], path.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if EXIT.match(line)]
    for a, b in zip(starts, starts[1:] + [len(lines)], strict=True):
        m = EXIT.match(lines[a])
        b = next((i for i in range(a + 1, b) if lines[i].startswith("## ")), b)  # the file's next section
        takes: list[Take] = []
        walls: list[float] | None = None
        report = 0.0
        for line in lines[a + 1:b]:
            if t := TAKE.match(line):
                takes.append(Take(cls=t.group(5), again=bool(t.group(3))))
            elif (i := ITER.search(line)) and takes:
                takes[-1].iterations.append(float(i.group(1)) / 1e3)
            elif w := WALLS.search(line):  # the merge: every take's wall, the takes again last
                walls = [float(x) for x in w.group(1).split(",")] + \
                    ([float(x) for x in w.group(2).split(",")] if w.group(2) else [])
            elif line.startswith("prism: done in") and takes:
                takes[-1].end = "done"
            elif line.startswith("prism: ") and "ran out of memory under the target's cap" in line and takes:
                takes[-1].end = "oom"
            elif r := REPORT.match(line):
                report += float(r.group(1))
        if m.group(2) in ("124", "137") or walls is None or len(walls) != len(takes):
            continue  # cut by its time limit
        for take, wall in zip(takes, walls, strict=True):
            take.wall = wall
        runs.append(Run(m.group(1), float(m.group(3)), takes, report, path.name))
    return runs


def is_moe(plan: dict) -> bool:
    return "·EP" in plan["layout"]


def live_flops(plan: dict) -> float:
    """One live rank's model FLOPs per iteration, as the plan counts them."""
    return plan["time"]["sandbox_flops_per_iteration"] / len(plan["fold"]["live"])


def geomean(xs: list[float]) -> float:
    """NaN for none: a set of runs without a finished capture of that kind says nothing of its rate."""
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else math.nan


def derive(runs: list[Run], plans: dict[str, dict]) -> tuple[dict[str, float], list[str]]:
    """The constants, each from the part of the walls it stands for; and how each was read."""
    done = [t for r in runs for t in r.takes if t.end == "done"]
    capture_own = [t.wall - sum(t.iterations) for t in done]  # the capture's start and end around its iterations
    own = statistics.median(capture_own)
    # the rest of a run (neither a capture's wall nor the report) against its captures: run_s + gap x captures
    xs = [len(r.takes) for r in runs]
    ys = [r.wall - sum(t.wall for t in r.takes) - r.report for r in runs]
    gap = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else 0.0
    run_s = statistics.fmean(ys) - gap * statistics.fmean(xs)
    rates: dict[str, list[float]] = {"dense": [], "moe": []}
    for r in runs:  # per recipe: its live rank's model FLOPs per iteration over its captures' mean iteration
        its = [s for t in r.takes if t.end == "done" for s in t.iterations]
        if its:
            rates["moe" if is_moe(plans[r.name]) else "dense"].append(live_flops(plans[r.name]) / statistics.fmean(its))
    dense, moe = geomean(rates["dense"]), geomean(rates["moe"])
    oom_parts = []
    for r in runs:  # a capture that ran out: its wall past the capture's own cost, in its class's iterations
        p = plans[r.name]
        per_it = live_flops(p) / (moe if is_moe(p) else dense)
        oom_parts += [max(0.0, t.wall - own) / per_it for t in r.takes if t.end == "oom"]
    model = {"run_s": run_s, "capture_s": own + gap, "dense_flops": dense, "moe_flops": moe,
             "oom_iterations": statistics.median(oom_parts)}
    how = [f"captures that ran to the end: {len(done)}; each one's wall less its iterations: median "
           f"{own:.1f} s ({min(capture_own):.1f}-{max(capture_own):.1f})",
           f"a run's rest against its captures (least squares over {len(runs)} runs): {run_s:.1f} s + {gap:.1f} s "
           "per capture (the gap counted in capture_s)",
           "model FLOP/s of a live rank's iteration, per recipe: dense " +
           ", ".join(f"{x / 1e12:.0f}" for x in rates["dense"]) + f" T (geometric mean {dense / 1e12:.0f}); MoE " +
           ", ".join(f"{x / 1e12:.0f}" for x in rates["moe"]) + f" T ({moe / 1e12:.0f})",
           f"captures that ran out of memory: {len(oom_parts)}, iterations run past the capture's own cost: "
           f"median {statistics.median(oom_parts):.2f} (" + ", ".join(f"{x:.2f}" for x in sorted(oom_parts)) + ")"]
    return model, how


def expected(plan: dict, model: dict[str, float]) -> float:
    """The plan's expected seconds with ``model``'s constants in place of plan.py's, from the plan's own
    structure (its captures' classes, predicted OOMs, takes again, report step): checked against the plan's
    figure with plan.py's constants, so it is the plan's sum and not another model."""
    t, fold = plan["time"], plan["fold"]
    per_it = live_flops(plan) / (model["moe_flops"] if is_moe(plan) else model["dense_flops"])
    ooms = set((plan["memory"].get("target") or {}).get("oom") or {})
    names = [fold["classes"][fold["class_of"][r]]["name"] for r in fold["live"]]
    again = plan["capture"]["second_pass"]["counted"]
    captures = [model["oom_iterations"] if name in ooms else t["iterations"] for name in names]
    captures += [t["iterations"]] * again
    return model["run_s"] + sum(model["capture_s"] + k * per_it for k in captures) + t["report_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--plans", type=Path, required=True, help="a directory of NAME.json (plan --json)")
    a = ap.parse_args()
    from prism_megatron.megatron.plan import SERIAL_GPU_TIME_MODEL

    runs = [r for f in a.results for r in read_runs(f)]
    plans = {r.name: json.loads((a.plans / f"{r.name}.json").read_text()) for r in runs}
    for name, p in plans.items():
        mine = expected(p, SERIAL_GPU_TIME_MODEL)
        if abs(mine - p["time"]["seconds"]) > 0.5:
            sys.exit(f"{name}: this script's sum {mine:.1f} s is not the plan's {p['time']['seconds']:.1f} s: "
                     "plan.py's time model changed; change expected() with it")
    model, how = derive(runs, plans)
    print("# derived from", ", ".join(sorted({r.source for r in runs})))
    for line in how:
        print("#", line)
    print("# constant          derived    plan.py")
    for k, v in model.items():
        print(f"# {k:16s} {v:10.4g} {SERIAL_GPU_TIME_MODEL[k]:10.4g}")
    print(f"\n{'recipe':42s} {'takes':>5s} {'measured s':>10s} {'plan s':>7s} {'ratio':>6s} {'held out':>8s}  "
          "(plan: plan.py's constants; held out: the constants derived without this recipe's runs)")
    ratios, held = [], []
    for r in runs:
        p = plans[r.name]
        others = [o for o in runs if o.name != r.name]
        out = expected(p, derive(others, plans)[0])
        ratios.append(p["time"]["seconds"] / r.wall)
        held.append(out / r.wall)
        print(f"{r.name:42s} {len(r.takes):5d} {r.wall:10.0f} {p['time']['seconds']:7.0f} {ratios[-1]:6.2f} "
              f"{held[-1]:8.2f}  {r.source}")
    for what, xs in (("plan", ratios), ("held out", [x for x in held if not math.isnan(x)])):
        if not xs:
            continue
        print(f"# {what}: plan / measured {min(xs):.2f}-{max(xs):.2f}, mean |log ratio| "
              f"{statistics.fmean(abs(math.log(x)) for x in xs):.2f} ({len(xs)} runs)")


if __name__ == "__main__":
    main()
