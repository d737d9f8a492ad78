"""Memory: target-GPU table, the CPU byte accountant, and the OOM-as-prediction path end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prism_megatron.megatron import cpu_mode
from prism_megatron.megatron.workload import flops_per_iteration
from prism_megatron.memory import ByteAccountant, TargetError, requested_bytes, resolve_target, untracked
from prism_megatron.memory.targets import GiB, MiB
from prism_megatron.trace import read_trace

REPO = Path(__file__).resolve().parents[1]


# ---- target GPUs -------------------------------------------------------------------------------------
def test_target_names_aliases_and_gib():
    h100 = resolve_target("H100")
    assert h100.name == "h100-80gb" and h100.capacity == 81559 * MiB
    assert h100.usable == h100.capacity - int(3.5 * GiB) and "nccl#1264" in h100.source
    custom = resolve_target("79.5", context_gib=0.5)
    assert custom.capacity == int(79.5 * GiB) and custom.context == GiB // 2 and custom.usable == 79 * GiB
    assert resolve_target("h200-141gb").as_dict()["usable"] == 143771 * MiB - int(3.5 * GiB)


@pytest.mark.parametrize("spec, context, needle", [
    ("h300-999gb", None, "'h300-999gb' is neither a known GPU"),
    ("-3", None, "'-3': the capacity must be a positive"),
    ("3", None, "leaves nothing"),
    ("h100", -1.0, "--prism-target-context -1.0"),
])
def test_target_errors_name_the_value(spec, context, needle):
    with pytest.raises(TargetError) as info:
        resolve_target(spec, context)
    assert needle in str(info.value)


# ---- the CPU byte accountant ------------------------------------------------------------------------
def test_accountant_counts_storages_once_and_frees_them():
    with ByteAccountant() as acc:
        a = torch.zeros(1000)  # 4000 bytes
        view = a.view(10, 100)  # same storage: not counted again
        b = a + 1
        assert acc.current == 8000
        del b
        assert acc.current == 4000
        del a
        assert acc.current == 4000  # the view keeps the storage alive
        del view
        assert acc.current == 0 and acc.peak == 8000
        with untracked():
            c = torch.ones(500)
        assert acc.current == 0
        del c


def test_accountant_counts_backward_and_in_place_growth():
    with ByteAccountant() as acc:
        x = torch.randn(256, requires_grad=True)
        (x * 2).sum().backward()
        assert acc.current >= 2 * 256 * 4  # x and x.grad at least
        buf = torch.empty(0)
        base = acc.current
        buf.resize_(1024)
        assert acc.current == base + 4096


def _model_forward() -> torch.Tensor:
    return torch.ones(1 << 20)  # 4 MiB: the failing request


def _train_step() -> torch.Tensor:
    try:
        return _model_forward()
    except torch.OutOfMemoryError as e:
        raise RuntimeError("step failed") from e  # as Megatron re-raises some errors


def test_an_oom_site_is_the_programs_innermost_frames_not_torchs_or_prisms():
    """The report's "asked for at": the OOM's own traceback (through a wrapping re-raise), the program's frames
    outermost first, without the accountant's or torch's dispatch frames, paths from their import root."""
    import inspect

    from prism_megatron.memory.probe import allocation_site

    with ByteAccountant(cap=1024):
        with pytest.raises(RuntimeError) as info:
            _train_step()
    step_line = inspect.getsourcelines(_train_step)[1] + 2
    forward_line = inspect.getsourcelines(_model_forward)[1] + 1
    site = allocation_site(info.value)
    assert site == [f"test_memory.py:{step_line} (_train_step)", f"test_memory.py:{forward_line} (_model_forward)"]
    assert allocation_site(info.value, depth=1) == site[-1:]


def test_accountant_raises_torch_oom_above_cap_and_keeps_peak_honest():
    with ByteAccountant(cap=10_000) as acc:
        keep = torch.zeros(2000)  # 8000 bytes
        with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 0.00 MiB"):
            torch.zeros(1000)  # +4000 > cap
        assert acc.failed == 4000
        assert acc.peak == 8000  # the failed allocation never counted as held
        assert acc.current == 8000
        del keep


def test_requested_bytes_from_cuda_message():
    msg = "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.10 GiB"
    assert requested_bytes(msg) == 20 * MiB
    assert requested_bytes("Tried to allocate 1.50 GiB") == int(1.5 * GiB)
    assert requested_bytes("something else") is None


def test_capped_gpu_rank_records_no_traceback_per_allocation(monkeypatch, tmp_path):
    """A capped GPU rank's allocator history is the OOM snapshot's, recorded inside every measured
    compute segment: with a traceback per allocation and free (PyTorch's default context) that host
    work became the target's compute (thousands of events per micro-batch). Events only, and the cap
    still applies."""
    import inspect

    from prism_megatron.memory.probe import MemoryProbe

    calls: dict[str, object] = {}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"total_memory": 140 * GiB})())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: calls.update(fraction=fraction))
    record = torch.cuda.memory._record_memory_history

    def recorded(*args, **kwargs):
        bound = inspect.signature(record).bind(*args, **kwargs)
        bound.apply_defaults()
        calls["history"] = dict(bound.arguments)

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", recorded)
    MemoryProbe(0, on_gpu=True, cap=70 * GiB, snapshot_dir=tmp_path).install()
    assert calls["fraction"] == pytest.approx(0.5)
    history = calls["history"]
    assert history["enabled"] == "all" and history["max_entries"] > 0  # the snapshot keeps its timeline
    assert history["context"] is None, f"a traceback per allocation is recorded: context={history['context']!r}"


def test_flops_match_the_classic_gpt_formula():
    """72·B·s·L·h²·(1 + s/(6h) + V/(12·L·h)) for MHA, 4h MLP, no recompute (Narayanan et al., 2021)."""
    class Args:
        hidden_size, num_layers, seq_length, num_attention_heads, global_batch_size = 1024, 8, 2048, 16, 32
        kv_channels = ffn_hidden_size = num_query_groups = num_experts = None
        group_query_attention = swiglu = False

    B, s, L, h, V = 32, 2048, 8, 1024, 32000
    classic = 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
    assert flops_per_iteration(Args, V) == pytest.approx(classic, rel=1e-12)
    Args.swiglu = True
    assert flops_per_iteration(Args, V) > classic  # a third MLP matrix


# ---- end to end: a mini recipe under a byte budget ---------------------------------------------------
_CPU_ONLY = pytest.mark.skipif(cpu_mode._gpu_present(), reason="CPU-mode runs refuse a GPU")


def _run(tmp_path: Path, name: str, cap_gib: str) -> tuple[subprocess.CompletedProcess, Path]:
    trace = tmp_path / name
    # --prism-fold off: the full capture a fold auto chooses here, without planning it (Megatron's parser in
    # a child interpreter: seconds); the fold's choice is test_fold_megatron's
    cmd = [sys.executable, "-m", "prism_megatron", "run", "--recipe", "mini-dense-tp2pp2", "--prism-driver", "core",
           "--prism-trace-dir", str(trace), "--prism-target-gpu", cap_gib, "--prism-target-context", "0",
           "--prism-report", "off", "--prism-fold", "off"]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env), trace


def _marks(trace: Path, name: str) -> list[tuple[int, dict]]:
    return [(m["rank"], json.loads(m["attrs"])) for m in read_trace(trace).marks.to_pylist() if m["name"] == name]


@_CPU_ONLY
@pytest.mark.megatron
def test_budget_run_records_memory_and_an_oom_is_a_prediction(tmp_path):
    ok, trace = _run(tmp_path, "fits", "0.05")  # 50 MiB: the mini model needs ~5 MiB per rank
    assert ok.returncode == 0, ok.stderr[-3000:]
    memory = _marks(trace, "memory")
    per_rank = {r: [a for rr, a in memory if rr == r] for r in range(4)}
    cap = int(0.05 * GiB)
    for r, marks in per_rank.items():
        assert [a["iteration"] for a in marks] == [1, 2, 3, None], (r, marks)
        assert all(a["source"] == "cpu-accountant" and a["cap"] == cap for a in marks)
        assert 0 < marks[-1]["max_allocated"] <= cap
        assert all(a["allocated"] <= a["max_allocated"] for a in marks)
    layouts = dict(_marks(trace, "layout"))
    assert {(a["pp"], a["tp"]) for a in layouts.values()} == {(0, 0), (0, 1), (1, 0), (1, 1)}
    need = max(a["max_allocated"] for _, a in memory)

    oom, trace2 = _run(tmp_path, "ooms", str(need * 0.75 / GiB))  # three quarters of what the job needs
    assert oom.returncode == 5, oom.stderr[-3000:]
    assert "ran out of memory under the target's cap: predicted OOM" in oom.stderr
    ooms = _marks(trace2, "oom")
    assert ooms, "the OOM verdict must reach the trace"
    cap2 = int(need * 0.75 / GiB * GiB)
    for _rank, a in ooms:
        assert a["cap"] == cap2 and a["requested"] > 0
        assert a["allocated"] <= cap2 < a["allocated"] + a["requested"] or a["max_allocated"] <= cap2
        assert "prism CPU-mode budget: tried to allocate" in a["message"]
        # where the program asked: Megatron's frames, shown from their import root (no machine's directories)
        assert a["where"] and any(f.startswith("megatron/") for f in a["where"]), a["where"]
        assert not any(f.startswith("/") or "torch/" in f for f in a["where"]), a["where"]
    exit_codes = {e["rank"]: e["exit_code"] for e in read_trace(trace2).manifest["ranks"]}
    assert any(exit_codes[r] == 5 for r, _ in ooms)
    assert read_trace(trace2).manifest["job"]["target_gpu"]["usable"] == cap2


# ---- Megatron's --fake-process-group anchor ---------------------------------------------------------
def test_megatron_memory_lines_are_parsed_per_rank():
    from prism_megatron.megatron.anchors import parse_memory_lines

    text = ("[Rank 2] (after 1 iterations) memory (MB) | allocated: 1.53 | max allocated: 2.50 | reserved: 1.53 | "
            "max reserved: 2.50\nnoise\n[Rank 0] (after 2 iterations) memory (MB) | allocated: 9.00 | max allocated: "
            "9.50 | reserved: 10.00 | max reserved: 12.00\n[Rank 2] (after 2 iterations) memory (MB) | allocated: "
            "1.53 | max allocated: 3.20 | reserved: 1.53 | max reserved: 3.25 | total device memory used: 99.00\n")
    assert parse_memory_lines(text, 2) == {"iteration": 2, "max_allocated": int(3.2 * MiB),
                                           "max_reserved": int(3.25 * MiB)}
    assert parse_memory_lines(text, 0)["max_reserved"] == 12 * MiB
    assert parse_memory_lines(text, 1) is None


@_CPU_ONLY
def test_fake_pg_anchor_beside_the_measured_peak(published_run, tmp_path):
    """Dense job: Megatron's fake process group and our emulation agree on each class's peak (as on the
    H200, device-notes); the report carries both; a broken anchor file is named in the error. (The run is
    test_publish's too: ``published_run``.)"""
    import shutil

    from prism_megatron.report import build_report
    from prism_megatron.trace import TraceFormatError

    p = published_run["proc"]
    assert p.returncode == 0, p.stderr[-3000:]
    shutil.copytree(published_run["dir"] / "prism-trace", tmp_path / "prism-trace")  # this test breaks its copy
    anchors = json.loads((tmp_path / "prism-trace" / "fake-pg-anchor.json").read_text())
    assert [(a["rank"], a["class"]) for a in anchors["ranks"]] == [(0, "stage 0 of 2 (first)"),
                                                                  (2, "stage 1 of 2 (last)")]
    report = json.loads((tmp_path / "prism-trace" / "report.json").read_text())
    for a in report["anchors"]["fake_pg"]:
        assert a["max_allocated"] == pytest.approx(a["measured_max_allocated"], rel=0.01), a
    assert "Megatron --fake-process-group, rank 2 (stage 1 of 2 (last))" in p.stdout
    (tmp_path / "prism-trace" / "fake-pg-anchor.json").write_text('{"format": "other"}')
    with pytest.raises(TraceFormatError, match="fake-pg-anchor.json: field 'format'/'version'"):
        build_report(tmp_path / "prism-trace")


def test_formula_args_read_flags_the_driver_never_parsed_as_off():
    """Megatron's memory formula reads flags each version adds (0.19: hybrid_layer_pattern); a core-driver
    namespace lacks them: they read as their default, else None, instead of failing the estimate."""
    from prism_megatron.megatron.workload import _FORMULA_DEFAULTS, _FormulaArgs

    ns = _FormulaArgs(**{**_FORMULA_DEFAULTS, "hidden_size": 64})
    assert ns.hidden_size == 64 and ns.swiglu is False
    assert ns.hybrid_layer_pattern is None and getattr(ns, "some_future_flag", "x") is None
    with pytest.raises(AttributeError):
        ns.__missing_dunder__  # noqa: B018 - dunders stay real attribute errors (copy, pickle)
