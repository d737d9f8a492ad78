"""`prism-megatron replay` and `cluster` on a real captured trace."""

from __future__ import annotations

import json
import math

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

    # every wait of ring.py's on its batched isend/irecv is in the trace, whether or not the op had
    # completed by then, and the graph waits there: within the iteration (from the slot log alone, one
    # that found its op complete waited after the next iteration's all_reduce)
    from prism_megatron.replay import graph_from_trace
    from prism_megatron.replay.graph import Comm, Mark, Wait
    from prism_megatron.trace import read_trace

    trace = read_trace(tmp_path / "t")
    for op in trace.ops.to_pylist():
        if op["async_op"]:
            assert op["t_issue"] <= op["t_wait"] and op["wait_clock"] >= 0, op
        else:  # synchronous: waited at issue
            assert math.isnan(op["t_wait"]) and math.isnan(op["wait_clock"]), op
    for rank, evs in graph_from_trace(trace).events.items():
        for i, ev in enumerate(evs):
            if isinstance(ev, Comm) and ev.kind == "recv":  # the batch's second op, after its send
                end = next(j for j in range(i, len(evs)) if isinstance(evs[j], Mark))  # the iteration's end
                waited = {ref for e in evs[i:end] if isinstance(e, Wait) for ref in e.refs}
                send = max(j for j in range(i) if isinstance(evs[j], Comm) and evs[j].kind == "send")
                assert waited == {send, i} and not any(isinstance(e, Comm) for e in evs[i + 1:end]), (rank, i)


def test_cluster_commands(tmp_path):
    listed = prism("cluster", "list", cwd=tmp_path)
    assert listed.returncode == 0 and "h200-nvlink-ib400" in listed.stdout
    missing = prism("cluster", "fit", str(tmp_path / "nope.log"), cwd=tmp_path)
    assert missing.returncode == 1 and "nope.log' does not exist" in missing.stderr
    bad = prism("replay", str(tmp_path), "--cluster", "no-such-cluster", cwd=tmp_path)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr


def test_each_rank_profiles_its_script_where_asked_and_says_where(tmp_path):
    """PRISM_PROFILE_RANKS=PREFIX: every rank writes PREFIX-rankR.prof of its script (the program's own functions and
    the runtime's collectives in it), and says so; unset, nothing is written."""
    import os
    import pstats
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PRISM_PROFILE_RANKS": str(tmp_path / "prof" / "p")}
    p = subprocess.run([sys.executable, "-m", "prism_megatron", "launch", "-w", "2", "--trace-dir", str(tmp_path / "t"),
                        "--log-ranks", "all", str(PROGRAMS / "ring.py"), "2"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for rank in (0, 1):
        out = tmp_path / "prof" / f"p-rank{rank}.prof"
        assert f"prism: rank {rank}: profile in {out}" in p.stderr
        functions = {(Path(file).name, name) for file, _, name in pstats.Stats(str(out)).stats}
        assert ("ring.py", "<module>") in functions
        assert any(file == "backend.py" for file, _ in functions), sorted(functions)[:20]
    q = prism("launch", "-w", "2", "--trace-dir", str(tmp_path / "t2"), "--log-ranks", "none",
              str(PROGRAMS / "ring.py"), "1", cwd=tmp_path, timeout=120)
    assert q.returncode == 0 and "profile in" not in q.stderr
