"""One logical rank running PyTorch's own process-group test suite (``DistributedTest._DistTestBase`` in
``torch.testing._internal.distributed.distributed_test``, shipped in the torch wheel) against the backend
named by BACKEND (default gloo), as prism's logical rank: torch's harness spawns its own processes, so
here each rank makes the test case itself, with its RANK, in one process group for the whole run.

Usage: rank_torch.py OUT PATTERN[,PATTERN...] ; writes OUT/rank-R.json as rank_pytest.py does. A test
runs when its name contains one of the PATTERNs and none of the ``!PATTERN``s. torch's file-based
barrier (processes polling files) becomes ``dist.barrier()``: polling ranks would hold every compute slot.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time
import traceback
import unittest
from pathlib import Path


def main() -> int:
    out = Path(sys.argv[1])
    patterns = [p for arg in sys.argv[2:] for p in arg.split(",") if p]
    keep, drop = [p for p in patterns if not p.startswith("!")], [p[1:] for p in patterns if p.startswith("!")]
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="prism-torch-peer-"))
    for d in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(os.environ["TEMP_DIR"], d), exist_ok=True)
    import torch.distributed as dist
    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import TestCase
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    skip_codes = {s.exit_code: s.message for s in TEST_SKIPS.values()}  # torch's decorators skip by exiting

    class Suite(DistributedTest._DistTestBase, TestCase):
        def _barrier(self, *args, **kwargs) -> None:
            dist.barrier()

        @property
        def world_size(self) -> str:
            return str(world)

    dist.init_process_group(os.environ["BACKEND"])
    names = sorted(n for n in dir(Suite) if n.startswith("test_") and any(p in n for p in keep)
                   and not any(p in n for p in drop))
    tests = []
    t0 = time.perf_counter()
    for name in names:
        case = Suite(name)
        case.rank = rank
        result = unittest.TestResult()
        t = time.perf_counter()
        case.run(result)
        entry = {"id": name, "outcome": "passed", "text": "", "s": time.perf_counter() - t}
        text = "\n".join(tb for _, tb in result.errors + result.failures)
        code = re.search(r"SystemExit: (\d+)\s*$", text)
        if code and int(code.group(1)) in skip_codes:
            entry["outcome"] = "skipped"
            entry["text"] = skip_codes[int(code.group(1))]
        elif text:
            entry["outcome"] = "failed"
            entry["text"] = text[-6000:]
        elif result.skipped:
            entry["outcome"] = "skipped"
            entry["text"] = result.skipped[0][1][-500:]
        tests.append(entry)
        try:
            dist.barrier()  # the next test starts together, as under torch's harness
        except Exception:  # the job is ending (a mismatch elsewhere): keep what we have
            tests.append({"id": "<barrier>", "outcome": "failed", "text": traceback.format_exc(), "s": 0.0})
            break
    result = {"rank": rank, "exit": 0, "wall_s": time.perf_counter() - t0, "tests": tests}
    tmp = out / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.replace(out / f"rank-{rank}.json")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
