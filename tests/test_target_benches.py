"""The target runs' bench helpers (bench/targets/): what a device run brings back is read from them."""

from __future__ import annotations

import subprocess
import sys

from tests.bench_scripts import ROOT


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
