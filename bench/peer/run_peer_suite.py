"""Run a peer project's own distributed unit tests under prism, one launch per test file, and say per file
what passed, failed and was skipped in each rank, with every failure attributed (prism or the environment).

Megatron-LM is fetched at run time at a pinned tag into a cache outside this repository (or taken from
``--megatron-lm PATH``); its tests run as W logical ranks on CPU (prism's CPU execution mode), each rank
calling ``pytest.main`` on the file (bench/peer/rank_pytest.py). One launch per file: a file that ends
its job (a hang, a crash) cannot poison the next. See bench/peer/README.md.

    python bench/peer/run_peer_suite.py --world-size 8 --out bench/peer/results/x.txt \\
        tests/unit_tests/test_parallel_state.py tests/unit_tests/distributed/test_distributed_data_parallel.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TAG = "core_v0.19.0"
URL = "https://github.com/NVIDIA/Megatron-LM"

#: Failure text -> cause, first match wins. Prism first: a failure whose traceback passes through prism's
#: runtime, or that prism reports, is prism's until shown otherwise.
CAUSES: list[tuple[str, re.Pattern]] = [
    ("prism", re.compile(r"prism_megatron/runtime|prism backend|prism coordinator|UnsupportedOp|mismatch report")),
    ("env: no Transformer Engine", re.compile(r"transformer_engine|TransformerEngine|\bTE\b|HAVE_TE|te_min_version")),
    ("env: no GPU", re.compile(r"CUDA|cuda|NCCL|nccl|GPU|device-side|cudaError|torch\.cuda")),
    ("env: CPU mode", re.compile(r"prism_megatron/megatron/cpu_mode|cpu_cuda_stubs")),
    ("env: missing package", re.compile(r"ModuleNotFoundError|No module named")),
]


TE_FRAMES = re.compile(r"TESpecProvider|FP8GlobalStateManager|\[transformer_engine|"
                       r"megatron/core/extensions/transformer_engine|get_gpt_layer_with_transformer_engine")


def attribute(text: str) -> str:
    """The cause of one failure: prism when its traceback passes through prism or prism says so; else the
    environment by the error's own lines (CAUSES); 'unattributed' (read it) when nothing matches."""
    if CAUSES[0][1].search(text):
        return CAUSES[0][0]
    if TE_FRAMES.search(text):  # Megatron builds TE layers where TE is missing: the error itself says little
        return "env: no Transformer Engine"
    errors = "\n".join(ln for ln in text.splitlines() if ln.startswith("E ") or "Error" in ln[:80])
    for cause, pattern in CAUSES[1:]:
        if pattern.search(errors):
            return cause
    return "unattributed"


def megatron_checkout(path: str | None, tag: str) -> Path:
    """An existing checkout, or the pinned tag cloned once into the user's cache."""
    if path:
        p = Path(path).resolve()
        if not (p / "tests" / "unit_tests").is_dir():
            raise SystemExit(f"--megatron-lm {p}: no tests/unit_tests there (not a Megatron-LM checkout)")
        return p
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "prism-megatron" / f"megatron-lm-{tag}"
    if not (cache / "tests" / "unit_tests").is_dir():
        cache.parent.mkdir(parents=True, exist_ok=True)
        print(f"fetching {URL} {tag} into {cache}", file=sys.stderr, flush=True)
        r = subprocess.run(["git", "clone", "--depth", "1", "--branch", tag, URL, str(cache)])
        if r.returncode:
            raise SystemExit(f"cannot clone {URL} at {tag}; pass an existing checkout with --megatron-lm PATH")
    return cache


def run_file(checkout: Path, test_file: str, world: int, timeout: float, hang_timeout: float,
             extra_path: list[str], pytest_args: list[str], suite: str = "megatron") -> dict:
    """One launch: every rank runs ``test_file`` (for the torch suite: the tests whose names contain it);
    returns per-rank results and how the job ended."""
    with tempfile.TemporaryDirectory(prefix="prism-peer-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(checkout), *extra_path,
                                                           os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "prism_megatron", "launch", "-w", str(world), "--devices", "cpu",
               "--hang-timeout", str(hang_timeout), "--trace-dir", str(Path(tmp) / "trace"), "--log-ranks", "none",
               *([str(HERE / "rank_pytest.py"), str(out), "--cpu-mode", "--", test_file, *pytest_args]
                 if suite == "megatron" else [str(HERE / "rank_torch.py"), str(out), test_file])]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=timeout)
            code, err = p.returncode, p.stderr
        except subprocess.TimeoutExpired as e:
            code, err = "timeout", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else ""
        wall = time.perf_counter() - t0
        ranks = {}
        for r in range(world):
            f = out / f"rank-{r}.json"
            if f.exists():
                ranks[r] = json.loads(f.read_text())
        return {"file": test_file, "exit": code, "wall_s": wall, "ranks": ranks, "stderr_tail": err[-4000:]}


def summarize(res: dict, world: int) -> list[str]:
    """Lines for one file: per-rank counts, each failing test with its cause, and how the job ended."""
    lines = []
    causes: Counter = Counter()
    failing: dict[str, dict] = {}
    for r in range(world):
        d = res["ranks"].get(r)
        if d is None:
            lines.append(f"    rank {r}: no result (job ended before the rank finished)")
            continue
        n = Counter(t["outcome"] for t in d["tests"])
        lines.append(f"    rank {r}: {n['passed']} passed, {n['failed'] + n['error']} failed, {n['skipped']} skipped")
        for t in d["tests"]:
            if t["outcome"] in ("failed", "error"):
                cause = attribute(t["text"])
                if cause != "prism" and t.get("upstream_marks"):
                    cause = f"upstream: marked {'/'.join(t['upstream_marks'])}, deselected by Megatron's CI"
                entry = failing.setdefault(t["id"], {"ranks": [], "cause": cause, "line": _last_error(t["text"])})
                entry["ranks"].append(r)
    skips = Counter(_first_line(t["text"]) for d in res["ranks"].values() for t in d["tests"]
                    if t["outcome"] == "skipped")
    if skips:
        shown = "; ".join(f"{n}x {why}" for why, n in skips.most_common(4))
        lines.append(f"    skipped because (tests x ranks): {shown}" + ("; ..." if len(skips) > 4 else ""))
    for tid, e in failing.items():
        causes[e["cause"]] += 1
        lines.append(f"    FAIL {tid} ranks {_ranks(e['ranks'])}: {e['cause']} -- {e['line']}")
    if res["exit"] != 0 and len(res["ranks"]) < world:
        why = _job_end(res["stderr_tail"])
        cause = "prism" if "prism" in why and "hang" not in why else "see report"
        lines.append(f"    JOB ENDED (exit {res['exit']}): {why} [{cause}]")
    return lines


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0].replace("Skipped: ", "")[:100]


def _last_error(text: str) -> str:
    errs = [ln.strip() for ln in text.splitlines() if ln.startswith("E ") or "Error" in ln[:60]]
    return (errs[-1] if errs else text.strip().splitlines()[-1] if text.strip() else "")[:200]


def _job_end(stderr: str) -> str:
    for ln in stderr.splitlines():
        if "hang detected" in ln or "mismatch" in ln or "exited with code" in ln or "process group" in ln:
            return ln.strip()[:240]
    return (stderr.strip().splitlines() or ["(no output)"])[-1][:240]


def _ranks(rs: list[int]) -> str:
    return "all" if len(rs) > 1 and rs == list(range(rs[0], rs[-1] + 1)) and rs[0] == 0 and len(rs) >= 8 else str(rs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="test files, relative to the Megatron-LM checkout (--suite torch: "
                    "substrings of DistributedTest test names, one launch each)")
    ap.add_argument("--suite", choices=("megatron", "torch"), default="megatron",
                    help="torch: PyTorch's own process-group tests from the torch wheel, BACKEND=gloo")
    ap.add_argument("--megatron-lm", help="an existing Megatron-LM checkout (default: clone --tag into the cache)")
    ap.add_argument("--tag", default=TAG)
    ap.add_argument("--world-size", "-w", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per file")
    ap.add_argument("--hang-timeout", type=float, default=120)
    ap.add_argument("--path", action="append", default=[], help="more PYTHONPATH entries (test-only packages)")
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--raw", help="also write each file's per-rank results (JSON) into this directory")
    ap.add_argument("--pytest-arg", action="append", default=[], help="passed to pytest (repeatable)")
    a = ap.parse_args(argv)
    if a.suite == "megatron":
        checkout = megatron_checkout(a.megatron_lm, a.tag)
        head = [f"peer suite: Megatron-LM {a.tag} at {checkout.name}, {a.world_size} logical ranks on CPU "
                f"(CPU mode), python {sys.version.split()[0]}", ""]
    else:
        import torch

        checkout = Path(tempfile.gettempdir())
        head = [f"peer suite: torch {torch.__version__} DistributedTest (BACKEND=gloo), {a.world_size} logical ranks "
                f"on CPU, python {sys.version.split()[0]}", ""]
    print("\n".join(head), flush=True)
    body = []
    for f in a.files:
        print(f"running {f} ...", file=sys.stderr, flush=True)
        res = run_file(checkout, f, a.world_size, a.timeout, a.hang_timeout, a.path, a.pytest_arg, a.suite)
        if a.raw:
            Path(a.raw).mkdir(parents=True, exist_ok=True)
            (Path(a.raw) / (re.sub(r"[^\w.-]+", "_", f) + ".json")).write_text(json.dumps(res))
        block = [f"{f}  ({res['wall_s']:.0f} s wall, exit {res['exit']})", *summarize(res, a.world_size), ""]
        print("\n".join(block), flush=True)
        body.extend(block)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(a.out).with_suffix(".tmp")
        tmp.write_text("\n".join(head + body) + "\n")
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
