"""Memory-aware residency with a stand-in swapper that enforces a device budget (no GPU needed)."""

from __future__ import annotations

import random

import pytest

from prism_megatron.launcher.config import LaunchConfig, LaunchError
from prism_megatron.runtime.memory import DeviceMemory, HostBudget
from prism_megatron.runtime.swap import BudgetSwapper, SwapNoRoom

GIB = 2**30


def _device(capacity_gib: int, footprints: dict[int, int]) -> tuple[DeviceMemory, BudgetSwapper]:
    sw = BudgetSwapper(capacity_gib * GIB)
    mem = DeviceMemory(capacity_gib * GIB, sw)
    for r, f in footprints.items():
        mem.report(r, f * GIB)
    return mem, sw


def test_evicts_the_rank_that_will_wait_longest():
    # 4 ranks of 60 GiB; a 141 GiB device holds 2. Each ran once (reported), then was swapped out.
    mem, sw = _device(300, {r: 60 for r in range(4)})
    pids = {r: 1000 + r for r in range(4)}
    for r in range(4):
        mem.swap_out(r, pids[r])
    mem.capacity = sw.capacity = 141 * GIB
    waits = {0: 1.0, 1: 5.0, 2: 0.0, 3: 0.0}  # rank 1's collective misses the most members
    assert mem.make_resident(0, 0, [], pids, waits.get)  # need 0: no growth beyond what it holds
    mem.released(0)
    assert mem.make_resident(1, 0, [0], pids, waits.get)
    mem.released(1)
    assert mem.resident == {0, 1}
    assert mem.make_resident(2, 0, [0, 1], pids, waits.get)
    assert mem.resident == {0, 2}  # rank 1 went out, not rank 0
    assert sw.log[-2:] == [("out", 1), ("in", 2)]
    assert mem.used() <= mem.capacity
    assert mem.stats[1].swaps_out == 2 and mem.stats[2].swaps_in == 1 and mem.stats[2].bytes_in == 60 * GIB


def test_never_over_budget_under_random_schedules():
    rng = random.Random(7)
    for _ in range(50):
        n = rng.randint(2, 10)
        cap = rng.randint(100, 300)
        sizes = {r: rng.randint(10, 100) for r in range(n)}
        mem, sw = _device(10_000, sizes)
        pids = dict.fromkeys(sizes, 1)
        for r in sizes:
            mem.swap_out(r, 1)
        mem.capacity = sw.capacity = cap * GIB
        running: set[int] = set()
        for _ in range(200):
            r = rng.randrange(n)
            if r in running:
                running.discard(r)  # it blocks: evictable now
                mem.released(r)
                continue
            blocked = [x for x in sizes if x not in running]
            if mem.make_resident(r, 0, blocked, pids, lambda x: rng.random()):
                running.add(r)
                assert r in mem.resident
            assert mem.used() <= mem.capacity
            assert sum(sw.used.values()) <= sw.capacity
            assert running <= mem.resident  # a computing rank is never swapped out


def test_restore_without_room_waits_for_an_evictable_rank():
    mem, sw = _device(200, {0: 60, 1: 60})
    mem.swap_out(1, 2)
    mem.capacity = sw.capacity = 100 * GIB
    assert not mem.make_resident(1, 0, [], {0: 1, 1: 2}, lambda r: 0)  # rank 0 computes: cannot evict it
    assert mem.resident == {0}
    assert mem.make_resident(1, 0, [0], {0: 1, 1: 2}, lambda r: 0)  # rank 0 blocked now
    assert mem.resident == {1} and mem.stats[0].swaps_out == 1 and mem.stats[1].swaps_in == 1


def test_swap_outs_stay_within_the_host_memory_budget():
    """Checkpointed state lives in host RAM: a victim whose state does not fit the host budget is
    passed over (another that fits is taken), and with none that fits the rank waits."""
    mem, sw = _device(300, {0: 60, 1: 60, 2: 40})
    mem.host = HostBudget(50 * GIB)
    mem.capacity = sw.capacity = 160 * GIB
    pids = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}
    for r, f in ((3, 40), (4, 50)):  # ranks that ran before and are out (their state held elsewhere)
        mem.footprint[r], mem.stats[r] = f * GIB, mem.stats[0].__class__()
    waits = {0: 9.0, 1: 5.0, 2: 1.0, 3: 0.0}  # rank 0 would be the first choice, but 60 GiB do not fit the host
    for r in (3, 4):
        mem.swapped.add(r)
    assert mem.make_resident(3, 0, [0, 1, 2], pids, waits.get)
    mem.released(3)
    assert sw.log[-2:] == [("out", 2), ("in", 3)] and mem.host.held == {2: 40 * GIB}
    assert not mem.make_resident(4, 0, [0, 1, 3], pids, waits.get)  # 10 GiB of host left: no victim fits
    assert mem.resident == {0, 1, 3} and mem.used() <= mem.capacity
    mem.forget(0)  # rank 0 ended: room on the device, no swap-out needed
    assert mem.make_resident(2, 0, [1, 3], pids, waits.get)
    assert mem.resident == {1, 2, 3} and mem.host.held == {}  # its host memory is free again


def test_a_swapped_out_rank_that_fits_comes_back_first_so_its_host_memory_takes_the_victims_state():
    """Issue 18's shape under checkpoint swaps (H200, host budget 100 GiB): rank 0 was out with 7.6 GiB of
    state in host memory, rank 1 resident with 96.7 GiB, blocked; rank 0's turn needs 95.6 GiB. Rank 1's state
    fits the budget only once rank 0's is back on the device, which its 7.6 GiB fit as it is: restore first,
    then evict. Before, the job hung with "rank 1 stays: its swap out needs 96.7 GiB, 92.4 GiB are left"."""
    mib = 2**20
    mem, sw = _device(140, {})
    for r, f in ((0, 7782), (1, 99021)):  # 7.6 and 96.7 GiB
        mem.report(r, f * mib)
    mem.host = HostBudget(100 * GIB)
    pids = {0: 1, 1: 2}
    mem.swap_out(0, pids[0])
    assert mem.host.held == {0: 7782 * mib}
    assert mem.make_resident(0, 97894 * mib, [1], pids, lambda r: r)  # 95.6 GiB
    assert sw.log[-2:] == [("in", 0), ("out", 1)]
    assert mem.host.held == {1: 99021 * mib} and mem.resident == {0}
    assert mem.used() <= mem.capacity
    # where its state does not fit the device as it is, the victims go first, within the budget as it stands
    mem2, sw2 = _device(100, {0: 50, 1: 60})
    mem2.host = HostBudget(120 * GIB)
    mem2.swap_out(0, pids[0])
    assert mem2.make_resident(0, 50 * GIB, [1], pids, lambda r: r)
    assert sw2.log[-2:] == [("out", 1), ("in", 0)]
    # and a budget too small for the victim even with the rank's host memory back is refused, nothing moved
    mem3, sw3 = _device(140, {0: 8, 1: 100})
    mem3.host = HostBudget(95 * GIB)
    mem3.swap_out(0, pids[0])
    moved = list(sw3.log)
    assert not mem3.make_resident(0, 60 * GIB, [1], pids, lambda r: r)
    assert sw3.log == moved and mem3.swapped == {0} and mem3.resident == {1}
    assert mem3.held_out(0) is None  # its 8 GiB fit beside rank 1: it is kept out by the budget alone
    # the H200 run's second hang: rank 1 out with 96.6 GiB in host memory, rank 0 resident with 96.7 GiB
    mem4, _ = _device(140, {})
    for r, f in ((1, 98918), (0, 99021)):
        mem4.report(r, f * mib)
    mem4.host = HostBudget(100 * GIB)
    mem4.swap_out(1, pids[1])
    assert not mem4.make_resident(1, 98918 * mib, [0], pids, lambda r: r)
    why = mem4.held_out(1)
    assert "rank 1 is out, its state taking 96.6 GiB of host memory" in why and "cannot come back first" in why
    assert "--swap inprocess copies only the blocks in use" in why
    assert mem4.kept_in([0]) == [(0, 99021 * mib)]


def test_a_rank_without_cuda_state_is_never_evicted_and_is_admitted_with_room_for_its_need():
    """A rank blocked before its first CUDA call reports 0 bytes; the driver refuses to lock such a
    process (CUDA_ERROR_NOT_INITIALIZED on the H200, the stand-in likewise). It must not be picked as a victim,
    and when it runs again room is made for what it may allocate (the caller's need), before it runs."""
    mem, sw = _device(100, {0: 40, 1: 40})
    pids = {r: 10 + r for r in range(3)}
    mem.report(2, 0)  # rank 2 blocked in init_process_group: no CUDA context yet
    assert 2 not in mem.resident
    mem.capacity = sw.capacity = 90 * GIB
    mem.enforce([0, 1, 2], pids, lambda r: {2: 9.0}.get(r, 0.0))  # rank 2 waits longest; nothing to free
    assert sw.log == [] and mem.resident == {0, 1}
    assert mem.make_resident(2, 40 * GIB, [0, 1, 2], pids, lambda r: {0: 1.0}.get(r, 0.0))  # 40 GiB made free
    assert sw.log == [("out", 0)] and mem.resident == {1} and mem.used() == 80 * GIB  # its reserve counts
    assert not mem.make_resident(0, 0, [], pids, lambda r: 0.0)  # rank 2 computes: its 40 GiB are held
    mem.report(2, 30 * GIB)  # it allocated, then blocked: an ordinary resident from now on
    mem.released(2)
    assert mem.used() == 70 * GIB
    assert mem.make_resident(0, 0, [1, 2], pids, lambda r: {2: 1.0}.get(r, 0.0))
    assert sw.log[-2:] == [("out", 2), ("in", 0)]


def test_admission_reserves_the_expected_peak_and_evicts_blocked_ranks_for_it():
    """A rank that grows in its turn: admitted with room for its peak, not for what it held."""
    mem, sw = _device(100, {0: 30, 1: 30, 2: 30})
    pids = {r: r for r in range(3)}
    assert mem.make_resident(0, 70 * GIB, [1, 2], pids, lambda r: r)  # 30 held, 70 expected: one must go
    assert sw.log == [("out", 2)] and mem.used() == 100 * GIB
    assert mem.reserve == {0: 70 * GIB}
    mem.report(0, 70 * GIB)  # it grew to its peak and blocked
    mem.released(0)
    assert mem.used() == 100 * GIB and mem.reserve == {}
    assert not mem.make_resident(2, 30 * GIB, [], pids, lambda r: r)  # nobody evictable: it waits, nothing moved
    assert sw.log == [("out", 2)]
    assert mem.make_resident(2, 30 * GIB, [0, 1], pids, {0: 1.0, 1: 0.0}.get)
    assert sw.log[-2:] == [("out", 0), ("in", 2)] and mem.used() == 60 * GIB


def test_stand_in_refuses_restore_without_room():
    sw = BudgetSwapper(GIB)
    sw.footprint[5] = 2 * GIB
    with pytest.raises(SwapNoRoom, match="rank 5: restore of 2147483648 bytes does not fit"):
        sw.restore(5, 1)


@pytest.mark.parametrize(("kw", "msg"), [
    ({"swap": "sometimes"},
     "--swap must be auto, none, inprocess, checkpoint, budget, budget-auto or budget-inprocess, got 'sometimes'"),
    ({"swap": "checkpoint"}, "--swap checkpoint needs GPU --devices"),
    ({"swap": "budget"}, "--swap budget needs --device-memory GiB"),
    ({"device_memory_gib": -2.0}, "--device-memory must be a positive number of GiB, got -2.0"),
    ({"host_memory_gib": 0.0}, "--host-memory must be a positive number of GiB, got 0.0"),
])
def test_swap_options_are_validated(tmp_path, kw, msg):
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(LaunchError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        LaunchConfig(script=script, world_size=2, trace_dir=tmp_path / "t", **kw).validate()


def test_checkpoint_swaps_turn_gpu_timing_off_and_refuse_it_when_asked_for(tmp_path):
    """The driver cannot lock a process the CUDA profiler ran in (H200 lock probe: NOT_SUPPORTED), so
    --swap checkpoint means no GPU timing; asking for both is an error that says what to do."""
    script = tmp_path / "s.py"
    script.write_text("")
    gpu = dict(script=script, world_size=2, trace_dir=tmp_path / "t", devices=["0"])
    assert LaunchConfig(**gpu).times_gpu and LaunchConfig(**gpu, swap="none").times_gpu
    assert not LaunchConfig(**gpu, swap="checkpoint").times_gpu
    with pytest.raises(LaunchError, match="--swap checkpoint and GPU timing exclude each other.*--swap none"):
        LaunchConfig(**gpu, swap="checkpoint", gpu_timing=True).validate()


def test_auto_swap_is_none_on_cpu_and_swaps_with_gpu_timing_gated_on_a_gpu(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    base = dict(script=script, world_size=2, trace_dir=tmp_path / "t")
    cpu = LaunchConfig(**base).validate()
    assert (cpu.swap_mode, cpu.host_memory) == ("none", None)
    gpu = LaunchConfig(**base, devices=["0"])
    assert (gpu.swap_mode, gpu.swapper, gpu.times_gpu) == ("auto", "cuda", True)
    assert LaunchConfig(**base, devices=["0"], swap="none").swap_mode == "none"
    stand_in = LaunchConfig(**base, swap="budget-auto", device_memory_gib=10).validate()
    assert (stand_in.swap_mode, stand_in.swapper, stand_in.host_memory) == ("auto", "budget", None)
    assert LaunchConfig(**base, swap="budget", device_memory_gib=10).validate().swap_mode == "checkpoint"


def test_a_device_without_swaps_by_iteration_1_is_pinned_for_gpu_timing_and_swaps_no_more():
    mem, sw = _device(100, {r: 30 for r in range(3)})
    pids = {r: 1000 + r for r in range(4)}
    on, why = mem.timing_verdict()
    assert on and mem.pinned and "peaks expected from iteration 1 add up to 90.0 of 100.0 GiB" in why
    mem.report(0, 45 * GIB)  # grew past the device: profiled processes cannot be locked, so no victim
    mem.enforce([1, 2], pids, lambda r: r)
    assert mem.make_resident(3, 50 * GIB, [0, 1, 2], pids, lambda r: r)
    assert sw.log == [] and mem.resident == {0, 1, 2}  # rank 3 holds nothing yet: resident once it reports


@pytest.mark.parametrize(("capacity", "footprints", "why"), [
    (100, {0: 40, 1: 40, 2: 40}, "peaks expected from iteration 1 add up to 120.0 of 100.0 GiB"),
    (100, {0: 48, 1: 48}, "peaks expected from iteration 1 add up to 96.0 of 100.0 GiB, less than 5% left"),
])
def test_a_device_whose_peaks_do_not_fit_with_headroom_keeps_swapping_without_gpu_timing(capacity, footprints, why):
    mem, sw = _device(capacity, footprints)
    pids = {r: 1000 + r for r in footprints}
    mem.enforce(list(footprints), pids, lambda r: r)
    on, said = mem.timing_verdict({r: f * GIB for r, f in footprints.items()})
    assert not on and not mem.pinned and why in said and "GPU timing stays off" in said
    mem.report(0, 60 * GIB)
    mem.enforce(list(footprints), pids, lambda r: r)
    assert mem.used() <= mem.capacity  # swapping goes on


def _coordinator(world: int):
    """A coordinator of `world` ranks on one device that sends nothing; `hello()` connects them all."""
    from prism_megatron.runtime import protocol as P
    from prism_megatron.runtime.coordinator import Coordinator

    coord = Coordinator(world_size=world, num_devices=1, slots_per_device=1, device_of={r: 0 for r in range(world)},
                        device_names=["cuda:0"], hang_timeout=60.0, authkey=b"k" * 16)
    coord._send = lambda rs, msg: None
    coord._progress = lambda: None
    hello = lambda: [coord._dispatch(object(), {"t": P.HELLO, "rank": r, "pid": 1000 + r}) for r in range(world)]
    return coord, hello


def test_job_over_budget_swaps_and_keeps_results(tmp_path):
    """8 ranks of 60 GiB (stand-in footprints) on a 141 GiB device: swaps happen, results do not change."""
    import os
    import subprocess
    import sys

    import torch

    from conftest import PROGRAMS
    from prism_megatron.trace import read_trace

    outs = {}
    for mode in ("none", "budget"):
        out = tmp_path / mode
        out.mkdir()
        env = dict(os.environ, RING_OUT=str(out), PRISM_FOOTPRINT_BYTES=str(60 * GIB))
        p = subprocess.run([sys.executable, "-m", "prism_megatron", "launch", "-w", "8", "--slots-per-device", "2",
                            "--swap", mode, "--device-memory", "141", "--log-ranks", "none", "--trace-dir",
                            str(tmp_path / f"trace-{mode}"), str(PROGRAMS / "ring.py"), "2"],
                           capture_output=True, text=True, timeout=180, env=env)
        assert p.returncode == 0, p.stderr
        assert "marked a training iteration" not in p.stderr  # ring.py marks them: admitted by its peaks
        outs[mode] = [torch.load(out / f"rank-{r}.pt") for r in range(8)]
    for a, b in zip(outs["none"], outs["budget"], strict=True):
        assert torch.equal(a, b)
    swap = read_trace(tmp_path / "trace-budget").manifest["job"]["swap"]
    out, into = sum(s["swaps_out"] for s in swap.values()), sum(s["swaps_in"] for s in swap.values())
    assert out > 0 and into > 0
    from prism_megatron.trace.summary import summarize

    gib = sum(s["bytes_out"] + s["bytes_in"] for s in swap.values()) / GIB
    assert f"swaps: {out} out, {into} in, {gib:.1f} GiB moved" in summarize(tmp_path / "trace-budget")
    assert "swap" not in read_trace(tmp_path / "trace-none").manifest["job"]


def test_too_little_host_memory_for_swapped_state_ends_in_a_report_that_says_so(tmp_path):
    """8 ranks of 60 GiB on a 141 GiB device need swapping, but 50 GiB of host memory hold no rank's
    state: the job cannot go on, and the hang report names the host budget instead of hanging."""
    import os
    import subprocess
    import sys

    from conftest import PROGRAMS

    env = dict(os.environ, RING_OUT=str(tmp_path), PRISM_FOOTPRINT_BYTES=str(60 * GIB))
    p = subprocess.run([sys.executable, "-m", "prism_megatron", "launch", "-w", "8", "--slots-per-device", "2",
                        "--swap", "budget", "--device-memory", "141", "--host-memory", "50", "--hang-timeout", "5",
                        "--log-ranks", "none", "--trace-dir", str(tmp_path / "trace"), str(PROGRAMS / "ring.py"), "2"],
                       capture_output=True, text=True, timeout=180, env=env)
    assert p.returncode == 3, p.stderr
    report = (tmp_path / "trace.logs" / "hang-report.txt").read_text()
    assert "waiting for device memory" in report
    assert "host memory for checkpointed GPU state: 0.0 of 50.0 GiB held" in report
    import re

    stays = re.findall(r"rank (\d) stays: its swap out needs 60.0 GiB of host memory, 50.0 GiB are left", report)
    assert stays, report  # the blocked residents the budget keeps in, each named


DIES_SWAPPED_OUT = """
import os, threading, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
r = dist.get_rank()
x = torch.ones(4)
dist.all_reduce(x)  # every rank has run: each reported its footprint
if r == 7:
    threading.Timer(3.0, lambda: os._exit(9)).start()  # dies while blocked below
    dist.send(x, 0)
if r == 0:
    dist.recv(x, 7)  # rank 7's timer runs before rank 0 takes the device, whichever turn order the grants take
    time.sleep(20)  # the device holds one rank: rank 0, computing; so rank 7 is swapped out when it dies
dist.all_reduce(x)
"""

THREAD_OUTLIVES_MAIN = """
import os, sys, threading, time
import torch.distributed as dist

dist.init_process_group("gloo")
out = sys.argv[1]
def late():
    time.sleep(0.5)
    with open(f"{out}/late-{dist.get_rank()}", "w") as f:
        f.write("ran")
    if dist.get_rank() == 1:
        os._exit(3)
threading.Thread(target=late).start()  # non-daemon: Python waits for it after the script's last line
"""


def test_a_rank_that_dies_while_swapped_out_is_reported_like_any_crash(tmp_path):
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "dies.py"
    script.write_text(DIES_SWAPPED_OUT)
    env = dict(os.environ, PRISM_FOOTPRINT_BYTES=str(60 * GIB))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "prism_megatron", "launch", "-w", "8", "--slots-per-device", "2",
                        "--swap", "budget", "--device-memory", "61", "--hang-timeout", "60", "--log-ranks", "none",
                        "--trace-dir", str(tmp_path / "trace"), str(script)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stderr
    assert "rank 7 exited with code 9; ending the job" in p.stderr
    assert time.perf_counter() - t0 < 45  # ended at the death, not at the 60 s hang timeout


def test_a_rank_waits_for_its_non_daemon_threads_as_python_does(tmp_path):
    """The script's last line is not the process's end: Python joins non-daemon threads first, and what
    they do (write, exit with a code of their own) is the rank's behaviour."""
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(THREAD_OUTLIVES_MAIN)
    p = subprocess.run([sys.executable, "-m", "prism_megatron", "launch", "-w", "2", "--log-ranks", "none",
                        "--trace-dir", str(tmp_path / "trace"), str(script), str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert (tmp_path / "late-0").read_text() == "ran" and (tmp_path / "late-1").read_text() == "ran"
    assert p.returncode == 1 and "rank 1 exited with code 3" in p.stderr, p.stderr


UNMARKED = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
x = torch.ones(4)
for _ in range(3):
    dist.all_reduce(x)
"""


def test_swaps_of_a_program_that_marks_no_iteration_end_with_what_to_do(tmp_path):
    """4 ranks of 20 GiB on a 61 GiB device: any 3 fit, but a program that marks no iteration gives admission
    no peak to go by, so every turn reserves the device and swaps the others out; the job's end says why
    and what to do (a program that marks its iterations is admitted by its peaks: no such line, above)."""
    import os
    import subprocess
    import sys

    from prism_megatron.trace import read_trace

    script = tmp_path / "unmarked.py"
    script.write_text(UNMARKED)
    env = dict(os.environ, PRISM_FOOTPRINT_BYTES=str(20 * GIB))
    p = subprocess.run([sys.executable, "-m", "prism_megatron", "launch", "-w", "4", "--slots-per-device", "2",
                        "--swap", "budget", "--device-memory", "61", "--log-ranks", "none",
                        "--trace-dir", str(tmp_path / "trace"), str(script)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    job = read_trace(tmp_path / "trace").manifest["job"]
    swaps = sum(s["swaps_out"] for s in job["swap"].values())
    assert swaps > 0 and job["admission"]["own"] == job["admission"]["class"] == 0
    assert (f"prism: {swaps} swap(s) out: no rank marked a training iteration, so each of the "
            f"{job['admission']['bound']} turns was admitted with room") in p.stderr
    assert "or run with --swap none where the ranks fit the device together" in p.stderr


def test_nvml_figures_replace_a_blocked_ranks_report_and_later_reports_move_them():
    """A rank's footprint is what NVML says the driver holds for it (what a checkpoint moves) once it was
    cross-checked; its later reports move it by what the allocator moved. Swapped-out ranks and ranks
    without CUDA state are not compared (NVML sees a checkpointed process as nearly empty)."""
    mem, sw = _device(100, {0: 10, 1: 10})
    assert mem.cross_check(0, 11 * GIB) == (10 * GIB, 11 * GIB)
    assert mem.footprint[0] == 11 * GIB and sw.footprint[0] == 11 * GIB
    mem.report(0, 12 * GIB)
    assert mem.footprint[0] == 13 * GIB and mem.reported[0] == 12 * GIB
    mem.swap_out(1, 1001)
    assert mem.cross_check(1, 4 << 20) is None and mem.footprint[1] == 10 * GIB
    mem.report(2, 0)
    assert mem.cross_check(2, 1 * GIB) is None


def test_coordinator_samples_nvml_at_most_once_a_second_for_blocked_ranks_and_says_a_large_gap_once(capsys):
    from prism_megatron.runtime.nvml import FootprintCheck

    coord, hello = _coordinator(3)
    coord.governor.enable_swap(BudgetSwapper(100 * GIB), [100 * GIB])
    now = [0.0]
    reads = []
    held = {1000: 12 * GIB, 1001: 11 * GIB, 1002: 30 * GIB}
    coord.governor.footprint_check = FootprintCheck(lambda: reads.append(1) or dict(held), clock=lambda: now[0])
    hello()
    for r in range(3):
        coord.governor.memory[0].report(r, 10 * GIB)
    coord.ranks[0].state = coord.ranks[1].state = "blocked"
    coord.ranks[2].state = "running"  # its report is old: it has run since
    coord.governor.check_footprints()
    assert len(reads) == 1 and coord.governor.memory[0].footprint == {0: 12 * GIB, 1: 11 * GIB, 2: 10 * GIB}
    now[0] = 0.5
    coord.ranks[2].state = "blocked"
    coord.governor.check_footprints()
    assert len(reads) == 1 and coord.governor.memory[0].footprint[2] == 10 * GIB  # not due yet
    now[0] = 1.0
    coord.governor.check_footprints()
    assert len(reads) == 2 and coord.governor.memory[0].footprint[2] == 30 * GIB
    err = capsys.readouterr().err
    assert err.count("by NVML") == 1 and "rank 0 holds 12.00 GiB on cuda:0 by NVML, +2.00 GiB off" in err
    assert coord.governor.footprint_check.summary() == {"source": "nvml", "samples": 2, "ranks_checked": 3,
                                               "gap_gib_median": 2.0, "gap_gib_worst": 20.0, "rank_of_worst": 2}


def test_nvml_that_cannot_be_read_says_why(monkeypatch):
    import sys

    from prism_megatron.runtime.nvml import NvmlUnavailable, nvml_process_memory

    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(NvmlUnavailable, match="nvidia-ml-py is not installed"):
        nvml_process_memory()


def test_nvml_that_fails_mid_run_is_said_once_and_the_reports_plan_from_there(capsys):
    from prism_megatron.runtime.nvml import FootprintCheck

    coord, hello = _coordinator(2)
    coord.governor.enable_swap(BudgetSwapper(100 * GIB), [100 * GIB])
    now = [0.0]

    def gone() -> dict:
        raise RuntimeError("GPU is lost")
    coord.governor.footprint_check = FootprintCheck(gone, clock=lambda: now[0])
    hello()
    coord.governor.memory[0].report(0, 10 * GIB)
    coord.ranks[0].state = "blocked"
    for t in (0.0, 5.0):
        now[0] = t
        coord.governor.check_footprints()
    assert capsys.readouterr().err.count("reading NVML failed (RuntimeError: GPU is lost)") == 1
    assert coord.governor.memory[0].footprint[0] == 10 * GIB
    assert coord.governor.footprint_check.summary() == {"source": "nvml", "samples": 1, "ranks_checked": 0,
                                               "failed": "RuntimeError: GPU is lost"}
