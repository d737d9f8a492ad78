"""One logical rank of a peer-suite run: run a test file with pytest and write what happened to each test.

Started by ``prism-megatron launch`` (bench/peer/run_peer_suite.py), so every rank runs the same file
with its own RANK; each writes OUT/rank-R.json: {"tests": [{"id", "outcome", "text"}], "exit"}.
``--cpu-mode`` turns on prism's CPU execution mode first (what ``prism-megatron run`` does on a
machine without a GPU). Usage: rank_pytest.py OUT [--cpu-mode] -- PYTEST_ARGS...
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


class Collector:
    """pytest plugin: the outcome of each test (setup, call and teardown folded; the worst wins), written
    after every test (``"exit": null`` until the file ends), so a job ended early still says how far it got."""

    def __init__(self, out: Path, rank: int) -> None:
        self.tests: dict[str, dict] = {}
        self.out, self.rank, self.t0 = out, rank, time.perf_counter()

    def write(self, code: int | None) -> None:
        result = {"rank": self.rank, "exit": code, "wall_s": time.perf_counter() - self.t0,
                  "tests": list(self.tests.values())}
        tmp = self.out / f".rank-{self.rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.replace(self.out / f"rank-{self.rank}.json")

    def pytest_runtest_logreport(self, report) -> None:  # noqa: ANN001 - pytest's hook signature
        t = self.tests.setdefault(report.nodeid, {"id": report.nodeid, "outcome": "passed", "text": "", "s": 0.0})
        t["s"] += report.duration
        # Megatron's CI deselects these (tests/unit_tests/run_ci_test.sh): known to fail upstream
        t["upstream_marks"] = sorted(k for k in ("flaky", "flaky_in_dev", "internal", "experimental")
                                     if k in report.keywords)
        if report.failed:
            t["outcome"] = "failed" if report.when == "call" or t["outcome"] != "failed" else t["outcome"]
            t["text"] += f"[{report.when}] {report.longreprtext[-6000:]}\n"
        elif report.skipped and t["outcome"] == "passed":
            t["outcome"] = "skipped"
            t["text"] = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)[-500:]
        if report.when == "teardown":
            self.write(None)

    def pytest_collectreport(self, report) -> None:  # noqa: ANN001
        if report.failed:
            self.tests[report.nodeid or "<collection>"] = {"id": report.nodeid or "<collection>", "outcome": "error",
                                                            "text": report.longreprtext[-6000:], "s": 0.0}


def main() -> int:
    out = Path(sys.argv[1])
    rest = sys.argv[2:]
    cpu = "--cpu-mode" in rest[: rest.index("--")]
    args = rest[rest.index("--") + 1:]
    if sys.version_info < (3, 12):  # Megatron-LM's training package (imported by its test utilities) needs 3.12
        import typing

        import typing_extensions

        typing.override = getattr(typing, "override", typing_extensions.override)
    if cpu:
        from prism_megatron.megatron.cpu_mode import enable_cpu_mode

        enable_cpu_mode()
    import pytest

    collector = Collector(out, int(os.environ.get("RANK", "0")))
    code = pytest.main(["-p", "no:cacheprovider", "-q", "-rN", *args], plugins=[collector])
    collector.write(int(code))
    # a failed test leaves the job's other ranks as they are: the file's result is in, so end cleanly
    return 0


if __name__ == "__main__":
    sys.exit(main())
