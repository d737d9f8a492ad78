"""dist.all_gather_coalesced under prism gives what gloo gives, as one coalesced all_gather per call."""

from __future__ import annotations

import json

import torch

from conftest import PROGRAMS, torchrun
from prism_megatron.launcher.config import LaunchConfig
from prism_megatron.launcher.launch import launch
from prism_megatron.trace import read_trace

W = 3


def _load(d) -> list[dict]:
    return [torch.load(d / f"rank-{r}.pt") for r in range(W)]


def test_all_gather_coalesced_as_gloo(tmp_path):
    g = torchrun(W, PROGRAMS / "gather_coalesced.py", str(tmp_path / "gloo"), cwd=tmp_path)
    assert g.returncode == 0, g.stdout[-3000:] + g.stderr[-3000:]
    # in-process (ranks fork from this one: no interpreter start per rank)
    code = launch(LaunchConfig(PROGRAMS / "gather_coalesced.py", script_args=[str(tmp_path / "prism")], world_size=W,
                               trace_dir=tmp_path / "trace", log_ranks=[], hang_timeout=60).validate())
    assert code == 0, f"exit {code}; logs in {tmp_path / 'trace'}.logs"
    want, got = _load(tmp_path / "gloo"), _load(tmp_path / "prism")
    for r in range(W):
        assert got[r].keys() == want[r].keys(), r
        for key, w in want[r].items():
            assert got[r][key].dtype == w.dtype and torch.equal(got[r][key], w), f"rank {r} {key}"
    assert all(want[r]["refused"].item() == 1 for r in range(W))
    # each call is one all_gather of its inputs into flat buffers, inputs then outputs (a coalesced record)
    trace = read_trace(tmp_path / "trace")
    gathers = [json.loads(o["shapes"]) for o in trace.ops_for_rank(1) if o["kind"] == "all_gather"]
    assert gathers == [[[1], [2, 2], [3, 3, 3], [3], [12], [81]],
                       [[2, 2], [0], [3], [0], [12], [0], [9], [0]],
                       [[100_000], [7], [300_000], [21]],
                       [[4], [2, 3], [4], [6]]]
