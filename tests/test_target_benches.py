"""The target runs' bench helpers (bench/targets/): what a device run brings back is read from them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.bench_scripts import ROOT, load_bench


def test_stamp_lines_passes_the_run_through_and_times_prisms_lines(tmp_path):
    producer = ("import sys, time\n"
                "print('prism: planning', flush=True)\n"
                "print('a Megatron warning', flush=True)\n"
                "print('[after model, optimizer, and learning rate scheduler are built] datetime: 2026', flush=True)\n"
                "time.sleep(0.5)\n"
                "print(' [2026-12-05 01:02:03] iteration        1/       3 | elapsed', flush=True)\n"
                "print('prism: done in 0.5 s', flush=True)\n")
    times = tmp_path / "times.txt"
    producer_proc = subprocess.Popen([sys.executable, "-c", producer], stdout=subprocess.PIPE)
    run = subprocess.run([sys.executable, "-u", str(ROOT / "bench" / "targets" / "stamp_lines.py"), str(times)],
                         stdin=producer_proc.stdout, capture_output=True, text=True, timeout=60)
    assert producer_proc.wait(timeout=60) == 0
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["prism: planning", "a Megatron warning",
                                       "[after model, optimizer, and learning rate scheduler are built] datetime: 2026",
                                       " [2026-12-05 01:02:03] iteration        1/       3 | elapsed",
                                       "prism: done in 0.5 s"]
    rows = [line.split(None, 1) for line in times.read_text().splitlines()[1:]]
    assert [text for _, text in rows] == [
        "prism: planning", "[after model, optimizer, and learning rate scheduler are built] datetime: 2026",
        "[2026-12-05 01:02:03] iteration        1/       3 | elapsed", "prism: done in 0.5 s",
        "(end of the run's output)"]
    seconds = [float(s) for s, _ in rows]
    assert seconds == sorted(seconds) and seconds[2] - seconds[1] >= 0.4  # the producer's sleep, between them


SUMMARY = """\
== qwen3-235b-tp2: exit 5 in 337 s (flags: --recipe targets-qwen3-235b-tp2)
prism: serial capture 1/2: rank 0 (class first) is the only process; every other rank is virtual
 [2026-12-05 03:46:57.912046] iteration        1/       2 | elapsed time per iteration (ms): 22051.1
 [2026-12-05 03:47:20.613456] iteration        2/       2 | elapsed time per iteration (ms): 22693.9
prism: done in 73.5 s; trace written to WORK/trace.captures/capture-0-rank-0
prism: serial capture 2/2: rank 32 (class last) is the only process; every other rank is virtual
prism: serial capture 2/2 (rank 32, class last) ran out of memory under the target's cap: predicted OOM for its class
prism: serial capture 1/2 again: rank 0 (class first) is the only process; every other rank is virtual
 [2026-12-05 03:50:03.383310] iteration        1/       2 | elapsed time per iteration (ms): 19466.2
prism: done in 66.7 s; trace written to WORK/trace.captures/capture-0-rank-0-take-2
prism: serial capture: merged 2 of 2 capture(s), 1 complete, into WORK/trace (wall s per capture: 74.2, 38.0; \
again: 67.4); capture 2 (rank 32) incomplete: rank 32 ran out of memory under the target's cap (predicted OOM)
prism: report: replayed and built in 0.5 s
prism: report: report.json and report.html written in 0.25 s
no prediction: class(es) last ran out of memory under the target's cap (the verdict names each)
## the file's next section: another run's lines, stamped, are no take of this one
    56.5  prism: serial capture: merged 1 of 1 capture(s), 0 complete, into WORK/trace (wall s per capture: 24.7)
== qwen3-235b-ep32: exit 124 in 90 s (flags: ...)
prism: serial capture 1/3: rank 0 (class first) is the only process; every other rank is virtual
"""


def test_the_capture_time_bench_reads_each_take_of_a_run_not_cut(tmp_path):
    """bench/targets/capture_time_model.py: each take's class, iterations, end and wall (the merged line names an
    OOM too: it is the walls' line, not a take's end; so does the report's verdict line), the report's steps, up
    to the file's next section; a run cut by its time limit is left out."""
    bench = load_bench("targets/capture_time_model.py")
    (tmp_path / "r.txt").write_text(SUMMARY)
    [run] = bench.read_runs(tmp_path / "r.txt")
    assert (run.name, run.wall, run.report) == ("qwen3-235b-tp2", 337.0, 0.75)
    assert [(t.cls, t.again, t.end, t.wall, t.iterations) for t in run.takes] == [
        ("first", False, "done", 74.2, pytest.approx([22.0511, 22.6939])), ("last", False, "oom", 38.0, []),
        ("first", True, "done", 67.4, pytest.approx([19.4662]))]
