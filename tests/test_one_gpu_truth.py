"""bench/gpu/one_gpu_truth.py's scoring: real repeats against an emulation, with and without its trace."""

from __future__ import annotations

import pytest
from bench_scripts import load_bench

WARM = [900.0, 600.0]  # iterations 1-2, left out on both sides


def _iters(values: list[float]) -> dict[str, dict]:
    return {str(i): {"ms": v, "note": None, "loss": "1.0", "at": float(i)} for i, v in enumerate(WARM + values, 1)}


def _step(kind: str, ms: float) -> dict:
    """A step of eight measured iterations of ``ms`` each; an emulation's names a trace that is not there."""
    step = {"kind": kind, "iterations": _iters([ms] * 8), "measured_from": 3}
    if kind.startswith("emu"):
        step.update(world=1, variant="", trace="dense-bf16-mbs2/trace-01-emu1")
    return step


def test_an_emulation_without_its_trace_is_scored_by_its_live_prediction_and_marked(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    report = {"steps": {"dense-bf16-mbs2": [_step("real-threads1", 200.0), _step("emu1", 202.0),
                                            _step("real-threads1", 200.0)]}}
    text = truth.analyse(report, tmp_path)  # no trace under tmp_path
    em = report["rows"]["dense-bf16-mbs2"]["emulations"]["emu1"]
    assert em["predicted_ms"] == 202.0 and em["predicted_from"] == "live"
    assert abs(em["error_pct"] - 1.0) < 1e-9
    assert "emu1*" in text and "traces not kept" in text
    assert "(1 emulations): 1.00 %" in text  # two real repeats that agree: ground truth, scored


def test_a_repeated_emulation_is_scored_beside_the_first(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    report = {"steps": {"dense-bf16-mbs2": [_step("real-threads1", 200.0), _step("emu1", 202.0),
                                            _step("real-threads1", 200.0), _step("emu1", 196.0),
                                            _step("real-threads1", 200.0)]}}
    text = truth.analyse(report, tmp_path)
    assert set(report["rows"]["dense-bf16-mbs2"]["emulations"]) == {"emu1", "emu1#1"}
    assert "(2 emulations): 1.50 %" in text  # |+1 %| and |-2 %|
    report["steps"]["dense-bf16-mbs2"][-1] = _step("real-threads1", 210.0)  # no truth: both repeats named apart
    text = truth.analyse(report, tmp_path)
    assert "dense-bf16-mbs2 emu1 error +1.0 %" in text and "dense-bf16-mbs2 emu1#1 error -2.0 %" in text


def test_real_repeats_that_disagree_are_no_ground_truth(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    report = {"steps": {"dense-bf16-mbs2": [_step("real-threads1", 200.0), _step("emu1", 202.0),
                                            _step("real-threads1", 210.0)]}}
    text = truth.analyse(report, tmp_path)
    assert "(0 emulations)" in text
    assert "not ground truth (spread" in text and "dense-bf16-mbs2 emu1 error" in text


def test_a_forked_real_run_is_listed_beside_the_real_runs_and_not_scored_as_one(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    report = {"steps": {"dense-bf16-mbs2": [_step("real-threads1", 200.0), _step("real-forked", 210.0),
                                            _step("real-threads1", 200.0)]}}
    text = truth.analyse(report, tmp_path)
    row = report["rows"]["dense-bf16-mbs2"]
    assert row["real_medians_ms"] == [200.0, 200.0] and row["real_spread_pct"] == 0.0  # not pooled with the reals
    assert row["forked"] == [210.0]
    assert "real-forked (the driver forked from a template" in text and "210.0 ms (+5.0 % against real)" in text


def test_a_real_spans_run_splits_each_measured_iteration_into_forward_backward_and_the_rest():
    truth = load_bench("gpu/one_gpu_truth.py")
    assert truth.microbatches(truth.config_of("dense-fp32-mbs1-host-recompute")) == 8
    # 2 micro-batches per iteration; iteration k's forwards take k ms each, its backwards 2k ms
    spans = []
    for k in (1, 2, 3, 4):
        for _ in range(2):
            spans += [["forward", 0.0, k / 1e3], ["backward", 0.0, 2 * k / 1e3]]
    step = {"kind": "real-spans", "measured_from": 3, "spans": spans,
            "iterations": {str(k): {"ms": 10.0 * k} for k in (1, 2, 3, 4, 5)}}  # iteration 5 has no spans: left out
    got = truth.real_spans(step, 2)
    assert got["iterations"] == 2  # iterations 3 and 4
    assert got["iteration_ms"] == pytest.approx(35.0)
    assert got["forward_ms"] == pytest.approx(7.0)  # medians of 2x3 and 2x4
    assert got["backward_ms"] == pytest.approx(14.0)
    assert got["rest_ms"] == pytest.approx(35 - 21)  # (30 - 18, 40 - 24): median 14
    assert truth.real_spans({**step, "spans": spans[:8]}, 2) is None  # no measured iteration has its spans


def test_counted_steps_are_neither_truth_nor_scored_and_their_calls_are_compared(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    real = {"forwards": 8, "per_forward": {"a.py:1 f": 10.0, "c builtins.len": 4.0}}
    emulated = {"forwards": 8, "per_forward": {"a.py:1 f": 10.0, "c builtins.len": 7.0, "b.py:3 g": 2.0}}
    counted_real = {**_step("real-spans+calls", 900.0), "calls": real}  # times of a profiled run: far off
    counted_emu = {**_step("emu1+calls", 950.0), "calls": emulated}
    report = {"steps": {"dense-bf16-mbs2": [_step("real-threads1", 200.0), _step("emu1", 202.0),
                                            _step("real-threads1", 200.0), counted_real, counted_emu]}}
    text = truth.analyse(report, tmp_path)
    row = report["rows"]["dense-bf16-mbs2"]
    assert row["real_ms"] == 200.0 and row["real_spread_pct"] == 0.0  # the counted real run is no repeat
    assert list(row["emulations"]) == ["emu1"]
    assert "emu1+calls against real-spans+calls, over 8 and 8 forwards: calls per forward: real 10 Python + 4 C, " \
           "emulated 12 + 7; most apart: +3 c builtins.len, +2 b.py:3 g" in text


def test_the_call_census_counts_each_forward_past_the_skipped_ones_in_each_process(tmp_path):
    """forward_probe/sitecustomize.py, as a +calls step loads it: a sink installed through ``set_sink`` is wrapped,
    the first FORWARD_PROBE_SKIP forwards are left out, a forked child counts its own forwards into a file of its
    own."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    program = """
import os
from prism_megatron.trace import markers

class Sink:
    def __init__(self):
        self.marks = []
    def record_mark(self, name, phase, attrs):
        self.marks.append((name, phase))

def body(n):
    for _ in range(n):
        len([])

sink = Sink()
markers.set_sink(sink)
for i in range(3):
    with markers.span("forward", iteration=i):
        body(5)
    with markers.span("backward", iteration=i):
        body(100)
assert [m for m in sink.marks if m[0] == "forward"] == [("forward", "B"), ("forward", "E")] * 3
pid = os.fork()
if pid == 0:
    for i in range(4):
        with markers.span("forward", iteration=i):
            body(2)
    os._exit(0)
os.waitpid(pid, 0)
"""
    env = dict(os.environ, FORWARD_PROBE_DIR=str(tmp_path), FORWARD_PROBE="calls", FORWARD_PROBE_SKIP="1",
               PYTHONPATH=os.pathsep.join([str(repo / "bench" / "gpu" / "forward_probe"), str(repo)]))
    subprocess.run([sys.executable, "-c", program], env=env, check=True, timeout=60)
    files = {json.loads(f.read_text())["forwards"]: json.loads(f.read_text()) for f in tmp_path.glob("calls-*.json")}
    assert sorted(files) == [2, 3]  # the parent's 3 forwards less 1 skipped; the child's 4 less 1
    assert files[2]["calls"]["<string>:11 body"] == 2 and files[2]["calls"]["c builtins.len"] == 10
    assert files[3]["calls"]["c builtins.len"] == 6
    truth = load_bench("gpu/one_gpu_truth.py")
    assert truth.read_probe(tmp_path, "calls")["forwards"] == 3  # the process that ran the most forwards


def test_the_canary_times_each_forward_past_the_skipped_ones(tmp_path):
    """forward_probe/sitecustomize.py as a +canary step loads it: one value per probed forward for each measure this
    machine has (no GPU here: no launches), read back by ``read_probe`` and said by ``canary_text``."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    program = """
from prism_megatron.trace import markers

class Sink:
    def record_mark(self, name, phase, attrs):
        pass

class Settings:
    level = 0

markers.set_sink(Sink())
for i in range(5):
    with markers.span("forward", iteration=i):
        pass
"""
    env = dict(os.environ, FORWARD_PROBE_DIR=str(tmp_path), FORWARD_PROBE="canary", FORWARD_PROBE_SKIP="2",
               PYTHONPATH=os.pathsep.join([str(repo / "bench" / "gpu" / "forward_probe"), str(repo)]))
    subprocess.run([sys.executable, "-c", program], env=env, check=True, timeout=120)
    truth = load_bench("gpu/one_gpu_truth.py")
    found = truth.read_probe(tmp_path, "canary")
    assert found["forwards"] == 3
    assert sorted(found["canary"]) == ["aten_cpu_us", "python_us"]
    assert all(len(v) == 3 and all(x > 0 for x in v) for v in found["canary"].values())
    assert truth.canary_text(found["canary"]).startswith("python ")


def test_the_times_probe_finds_the_function_whose_own_time_grew(tmp_path):
    """FORWARD_PROBE=times as a +times step loads it: each function's own time in each probed forward, a callee's
    time taken out of its caller's; ``times_text`` names the function that grew between two sides."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    program = """
import sys, time
from prism_megatron.trace import markers

class Sink:
    def record_mark(self, name, phase, attrs):
        pass

class Settings:
    level = 0

def layer(nap):
    time.sleep(nap)
    if nap > 0.01:
        settle()
    total = 0
    for i in range(2000):  # warm: the interpreter specialises its bytecode
        total += i
    return total

def settle():
    import torch
    torch.ones(2).sum().item()
    Settings.level = len(sys.argv)  # a class assigned to at every forward: its cached reads invalidated

markers.set_sink(Sink())
for i in range(4):
    with markers.span("forward", iteration=i):
        layer(float(sys.argv[1]))
"""
    found = {}
    for side, nap in (("real", "0.002"), ("emulated", "0.012")):
        out = tmp_path / side
        env = dict(os.environ, FORWARD_PROBE_DIR=str(out), FORWARD_PROBE="times", FORWARD_PROBE_SKIP="1",
                   FORWARD_PROBE_CENSUS_EVERY="1",
                   PYTHONPATH=os.pathsep.join([str(repo / "bench" / "gpu" / "forward_probe"), str(repo)]))
        subprocess.run([sys.executable, "-c", program, nap], env=env, check=True, timeout=120)
        found[side] = load_bench("gpu/one_gpu_truth.py").read_probe(out, "times")
    truth = load_bench("gpu/one_gpu_truth.py")
    real, emulated = found["real"], found["emulated"]
    assert real["forwards"] == emulated["forwards"] == 3
    slept = [f["self_us"]["c time.sleep"] for f in emulated["forward"]]
    assert all(s >= 12_000 for s in slept)
    assert all(us < 2_000 for f in emulated["forward"] for k, us in f["self_us"].items() if k.endswith(" layer"))
    assert all(f["ms"] >= 12 and f["python_us"] > 0 for f in emulated["forward"])
    sung = emulated["forward"][0]["canary"]  # the canary and what the slowest frames do, before each forward
    assert {"python_us", "tls_us", "weakref_us", "environ_us", "module_us", "record_us", "data_ptr_us"} <= set(sung)
    assert all(v > 0 for v in sung.values())
    fingerprint = emulated["process"]  # what of the process may make frames cost more, read once
    assert "MainThread" in fingerprint["threads"] and fingerprint["gc.objects"] > 0
    counted = [[int(n) for n in b.split()[0].split("/")] for _, _, b in emulated["dynamo"]["functions"].values()]
    assert all(done <= of for done, of in counted) and any(done > 0 for done, _ in counted), counted  # warm ones
    assert "torch" in fingerprint["modules"] and fingerprint["torch.function_modes"] == 0
    assert emulated["mutations"]["censuses"] == real["mutations"]["censuses"] == 2  # after forwards 2 and 3
    assert emulated["mutations"]["classes"].get("__main__.Settings") == 2 and not real["mutations"]["classes"]
    assert fingerprint["types.unversioned"].split(":")[0].isdigit()
    assert "thp" in fingerprint and fingerprint["memory_mib"]["Rss"] > 0
    usage = emulated["forward"][0]["usage"]  # the main thread's faults and switches in each forward
    assert set(usage) == {"minflt", "majflt", "nvcsw", "nivcsw"} and usage["nvcsw"] >= 1  # it slept 12 ms
    for f in real["forward"] + emulated["forward"]:  # the host at full speed throughout, whatever this one did
        f["python_us"] = 0.03
    text = truth.times_text(real, emulated)
    assert "real 3 of 3" in text and "emulated 3 of 3" in text and "weakref " in text
    assert "main thread per forward (medians), real / emulated: minflt " in text
    # the emulated side's .item(), traced to who called it
    assert "waits apart: c Tensor.Tensor.item 0.00 / 1.00 per forward, emulated's from " in text
    assert "settle < " in text.split("emulated's from ")[1]
    assert "changed between forwards: real over 2 censuses 0 classes, " in text
    assert "emulated over 2 censuses 1 classes: __main__.Settings 2/2" in text
    most = text.split("ms per forward: ")[1].split(", ")[0]
    assert float(most.split()[0]) > 5 and "c time.sleep" in most  # ~+10 ms (sleeps of 12 and 2 ms; a loaded machine
    # oversleeps the short naps more), the first named
    assert all(f["calls"]["c time.sleep"] == 1 for f in real["forward"] + emulated["forward"])
    each = most.split("; ")[1]  # one sleep a forward on each side: the growth is in the call, not in more calls
    assert each.startswith("1 -> 1 calls at ") and float(each.split(" -> ")[2].split()[0]) >= 12_000
    real["forward"][0]["python_us"] = 0.06  # a forward the host ran at half speed is left out
    assert "real 2 of 3" in truth.times_text(real, emulated)
    for f in real["forward"]:  # none at full speed on one side: the waits and processes still compared
        f["python_us"] = 0.06
    assert "no forward at full speed on one side" in truth.times_text(real, emulated)
    assert "waits apart: c Tensor.Tensor.item" in truth.times_text(real, emulated)


def test_dynamo_text_names_what_dynamo_sees_apart():
    truth = load_bench("gpu/one_gpu_truth.py")
    real = {"functions": {"a.py:1 f": [["none"], 0], "b.py:2 g": [["run-only"], 1]},
            "counters": {"stats": {"calls_captured": 10, "unique_graphs": 3}}}
    emulated = {"functions": {"a.py:1 f": [["none", "run-only"], 2], "b.py:2 g": [["run-only"], 1]},
                "counters": {"stats": {"calls_captured": 10, "unique_graphs": 4}, "recompiles": {"x": 1}}}
    text = truth.dynamo_text(real, emulated, ["a.py:1 f", "b.py:2 g"])
    assert "a.py:1 f real none/0, emulated none+run-only/2" in text and "b.py:2 g" not in text
    assert "stats.unique_graphs 3/4" in text and "recompiles.x 0/1" in text and "calls_captured" not in text
    assert truth.dynamo_text(real, real, ["a.py:1 f"]) == ""
    real["functions"]["b.py:2 g"].append("5/5")  # the interpreter specialised g in one process, not in the other
    emulated["functions"]["b.py:2 g"].append("3/5 LOAD_ATTR@12 CALL@40")
    assert "b.py:2 g real run-only/1/5/5, emulated run-only/1/3/5 LOAD_ATTR@12 CALL@40" in \
        truth.dynamo_text(real, emulated, ["b.py:2 g"])


def test_process_text_names_the_settings_env_and_modules_apart():
    truth = load_bench("gpu/one_gpu_truth.py")
    real = {"threads": ["MainThread"], "gc.threshold": [700, 10, 10], "env": {"OMP_NUM_THREADS": "1"},
            "modules": ["json", "torch"]}
    emulated = {"threads": ["MainThread", "receiver"], "gc.threshold": [700, 10, 10], "env": {},
                "modules": ["torch", "zmq", "zmq.sugar"]}
    text = truth.process_text(real, emulated)
    assert "threads ['MainThread'] / ['MainThread', 'receiver']" in text and "gc.threshold" not in text
    assert "$OMP_NUM_THREADS 1 / -" in text
    assert "modules only real: 1 (json)" in text and "modules only emulated: 2 (zmq, zmq.sugar)" in text
    assert truth.process_text(real, real) == "; process alike" and truth.process_text(real, {}) == ""


def test_forwards_are_split_by_the_host_speed_their_canary_found():
    truth = load_bench("gpu/one_gpu_truth.py")
    real = [0.030, 0.031, 0.060, 0.029]  # the third forward ran on a slowed host
    emulated = [0.033, 0.058, 0.030]
    split = truth.canary_split([("real-spans+canary", real, [99.0, 20.0, 21.0, 30.0, 19.0]),
                                ("emu1+canary", emulated, [24.0, 35.0, None])])  # None: a copied host time
    assert split == [("real-spans+canary", [20.0, 21.0, 19.0], [30.0]),  # the last four forwards were probed
                     ("emu1+canary", [24.0], [35.0])]


def test_a_forward_body_is_its_longest_stretch_without_a_collective():
    truth = load_bench("gpu/one_gpu_truth.py")
    spans = [["forward", 0.0, 0.010], ["collective", 0.001, 0.0], ["collective", 0.002, 0.0],
             ["collective", 0.009, 0.0], ["backward", 0.010, 0.020], ["collective", 0.025, 0.0],
             ["forward", 0.030, 0.004], ["backward", 0.034, 0.008]]
    bodies = truth._bodies(spans)
    assert [round(b, 6) for b in bodies] == [7.0, 4.0]  # 2-9 ms; a forward without collectives: all of it
    step = {"iterations": {"1": {"ms": 50.0}}, "measured_from": 1, "spans": spans}
    split = truth.real_spans(step, 2)
    assert round(split["body_ms"], 6) == 11.0 and round(split["forward_ms"], 6) == 14.0
    assert "14.0 (body 11.0) + 28.0 + 8.0" in truth.split_text(split)


def test_a_forward_probe_on_a_real_run_without_spans_is_refused_before_it_runs(tmp_path):
    truth = load_bench("gpu/one_gpu_truth.py")
    config = truth.config_of("dense-bf16-mbs2")
    with pytest.raises(ValueError, match=r"'00-real-threads1\+calls'.*only real-spans"):
        truth.step("real-threads1+calls", config, tmp_path, 4, 0, 10.0)
    assert not any(tmp_path.iterdir())  # nothing ran


def test_a_real_run_beside_a_neighbour_has_the_neighbour_for_its_length_only(tmp_path, monkeypatch):
    """``real-spans-neighbour`` runs the spans driver while bench/gpu/neighbour.py wakes beside it, and stops the
    neighbour with the step."""
    import json
    import os
    import time
    from pathlib import Path

    truth = load_bench("gpu/one_gpu_truth.py")

    def neighbours() -> list[int]:
        found = []
        for d in Path("/proc").iterdir():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
                parent = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent == os.getpid() and any(c.endswith(b"neighbour.py") for c in cmd):
                found.append(int(d.name))
        return found

    seen: dict[str, object] = {}

    def run(cmd, log, env, timeout):
        deadline = time.monotonic() + 10
        while not neighbours() and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["during"], seen["cmd"] = neighbours(), cmd
        Path(env["SPANS_OUT"]).write_text(json.dumps([["forward", 0.0, 0.01]]))
        return ""

    monkeypatch.setattr(truth, "_run", run)
    result = truth.step("real-spans-neighbour", truth.config_of("dense-bf16-mbs2"), tmp_path, 4, 0, 10.0)
    assert len(seen["during"]) == 1 and neighbours() == []  # one beside the run, none after it
    assert any(str(c).endswith("spans_driver.py") for c in seen["cmd"])
    assert result["kind"] == "real-spans-neighbour" and result["spans"] == [["forward", 0.0, 0.01]]
    assert not truth.is_truth("real-spans-neighbour")  # a diagnosis, never what the emulations are scored against


def test_a_launched_real_program_runs_as_a_prism_rank_and_is_split_not_scored(tmp_path, monkeypatch):
    """``launched-spans`` runs the spans driver as the one rank of ``prism-megatron launch`` (not ``run
    --prism-emulate``); with a probe suffix its spans still split its iterations in the row, as a real-spans
    run's do, and it is never a real run the emulations are scored against."""
    import json
    from pathlib import Path

    truth = load_bench("gpu/one_gpu_truth.py")
    seen: dict[str, object] = {}
    spans = [[name, float(i), 0.01] for i in range(16) for name in ("forward", "backward")]

    def run(cmd, log, env, timeout):
        seen["cmd"] = cmd
        Path(env["SPANS_OUT"]).write_text(json.dumps(spans))
        return "".join(f" iteration {k}/ 8 | elapsed time per iteration (ms): {100 + k}.0 | lm loss: 1.0E+01 |\n"
                       for k in range(1, 9))

    monkeypatch.setattr(truth, "_run", run)
    config = truth.config_of("dense-bf16-mbs2")  # 4 micro-batches an iteration
    launched = truth.step("launched-spans", config, tmp_path, 8, 0, 10.0)
    cmd = [str(c) for c in seen["cmd"]]
    assert cmd[cmd.index("-m") + 1:cmd.index("-m") + 3] == ["prism_megatron", "launch"]
    assert "--prism-emulate" not in cmd and cmd[cmd.index("--gpu-timing") + 1] == "off"
    assert cmd[cmd.index("--") + 1].endswith("spans_driver.py")
    assert not truth.is_truth(launched["kind"])
    launched["kind"] += "+times"  # as a probed step is named (step's ``counted``)
    row = truth.analyse_config([launched], tmp_path, microbatches=truth.microbatches(config))
    assert [k for k, _ in row["spans"]] == ["launched-spans+times"]
    assert row["spans"][0][1]["iterations"] == 2  # 3 and 4: 16 forwards, 4 an iteration
    assert "real_ms" not in row


def test_a_real_program_given_one_part_of_a_rank_is_told_it_and_set_against_the_plain_real_run(tmp_path, monkeypatch):
    """``real-spans-history`` / ``-receiver`` tell the spans driver the rank's part to add, ``real-spans-rankenv``
    runs in the environment the launcher gives its rank but rendezvouses as a plain process; none is scored, and
    with ``+times`` each is set against the plain ``real-spans`` run, not against one another."""
    from pathlib import Path

    truth = load_bench("gpu/one_gpu_truth.py")
    ran: dict[str, tuple[list[str], dict[str, str]]] = {}

    def run(cmd, log, env, timeout):
        ran[log.stem] = ([str(c) for c in cmd], env)
        Path(env["SPANS_OUT"]).write_text("[]")
        return ""

    monkeypatch.setattr(truth, "_run", run)
    config = truth.config_of("dense-bf16-mbs2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for i, kind in enumerate(("real-spans", "real-spans-history", "real-spans-receiver", "real-spans-rankenv",
                              "real-spans-forked", "launched-spans-exec", "launched-spans-fork",
                              "real-spans-forked-launcher")):
        truth.step(kind, config, tmp_path, 4, i, 10.0)
    envs = {name: env for name, (_, env) in ran.items()}
    assert envs["01-real-spans-history"]["SPANS_MEMORY_HISTORY"] == "1"
    assert "SPANS_IDLE_RECEIVER" not in envs["01-real-spans-history"]
    assert envs["02-real-spans-receiver"]["SPANS_IDLE_RECEIVER"] == "1"
    assert not {"SPANS_MEMORY_HISTORY", "SPANS_IDLE_RECEIVER", "PRISM_EMULATED"} & set(envs["00-real-spans"])
    plain, ranked = envs["00-real-spans"], envs["03-real-spans-rankenv"]
    assert ranked["PRISM_EMULATED"] == "1" and ranked["CUDA_VISIBLE_DEVICES"] == "0"
    assert ranked["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1" and ranked["TORCH_DIST_INIT_BARRIER"] == "0"
    assert ranked["OMP_NUM_THREADS"].isdigit()  # the launcher's rule for a rank's torch threads
    assert "TORCHELASTIC_USE_AGENT_STORE" not in ranked  # it rendezvouses as the plain process does, on its own
    assert ranked["MASTER_ADDR"] == plain["MASTER_ADDR"] and ranked["RANK"] == "0"
    assert ran["03-real-spans-rankenv"][0][1].endswith("spans_driver.py")
    forked = ran["04-real-spans-forked"][0]  # the forked child runs the spans driver, which runs the program
    assert forked[1].endswith("forked_driver.py") and forked[2].endswith("spans_driver.py")
    assert forked[3] == str(truth.DRIVER_SCRIPT)
    fresh = ran["05-launched-spans-exec"][0]
    assert fresh[fresh.index("-m") + 1:fresh.index("-m") + 3] == ["prism_megatron", "launch"]
    assert fresh[fresh.index("--rank-start") + 1] == "exec"
    assert ran["06-launched-spans-fork"][0][fresh.index("--rank-start") + 1] == "fork"
    launcher_like, launcher_env = ran["07-real-spans-forked-launcher"]
    assert launcher_like[1].endswith("forked_driver.py") and launcher_env["FORKED_AS_LAUNCHER"] == "all"
    assert "FORKED_AS_LAUNCHER" not in ran["04-real-spans-forked"][1]
    assert not any(truth.is_truth(k) for k in truth.SPANNED)

    monkeypatch.setattr(truth, "times_text", lambda real, other: f"{real['side']} -> {other['side']}")
    steps = [{**_step(f"{kind}+times", 900.0), "times": {"side": kind, "forward": []}}
             for kind in ("real-spans", "real-spans-history", "launched-spans")]
    report = {"steps": {"dense-bf16-mbs2": [_step("real-threads1", 200.0), *steps]}}
    text = truth.analyse(report, tmp_path)
    assert "real-spans-history+times against real-spans+times: real-spans -> real-spans-history" in text
    assert "launched-spans+times against real-spans+times: real-spans -> launched-spans" in text
    assert "real-spans+times against" not in text


def test_the_compiled_call_frames_are_set_side_by_side_per_call_over_every_forward():
    """``frames_text``: each compiled-call frame's own time per call over all of a step's forwards (the host's speed
    in each forward aside), matched by file and function whatever the line, a C function by its name."""
    truth = load_bench("gpu/one_gpu_truth.py")

    def forward(scale: float) -> dict:
        keys = {"torch/_inductor/output_code.py:628 __call__": (36, 13.0),
                "torch/_inductor/utils.py:3397 run": (36, 9.0), "c builtins.isinstance": (1595, 5.0),
                "torch/_inductor/output_code.py:99 helper": (5, 100.0)}
        return {"python_us": 0.05, "self_us": {k: n * us * scale for k, (n, us) in keys.items()},
                "calls": {k: n for k, (n, _) in keys.items()}}

    real = {"forward": [forward(1.0), forward(1.0)]}
    launched = {"forward": [forward(1.0), forward(5.0)]}  # one forward five times slower: 3x on average
    text = truth.frames_text([("real-spans+times", real), ("launched-spans+times", launched)])
    assert "output_code.__call__ real-spans 13.0 (36), launched-spans 39.0 (36)" in text
    assert "utils.run real-spans 9.0 (36), launched-spans 27.0 (36)" in text
    assert "builtins.isinstance real-spans 5.0 (1595), launched-spans 15.0 (1595)" in text
    assert "helper" not in text  # another function of the same file is not one of the frames
    assert "no compiled-call frame" in truth.frames_text([("real-spans+times", {"forward": [
        {"python_us": 0.05, "self_us": {"a.py:1 f": 50}, "calls": {"a.py:1 f": 1}}]})])


def test_a_forked_child_runs_the_spans_driver_to_its_exit_functions(tmp_path):
    """``real-spans-forked``: ``forked_driver.fork_and_run`` runs the spans driver in a forked child, whose exit
    functions run as a plain process's do, so the spans it keeps are written; and the child's exit code comes back."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    program = tmp_path / "program.py"
    program.write_text("import sys\nfrom prism_megatron.trace import markers\nfor i in range(3):\n"
                       "    with markers.span('forward', iteration=i):\n        pass\nsys.exit(int(sys.argv[1]))\n")
    spans = tmp_path / "spans.json"
    runner = ("import sys; sys.path.insert(0, sys.argv[1]); import forked_driver; "
              "sys.exit(forked_driver.fork_and_run(sys.argv[2], sys.argv[3:]))")
    env = dict(os.environ, SPANS_OUT=str(spans), PYTHONPATH=str(repo))
    for code in (0, 3):
        spans.unlink(missing_ok=True)
        done = subprocess.run([sys.executable, "-c", runner, str(repo / "bench" / "gpu"),
                               str(repo / "bench" / "gpu" / "spans_driver.py"), str(program), str(code)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == code, done.stderr
        assert [name for name, _, _ in json.loads(spans.read_text())] == ["forward"] * 3


def test_a_template_given_the_launchers_state_forks_a_child_that_inherits_it_and_closes_the_control_socket(tmp_path):
    """``real-spans-forked-launcher``: the template imports what the launcher imports, handles SIGTERM in Python, runs
    a child process and holds a connected socket at its fork; its child inherits the first three and closes the
    socket as the launcher's rank closes its control connection. An unknown part is named."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    program = tmp_path / "program.py"
    program.write_text(
        "import os, signal, sys\n"
        "handled = signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)\n"
        "import stat\n"  # the number may be open again, on a file: the socket itself must be gone
        "try:\n    closed = not stat.S_ISSOCK(os.fstat(int(os.environ['CLOSED_FD'])).st_mode)\n"
        "except OSError:\n    closed = True\n"
        "imported = 'prism_megatron.launcher.launch' in sys.modules\n"
        "sys.exit(0 if handled and closed and imported else 10 + 4 * handled + 2 * closed + imported)\n")
    runner = ("import os, sys; sys.path.insert(0, sys.argv[1]); import forked_driver as d; "
              "held, close = d.as_the_launcher(sys.argv[2].split(',')); os.environ['CLOSED_FD'] = str(close[0]); "
              "alive = held[0].poll() is None; code = d.fork_and_run(sys.argv[3], [], tuple(close)); held[0].kill(); "
              "sys.exit(code if alive else 9)")
    env = dict(os.environ, PYTHONPATH=str(repo))
    done = subprocess.run([sys.executable, "-c", runner, str(repo / "bench" / "gpu"), "child,socket,signals,imports",
                           str(program)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    bad = subprocess.run([sys.executable, "-c", runner, str(repo / "bench" / "gpu"), "socket,threads", str(program)],
                         env=env, capture_output=True, text=True, timeout=180)
    assert bad.returncode != 0 and "FORKED_AS_LAUNCHER: unknown threads" in bad.stderr


def test_the_spans_driver_gives_the_plain_process_the_rank_part_it_is_asked_for(monkeypatch):
    """``SPANS_IDLE_RECEIVER=1``: a thread blocked in a socket read for the program's life; ``SPANS_MEMORY_HISTORY=1``
    where there is no CUDA device: an error naming it, not a run without the history."""
    import threading

    import torch

    driver = load_bench("gpu/spans_driver.py")
    monkeypatch.delenv("SPANS_MEMORY_HISTORY", raising=False)
    monkeypatch.setenv("SPANS_IDLE_RECEIVER", "1")
    kept = driver._as_a_rank()
    receiver = next(t for t in threading.enumerate() if t.name == "idle-receiver")
    receiver.join(0.2)
    assert receiver.is_alive() and receiver.daemon  # blocked in its read
    kept[1].close()  # the other end gone: the read returns and the thread ends
    receiver.join(5)
    assert not receiver.is_alive()
    kept[0].close()
    monkeypatch.delenv("SPANS_IDLE_RECEIVER")
    assert driver._as_a_rank() == []
    monkeypatch.setenv("SPANS_MEMORY_HISTORY", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="SPANS_MEMORY_HISTORY=1 records the CUDA allocator's history"):
        driver._as_a_rank()


def test_each_emulation_variant_runs_prism_with_its_flag(tmp_path, monkeypatch):
    """``emuW-off`` turns GPU timing off, ``emuW-nolive`` the live prediction, ``emuW-awake`` spins through every
    wait for a grant, ``emuW-fork`` forks the ranks from the launcher's template; the plain ``emuW`` none of them."""
    truth = load_bench("gpu/one_gpu_truth.py")
    ran: dict[str, list[str]] = {}
    envs: dict[str, dict[str, str]] = {}

    def run(cmd, log, env, timeout):
        ran[log.stem], envs[log.stem] = cmd, env
        return ""

    monkeypatch.setattr(truth, "_run", run)
    config = truth.config_of("dense-bf16-mbs2")
    for name in ("PRISM_SPIN_GRANT_US", "PRISM_PIN_CORES"):
        monkeypatch.delenv(name, raising=False)
    for i, kind in enumerate(("emu1", "emu1-off", "emu2-nolive", "emu1-awake", "emu1-fork")):
        truth.step(kind, config, tmp_path, 4, i, 10.0)
    assert envs["03-emu1-awake"]["PRISM_SPIN_GRANT_US"] == "10000000" and "PRISM_PIN_CORES" not in envs["03-emu1-awake"]
    assert "PRISM_SPIN_GRANT_US" not in envs["00-emu1"]
    flags = {name: [f for f in cmd if f.startswith("--prism-")] for name, cmd in ran.items()}
    assert not {"--prism-gpu-timing", "--prism-live-prediction", "--prism-rank-start"} & set(flags["00-emu1"])
    assert ran["04-emu1-fork"][ran["04-emu1-fork"].index("--prism-rank-start") + 1] == "fork"
    assert ran["01-emu1-off"][ran["01-emu1-off"].index("--prism-gpu-timing") + 1] == "off"
    assert ran["02-emu2-nolive"][ran["02-emu2-nolive"].index("--prism-live-prediction") + 1] == "off"
    with pytest.raises(ValueError, match="unknown step 'emu1-never'"):
        truth.step("emu1-never", config, tmp_path, 4, 5, 10.0)


def test_a_committed_result_compressed_as_json_gz_reads_as_its_json_and_names_its_run(tmp_path):
    import gzip
    import json

    truth = load_bench("gpu/one_gpu_truth.py")
    report = {"steps": {"dense-bf16-mbs2": [_step("real-threads1", 200.0), _step("emu1", 202.0),
                                            _step("real-threads1", 200.0)]}, "configs": {}}
    plain, packed = tmp_path / "x-run7.json", tmp_path / "x-run8.json.gz"
    plain.write_text(json.dumps(report))
    packed.write_bytes(gzip.compress(json.dumps(report).encode()))
    text = truth.analyse_runs([plain, packed])
    assert "dense-bf16-mbs2 [run7]" in text and "dense-bf16-mbs2 [run8]" in text
    assert "(2 emulations): 1.00 %" in text
    (tmp_path / "bad-run9.json.gz").write_bytes(b"not gzip")
    with pytest.raises(SystemExit, match="bad-run9.json.gz: not JSON"):
        truth.analyse_runs([tmp_path / "bad-run9.json.gz"])


def test_the_wait_before_each_iteration_is_set_against_the_host_time_of_those_that_measured_their_own(tmp_path):
    from prism_megatron.trace import write_trace

    truth = load_bench("gpu/one_gpu_truth.py")
    manifest = {"world_size": 1, "groups": [{"id": 0, "name": "w", "ranks": [0], "backend": "nccl"}],
                "ranks": [{"rank": 0, "exit_code": 0, "device": "cuda:0"}]}
    # iteration k: begins after a wait of 10 k ms; host time 100 + k ms, except that each even iteration (a profiled
    # one) copies the one before it
    marks, gpu, t, clock = [], [], 0.0, 0.0
    for k in range(1, 11):
        t += 0.010 * k
        host = 0.100 + 0.001 * (k if k % 2 else k - 1)
        marks += [{"rank": 0, "name": "iteration", "phase": "B", "t": t, "compute_clock": clock, "attrs": {}},
                  {"rank": 0, "name": "iteration", "phase": "E", "t": t + 0.5, "compute_clock": clock + 0.4,
                   "attrs": {}}]
        gpu.append({"rank": 0, "clock_start": clock, "clock_end": clock + 0.4, "cpu": host, "gpu": 0.3, "syncs": []})
        t, clock = t + 0.5, clock + 0.4
    path = write_trace(tmp_path / "t", manifest, [], marks=marks, gpu=gpu)
    got = truth.waits_and_host(path)
    assert sorted(got["host_ms"]) == [3, 5, 7, 9]  # from the warm-up's end, the even ones left out
    assert got["waits_ms"][5] == pytest.approx(50.0) and got["host_ms"][5] == pytest.approx(105.0)
    assert got["correlation"] == pytest.approx(1.0) and got["early"][0] < got["late"][0]
    assert truth.waits_and_host(write_trace(tmp_path / "untimed", manifest, [], marks=marks)) is None


def test_a_host_only_segment_longer_without_the_profiler_than_with_it_is_named(tmp_path):
    """The first segment after an iteration's end (the log line's code) took 2.5-3.6 ms in the plain iterations and
    0.5-1.0 in the profiled ones (the first CUDA call after CUPTI's teardown, runs 47-50): GPU timing's own cost in
    the host time both twins take. The profiled iterations are the slower ones overall; a segment with device work
    (waits that differ) is not named."""
    from prism_megatron.trace import write_trace

    truth = load_bench("gpu/one_gpu_truth.py")
    manifest = {"world_size": 1, "groups": [{"id": 0, "name": "w", "ranks": [0], "backend": "nccl"}],
                "ranks": [{"rank": 0, "exit_code": 0, "device": "cuda:0"}]}

    def trace(name: str, first_plain_ms: float) -> object:
        # per iteration: a host-only segment before its begin (the log line), a body with device work, one after
        marks, gpu, clock = [], [], 0.0
        for k in range(1, 11):
            profiled = k % 2 == 0
            segs = [((0.5 if profiled else first_plain_ms) / 1e3, 0.0), ((130.0 if profiled else 100.0) / 1e3, 0.05),
                    (0.3e-3, 0.0)]
            gpu.append({"rank": 0, "clock_start": clock, "clock_end": clock + segs[0][0], "cpu": segs[0][0],
                        "gpu": 0.0, "syncs": []})
            clock += segs[0][0]
            marks.append({"rank": 0, "name": "iteration", "phase": "B", "t": clock, "compute_clock": clock,
                          "attrs": {}})
            for d, g in segs[1:]:
                gpu.append({"rank": 0, "clock_start": clock, "clock_end": clock + d, "cpu": d, "gpu": g, "syncs": []})
                clock += d
            marks.append({"rank": 0, "name": "iteration", "phase": "E", "t": clock, "compute_clock": clock,
                          "attrs": {}})
        return write_trace(tmp_path / name, manifest, [], marks=marks, gpu=gpu)

    got = truth.plain_excess(trace("artefact", 2.9))
    assert [(x["segment"], round(x["plain_ms"], 2), round(x["profiled_ms"], 2)) for x in got] == [(0, 2.9, 0.5)]
    assert truth.plain_excess(trace("clean", 0.45)) == []  # the profiled body slower, the first segment not


def test_the_packed_traces_leave_out_the_coordinators_live_snapshots_and_keep_the_rest(tmp_path):
    """A live snapshot (``trace-NN.logs/live-trace``) is the run's trace again, cut at its last logged iteration; the
    trace, its logs and a directory merely named like it stay."""
    import tarfile

    truth = load_bench("gpu/one_gpu_truth.py")
    work = tmp_path / "work"
    for rel in ("c/trace-01-emu1/gpu.parquet", "c/trace-01-emu1.logs/rank-0.log",
                "c/trace-01-emu1.logs/live-trace/gpu.parquet", "c/live-trace/kept.txt", "c/01-emu1.log"):
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(rel)
    packed = tmp_path / "traces.tar.gz"
    with tarfile.open(packed, "w:gz") as tar:
        tar.add(work, arcname="work", filter=truth._without_live_snapshots)
    with tarfile.open(packed) as tar:
        files = sorted(m.name for m in tar.getmembers() if m.isfile())
    assert files == ["work/c/01-emu1.log", "work/c/live-trace/kept.txt", "work/c/trace-01-emu1.logs/rank-0.log",
                     "work/c/trace-01-emu1/gpu.parquet"]


def test_the_template_probe_runs_its_workload_in_a_child_of_a_template_that_imported_the_variants_modules(
        monkeypatch, capsys):
    """Each forked variant imports its modules, forks, and prints what its child measured (the child's own pid: a
    fork, not the template); a fresh variant runs the workload in its own process; a bad variant is named."""
    import json
    import os
    import sys

    probe = load_bench("gpu/fork_template_probe.py")
    parent = os.getpid()
    monkeypatch.setattr(probe, "workload", lambda: {"pid": os.getpid(), "json_loaded": "json" in sys.modules})
    probe.child(("json",))
    forked = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert forked["pid"] != parent and forked["json_loaded"]
    probe.child(None)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["pid"] == parent
    monkeypatch.setattr(sys, "argv", ["fork_template_probe.py", "--variants", "fresh,fork-nothing"])
    with pytest.raises(SystemExit):
        probe.main()
    assert "unknown fork-nothing" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["fork", "exec"])
def test_the_template_probe_runs_its_workload_as_a_launched_rank_started_either_way(mode):
    """The launched variants run the workload as rank 0 of a one-rank launch job: forked, the rank holds the launcher's
    modules; exec'd, a fresh interpreter, it does not. Both measure the same figures (CPU here, the GPU there)."""
    probe = load_bench("gpu/fork_template_probe.py")
    found = probe.launched(mode)
    assert "error" not in found, found.get("error")
    assert found["rank"] == "0"
    assert found["launcher_loaded"] is (mode == "fork")
    assert found["compiled_grad_us"] > 0 and found["isinstance_us"] > 0
