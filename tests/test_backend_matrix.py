"""The prism backend gives the results real gloo gives, for every supported op, with 1 and 2 slots."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import PROGRAMS, prism, torchrun
from prism_megatron.trace import read_trace
from programs.matrix_tolerance import ORDER_DEPENDENT, tolerance

W = 8


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory) -> list[dict]:
    d = tmp_path_factory.mktemp("gloo")
    p = torchrun(W, PROGRAMS / "op_matrix.py", str(d / "out"), cwd=d)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return [torch.load(d / "out" / f"rank-{r}.pt") for r in range(W)]


def _run_prism(tmp: Path, slots: int) -> tuple[list[dict], Path]:
    p = prism("launch", "--world-size", str(W), "--slots-per-device", str(slots), "--hang-timeout", "60",
              "--trace-dir", str(tmp / "trace"), "--log-ranks", "none", str(PROGRAMS / "op_matrix.py"),
              str(tmp / "out"), cwd=tmp)
    assert p.returncode == 0, p.stderr[-4000:]
    return [torch.load(tmp / "out" / f"rank-{r}.pt") for r in range(W)], tmp / "trace"


@pytest.mark.parametrize("slots", [1, 2])
def test_same_results_as_gloo(gloo_results, tmp_path, slots):
    results, trace_dir = _run_prism(tmp_path, slots)
    checked = 0
    for r in range(W):
        assert results[r].keys() == gloo_results[r].keys()
        for key, want in gloo_results[r].items():
            got = results[r][key]
            assert got.dtype == want.dtype and got.shape == want.shape, key
            if key.startswith(ORDER_DEPENDENT):
                tol = tolerance(want.dtype)
                torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=key)
            else:
                assert torch.equal(got, want), f"rank {r} {key}: {got} != {want}"
            checked += 1
    assert checked > 40 * W

    trace = read_trace(trace_dir)
    assert trace.world_size == W
    kinds = set(trace.ops.column("kind").to_pylist())
    assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "barrier"} <= kinds
    # every rank's ops are numbered 0..n-1 and the compute time (the rank's own clock) is non-negative
    for r in range(W):
        ops = trace.ops_for_rank(r)
        assert [o["index"] for o in ops] == list(range(len(ops)))
        assert all(o["compute_before"] >= 0 and o["t_complete"] >= o["t_issue"] for o in ops)
    slots_tbl = trace.slots.to_pylist()
    assert {s["slot"] for s in slots_tbl} == set(range(slots))
    # never more than `slots` ranks computing at once
    events = sorted([(s["t_grant"], 1) for s in slots_tbl] + [(s["t_release"], -1) for s in slots_tbl],
                    key=lambda e: (e[0], e[1]))
    level = peak = 0
    for _, d in events:
        level += d
        peak = max(peak, level)
    assert peak <= slots
