"""bench/peer/run_peer_suite.py: launcher options reach each file's launch, and the swaps prism made in a
file's job are shown beside its results (on a GPU they, not the tests, can be most of a file's time)."""

from __future__ import annotations

from tests.bench_scripts import load_bench


def _tool():
    return load_bench('peer/run_peer_suite.py')


def _result(swap: dict, admission: dict) -> dict:
    tests = [{"id": "t.py::test_a", "outcome": "passed", "text": "", "s": 0.1}]
    return {"file": "t.py", "exit": 0, "wall_s": 1.0, "stderr_tail": "", "swap": swap, "admission": admission,
            "ranks": {r: {"rank": r, "exit": 0, "tests": tests} for r in range(2)}}


def test_summary_names_the_jobs_swaps_and_how_turns_were_admitted():
    tool = _tool()
    swap = {"0": {"swaps_out": 3, "swaps_in": 2, "bytes_out": 3 << 30, "bytes_in": 2 << 30, "seconds": 1.5},
            "1": {"swaps_out": 1, "swaps_in": 1, "bytes_out": 1 << 30, "bytes_in": 1 << 30, "seconds": 0.5}}
    lines = tool.summarize(_result(swap, {"own": 0, "class": 1, "estimate": 2, "bound": 9}), 2)
    line = [ln for ln in lines if "swaps" in ln]
    assert len(line) == 1
    assert "swaps: 4 out, 3 in, 7.0 GiB moved" in line[0] and "rank 0" in line[0]
    assert "no peak or estimate known 9" in line[0] and "class peak 1" in line[0]
    assert "prism's estimate, no peak known 2" in line[0]


def test_no_swap_line_where_the_job_swapped_nothing():
    tool = _tool()
    assert not [ln for ln in tool.summarize(_result({}, {"own": 0, "class": 0, "bound": 4}), 2) if "swap" in ln]


def test_launch_args_reach_every_files_launch(tmp_path, monkeypatch):
    tool = _tool()
    seen = []

    def fake_run_file(checkout, test_file, *args):
        seen.append((test_file, args[-1]))
        return _result({}, {})

    monkeypatch.setattr(tool, "run_file", fake_run_file)
    monkeypatch.setattr(tool, "megatron_checkout", lambda path, tag: tmp_path)
    monkeypatch.setattr(tool, "expand", lambda checkout, files: files)
    out = tmp_path / "table.txt"
    assert tool.main(["a.py", "b.py", "--devices", "0", "--launch-arg=--swap", "--launch-arg=none",
                      "--out", str(out)]) == 0
    assert seen == [("a.py", ["--swap", "none"]), ("b.py", ["--swap", "none"])]
    assert "launch --swap none" in out.read_text()
