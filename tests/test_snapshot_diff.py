"""bench/gpu/snapshot_diff.py on synthetic allocator histories, and the snapshot switch off the GPU."""

from __future__ import annotations

import pickle

import pytest
from bench_scripts import load_bench

MiB = 1 << 20


def _frames(*names):
    return [{"filename": f"/x/{n}.py", "line": i + 1, "name": n} for i, n in enumerate(names)]


def _dump(path, events):
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[], events]}))
    return path


def _history(extra_segment: bool):
    """Two 20 MiB segments for the weights; optionally a third where the allocator could not reuse a freed
    block (the run's reserved grows, its allocated does not)."""
    w, a = _frames("weights", "build"), _frames("activation", "forward")
    ev = [{"action": "segment_alloc", "addr": 0, "size": 20 * MiB, "frames": w},
          {"action": "alloc", "addr": 0, "size": 20 * MiB, "frames": w},
          {"action": "segment_alloc", "addr": 100 * MiB, "size": 20 * MiB, "frames": a},
          {"action": "alloc", "addr": 100 * MiB, "size": 8 * MiB, "frames": a},
          {"action": "free_requested", "addr": 100 * MiB, "size": 8 * MiB, "frames": a},
          {"action": "free_completed", "addr": 100 * MiB, "size": 8 * MiB, "frames": a}]
    if extra_segment:
        ev.append({"action": "segment_alloc", "addr": 200 * MiB, "size": 20 * MiB, "frames": a})
        addr = 200 * MiB
    else:
        addr = 100 * MiB
    ev += [{"action": "alloc", "addr": addr, "size": 8 * MiB, "frames": a},
           {"action": "free_requested", "addr": addr, "size": 8 * MiB, "frames": a}]
    return ev


def test_reserved_peaks_differ_where_one_run_grew_its_cache_and_allocated_peaks_agree(tmp_path, capsys):
    sd = load_bench("gpu/snapshot_diff.py")
    first = _dump(tmp_path / "a.pickle", _history(extra_segment=False))
    second = _dump(tmp_path / "b.pickle", _history(extra_segment=True))
    assert sd.main([str(first), str(second), "--names", "fakepg,prism"]) == 0
    out = capsys.readouterr().out
    allocated, reserved = out.split("== reserved")
    assert "fakepg: peak 28.00 MiB in 2 block(s)" in allocated and "prism: peak 28.00 MiB in 2 block(s)" in allocated
    assert "MiB  fakepg" not in allocated  # the same blocks under the same stacks: no difference row
    assert "fakepg: peak 40.00 MiB in 2 block(s)" in reserved and "prism: peak 60.00 MiB in 3 block(s)" in reserved
    grew = "+20.00 MiB  fakepg     20.00  prism     40.00  activation.py:1:activation < forward.py:2:forward"
    reserved, over = reserved.split("== segments reserved over the recording")
    assert grew in reserved and grew in over


def test_each_run_says_its_segments_released_and_its_reserved_over_the_recording(tmp_path, capsys):
    """A run that released its cache (a retry under its cap, or empty_cache) shows it: its released
    segments, the failed allocation, and reserved bytes that fall in its curve."""
    sd = load_bench("gpu/snapshot_diff.py")
    a = _frames("activation", "forward")
    released = _history(extra_segment=False) + [
        {"action": "oom", "addr": 0, "size": 40 * MiB, "frames": a},
        {"action": "segment_free", "addr": 100 * MiB, "size": 20 * MiB, "frames": a},
        {"action": "segment_alloc", "addr": 300 * MiB, "size": 40 * MiB, "frames": a}]
    first = _dump(tmp_path / "a.pickle", _history(extra_segment=True))
    second = _dump(tmp_path / "b.pickle", released)
    assert sd.main([str(first), str(second), "--names", "fakepg,prism"]) == 0
    out = capsys.readouterr().out
    assert "fakepg: segments reserved 3 (60 MiB), released 0 (0 MiB); failed allocations 0;" in out
    assert "prism: segments reserved 3 (80 MiB), released 1 (20 MiB); failed allocations 1;" in out
    curve = [int(x) for x in out.split("prism: segments")[1].split("recording: ")[1].splitlines()[0].split()]
    assert len(curve) == 10 and curve[-1] == 60 and 20 in curve and max(curve) == 60
    assert any(x > y for x, y in zip(curve, curve[1:], strict=False))  # it fell where the cache was released
    # the released segment and the one reserved after it both count: 20 MiB more over the recording
    assert "+20.00 MiB  fakepg     40.00  prism     60.00  activation.py:1:activation" in out


def test_the_first_request_the_two_runs_do_not_share_is_named_with_the_segments_before_it(tmp_path, capsys):
    """The same requests placed differently (one run reserved a third segment): no divergence of requests.
    One request more (a staging buffer in one run): its index, the requests around it, the segments before."""
    sd = load_bench("gpu/snapshot_diff.py")
    first = _dump(tmp_path / "a.pickle", _history(extra_segment=False))
    second = _dump(tmp_path / "b.pickle", _history(extra_segment=True))
    assert sd.main([str(first), str(second), "--names", "fakepg,prism"]) == 0
    assert "fakepg and prism: the same 5 requests" in capsys.readouterr().out
    staged = _history(extra_segment=False)
    s = _frames("stage", "collective")
    staged[6:6] = [{"action": "alloc", "addr": 60 * MiB, "size": 2 * MiB, "frames": s, "stream": 7},
                   {"action": "free_requested", "addr": 60 * MiB, "size": 2 * MiB, "frames": s, "stream": 7}]
    second = _dump(tmp_path / "c.pickle", staged)
    assert sd.main([str(first), str(second), "--names", "fakepg,prism"]) == 0
    out = capsys.readouterr().out.split("== first divergence")[1]
    assert "fakepg and prism agree on their first 3 requests (of 5 and 7)" in out
    assert "prism: 2 segment(s), 40 MiB reserved before it" in out
    assert "  >       3 alloc                2.00 MiB  stream 7  stage.py:1:stage < collective.py:2:collective" in out
    assert "  >       3 alloc                8.00 MiB  stream 0  activation.py:1:activation" in out
    assert "+1 x      2.000 MiB =       +2.0 MiB  fakepg      0  prism      1  stage.py:1:stage" in _out(
        sd, first, second, capsys).split("== allocations by size and stack")[1]


def _out(sd, first, second, capsys) -> str:
    assert sd.main([str(first), str(second), "--names", "fakepg,prism"]) == 0
    return capsys.readouterr().out


def test_a_small_request_only_one_run_makes_diverges_the_requests_but_not_the_large_pools(tmp_path, capsys):
    """A scalar allocated in one run only (a NaN check's norm): the request sequences part there, the large
    pool's (above 1 MiB, which alone places the large blocks) do not, and the extra allocation is counted."""
    sd = load_bench("gpu/snapshot_diff.py")
    first = _dump(tmp_path / "a.pickle", _history(extra_segment=False))
    checked = _history(extra_segment=False)
    n = _frames("norm", "check_grads")
    checked[4:4] = [{"action": "alloc", "addr": 90 * MiB, "size": 512, "frames": n},
                    {"action": "free_requested", "addr": 90 * MiB, "size": 512, "frames": n}]
    out = _out(sd, first, _dump(tmp_path / "b.pickle", checked), capsys)
    everything, large = out.split("== first divergence")[1:]
    assert "fakepg and prism agree on their first 2 requests (of 5 and 7)" in everything
    assert "requests above 1 MiB only" in large and "fakepg and prism: the same 5 requests" in large
    assert "+1 x      0.000 MiB =       +0.0 MiB  fakepg      0  prism      1  norm.py:1:norm" in out


def test_a_side_stream_compares_by_its_order_not_its_address(tmp_path, capsys):
    """A side stream's id is its address in each process: the same program's requests on it agree across two
    runs whose ids differ; a request moved from the default stream to a side stream does not."""
    sd = load_bench("gpu/snapshot_diff.py")

    def on(stream: int, moved: bool = False) -> list[dict]:
        trace = _history(extra_segment=False)
        for e in trace:
            if e["action"] in ("alloc", "free_requested") and (e["size"] == 8 * MiB or (moved and e["size"] > 8 * MiB)):
                e["stream"] = stream
        return trace

    first = _dump(tmp_path / "a.pickle", on(1040856704))
    assert "fakepg and prism: the same 5 requests" in _out(sd, first, _dump(tmp_path / "b.pickle", on(599137152)),
                                                            capsys)
    out = _out(sd, first, _dump(tmp_path / "c.pickle", on(599137152, moved=True)), capsys)
    assert "fakepg and prism agree on their first 0 requests (of 5 and 5)" in out


def test_a_dump_of_several_devices_and_bad_names_are_refused(tmp_path):
    sd = load_bench("gpu/snapshot_diff.py")
    two = tmp_path / "two.pickle"
    two.write_bytes(pickle.dumps({"device_traces": [_history(False), _history(False)]}))
    one = _dump(tmp_path / "one.pickle", _history(False))
    with pytest.raises(SystemExit, match=r"two.pickle: 2 devices with events, expected 1"):
        sd.main([str(two), str(one)])
    with pytest.raises(SystemExit, match=r"--names 'x,x'"):
        sd.main([str(one), str(one), "--names", "x,x"])


def test_the_snapshot_switch_records_nothing_without_a_gpu(tmp_path, monkeypatch):
    from prism_megatron.memory import snapshot

    monkeypatch.setenv(snapshot.ENV, str(tmp_path / "snap"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert snapshot.start_from_env()() is None
    assert not list(tmp_path.iterdir())
