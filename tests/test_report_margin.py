"""Per-class memory verdicts and the Transformer Engine substitution margin (report.margin)."""

from __future__ import annotations

from test_report import CAP, GIB, MIB, make_trace, set_job

from prism_megatron.report import build_report, summary_text
from prism_megatron.report.margin import FITS, OOM, WITHIN_MARGIN, class_verdicts, te_substituted

TE = {"setting": "model.transformer_impl", "published": "transformer_engine", "rendered": "local",
      "affects": "activation memory"}
LAST = "stage 1 of 2 (last)"


def _memory(*rows):
    """rows: (class, max_reserved, cap, oom)"""
    ranks = [{"rank": i, "class": c, "max_allocated": m, "max_reserved": m, "cap": cap, "headroom": None, "oom": o}
             for i, (c, m, cap, o) in enumerate(rows)]
    return {"source": "cuda", "ranks": ranks,
            "classes": [{"class": c, "ranks": [i], "max_allocated": m, "max_reserved": m, "headroom": None}
                        for i, (c, m, _, _) in enumerate(rows)]}


def test_class_verdicts_within_the_margin_either_side_of_the_cap():
    cap = 80 * GIB
    mem = _memory(("near fit", cap - 2 * GIB, cap, False), ("far fit", cap - 10 * GIB, cap, False),
                  ("near oom", cap - 1 * GIB, cap, True), ("far oom", cap - 1 * GIB, cap, True),
                  ("no cap", GIB, None, False))
    oom = [{"class": "near oom", "requested": 3 * GIB, "reserved": cap - GIB},  # needs cap + 2 GiB: 2.5%
           {"class": "far oom", "requested": 9 * GIB, "reserved": cap - GIB}]   # needs cap + 8 GiB: 10%
    estimates = {"near oom": cap + GIB, "far oom": cap + GIB}  # below what the failing allocations show
    plain = class_verdicts(mem, oom, None, estimates)
    assert plain == {"near fit": FITS, "far fit": FITS, "near oom": OOM, "far oom": OOM, "no cap": None}
    assert class_verdicts(mem, oom, 0.05, estimates) == {
        "near fit": WITHIN_MARGIN, "far fit": FITS, "near oom": WITHIN_MARGIN, "far oom": OOM, "no cap": None}
    # an OOM whose request size is unknown cannot be placed within a margin
    unknown = [{"class": "near oom", "requested": None, "reserved": cap - GIB}]
    assert class_verdicts(mem, unknown, 0.05, estimates)["near oom"] == OOM
    # nor one without prism's estimate: its failing request shows only the least it needs
    assert class_verdicts(mem, oom, 0.05, {"far oom": cap + GIB})["near oom"] == OOM


def test_an_oom_class_is_weighed_by_its_estimate_not_only_by_its_failing_allocation():
    """A capture under the cap stops at its first failing request: 2 GiB over the cap is the least the class
    needs. Where prism's estimate says it needs far more, it is plainly OOM, not within the margin; without
    an estimate its need is unknown, so no margin can be claimed."""
    cap = 80 * GIB
    mem = _memory(("oom", cap - GIB, cap, True))
    oom = [{"class": "oom", "requested": 3 * GIB, "reserved": cap - GIB}]
    assert class_verdicts(mem, oom, 0.05, {"oom": int(cap * 1.6)})["oom"] == OOM
    assert class_verdicts(mem, oom, 0.05, {"oom": int(cap * 1.03)})["oom"] == WITHIN_MARGIN
    assert class_verdicts(mem, oom, 0.05)["oom"] == OOM


def test_te_substituted_only_for_a_published_transformer_engine():
    assert te_substituted([TE]) and not te_substituted(None) and not te_substituted([])
    assert not te_substituted([{**TE, "setting": "parallel.cp"}])
    assert not te_substituted([{**TE, "published": "local"}])


def test_report_marks_a_class_within_the_margin_only_under_a_te_substitution(tmp_path, monkeypatch):
    # the last stage peaks 320 MiB (7.8%) under its 4 GiB cap: outside the 5% margin, inside a 10% one
    plain = build_report(make_trace(tmp_path / "plain"))
    assert {c["class"]: c["verdict"] for c in plain["memory"]["classes"]} == {"stage 0 of 2 (first)": FITS,
                                                                               LAST: FITS}
    te = build_report(set_job(make_trace(tmp_path / "te"), "substitutions", [TE]))
    assert te["verdict"] == plain["verdict"]  # 320 MiB is outside the 5% margin of 4 GiB
    monkeypatch.setattr("prism_megatron.report.build.TE_SUBSTITUTION_MARGIN", (320 * MIB + 1) / CAP)
    wide = build_report(tmp_path / "te")
    assert {c["class"]: c["verdict"] for c in wide["memory"]["classes"]}[LAST] == WITHIN_MARGIN
    assert wide["verdict"].startswith("fits: ")
    assert wide["verdict"].endswith(f"Transformer Engine): {LAST}")
    assert WITHIN_MARGIN in summary_text(wide)
    unsubstituted = build_report(tmp_path / "plain")  # no TE substitution recorded: no margin, however wide
    assert WITHIN_MARGIN not in unsubstituted["verdict"] and unsubstituted["memory"]["classes"][1]["verdict"] == FITS


def test_report_weighs_an_oom_class_by_the_estimate_its_trace_recorded(tmp_path):
    """A run records prism's estimate per rank (job.memory_estimates); the report gives it in the OOM class's
    row and after the verdict line; a malformed record is refused, naming the field."""
    import pytest

    from prism_megatron.trace import TraceFormatError

    trace = set_job(make_trace(tmp_path / "t", oom_rank=3), "substitutions", [TE])
    bare = build_report(trace)  # no estimate recorded: the failing allocation alone (12.5 % over the cap)
    assert {c["class"]: c["verdict"] for c in bare["memory"]["classes"]}[LAST] == OOM
    assert "estimate" not in bare["verdict"]
    set_job(trace, "memory_estimates", {"3": int(CAP * 1.6), "0": GIB})
    rep = build_report(trace)
    row = {c["class"]: c for c in rep["memory"]["classes"]}[LAST]
    assert row["verdict"] == OOM and row["estimate"] == int(CAP * 1.6)
    assert rep["verdict"].endswith(f"prism's estimate gives the class's need: {LAST} 6.4 GiB (2.4 GiB past its cap)")
    set_job(trace, "memory_estimates", {"3": "lots"})
    with pytest.raises(TraceFormatError, match="job.memory_estimates"):
        build_report(trace)
