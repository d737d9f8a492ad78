"""What `run` does after the capture: report files, terminal summary, W&B (ours and Megatron's run)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_report import make_trace

from prism_megatron.megatron import cpu_mode
from prism_megatron.report import publish as publish_mod
from prism_megatron.report import read_report
from prism_megatron.trace import read_trace, write_trace


def _wandb_env(tmp_path: Path) -> dict[str, str]:
    return {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "cfg"),
            "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_DATA_DIR": str(tmp_path / "data")}


def test_publish_logs_ours_and_resumes_megatrons_run(tmp_path, monkeypatch):
    """With a wandb_run mark (Megatron's writer ran), the figures go to our run and into theirs."""
    trace = make_trace(tmp_path / "t")
    t = read_trace(trace)
    marks = t.marks.to_pylist()
    marks.append({"rank": 3, "name": "wandb_run", "phase": "i", "t": 0.0, "compute_clock": 0.0,
                  "attrs": {"id": "meg123", "project": "gpt-scale", "entity": None, "dir": str(tmp_path / "meg")}})
    manifest = {k: t.manifest[k] for k in ("world_size", "groups", "ranks", "job")}
    trace = write_trace(tmp_path / "t2", manifest, t.ops.to_pylist(), marks=marks)
    calls = []

    class Logged:
        def describe(self) -> str:
            return "W&B (test)"

    def fake_log(report, **kw):
        calls.append(kw)
        return Logged()

    import prism_megatron.report.wandb_log as wandb_log

    monkeypatch.setattr(wandb_log, "log_report", fake_log)
    out = publish_mod.publish(Path(trace), cluster=None, config={"flags": ["--x"]}, wandb_project="prism-test")
    assert out["report"]["format"] == "prismreport" and out["paths"]["html"].exists()
    ours, theirs = calls
    assert ours["project"] == "prism-test" and ours.get("resume_id") is None
    assert theirs["resume_id"] == "meg123" and theirs["project"] == "gpt-scale"
    assert theirs["run_dir"] == tmp_path / "meg" and theirs["timeline"] == out["paths"]["timeline"]


@pytest.mark.skipif(cpu_mode._gpu_present(), reason="CPU-mode runs refuse a GPU")
@pytest.mark.megatron
@pytest.mark.heavy  # the report and W&B are prism's; the second stack's captures run the same Megatron job
def test_run_writes_report_and_an_offline_wandb_run(published_run):
    p, tmp_path = published_run["proc"], published_run["dir"]  # its offline W&B runs are under its own dir
    assert p.returncode == 0, p.stderr[-3000:]
    report = read_report(tmp_path / "prism-trace" / "report.json")
    assert len(report["prediction"]["iteration_times_s"]) == 3
    assert report["memory"]["source"] == "cpu-accountant"
    assert {c["class"] for c in report["memory"]["classes"]} == {"stage 0 of 2 (first)", "stage 1 of 2 (last)"}
    assert all((tmp_path / "prism-trace" / f).is_file() for f in ("report.html", "timeline.json"))
    assert "predicted iteration" in p.stdout
    # Megatron's log line carries the live prediction, and it is the report's figure for that iteration
    live = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+) \(predicted", p.stdout)]
    assert live == [round(t * 1000, 1) for t in report["prediction"]["iteration_times_s"]], p.stdout[-3000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), p.stderr[-2000:]
    assert "upload later with: wandb sync" in p.stderr


def test_publish_without_wandb_or_with_a_failing_wandb_keeps_the_report(tmp_path, monkeypatch, capsys):
    import importlib.util

    import prism_megatron.report.wandb_log as wandb_log

    trace = make_trace(tmp_path / "t")
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(
        name, *a))
    out = publish_mod.publish(Path(trace), cluster=None, config={}, wandb_project="p")
    assert out["wandb"] == [] and out["paths"]["report"].exists()
    assert "W&B: not logged (wandb is not installed)" in capsys.readouterr().err
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)

    def broken(report, **kw):
        raise RuntimeError("no route to host")

    monkeypatch.setattr(wandb_log, "log_report", broken)
    out = publish_mod.publish(Path(trace), cluster=None, config={}, wandb_project="p")
    assert out["wandb"] == [] and out["paths"]["html"].exists()
    assert "W&B: not logged into p (RuntimeError: no route to host)" in capsys.readouterr().err


@pytest.mark.skipif(cpu_mode._gpu_present(), reason="CPU-mode runs refuse a GPU")
def test_run_with_calibration_predicts_from_the_calibrated_graph(tmp_path):
    """--prism-calibrate on: each slice (a TP pair) re-runs Megatron for real beside virtual ranks (which
    contribute the recorded pickles of Megatron's object collectives), and the report uses the result."""
    env = {**os.environ, **_wandb_env(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "prism_megatron", "run", "--recipe", "mini-dense-tp2pp2",
                        "--prism-driver", "core", "--prism-calibrate", "on",
                        "--prism-fold", "off"],  # the full capture fold auto would choose, without planning it
                       cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "prism-trace.calibration" / "calibrated" / "manifest.json").is_file()
    assert re.search(r"iteration +bare graph +calibrated", p.stderr), p.stderr[-3000:]
    rows = re.findall(r"prism: +(\d) +([0-9.]+) ms +([0-9.]+) ms", p.stderr)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    report = read_report(tmp_path / "prism-trace" / "report.json")
    assert report["prediction"]["provenance"].startswith("calibrated graph")
    calibrated = [float(r[2]) for r in rows]
    assert [t * 1e3 for t in report["prediction"]["iteration_times_s"]] == pytest.approx(calibrated, abs=1e-3)
