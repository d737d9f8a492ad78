"""`prism-megatron compare`: layouts of one model side by side, from traces and report.json files."""

from __future__ import annotations

import gzip
import json

import pytest
from click.testing import CliRunner
from test_report import CAP, GIB, OOM_SITE, make_trace

from prism_megatron.cli import main
from prism_megatron.report import make_report
from prism_megatron.report.compare import compare, comparison_text, layout_of, load_report
from prism_megatron.report.margin import WITHIN_MARGIN
from prism_megatron.report.schema import ReportFormatError, read_report


@pytest.fixture
def layouts(tmp_path):
    """Three small pp=2 jobs: 4 and 8 ranks that fit, and 4 ranks of which rank 3 runs out of memory."""
    make_trace(tmp_path / "pp2dp4", world=8)
    make_trace(tmp_path / "pp2dp2", world=4)
    make_trace(tmp_path / "oom", world=4, oom_rank=3)
    return tmp_path


def test_rows_sorted_by_predicted_time_with_per_gpu_rates(layouts):
    rows = compare([layouts / "pp2dp4", layouts / "pp2dp2", layouts / "oom"], cluster="h100-nvlink-ib400")
    # A ring all-reduce over 8 ranks pays 14 latency steps against 6 over 4: the 4-rank job is faster.
    assert [r.label for r in rows][:2] == ["pp2dp2", "pp2dp4"]
    times = [r.iteration_time_s for r in rows if r.iteration_time_s is not None]
    assert times == sorted(times) and rows[0].iteration_time_s < rows[1].iteration_time_s
    fast = rows[0]
    pred = fast.report["prediction"]
    assert fast.tokens_per_s_per_gpu == pytest.approx(pred["tokens_per_s"] / 4)
    assert fast.tokens_per_s_per_gpu == pytest.approx(4096 / pred["iteration_time_s"] / 4)
    assert fast.tflops_per_gpu == pytest.approx(pred["tflops_per_gpu"])
    assert not fast.oom and fast.verdict.startswith("fits")
    # headroom per class: the tightest rank of each class (stage 1 reserves up to 3.5 GiB + r/16)
    assert fast.headroom == {c["class"]: c["headroom"] for c in fast.report["memory"]["classes"]}
    assert min(fast.headroom.values()) == CAP - int((3.5 + 3 / 16) * GIB)
    oom = next(r for r in rows if r.label == "oom")
    assert oom.oom and oom.verdict.startswith("OOM: rank 3")


def test_report_files_and_traces_mix(layouts):
    make_report(layouts / "pp2dp4", layouts / "pp2dp4-report", "h100-nvlink-ib400")
    from_file = load_report(layouts / "pp2dp4-report" / "report.json")
    rows = compare([layouts / "pp2dp4-report", layouts / "pp2dp2"], cluster="h100-nvlink-ib400",
                   labels=["tp1pp2dp4", "tp1pp2dp2"])
    assert [r.label for r in rows] == ["tp1pp2dp2", "tp1pp2dp4"]
    assert rows[1].iteration_time_s == pytest.approx(from_file["prediction"]["iteration_time_s"])
    with pytest.raises(ValueError, match="1 label"):
        compare([layouts / "pp2dp4", layouts / "pp2dp2"], labels=["x"])
    with pytest.raises(ValueError, match="is missing"):
        compare([layouts / "nowhere"])


def test_without_prediction_sorts_last_and_text_shows_each_class(layouts):
    rows = compare([layouts / "oom", layouts / "pp2dp2"])
    report = dict(rows[0].report, prediction=None, prediction_error="replay failed")
    broken = layout_of(report, "broken", "x")
    text = comparison_text([*rows, broken])
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["#", "layout", "GPUs", "iteration"]
    assert "broken" in lines[3] and lines[3].split()[3] == "-"
    assert "     stage 1 of 2 (last): headroom 320.0 MiB" in lines
    assert "OOM" in text


def test_an_oom_layout_shows_what_its_classes_need_not_their_headroom_at_the_failure(layouts, tmp_path):
    """An OOM capture stops at its failing request: its class's headroom then (the cap less what was reserved)
    is no margin. Without prism's estimate of the class's peak the table gives how far past the cap its failing
    request went (the least it needs); with one, the estimate where it is larger; the class lines too."""
    rows = compare([layouts / "pp2dp2", layouts / "oom"])
    oom = rows[1]
    last = "stage 1 of 2 (last)"
    # rank 3 asked for 1 GiB with 3.5 GiB reserved under a 4 GiB cap: 512 MiB past it
    assert oom.excess == {last: GIB // 2} and oom.estimated == frozenset()
    assert 0 < oom.headroom[last] <= CAP - int(3.5 * GIB)
    lines = comparison_text(rows).splitlines()
    assert lines[2].endswith(f"OOM, failing request 512.0 MiB past the cap ({last})")
    assert (f"     {last}: out of memory, its failing request 512.0 MiB past its cap (its capture stopped there: "
            "the least it needs)") in lines
    assert "     stage 0 of 2 (first): headroom" in "\n".join(lines)  # the class that ran on keeps its headroom
    assert rows[0].excess == {} and "fits, min headroom" in lines[1]
    # prism's estimate of the class's peak, past what the failing request reached: the estimate gives the need
    def estimated(bytes_: int) -> dict:
        classes = [dict(c, estimate=bytes_) if c["class"] == last else c for c in oom.report["memory"]["classes"]]
        return dict(oom.report, memory=dict(oom.report["memory"], classes=classes))
    big = layout_of(estimated(CAP + 3 * GIB), "big", "x")
    assert big.excess == {last: 3 * GIB} and big.estimated == {last}
    text = comparison_text([big])
    assert f"OOM, needs ~3.0 GiB more ({last}, prism's estimate)" in text
    assert f"{last}: out of memory, needs ~3.0 GiB more than its cap (prism's estimate of its peak" in text
    small = layout_of(estimated(CAP - GIB), "small", "x")  # below the failing request: the request's figure stays
    assert small.excess == {last: GIB // 2} and small.estimated == frozenset()
    # a class the report judged within the TE-substitution margin is said to be so beside its figure
    near = estimated(CAP + 3 * GIB)
    near["memory"]["classes"] = [dict(c, verdict=WITHIN_MARGIN) if c["class"] == last else c
                                 for c in near["memory"]["classes"]]
    assert (f"OOM, needs ~3.0 GiB more ({last}, prism's estimate; within the TE-substitution margin)"
            in comparison_text([layout_of(near, "near", "x")]))
    # a request that would have fit the cap in total: fragmentation, said so
    frag = dict(oom.report, oom=[dict(oom.report["oom"][0], requested=GIB // 4)])
    text = comparison_text([layout_of(frag, "frag", "x")])
    assert "OOM (stage 1 of 2 (last): fragmentation)" in text
    assert "stage 1 of 2 (last): out of memory with 256.0 MiB of its cap free in total (fragmentation)" in text
    # report files kept side by side in one folder are labelled by their own names
    for name in ("pp2dp2", "oom"):
        make_report(layouts / name, tmp_path / name, None)
        (tmp_path / name / "report.json").rename(tmp_path / f"{name}-report.json")
    assert [r.label for r in compare([tmp_path / "oom-report.json", tmp_path / "pp2dp2-report.json"])] == [
        "pp2dp2-report", "oom-report"]
    # a gzip-compressed copy (results kept beside the code) reads the same and is labelled alike
    plain = tmp_path / "oom-report.json"
    packed = tmp_path / "oom-packed-report.json.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    [row] = compare([packed])
    assert row.label == "oom-packed-report" and row.report == read_report(plain)
    broken = tmp_path / "broken-report.json.gz"
    broken.write_bytes(gzip.compress(plain.read_bytes())[:40])  # cut short
    with pytest.raises(ReportFormatError, match="cannot be read"):
        read_report(broken)


def test_cli_compare(layouts):
    res = CliRunner().invoke(main, ["compare", str(layouts / "pp2dp4"), str(layouts / "pp2dp2"),
                                    "--cluster", "h100-nvlink-ib400"])
    assert res.exit_code == 0, res.output
    first, second = res.output.splitlines()[1:3]
    assert first.split()[1] == "pp2dp2" and second.split()[1] == "pp2dp4"
    bad = CliRunner().invoke(main, ["compare", str(layouts / "nowhere")])
    assert bad.exit_code != 0 and "is missing" in bad.output
    (layouts / "junk.json").write_text(json.dumps({"format": "other"}))
    bad = CliRunner().invoke(main, ["compare", str(layouts / "junk.json")])
    assert bad.exit_code != 0 and "field 'format'" in bad.output


def test_recipe_substitutions_beside_the_figures(layouts):
    rows = compare([layouts / "pp2dp2", layouts / "pp2dp4"], cluster="h100-nvlink-ib400",
                   recipes=["targets-qwen3-235b-a22b-h100x256-tp2pp8vpp4ep32",
                            "targets-qwen3-235b-a22b-h100x256-tp1pp8vpp4ep8"])
    assert [r.label for r in rows] == ["targets-qwen3-235b-a22b-h100x256-tp2pp8vpp4ep32",
                                       "targets-qwen3-235b-a22b-h100x256-tp1pp8vpp4ep8"]
    assert {s["setting"] for s in rows[1].substitutions} >= {"model.transformer_impl", "target.gpu"}
    text = comparison_text(rows)
    assert "substituted model.transformer_impl: transformer_engine -> local (affects compute time" in text
    with pytest.raises(ValueError, match="1 recipe"):
        compare([layouts / "pp2dp2", layouts / "pp2dp4"], recipes=["targets-llama3-8b-h100x8"])


def test_report_carries_the_substitutions_the_run_recorded(layouts, tmp_path):
    from prism_megatron.report import read_report
    from prism_megatron.trace import TraceFormatError

    manifest = layouts / "pp2dp2" / "manifest.json"
    doc = json.loads(manifest.read_text())
    sub = {"setting": "training.precision", "published": "fp8", "rendered": "bf16", "affects": "GEMM time"}
    doc["job"]["substitutions"] = [sub]
    manifest.write_text(json.dumps(doc))
    paths = make_report(layouts / "pp2dp2", tmp_path / "out")
    report = read_report(paths["report"])
    assert report["substitutions"] == [sub]
    assert compare([paths["report"]])[0].substitutions == (sub,)
    from prism_megatron.report import summary_text
    assert "substituted training.precision: fp8 -> bf16 (affects GEMM time)" in summary_text(report, width=200)
    doc["job"]["substitutions"] = [{"setting": "x"}]
    manifest.write_text(json.dumps(doc))
    with pytest.raises(TraceFormatError, match="job.substitutions"):
        load_report(layouts / "pp2dp2")


def test_report_reader_checks_substitutions(layouts, tmp_path):
    from prism_megatron.report import ReportFormatError, read_report

    paths = make_report(layouts / "pp2dp2", tmp_path / "out")
    doc = json.loads(paths["report"].read_text())
    doc["substitutions"] = [{"setting": "x", "published": "y", "rendered": 3, "affects": "z"}]
    paths["report"].write_text(json.dumps(doc))
    with pytest.raises(ReportFormatError, match=r"substitutions\[0\]\.rendered"):
        read_report(paths["report"])


def test_report_reader_checks_an_oom_site_where_present(layouts, tmp_path):
    """``oom[].where`` is optional (older reports lack it) but typed where present."""
    from prism_megatron.report import ReportFormatError, read_report

    paths = make_report(layouts / "oom", tmp_path / "out")
    doc = json.loads(paths["report"].read_text())
    assert doc["oom"][0]["where"] == OOM_SITE
    del doc["oom"][0]["where"]
    paths["report"].write_text(json.dumps(doc))
    assert "where" not in read_report(paths["report"])["oom"][0]
    doc["oom"][0]["where"] = ["a.py:1 (f)", 2]
    paths["report"].write_text(json.dumps(doc))
    with pytest.raises(ReportFormatError, match=r"oom\[0\]\.where\[1\]"):
        read_report(paths["report"])
