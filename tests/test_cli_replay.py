"""`prism-megatron replay` and `cluster` on a real captured trace."""

from __future__ import annotations

import json

from conftest import PROGRAMS, prism


def test_capture_then_replay(tmp_path):
    p = prism("launch", "-w", "4", "--trace-dir", str(tmp_path / "t"), "--log-ranks", "none",
              str(PROGRAMS / "ring.py"), "3", cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    r = prism("replay", str(tmp_path / "t"), "--cluster", "h100-nvlink-ib400", "--chrome", str(tmp_path / "p.json"),
              cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count("iteration ") == 3  # ring.py marks 3 iterations
    assert "critical path" in out and "costed by cluster profile h100-nvlink-ib400" in out
    events = json.loads((tmp_path / "p.json").read_text())["traceEvents"]
    assert {0, 1, 2, 3} <= {e["pid"] for e in events if e.get("ph") == "X"}


def test_cluster_commands(tmp_path):
    listed = prism("cluster", "list", cwd=tmp_path)
    assert listed.returncode == 0 and "h200-nvlink-ib400" in listed.stdout
    missing = prism("cluster", "fit", str(tmp_path / "nope.log"), cwd=tmp_path)
    assert missing.returncode == 1 and "nope.log' does not exist" in missing.stderr
    bad = prism("replay", str(tmp_path), "--cluster", "no-such-cluster", cwd=tmp_path)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
