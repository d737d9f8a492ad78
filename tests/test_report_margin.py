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
    plain = class_verdicts(mem, oom, None)
    assert plain == {"near fit": FITS, "far fit": FITS, "near oom": OOM, "far oom": OOM, "no cap": None}
    assert class_verdicts(mem, oom, 0.05) == {"near fit": WITHIN_MARGIN, "far fit": FITS, "near oom": WITHIN_MARGIN,
                                              "far oom": OOM, "no cap": None}
    # an OOM whose request size is unknown cannot be placed within a margin
    unknown = [{"class": "near oom", "requested": None, "reserved": cap - GIB}]
    assert class_verdicts(mem, unknown, 0.05)["near oom"] == OOM


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
