"""The report, replay and comparison of a trace cost communication with the profile its run recorded."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner
from test_report import make_trace, set_job

from prism_megatron.calibration.profiles import PROFILES_DIR
from prism_megatron.cli import main
from prism_megatron.report import build_report, read_report
from prism_megatron.report.compare import compare
from prism_megatron.trace import TraceFormatError, read_trace

PROFILE = "h100-nvlink-ib400"


def test_recorded_profile_is_the_default_and_flags_override_it(tmp_path):
    free = build_report(make_trace(tmp_path / "old"))["prediction"]  # written before the key: free, as always
    assert free["cluster"] is None and "communication free (no cluster profile)" in free["provenance"]
    assert read_trace(tmp_path / "old").cluster is None

    trace = set_job(make_trace(tmp_path / "t"), "cluster", PROFILE)
    recorded = build_report(trace)["prediction"]
    given = build_report(make_trace(tmp_path / "g"), cluster=PROFILE)["prediction"]
    assert recorded["cluster"] == PROFILE and recorded["iteration_time_s"] == given["iteration_time_s"]
    assert recorded["iteration_time_s"] > free["iteration_time_s"]
    assert f"costed by cluster profile {PROFILE} (the run's, recorded in the trace)" in recorded["provenance"]
    assert "recorded in the trace" not in given["provenance"]
    # the run's own report passes the profile it recorded: it reads like the remade one
    assert build_report(trace, cluster=PROFILE)["prediction"]["provenance"] == recorded["provenance"]

    none = build_report(trace, cluster="none")["prediction"]
    assert none["cluster"] is None and none["iteration_time_s"] == free["iteration_time_s"]
    assert "communication free (no cluster profile)" in none["provenance"]

    other = tmp_path / "other.yaml"  # another profile, given: it is the one named
    other.write_text((PROFILES_DIR / f"{PROFILE}.yaml").read_text().replace(f"name: {PROFILE}", "name: other"))
    overridden = build_report(trace, cluster=str(other))["prediction"]
    assert overridden["cluster"] == str(other) and "recorded in the trace" not in overridden["provenance"]

    set_job(trace, "cluster", None)  # the run had no profile
    assert build_report(trace)["prediction"]["iteration_time_s"] == free["iteration_time_s"]


def test_recorded_profile_file_is_read_from_anywhere_and_a_missing_one_is_named(tmp_path, monkeypatch):
    profile = tmp_path / "site" / "mine.yaml"
    profile.parent.mkdir()
    shutil.copy(PROFILES_DIR / f"{PROFILE}.yaml", profile)
    trace = set_job(make_trace(tmp_path / "t"), "cluster", str(profile))
    monkeypatch.chdir(tmp_path / "site")
    ok = CliRunner().invoke(main, ["report", str(trace)])
    assert ok.exit_code == 0, ok.output
    assert read_report(trace / "report.json")["prediction"]["cluster"] == str(profile)

    profile.unlink()
    gone = CliRunner().invoke(main, ["report", str(trace)])
    assert gone.exit_code == 1 and "Traceback" not in gone.output
    assert str(profile) in gone.output and "no longer exists" in gone.output and "--cluster" in gone.output
    for cmd in (["report", str(trace), "--cluster", "none"], ["replay", str(trace), "--cluster", PROFILE]):
        res = CliRunner().invoke(main, cmd)
        assert res.exit_code == 0, res.output


def test_replay_and_compare_default_to_the_recorded_profile(tmp_path):
    trace = set_job(make_trace(tmp_path / "t"), "cluster", PROFILE)
    res = CliRunner().invoke(main, ["replay", str(trace)])
    assert res.exit_code == 0, res.output
    assert f"costed by cluster profile {PROFILE} (the run's, recorded in the trace)" in res.output
    res = CliRunner().invoke(main, ["replay", str(trace), "--cluster", "none"])
    assert res.exit_code == 0 and "communication free" in res.output, res.output

    free = compare([make_trace(tmp_path / "f")])[0]
    costed = compare([trace])[0]
    assert costed.iteration_time_s > free.iteration_time_s
    assert compare([trace], "none")[0].iteration_time_s == free.iteration_time_s


@pytest.mark.parametrize("value", [3, "", ["h100"]])
def test_bad_recorded_profile_names_file_and_field(tmp_path, value):
    trace = set_job(make_trace(tmp_path / "t"), "cluster", value)
    with pytest.raises(TraceFormatError, match=r"manifest.json: manifest field 'job.cluster' is"):
        read_trace(trace)


def test_run_records_the_profile_it_costs_with(tmp_path, monkeypatch):
    from prism_megatron.megatron.run import launch_config, parse_run_args

    script = tmp_path / "train.py"
    script.write_text("")
    shutil.copy(PROFILES_DIR / f"{PROFILE}.yaml", tmp_path / "mine.yaml")
    monkeypatch.chdir(tmp_path)
    base = ["--prism-emulate", "--prism-world-size", "4"]
    for flags, recorded in ((["--prism-cluster", PROFILE], PROFILE),
                            (["--prism-cluster", "mine.yaml"], str(tmp_path / "mine.yaml")), ([], None)):
        cfg = launch_config(parse_run_args([*base, *flags, str(script)]))
        assert cfg.job_extra["cluster"] == recorded and cfg.predictor_options["cluster"] == (flags or [None])[-1]
    recipe = launch_config(parse_run_args(["--recipe", "targets-llama3-70b-h100x64", str(script)]))
    assert recipe.job_extra["cluster"] == PROFILE
    assert cfg.predictor == "prism_megatron.report.live:predict_iteration"  # the log line's prediction, by default
    assert launch_config(parse_run_args([*base, "--prism-live-prediction", "off", str(script)])).predictor is None


LOGGED_ITERATIONS = """
import time, torch, torch.distributed as dist
from prism_megatron.runtime.live import predicted_iteration_time
from prism_megatron.trace import span
dist.init_process_group("gloo")
x = torch.ones(4)
for it in range(1, 5):
    with span("iteration", iteration=it):
        t = time.perf_counter()
        while time.perf_counter() - t < 0.005 * (1 + dist.get_rank()):
            pass
        dist.all_reduce(x)
    if dist.get_rank() == 1:  # the rank that logs, as Megatron's last rank does
        predicted_iteration_time(it)
dist.destroy_process_group()
"""


def test_the_report_sets_the_live_predictions_the_log_line_gave_against_its_own(tmp_path):
    """A run's live predictions reach its trace; its report finds each equal to its own figure, and names an
    iteration whose logged figure is not (here one edited in the manifest)."""
    import json

    from conftest import launch_source
    from prism_megatron.report.terminal import summary_text

    tr = launch_source(tmp_path, LOGGED_ITERATIONS, predictor="prism_megatron.report.live:predict_iteration")
    logged = tr.manifest["job"]["live_predictions"]
    assert sorted(logged) == ["1", "2", "3", "4"] and all(v > 0 for v in logged.values())
    report = build_report(tr.path)
    assert report["prediction"]["live_predictions"] == {"logged": 4, "differ": []}
    assert [logged[str(k)] for k in (1, 2, 3, 4)] == report["prediction"]["iteration_times_s"]
    assert "4 live prediction(s), each equal to this report's figure" in summary_text(report, width=200)

    manifest = json.loads((tr.path / "manifest.json").read_text())
    manifest["job"]["live_predictions"]["3"] *= 2
    (tr.path / "manifest.json").write_text(json.dumps(manifest))
    differ = build_report(tr.path)["prediction"]["live_predictions"]["differ"]
    assert [d["iteration"] for d in differ] == [3] and differ[0]["logged_s"] == 2 * differ[0]["report_s"]
    manifest["job"]["live_predictions"]["3"] = "fast"
    (tr.path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TraceFormatError, match="job.live_predictions"):
        build_report(tr.path)
