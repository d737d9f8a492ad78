"""Run a peer project's own distributed unit tests under prism, one launch per test file, and say per file
what passed, failed and was skipped in each rank, with every failure attributed (prism or the environment).

Megatron-LM is fetched at run time at a pinned tag into a cache outside this repository (or taken from
``--megatron-lm PATH``, or from an archive made by ``--pack``); its tests run as W logical ranks on CPU
(prism's CPU execution mode) or on GPUs (``--devices 0``), each rank calling ``pytest.main`` on the file
(bench/peer/rank_pytest.py). One launch per file: a file that ends its job (a hang, a crash) cannot
poison the next; ``--jobs`` runs several launches at once. See bench/peer/README.md.

    python bench/peer/run_peer_suite.py --world-size 8 --out bench/peer/results/x.txt \\
        tests/unit_tests/test_parallel_state.py 'tests/unit_tests/distributed/*.py'
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
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
                       r"megatron/core/extensions/transformer_engine|get_gpt_layer_with_transformer_engine|"
                       # a TE class Megatron left as its MagicMock placeholder, built by the test or Megatron
                       r"(return |= )TE(ColumnParallel|RowParallel|Layer|Norm|Linear|DotProduct|CudaRNGStatesTracker)"
                       r"\w*\(")


#: Causes that only the CPU run has (no GPU, the CPU mode's stand-ins): on a GPU such a failure is read, not assumed.
CPU_ONLY_CAUSES = ("env: no GPU", "env: CPU mode")


def attribute(text: str, on_gpu: bool = False) -> str:
    """The cause of one failure: prism when its traceback passes through prism or prism says so; else the
    environment by the error's own lines (CAUSES); 'unattributed' (read it) when nothing matches."""
    if CAUSES[0][1].search(text):
        return CAUSES[0][0]
    if TE_FRAMES.search(text):  # Megatron builds TE layers where TE is missing: the error itself says little
        return "env: no Transformer Engine"
    errors = "\n".join(ln for ln in text.splitlines() if ln.startswith("E ") or "Error" in ln[:80])
    for cause, pattern in CAUSES[1:]:
        if on_gpu and cause in CPU_ONLY_CAUSES:
            continue
        if pattern.search(errors):
            return cause
    return "unattributed"


def megatron_checkout(path: str | None, tag: str) -> Path:
    """An existing checkout (or an archive made by --pack, unpacked next to it once), or the pinned tag
    cloned once into the user's cache."""
    if path and path.endswith(".tar.gz"):
        return unpack(Path(path))
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


#: What the chosen test files need from a checkout, beyond the megatron-core wheel: the tag's own ``megatron``
#: package (the tests run against it, and import ``megatron.training``), the tests' shared helpers, the
#: pytest configuration (markers), and the test directories themselves.
PACKED = ("megatron", "pyproject.toml", "tests/__init__.py", "tests/test_utils", "tests/unit_tests/*.py",
          "tests/unit_tests/dist_checkpointing", "tests/unit_tests/distributed", "tests/unit_tests/pipeline_parallel",
          "tests/unit_tests/tensor_parallel")
#: Packed where the checkout has them: Megatron-LM's GPT entry and the modules beside it that it imports, for
#: bench/targets/fake_pg_peak.py (Megatron's own --fake-process-group run of a target's ranks).
PACKED_IF_PRESENT = ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py")


def pack(checkout: Path, archive: Path) -> None:
    """Write the parts of ``checkout`` the peer files need (PACKED) as a gzipped tar: a machine that cannot
    fetch the tag gets it this way (``--megatron-lm ARCHIVE``). Written atomically."""
    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for pattern in PACKED:
            found = sorted(checkout.glob(pattern))
            if not found:
                raise SystemExit(f"--pack: {checkout} has no {pattern} (not a Megatron-LM checkout?)")
            for path in found:
                tar.add(path, arcname=str(path.relative_to(checkout)),
                        filter=lambda ti: None if "__pycache__" in ti.name or ti.name.endswith(".pyc") else ti)
        for name in PACKED_IF_PRESENT:
            if (checkout / name).is_file():
                tar.add(checkout / name, arcname=name)
    tmp.replace(archive)


def unpack(archive: Path) -> Path:
    """An archive made by --pack, unpacked once into a directory beside it (named after it)."""
    if not archive.is_file():
        raise SystemExit(f"--megatron-lm {archive}: no such archive")
    dest = archive.with_name(archive.name.removesuffix(".tar.gz"))
    if not (dest / "tests" / "unit_tests").is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        tmp.replace(dest)
    return dest


def expand(checkout: Path, patterns: list[str]) -> list[str]:
    """Test files relative to the checkout; a pattern with ``*`` names the test_*.py files it matches."""
    files = []
    for pattern in patterns:
        if "*" not in pattern:
            files.append(pattern)
            continue
        found = sorted(str(p.relative_to(checkout)) for p in checkout.glob(pattern) if p.name.startswith("test_"))
        if not found:
            raise SystemExit(f"{pattern}: no test file matches in {checkout}")
        files.extend(found)
    return files


def run_file(checkout: Path, test_file: str, world: int, timeout: float, hang_timeout: float,
             extra_path: list[str], pytest_args: list[str], suite: str = "megatron", devices: str = "cpu",
             slots: int = 1, logs: Path | None = None, launch_args: list[str] | None = None) -> dict:
    """One launch: every rank runs ``test_file`` (for the torch suite: the tests whose names contain it);
    returns per-rank results and how the job ended. ``logs``: keep the job's logs (launcher output, rank
    logs, prism's reports, the trace's manifest: swaps, admissions, groups) in a directory of this file's
    own there. ``launch_args``: more options for ``prism-megatron launch`` (e.g. ``--swap none``)."""
    with tempfile.TemporaryDirectory(prefix="prism-peer-") as tmp:
        out = Path(tmp) / "out"
        out.mkdir()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(checkout), *extra_path,
                                                           os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   PYTHONUNBUFFERED="1")
        mode = ["--cpu-mode"] if devices == "cpu" else []
        cmd = [sys.executable, "-m", "prism_megatron", "launch", "-w", str(world), "--devices", devices,
               "--slots-per-device", str(slots), "--hang-timeout", str(hang_timeout),
               "--trace-dir", str(Path(tmp) / "trace"), "--log-ranks", "none", *(launch_args or []),
               *([str(HERE / "rank_pytest.py"), str(out), *mode, "--", test_file, *pytest_args]
                 if suite == "megatron" else [str(HERE / "rank_torch.py"), str(out), test_file])]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err = p.communicate(timeout=timeout)
            code = p.returncode
        except subprocess.TimeoutExpired:  # the launcher ends its job (ranks, coordinator, segments) on SIGTERM
            p.send_signal(signal.SIGTERM)
            try:
                _, err = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            code, err = "timeout", f"{err}\nrun_peer_suite: ended at the time limit ({timeout:.0f} s)"
        wall = time.perf_counter() - t0
        manifest = Path(tmp) / "trace" / "manifest.json"
        job = json.loads(manifest.read_text()).get("job", {}) if manifest.is_file() else {}
        ranks = {}
        for r in range(world):
            f = out / f"rank-{r}.json"
            if f.exists():
                ranks[r] = json.loads(f.read_text())
        if logs is not None:
            keep = logs / safe_name(test_file)
            if (Path(tmp) / "trace.logs").is_dir():
                shutil.copytree(Path(tmp) / "trace.logs", keep, dirs_exist_ok=True)
            keep.mkdir(parents=True, exist_ok=True)
            (keep / "launcher.txt").write_text(err)
            if manifest.is_file():
                shutil.copy(manifest, keep / "trace-manifest.json")
        return {"file": test_file, "exit": code, "wall_s": wall, "ranks": ranks, "stderr_tail": err[-4000:],
                "swap": job.get("swap") or {}, "admission": job.get("admission") or {}}


def safe_name(test_file: str) -> str:
    return re.sub(r"[^\w.-]+", "_", test_file)


def summarize(res: dict, world: int, on_gpu: bool = False) -> list[str]:
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
        lines.append(f"    rank {r}: {n['passed']} passed, {n['failed'] + n['error']} failed, {n['skipped']} skipped"
                     + ("  (so far: the file did not end)" if d.get("exit", 0) is None else ""))
        for t in d["tests"]:
            if t["outcome"] in ("failed", "error"):
                cause = attribute(f"{t['id']}\n{t['text']}", on_gpu)  # the id names TE parametrizations
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
    swapped = _swaps(res.get("swap") or {})
    if swapped:  # prism's cost, not the tests': on a GPU each swap is a process checkpoint or restore
        names = {"own": "own peak", "class": "class peak", "estimate": "prism's estimate, no peak known",
                 "bound": "bound, no peak or estimate known"}
        turns = ", ".join(f"{names.get(k, k)} {v}" for k, v in (res.get("admission") or {}).items())
        lines.append(f"    prism {swapped}" + (f"; slot turns admitted by {turns}" if turns else ""))
    unfinished = len(res["ranks"]) < world or any(d.get("exit", 0) is None for d in res["ranks"].values())
    if res["exit"] != 0 and unfinished:
        why = _job_end(res["stderr_tail"])
        cause = "prism" if "prism" in why and "hang" not in why else "see report"
        lines.append(f"    JOB ENDED (exit {res['exit']}): {why} [{cause}]")
    return lines


def _swaps(swap: dict) -> str | None:
    """The trace's swap line (prism's trace summary, from this repository wherever the harness runs)."""
    if not swap:
        return None
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from prism_megatron.trace.summary import swap_summary

    return swap_summary(swap)


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
    ap.add_argument("files", nargs="*", help="test files, relative to the Megatron-LM checkout, or patterns with * "
                    "(--suite torch: substrings of DistributedTest test names, one launch each)")
    ap.add_argument("--suite", choices=("megatron", "torch"), default="megatron",
                    help="torch: PyTorch's own process-group tests from the torch wheel, BACKEND=gloo")
    ap.add_argument("--megatron-lm", help="an existing Megatron-LM checkout, or an archive made by --pack "
                    "(default: clone --tag into the cache)")
    ap.add_argument("--pack", metavar="ARCHIVE", help="write what the peer files need from the checkout to "
                    "ARCHIVE (.tar.gz), for a machine that cannot fetch it, and stop")
    ap.add_argument("--tag", default=TAG)
    ap.add_argument("--world-size", "-w", type=int, default=8)
    ap.add_argument("--devices", default="cpu", help="cpu (CPU execution mode), or CUDA device indices: 0 or 0,1")
    ap.add_argument("--slots-per-device", type=int, default=1, help="ranks that compute at once on each device")
    ap.add_argument("--jobs", "-j", type=int, default=1, help="launches (files) run at once")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per file")
    ap.add_argument("--deadline", type=float, help="seconds for the whole run: a file not started by then is "
                    "listed as not run, one still running is ended then")
    ap.add_argument("--hang-timeout", type=float, default=120)
    ap.add_argument("--path", action="append", default=[], help="more PYTHONPATH entries (test-only packages)")
    ap.add_argument("--out", help="also write the table here")
    ap.add_argument("--raw", help="also write each file's per-rank results (JSON) into this directory")
    ap.add_argument("--logs", help="keep each file's logs (launcher output, rank logs, reports) in this directory")
    ap.add_argument("--pytest-arg", action="append", default=[], help="passed to pytest (repeatable)")
    ap.add_argument("--launch-arg", action="append", default=[], help="passed to prism-megatron launch "
                    "(repeatable; e.g. --launch-arg=--swap --launch-arg=none)")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    on_gpu = a.devices != "cpu"
    if a.suite == "megatron":
        checkout = megatron_checkout(a.megatron_lm, a.tag)
        if a.pack:
            pack(checkout, Path(a.pack))
            print(f"wrote {a.pack} ({Path(a.pack).stat().st_size / 2**20:.1f} MiB)")
            return 0
        where = (f"on CUDA device(s) {a.devices}, {a.slots_per_device} slot(s) per device" if on_gpu
                 else "on CPU (CPU mode)")
        launch = f", launch {' '.join(a.launch_arg)}" if a.launch_arg else ""
        head = [f"peer suite: Megatron-LM {a.tag} at {checkout.name}, {a.world_size} logical ranks {where}{launch}, "
                f"python {sys.version.split()[0]}", ""]
        files = expand(checkout, a.files)
    else:
        import torch

        checkout = Path(tempfile.gettempdir())
        head = [f"peer suite: torch {torch.__version__} DistributedTest (BACKEND=gloo), {a.world_size} logical ranks "
                f"on CPU, python {sys.version.split()[0]}", ""]
        files = a.files
    if not files:
        ap.error("no test files given")
    print("\n".join(head), flush=True)

    done: dict[str, list[str]] = {}
    lock = threading.Lock()

    def table(footer: str) -> None:
        """The table so far, in the files' order (rewritten as files end: a run cut short keeps what it had)."""
        if not a.out:
            return
        body = [line for f in files for line in done.get(f, [])]
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(a.out).with_suffix(".tmp")
        tmp.write_text("\n".join([*head, *body, footer]) + "\n")
        tmp.replace(a.out)

    def one(f: str) -> None:
        left = None if a.deadline is None else a.deadline - (time.monotonic() - t_start)
        if left is not None and left < 30:  # too little time to start 8 ranks and collect
            block = [f"{f}  (not run: the run's deadline of {a.deadline:.0f} s had passed)", ""]
        else:
            print(f"running {f} ...", file=sys.stderr, flush=True)
            res = run_file(checkout, f, a.world_size, a.timeout if left is None else min(a.timeout, left),
                           a.hang_timeout, a.path, a.pytest_arg, a.suite, a.devices, a.slots_per_device,
                           Path(a.logs) if a.logs else None, a.launch_arg)
            if a.raw:
                Path(a.raw).mkdir(parents=True, exist_ok=True)
                (Path(a.raw) / (safe_name(f) + ".json")).write_text(json.dumps(res))
            block = [f"{f}  ({res['wall_s']:.0f} s wall, exit {res['exit']})", *summarize(res, a.world_size, on_gpu),
                     ""]
        print("\n".join(block), flush=True)
        with lock:
            done[f] = block
            table(f"(so far: {len(done)} of {len(files)} files, {time.monotonic() - t_start:.0f} s)")

    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:  # each file is its own launch (a subprocess)
        list(pool.map(one, files))
    table(f"total wall: {time.monotonic() - t_start:.0f} s ({len(files)} files, {max(1, a.jobs)} at once)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
