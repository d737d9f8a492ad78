"""Megatron's own one-rank memory peak (``--fake-process-group``) for a target recipe's rank classes (issue 20).

For recipe NAME and some global ranks (default: the live rank of each class in ``prism-megatron plan
--json``), run Megatron-LM's ``pretrain_gpt.py`` once per rank in a subprocess of its own, with the
Megatron arguments prism's ranks receive for that recipe (``megatron.run.parse_run_args`` and, by
default, ``microbatch_mode.choose_microbatches``: the same command line, not re-derived here) plus
``--fake-process-group`` and WORLD_SIZE/RANK/LOCAL_RANK of the target, through prism's own child
(``prism_megatron.megatron.fake_pg_child``, what ``--prism-anchor-fake-pg`` runs): prism's rendering seams
only, so its model is the program prism's ranks build, and a rank that builds no dataset trains as rank 0's
broadcast tells it to (``FAKE_PG_BROADCAST=off``: Megatron's own behaviour). Each child prints
torch.cuda.max_memory_allocated/reserved when training ends, or the OOM (the failing allocation) when it
runs out of device memory; Megatron's own ``report_memory`` line is read too where it prints one
(data-parallel rank 0 only).

Usage (repo root; MEGATRON_LM_PATH a Megatron-LM checkout at the installed core's tag):
  python bench/targets/fake_pg_peak.py llama3-8b-h100x8 [--ranks 0,3] [--prism-report OUT/report.json]
      [--script PATH|driver] [--iters 3] [--microbatches prism|recipe] [--out DIR] [-- MEGATRON OVERRIDES]
``--script`` defaults to MEGATRON_LM_PATH/pretrain_gpt.py; ``driver`` is prism's training driver
(``pretrain_gpt_mini.py``: Megatron's ``pretrain`` on the mock GPT data path, the script prism's ranks run).
Writes OUT/fake-pg-NAME.json (one entry per rank) and prints a table; exit 0 when every rank ran or
ran out of memory (an OOM is a result), 1 when one failed otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from prism_megatron.megatron.fake_pg_child import (  # noqa: E402
    BROADCAST_ENV,
    CAP_ENV,
    MARK,
    command,
    rank_env,
    read_result,
)

MiB = 1 << 20
FORMAT, VERSION = "prismfakepg", 1


# ------------------------------------------------------------------------------------------------ argv

def plan_flags(name: str, depth: str, devices: str = "cpu") -> list[str]:
    """The prism flags run_target.sh runs a target with (its plan's live ranks are the defaults here), the
    recipe's emulation section giving the rest (attention, serial capture, micro-batch fold); ``devices`` as its
    --prism-devices (the fold depth ``auto`` picks depends on their memory)."""
    return ["--recipe", f"targets-{name}", "--prism-devices", devices, "--prism-driver", "training",
            "--prism-fold", "on", "--prism-fold-depth", depth]


def megatron_argv(name: str, *, depth: str = "auto", microbatches: str = "prism", iters: int | None = None,
                  overrides: list[str] = ()) -> tuple[list[str], dict[str, str], int]:
    """(Megatron's arguments, the environment, the world size) of recipe NAME as prism's ranks get them,
    made by prism's own code, with ``overrides`` appended as run appends them, then ``--train-iters``
    (the recipe's, at most 3 unless ``iters``) and ``--fake-process-group``; the training driver's
    argument defaults become flags where absent (another script defaults otherwise). ``microbatches``: ``prism``
    keeps the global batch prism's micro-batch fold gives the ranks (the same warm-up, so the same peak),
    ``recipe`` the recipe's own."""
    from prism_megatron.megatron.driver import DRIVER_ARG_DEFAULTS
    from prism_megatron.megatron.microbatch_mode import choose_microbatches
    from prism_megatron.megatron.run import _flag_int, cpu_defaults, parse_run_args

    if microbatches not in ("prism", "recipe"):
        raise ValueError(f"--microbatches {microbatches!r}: expected prism or recipe")
    if iters is not None and iters < 1:
        raise ValueError(f"--iters {iters}: expected at least 1")
    request = parse_run_args([*plan_flags(name, depth), *overrides])
    world = int(request.options["prism_world_size"])
    args = list(request.script_args)
    if microbatches == "prism":
        args, _ = choose_microbatches("auto", request.script, args, world, request.options["prism_gpus_per_node"],
                                      env=request.env, say=lambda m: None)
    if iters is None:
        iters = min(_flag_int(args, "--train-iters") or 3, 3)
    for key, value in DRIVER_ARG_DEFAULTS.items():  # what prism's driver defaults, as flags for pretrain_gpt.py
        flag = "--" + key.replace("_", "-")
        if not any(a == flag or a.startswith(flag + "=") for a in args):
            args += [flag, str(value)]
    args += ["--train-iters", str(iters), *cpu_defaults(args), "--fake-process-group"]
    return args, dict(request.env), world


def plan_ranks(name: str, depth: str, overrides: list[str] = (), devices: str = "cpu") -> dict[int, str]:
    """The lowest live rank of each class of the plan, with its class's name (at replica depth a class
    can have several live ranks: they hold alike, so one is measured)."""
    cmd = [sys.executable, "-m", "prism_megatron", "plan", "--json", *plan_flags(name, depth, devices), *overrides]
    p = subprocess.run(cmd, capture_output=True, text=True)
    start = p.stdout.find("{")
    if start < 0:
        raise SystemExit(f"fake_pg_peak: `{' '.join(cmd[2:])}` printed no plan (exit {p.returncode}): "
                         f"{(p.stderr.strip().splitlines() or ['no output'])[-1]}")
    fold = json.loads(p.stdout[start:p.stdout.rfind("}") + 1])["fold"]
    names = [c["name"] for c in fold["classes"]]
    first: dict[str, int] = {}
    for r in sorted(fold["live"]):
        first.setdefault(names[fold["class_of"][r]], r)
    return {r: name for name, r in first.items()}


def _default_devices() -> str:
    import torch

    return "0" if torch.cuda.is_available() else "cpu"


def resolve_script(choice: str | None) -> Path:
    """Megatron-LM's pretrain_gpt.py (MEGATRON_LM_PATH's), a path, or prism's training driver ('driver')."""
    if choice == "driver":
        from prism_megatron.megatron.driver import DRIVER_SCRIPT

        return Path(DRIVER_SCRIPT)
    if choice is None:
        root = os.environ.get("MEGATRON_LM_PATH")
        if not root:
            raise SystemExit("fake_pg_peak: set MEGATRON_LM_PATH (a Megatron-LM checkout) or pass --script")
        path = Path(root) / "pretrain_gpt.py"
        if not path.is_file():
            raise SystemExit(f"fake_pg_peak: {path} does not exist (an archive without Megatron-LM's root scripts?): "
                             "pass --script PATH, or --script driver for prism's training driver")
        return path
    path = Path(choice)
    if not path.is_file():
        raise SystemExit(f"fake_pg_peak: --script {choice!r} is not a file")
    return path


# ------------------------------------------------------------------------------------------------ one rank

def run_rank(script: Path, argv: list[str], env: dict[str, str], world: int, rank: int, timeout: float,
             log: Path | None = None) -> dict[str, Any]:
    """One rank alone under Megatron's fake process group: its peaks, or its OOM, or why it has neither."""
    from prism_megatron.megatron.anchors import parse_memory_lines

    child_env = {**os.environ, **env, **rank_env(world, rank),
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.monotonic()
    try:
        p = subprocess.run(command(script, argv), capture_output=True, text=True, env=child_env, timeout=timeout)
        out, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = None
    wall = round(time.monotonic() - t0, 1)
    if log is not None:
        log.write_text(out)
    entry: dict[str, Any] = {"rank": rank, "exit": rc, "wall_s": wall, "oom": False}
    result = read_result(out)
    entry.update(result or {})
    megatron = parse_memory_lines(out, rank)
    entry["megatron_report"] = megatron  # Megatron's own line (after its first iterations), DP rank 0 only
    if rc is None:
        entry["status"] = f"timed out after {timeout:.0f} s"
    elif entry.get("oom") or re.search(r"OutOfMemoryError|CUDA out of memory", out):
        entry["oom"] = True
        entry["status"] = "OOM: does not fit the device alone"
        entry.setdefault("error", next((x.strip()[:600] for x in out.splitlines() if "out of memory" in x), ""))
    elif rc != 0 or result is None:
        tail = [x for x in out.splitlines() if x.strip() and not x.startswith(MARK)][-3:]
        entry["status"] = f"failed (exit {rc})"
        entry["error"] = entry.get("error") or " | ".join(tail)[:600] or "no output"
    elif entry.get("iterations") != entry.get("train_iters"):
        entry["status"] = f"stopped after {entry.get('iterations')} of {entry.get('train_iters')} iterations"
    else:
        entry["status"] = "ran"
    return entry


# ------------------------------------------------------------------------------------------------ prism beside it

def prism_figures(report_path: Path) -> dict[int, dict[str, Any]]:
    """Per rank of a prism report.json: its class and measured peaks (``memory.ranks``)."""
    doc = json.loads(Path(report_path).read_text())
    ranks = (doc.get("memory") or {}).get("ranks")
    if not isinstance(ranks, list):
        raise SystemExit(f"fake_pg_peak: {report_path}: field 'memory.ranks' is missing or not a list")
    return {int(r["rank"]): r for r in ranks}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:,.0f}"


def table(entries: list[dict[str, Any]]) -> str:
    head = ("rank", "class", "status", "fake-pg max alloc", "max reserved", "Megatron line", "prism max alloc",
            "diff")
    rows = [head]
    for e in entries:
        mine, prism = e.get("max_allocated"), (e.get("prism") or {}).get("max_allocated")
        diff = "-" if mine is None or prism is None else f"{(prism - mine) / MiB:+,.0f} ({(prism - mine) / mine:+.2%})"
        meg = e.get("megatron_report") or {}
        rows.append((str(e["rank"]), e.get("class") or "-", e["status"], _mib(mine), _mib(e.get("max_reserved")),
                     _mib(meg.get("max_allocated")), _mib(prism), diff))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(MiB; diff = prism - fake-pg; Megatron line: its own report_memory max allocated)"


def main(argv: list[str]) -> int:
    own, overrides = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(prog="fake_pg_peak.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="target recipe (recipes/targets/NAME.yaml, without 'targets-')")
    ap.add_argument("--ranks", help="global ranks, comma-separated (default: the plan's live rank of each class)")
    ap.add_argument("--script", help="pretrain script (default MEGATRON_LM_PATH/pretrain_gpt.py; 'driver': prism's)")
    ap.add_argument("--iters", type=int, help="train iterations (default: the recipe's, at most 3)")
    ap.add_argument("--microbatches", default="prism", choices=("prism", "recipe"),
                    help="global batch as prism's ranks run it (default) or the recipe's")
    ap.add_argument("--fold-depth", default="auto", help="the plan's --prism-fold-depth (default auto)")
    ap.add_argument("--devices", help="the plan's --prism-devices (default: 0 where a GPU is visible, else cpu)")
    ap.add_argument("--prism-report", type=Path, help="a prism report.json: its per-rank peak beside each")
    ap.add_argument("--out", type=Path, default=Path("."), help="directory for fake-pg-NAME.json and the logs")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per rank (900)")
    ap.add_argument("--cap", metavar="GPU",
                    help="cap each rank's allocator at this target GPU's usable bytes, as prism caps an emulated "
                         "rank (e.g. h100-80gb; default: uncapped)")
    a = ap.parse_args(own)
    script = resolve_script(a.script)
    args, env, world = megatron_argv(a.name, depth=a.fold_depth, microbatches=a.microbatches, iters=a.iters,
                                     overrides=overrides)
    if a.cap:
        from prism_megatron.memory.targets import resolve_target

        env = {**env, CAP_ENV: str(resolve_target(a.cap).usable)}
    if a.ranks:
        ranks, classes = [int(r) for r in a.ranks.split(",")], {}
    else:
        classes = plan_ranks(a.name, a.fold_depth, overrides, a.devices or _default_devices())
        ranks = sorted(classes)
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise SystemExit(f"fake_pg_peak: --ranks {bad}: not ranks of a world of {world}")
    prism = prism_figures(a.prism_report) if a.prism_report else {}
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"fake_pg_peak: {a.name}: world {world}, ranks {ranks}, script {script}\n  args: {' '.join(args)}",
          flush=True)
    entries = []
    for i, rank in enumerate(ranks, start=1):
        print(f"fake_pg_peak: rank {rank} ({i}/{len(ranks)}) ...", flush=True)
        e = run_rank(script, args, env, world, rank, a.timeout, a.out / f"fake-pg-{a.name}-rank{rank}.log")
        e["class"] = classes.get(rank) or (prism.get(rank) or {}).get("class")
        if rank in prism:
            e["prism"] = {k: prism[rank].get(k) for k in ("class", "max_allocated", "max_reserved", "oom")}
        said = f"; {e['error']}" if e.get("error") else ""
        print(f"  rank {rank}: {e['status']} ({e.get('iterations')} iterations); max allocated "
              f"{_mib(e.get('max_allocated'))} MiB, max reserved {_mib(e.get('max_reserved'))} MiB in "
              f"{e['wall_s']} s{said}", flush=True)
        entries.append(e)
    doc = {"format": FORMAT, "version": VERSION, "recipe": a.name, "world_size": world, "script": str(script),
           "argv": args, "env": env, "source": "Megatron-LM --fake-process-group, one rank alone per process",
           "do_train": "Megatron's own" if os.environ.get(BROADCAST_ENV) == "off" else "as rank 0 broadcasts it",
           "ranks": entries}
    path = a.out / f"fake-pg-{a.name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    print(table(entries))
    print(f"fake_pg_peak: wrote {path}")
    return 1 if any(not (e["status"] == "ran" or e.get("oom")) for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
