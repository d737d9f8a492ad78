"""What each target recipe would need on one emulation machine, before any device time is spent.

For every recipe in ``prism_megatron/recipes/targets/`` this runs ``prism-megatron plan --recipe NAME
--json`` against a machine given by its device and host memory (default: one H200, 139 GiB, and the
115 GiB of host RAM the GPU machine leaves free), and prints one row per recipe: layout, fold depth,
live ranks of all, the memory the most loaded sandbox rank needs by prism's estimate (its class) and,
beside it, by Megatron's formula (weights and optimizer + activations), whether the sandbox fits (by
prism's estimate) and why not, and the plan's rough emulation time.

The target recipes are parsed by Megatron-LM's own parser, and Megatron's formula lives there too
(``megatron.training``, not in the megatron-core wheel): give a
checkout or an archive made by ``bench/peer/run_peer_suite.py --pack`` with ``--megatron-lm``, or let
it fetch the pinned tag into the user's cache. Run with a Python whose megatron-core matches the tag:

    python bench/targets/plan_all.py --megatron-lm .peer-cache/megatron-lm-core_v0.19.0.tar.gz --out OUT.txt
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "bench" / "peer"))
from run_peer_suite import TAG, megatron_checkout  # noqa: E402

GIB = 1 << 30


def plan(name: str, checkout: Path, device_gib: float, host_gib: float, options: list[str]) -> dict:
    """The plan's JSON for recipe ``name`` (a refused plan's too: it says why), or {'error': ...}."""
    env = dict(os.environ, MEGATRON_LM_PATH=str(checkout),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "prism_megatron", "plan", "--recipe", f"targets-{name}", "--prism-devices", "0",
           "--prism-device-memory", str(device_gib), "--prism-host-memory", str(host_gib), *options, "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    try:
        return json.loads(p.stdout)
    except json.JSONDecodeError:
        return {"error": (p.stderr.strip().splitlines() or ["no output"])[-1]}


PLAN_VERSION = 6  # the oldest plan JSON with every field this table reads (later ones only add fields)


def row(name: str, d: dict) -> list[str]:
    if "error" in d:
        return [name, "-", "-", "-", "-", "-", "-", f"error: {d['error']}"]
    if not isinstance(d.get("version"), int) or d["version"] < PLAN_VERSION:
        raise SystemExit(f"plan of {name}: field version {d.get('version')!r} is older than {PLAN_VERSION}, the first "
                         "this reads")
    m, fold = d["memory"], d.get("fold") or {}
    live = fold.get("live") or []
    formula = m.get("megatron") or {}
    gib = (lambda x: "-" if x is None else f"{x / GIB:.1f}")
    capture = d["capture"]
    verdict, why = (d["fits"], capture["why"]) if capture["mode"] == "serial" else (m.get("fits"), m.get("why"))
    fits = d["verdict"]  # runs, runs (to an OOM verdict), does not fit, refused, not checked
    if capture["mode"] == "serial":
        fits = f"serial, {capture['captures']} capture(s): {fits}"
    if d.get("predicted_oom"):
        why = f"{why}; " + "; ".join(d["predicted_oom"])
    depth = fold.get("depth") or "-"
    return [name, d["layout"], depth, f"{len(live)} of {fold.get('world_size', '?')}",
            f"{gib(m.get('per_rank'))} ({m.get('per_rank_class') or '-'})",
            f"{gib(formula.get('total'))} = {gib(formula.get('weight_and_optimizer'))} + "
            f"{gib(formula.get('activation'))}", _minutes(d["time"]),
            fits + (f": {why}" if capture["mode"] == "serial" or not verdict else "")]


def _minutes(time: dict) -> str:
    """The plan's expected emulation time, and the report step's part of it (plan JSON 9 on)."""
    report = time.get("report_s")
    return f"{time['seconds'] / 60:.1f} min" + (f" ({report:.0f} s report)" if report is not None else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron-lm", help=f"Megatron-LM checkout or --pack archive (default: fetch {TAG})")
    ap.add_argument("--device-memory", type=float, default=139.0, help="GiB of the emulation GPU")
    ap.add_argument("--host-memory", type=float, default=115.0, help="GiB of host RAM the emulation may use")
    ap.add_argument("--fold-depth", default="auto", choices=("auto", "replica", "class"),
                    help="--prism-fold-depth of every plan (class: MoE targets fold their expert peers too)")
    ap.add_argument("--out", type=Path, help="also write the table here")
    ap.add_argument("--options", default="", help="prism options every plan takes, e.g. '--prism-fold-capture "
                    "serial --prism-attention sdpa --prism-fold-microbatches auto'")
    a = ap.parse_args()
    checkout = megatron_checkout(a.megatron_lm, TAG)
    names = sorted(p.stem for p in (REPO / "prism_megatron" / "recipes" / "targets").glob("*.yaml"))
    head = ["recipe", "layout", "depth", "live", "GiB/rank (prism, class)", "Megatron's formula = w+opt + act.",
            "emulation", "sandbox here"]
    options = [*a.options.split(), "--prism-fold-depth", a.fold_depth]
    rows = []
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] plan {name}", file=sys.stderr, flush=True)
        rows.append(row(name, plan(name, checkout, a.device_memory, a.host_memory, options)))
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head) - 1)]
    shown = f" --fold-depth {a.fold_depth}" + (f" --options '{a.options}'" if a.options else "")
    lines = [f"# python bench/targets/plan_all.py --device-memory {a.device_memory:g} --host-memory {a.host_memory:g}"
             f"{shown}  (prism's estimate judges; Megatron-LM {TAG}'s formula beside it)"]
    for r in [head, *rows]:
        lines.append("  ".join(x.ljust(w) for x, w in zip(r, widths, strict=False)) + "  " + r[-1])
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out:
        tmp = a.out.with_name(a.out.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(a.out)


if __name__ == "__main__":
    main()
