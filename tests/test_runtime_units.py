"""Unit checks of the coordinator's pure parts: slots, matching, reductions."""

from __future__ import annotations

import json
import os
import tempfile
import textwrap

import pytest
import torch

from prism_megatron.runtime import collectives as C
from prism_megatron.runtime.matching import Member, P2PQueues, check_collective, check_p2p
from prism_megatron.runtime.slots import SlotScheduler


def test_slots_fifo_and_capacity():
    s = SlotScheduler(1, 2)
    assert [g.rank for g in s.request(5)] == [5]
    assert [g.rank for g in s.request(3)] == [3]
    assert s.request(1) == [] and s.request(7) == []  # full: queued in order
    assert [g.rank for g in s.release(5)] == [1]
    assert [g.rank for g in s.release(3)] == [7]
    assert set(s.holding) == {1, 7}
    assert {d for d, _ in s.holding.values()} == {0}


def test_slots_no_starvation_under_churn():
    s = SlotScheduler(1, 1)
    s.request(0)
    s.request(1)
    s.request(2)
    order = []
    holder = 0
    for _ in range(9):  # each holder releases and immediately asks again
        g = s.release(holder)
        s.request(holder)
        holder = g[0].rank
        order.append(holder)
    assert order == [1, 2, 0, 1, 2, 0, 1, 2, 0]


def test_slots_are_per_device():
    s = SlotScheduler(2, 1, device_of={0: 0, 1: 0, 2: 1})
    assert [g.rank for g in s.request(0)] == [0]
    assert s.request(1) == []  # device 0 is full
    assert [(g.rank, g.device) for g in s.request(2)] == [(2, 1)]
    with pytest.raises(RuntimeError, match="rank 0 asked for a slot while holding one"):
        s.request(0)
    with pytest.raises(ValueError):
        SlotScheduler(0, 1)


def _m(rank, kind, ins=(), outs=(), **params):
    msg = {"kind": kind, "ins": [(("r", n), dt, [n // 4]) for n, dt in ins],
           "outs": [(("r", n), dt, [n // 4]) for n, dt in outs], **params}
    return Member(rank, rank, msg)


def test_collective_checks_name_ranks_and_shapes():
    ok = [_m(r, "all_reduce", [(16, "float32")], [(16, "float32")], redop="sum") for r in range(3)]
    assert check_collective(ok) is None
    bad = ok[:2] + [_m(2, "all_reduce", [(20, "float32")], [(20, "float32")], redop="sum")]
    msg = check_collective(bad)
    assert "different sizes" in msg and "rank 2: all_reduce redop=sum in=[float32[5]]" in msg
    mixed = ok[:2] + [_m(2, "broadcast", [(16, "float32")], [], root=0)]
    assert "different operations" in check_collective(mixed)
    op = ok[:2] + [_m(2, "all_reduce", [(16, "float32")], [(16, "float32")], redop="max")]
    assert "different reduce ops" in check_collective(op)
    dt = ok[:2] + [_m(2, "all_reduce", [(16, "int32")], [(16, "int32")], redop="sum")]
    assert "different dtypes" in check_collective(dt)
    ag = [_m(r, "all_gather", [(8, "float32")], [(24 if r else 16, "float32")]) for r in range(3)]
    assert "rank 0's output holds 16 bytes" in check_collective(ag)


def test_all_to_all_split_disagreement():
    a = _m(0, "all_to_all", [(8, "float32")], [(8, "float32")], in_splits=[4, 4], out_splits=[4, 4])
    b = _m(1, "all_to_all", [(8, "float32")], [(8, "float32")], in_splits=[0, 8], out_splits=[8, 0])
    assert "rank 0 sends 4 bytes to rank 1, which expects 8" in check_collective([a, b])


def test_p2p_matches_in_issue_order_ignoring_tags():
    q = P2PQueues()
    s1 = _m(0, "send", [(4, "float32")], peer=1, tag=7)
    s2 = _m(0, "send", [(8, "float32")], peer=1, tag=3)
    assert q.add_send(s1) is None and q.add_send(s2) is None
    r1 = _m(1, "recv", [], [(4, "float32")], peer=0, tag=3)  # tag differs: NCCL ignores it
    assert q.add_recv(r1) == (s1, r1)
    r2 = _m(1, "recv", [], [(4, "float32")], peer=0)
    assert q.add_recv(r2) == (s2, r2)
    assert "rank 0 sends float32 of 8 bytes, rank 1 receives float32 of 4 bytes" in check_p2p(s2, r2)


def test_p2p_any_source_takes_earliest_send():
    q = P2PQueues()
    a = _m(2, "send", [(4, "float32")], peer=0)
    b = _m(1, "send", [(4, "float32")], peer=0)
    q.add_send(a)
    q.add_send(b)
    r = _m(0, "recv", [], [(4, "float32")], peer=None)
    assert q.add_recv(r) == (a, r)


def test_reduction_order_is_fixed_and_dtype_kept():
    xs = [torch.tensor([1e8, 1.0, -1e8], dtype=torch.float32) * (i + 1) for i in range(4)]
    a = C.reduce(xs, "sum")
    b = C.reduce(xs, "sum")
    assert torch.equal(a, b) and a.dtype == torch.float32
    ref = xs[0].clone()
    for x in xs[1:]:
        ref += x
    assert torch.equal(a, ref)
    ints = [torch.tensor([7, -7]), torch.tensor([2, 2])]
    assert C.reduce(ints, "avg").tolist() == [4, -2]  # truncated like NCCL's integer average
    assert C.reduce([torch.tensor([1.0, 2.0])] * 3, "premul_sum", 0.5).tolist() == [1.5, 3.0]
    assert C.reduce([torch.tensor([True, False]), torch.tensor([False, False])], "sum").tolist() == [True, False]
    assert C.reduce([torch.tensor([6]), torch.tensor([3])], "bxor").tolist() == [5]
    with pytest.raises(ValueError, match="unsupported reduce op 'median'"):
        C.reduce(xs, "median")


@pytest.mark.parametrize("op, dtype, factor", [("sum", torch.float32, None), ("avg", torch.int64, None),
                                               ("avg", torch.float32, None), ("premul_sum", torch.float32, 0.25),
                                               ("max", torch.bool, None), ("product", torch.int32, None)])
def test_reduce_into_an_output_equals_the_new_tensor_also_over_the_first_input(op, dtype, factor):
    """The coordinator reduces into the first member's output, which for an in-place op is that member's
    input: bit-equal to a fresh result either way, and no other input is touched."""
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn(257, generator=g) * 9).to(dtype) for _ in range(3)]
    want = C.reduce(xs, op, factor)
    copies = [x.clone() for x in xs]
    out = torch.empty_like(xs[0])
    assert C.reduce(xs, op, factor, out=out) is out and torch.equal(out, want)
    assert all(torch.equal(x, c) for x, c in zip(xs, copies, strict=True))
    got = C.reduce(xs, op, factor, out=xs[0])  # in place over the first input
    assert got.data_ptr() == xs[0].data_ptr() and torch.equal(xs[0], want)
    assert all(torch.equal(x, c) for x, c in zip(xs[1:], copies[1:], strict=True))


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast"])
def test_every_members_results_are_written_before_any_member_is_told(kind, tmp_path):
    """A member told its op is done frees its staging memory and stages its next op there, while the
    coordinator may still be copying a result out of it (an all-reduce is computed into the first
    member's output; a broadcast's data is the root's input). Here each member overwrites its staging
    the moment it is told, and every member must still have read the right result."""
    import os

    from prism_megatron.runtime import protocol as P
    from prism_megatron.runtime.coordinator import Coordinator
    from prism_megatron.runtime.groups import Group
    from prism_megatron.runtime.shm import Arena

    n, numel = 4, P.INLINE_LIMIT  # 4 bytes an element: staged in shared memory, not inlined
    coord = Coordinator(world_size=n, num_devices=1, slots_per_device=n, device_of=dict.fromkeys(range(n), 0),
                        device_names=["cpu"], hang_timeout=60.0, authkey=b"k" * 16)
    coord._progress = lambda: None
    coord._op_completed = lambda rs, op_id: None
    for r in range(n):
        coord._dispatch(object(), {"t": P.HELLO, "rank": r, "pid": 1000 + r})
    arenas = [Arena(f"prism-test-{os.getpid()}-{kind}-{r}") for r in range(n)]
    views, members = {}, []
    try:
        for r in range(n):
            seg, off, raw = arenas[r].alloc(numel * 4)
            x = raw.view(torch.float32)
            x.fill_(r + 1.0)
            views[r] = x
            desc = (("s", seg, off, numel * 4), "float32", [numel])
            if kind == "all_reduce":
                msg = {"id": 7, "kind": kind, "ins": [desc], "outs": [desc], "redop": "sum"}
            else:  # root 0 sends its staged input; the others receive into theirs
                msg = {"id": 7, "kind": kind, "ins": [desc] if r == 0 else [], "outs": [] if r == 0 else [desc],
                       "root": 0}
            assert coord.data.arrived(r, msg) is None
            members.append(Member(r, r, msg))
        read: dict[int, torch.Tensor] = {}

        def told(rs, msg: dict) -> None:  # the rank copies its result out, then stages its next op there
            assert msg["t"] == P.DONE
            read[rs.rank] = views[rs.rank].clone()
            views[rs.rank].fill_(-1.0)

        coord._send = told
        coord._run_collective(Group(id=1, name="g", ranks=list(range(n)), backend="gloo"), 0, members)
        want = sum(range(1, n + 1)) if kind == "all_reduce" else 1.0
        receivers = range(n) if kind == "all_reduce" else range(1, n)
        assert sorted(read) == list(range(n))
        assert {r: read[r].unique().tolist() for r in receivers} == {r: [want] for r in receivers}
    finally:
        coord.data.close()
        for a in arenas:
            a.close()


def test_resident_first_policy_prefers_resident_and_never_starves():
    from collections import deque

    from prism_megatron.runtime.slots import ResidentFirstPolicy

    resident = {2, 3}
    pol = ResidentFirstPolicy(lambda r: r in resident, max_skips=2)
    q = deque([1, 2, 3])
    assert pol.pick(q) == 2  # rank 1 is swapped out: a resident rank goes first
    q.append(2)
    assert pol.pick(q) == 3
    q.append(3)
    assert pol.pick(q) == 1  # passed over twice: its turn now
    assert list(q) == [2, 3]


def test_all_to_all_split_sizes_accept_lists_tensors_and_numpy():
    """megatron-core 0.19's MoE dispatcher passes numpy arrays (seen on the H200: 'truth value ambiguous')."""
    import numpy as np
    import torch

    from prism_megatron.runtime.backend import _split_bytes

    t = torch.zeros(6, 4)  # 16 bytes a row
    for splits in ([1, 5], (1, 5), np.array([1, 5]), torch.tensor([1, 5])):
        assert _split_bytes(t, splits, 2, "input") == [16, 80]
    assert _split_bytes(t, None, 2, "input") == [48, 48]
    assert _split_bytes(t, np.array([], dtype=np.int64), 2, "input") == [48, 48]
    with pytest.raises(ValueError, match=r"split sizes \[2, 5\] do not match"):
        _split_bytes(t, np.array([2, 5]), 2, "input")


def test_coordinator_takes_only_the_cores_no_rank_computes_on(tmp_path):
    """Its reductions are element-wise (threads do not change results) but may run beside a computing
    rank (async ops): only spare cores, one kept for the launcher, at most 8."""
    from prism_megatron.launcher.config import LaunchConfig
    from prism_megatron.launcher.launch import coordinator_threads

    def cfg(devices, slots, threads=1):
        return LaunchConfig(script=tmp_path / "s.py", world_size=8, trace_dir=tmp_path / "t", devices=devices,
                            slots_per_device=slots, threads_per_rank=threads)

    assert coordinator_threads(cfg(["cpu"], 1), cores=2) == 1  # this CI machine: nothing spare
    assert coordinator_threads(cfg(["cpu"], 2), cores=2) == 1  # never fewer than one
    assert coordinator_threads(cfg(["cpu"], 2, threads=2), cores=8) == 3
    assert coordinator_threads(cfg(["0", "1"], 1), cores=32) == 8  # a GPU host: capped


def test_the_cuda_import_check_is_started_once_per_process_and_answered_once(monkeypatch):
    """The run command starts the check before it parses Megatron's args, so both children run at once; each
    launch of the process (a serial capture launches several) then reads the same answer."""
    from prism_megatron.launcher import launch as launch_mod

    monkeypatch.setattr(launch_mod, "_import_checks", {})
    check = launch_mod.start_cuda_import_check(["json"])
    assert launch_mod.start_cuda_import_check(["json"]) is check
    assert check.result() is False  # importing json starts no CUDA (nor can torch here: no GPU)
    check._p = None  # answered: never asked of the child again
    assert check.result() is False
    other = launch_mod.start_cuda_import_check(["prism_megatron.no_such_module"])
    assert other is not check and other.result() is True  # an import that fails: not known, the safe answer
    assert other.why.startswith("not known: the check's import failed (exited with code 1: ModuleNotFoundError")


def test_the_cuda_import_check_names_the_line_that_started_cuda(tmp_path, monkeypatch):
    """Ranks import a preload that starts CUDA after the fork, seconds each capture: the note names the import
    to blame. No GPU here: the module asks for CUDA (torch.cuda's init, which refuses on this build) and then
    marks it started, as a GPU's init would."""
    from prism_megatron.launcher import launch as launch_mod

    (tmp_path / "asks_for_cuda.py").write_text(
        "import torch\n\n\ndef probe():\n    try:\n        torch.cuda.current_device()\n"
        "    except (AssertionError, RuntimeError):\n        pass\n\n\nprobe()\ntorch.cuda._initialized = True\n")
    (tmp_path / "quiet.py").write_text("import torch\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setattr(launch_mod, "_import_checks", {})
    check = launch_mod.start_cuda_import_check(["quiet", "asks_for_cuda"])
    assert check.result() is True
    module = tmp_path / "asks_for_cuda.py"
    assert check.why == f"started by {module}:6 (probe) < {module}:11 (<module>)"
    assert launch_mod.start_cuda_import_check(["quiet"]).result() is False


def test_pinned_staging_registers_every_segment_and_unregisters_it_before_unmapping(tmp_path, monkeypatch):
    """Arena.pin_with (PRISM_PINNED_STAGING on a GPU) registers the segments there are and every one
    made later, each exactly once; a dropped or closed segment is unregistered while still mapped."""
    from prism_megatron.runtime import shm

    monkeypatch.setattr(shm, "shm_dir", lambda: tmp_path)
    pinned: dict[int, int] = {}
    events: list[str] = []

    def pin(address: int, nbytes: int):
        assert address not in pinned
        pinned[address] = nbytes
        events.append(f"pin {nbytes}")

        def undo() -> None:
            events.append(f"unpin {pinned.pop(address)}")
        return undo

    close = shm._Segment.close

    def closing(seg) -> None:
        close(seg)
        events.append("unmapped")

    monkeypatch.setattr(shm._Segment, "close", closing)
    arena = shm.Arena("t", initial=1 << 12)
    name, _, view = arena.alloc(100)
    arena.pin_with(pin)
    assert sorted(pinned.values()) == [1 << 12]
    view[:] = 7  # a live region in the first segment: the next, larger one is a new segment
    arena.alloc(1 << 13)
    assert sorted(pinned.values()) == [1 << 12, 1 << 13]
    arena.free(name)  # the first segment is no longer active: dropped, so unregistered, then unmapped
    assert events == ["pin 4096", "pin 8192", "unpin 4096", "unmapped"] and list(pinned.values()) == [1 << 13]
    arena.close()
    assert pinned == {} and events[-2:] == ["unpin 8192", "unmapped"]


@pytest.mark.parametrize("swap", ["none", "auto", "checkpoint"])
def test_gpu_ranks_page_lock_staging_swaps_or_not_unless_staging_is_pageable(tmp_path, swap):
    """--staging names its bad value. The driver checkpoints a process that registered host memory
    (swap_bench.py's lock probes on the H200), so --staging auto page-locks on every GPU, swapping or
    not; CPU ranks' tensors are host memory already. The trace's job says which."""
    from prism_megatron.launcher.config import LaunchConfig, LaunchError
    from prism_megatron.launcher.launch import _Job
    from prism_megatron.launcher.rank import rank_env

    script = tmp_path / "s.py"
    script.write_text("")
    base = dict(script=script, world_size=2, trace_dir=tmp_path / "t")
    with pytest.raises(LaunchError, match=r"--staging must be auto or pageable, got 'pinned'"):
        LaunchConfig(**base, staging="pinned").validate()

    def told(cfg: LaunchConfig) -> tuple[list[bool], dict | None]:
        return ([rank_env(cfg, r, 1).get("PRISM_PAGE_LOCK") == "1" for r in range(2)],
                _Job(cfg).job_meta().get("staging_by_device"))

    assert told(LaunchConfig(**base, devices=["0", "1"], swap=swap)) == (
        [True, True], {"cuda:0": "page-locked", "cuda:1": "page-locked"})
    assert told(LaunchConfig(**base, devices=["0"], swap=swap, staging="pageable")) == (
        [False, False], {"cuda:0": "pageable"})
    assert told(LaunchConfig(**base).validate()) == ([False, False], None)


def test_the_trace_records_prisms_memory_estimate_of_each_rank_that_runs(tmp_path):
    """The report weighs a class that ran out of memory under the cap by prism's estimate of its peak
    (report.margin): the run must write it into the trace's job, rank by rank, as JSON keys."""
    from prism_megatron.launcher.config import LaunchConfig
    from prism_megatron.launcher.launch import _Job

    script = tmp_path / "s.py"
    script.write_text("")
    cfg = LaunchConfig(script=script, world_size=4, trace_dir=tmp_path / "t").validate()
    assert "memory_estimates" not in _Job(cfg).job_meta()  # none computed: nothing recorded
    cfg.memory_estimates = {2: 7 * 2**30, 0: 5 * 2**30}
    assert _Job(cfg).job_meta()["memory_estimates"] == {"0": 5 * 2**30, "2": 7 * 2**30}


def test_ranks_compile_in_process_unless_the_users_environment_sets_inductors_workers(tmp_path, monkeypatch):
    """An inductor worker pool per rank would start during the iterations the capture measures, W times over
    (docs/measurements.md, "Inductor's compile pool"); a value the user set reaches the ranks unchanged."""
    from prism_megatron.launcher.config import LaunchConfig
    from prism_megatron.launcher.rank import COMPILE_THREADS_ENV, rank_env

    script = tmp_path / "s.py"
    script.write_text("")
    cfg = LaunchConfig(script=script, world_size=2, trace_dir=tmp_path / "t").validate()
    monkeypatch.delenv(COMPILE_THREADS_ENV, raising=False)
    assert [rank_env(cfg, r, 1)[COMPILE_THREADS_ENV] for r in range(2)] == ["1", "1"]
    monkeypatch.setenv(COMPILE_THREADS_ENV, "8")
    assert COMPILE_THREADS_ENV not in rank_env(cfg, 0, 1)


def test_gpu_timed_ranks_detach_cupti_after_each_profiled_iteration_unless_told_or_graphs_are_captured(
        tmp_path, monkeypatch):
    """CUPTI left attached after a profiled iteration slows the plain iteration's kernel launches, whose host time the
    prediction takes (docs/measurements.md, "CUPTI left attached"): a GPU-timed rank gets TEARDOWN_CUPTI=1, unless
    the environment says otherwise (the user's word, torch's for inductor's CUDA graphs) or the job captures CUDA
    graphs (re-attaching CUPTI after a teardown crashes them); a rank that is not GPU-timed gets nothing."""
    from prism_megatron.launcher.config import LaunchConfig
    from prism_megatron.launcher.rank import rank_env
    from prism_megatron.runtime.gpu_timing import CUPTI_TEARDOWN_ENV, cupti_teardown_env

    monkeypatch.delenv(CUPTI_TEARDOWN_ENV, raising=False)
    script = tmp_path / "s.py"
    script.write_text("")

    def told(args: list[str], **kw) -> str | None:
        cfg = LaunchConfig(script=script, script_args=args, world_size=2, trace_dir=tmp_path / "t", **kw)
        return rank_env(cfg, 1, 1).get(CUPTI_TEARDOWN_ENV)

    assert told(["--lr", "1"], devices=["0"]) == "1"
    assert told(["--lr", "1"], devices=["0"], gpu_timing=False) is None
    assert told(["--lr", "1"]) is None  # a CPU rank
    for graphs in (["--enable-cuda-graph"], ["--cuda-graph-impl", "local"], ["--cuda-graph-impl=transformer_engine"],
                   ["--external-cuda-graph"]):
        assert told(["--lr", "1", *graphs], devices=["0"]) is None, graphs
    assert told(["--cuda-graph-impl", "none"], devices=["0"]) == "1"
    monkeypatch.setenv(CUPTI_TEARDOWN_ENV, "0")
    assert told(["--lr", "1"], devices=["0"]) is None  # the rank inherits the user's "0"
    assert cupti_teardown_env(["--cuda-graph-impl"], {}) == {}  # a flag without its value: graphs assumed


def test_ranks_get_the_torch_threads_torchrun_would_give_the_targets_ranks(tmp_path, monkeypatch):
    """torchrun sets OMP_NUM_THREADS=1 only where it starts several processes per node and the variable is
    unset; one rank per node keeps torch's default, every core: a one-rank emulation given one thread took
    its data loading's host time on one core while the real process had them all. The emulated rank leaves
    one core to prism's processes."""
    import os

    from prism_megatron.launcher.config import LaunchConfig, LaunchError, rank_threads, torchrun_threads
    from prism_megatron.launcher.rank import rank_env

    script = tmp_path / "s.py"
    script.write_text("")

    def threads(world: int, per_node: int = 8, given: int | None = None) -> int:
        cfg = LaunchConfig(script=script, world_size=world, trace_dir=tmp_path / "t", gpus_per_node=per_node,
                           threads_per_rank=given).validate()
        assert rank_env(cfg, 0, 1)["OMP_NUM_THREADS"] == str(cfg.threads_per_rank)
        return cfg.threads_per_rank

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    left = max(1, cores - 1)
    assert (threads(8), threads(2), threads(1), threads(4, per_node=1)) == (1, 1, left, left)
    assert torchrun_threads(1) == cores
    assert threads(8, given=3) == 3  # --threads-per-rank wins
    assert threads(1, given=cores) == cores  # even over the core left free
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert threads(8) == min(6, left) and torchrun_threads(8) == 6
    # one core beside the ranks computing at once, never below one thread
    assert (rank_threads(16, 1, 16), rank_threads(16, 2, 16), rank_threads(16, 4, 16), rank_threads(1, 1, 16),
            rank_threads(16, 1, 1), rank_threads(16, 16, 16)) == (15, 7, 3, 1, 1, 1)
    with pytest.raises(LaunchError, match=r"--threads-per-rank must be a positive integer, got 0"):
        threads(8, given=0)


def test_a_rank_given_fewer_threads_than_the_targets_is_told_so(tmp_path, monkeypatch, capsys):
    """The core left to prism is a difference from the target's rank: the start says it and how to override."""
    import os

    from prism_megatron.launcher import launch
    from prism_megatron.launcher.config import LaunchConfig

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core: the rank keeps its one thread")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "s.py"
    script.write_text("")
    cfg = LaunchConfig(script=script, world_size=1, trace_dir=tmp_path / "t").validate()
    launch._notes(cfg)
    err = capsys.readouterr().err
    cores = len(os.sched_getaffinity(0))
    assert f"each rank gets {cores - 1} torch thread(s) where the target's has {cores}" in err
    assert "--threads-per-rank overrides" in err
    launch._notes(LaunchConfig(script=script, world_size=1, trace_dir=tmp_path / "t", threads_per_rank=1).validate())
    assert "torch thread(s) where the target's" not in capsys.readouterr().err


def test_a_rank_forked_after_inductors_config_was_imported_still_gets_its_workers_number(monkeypatch):
    """The template may import inductor's config before the fork (Megatron does): its number of workers was
    read then, so the rank sets it again from its own environment (a pool started on the H200 otherwise)."""
    import sys
    import types

    from prism_megatron.launcher.rank import COMPILE_THREADS_ENV, _compile_threads_from_env

    config = types.SimpleNamespace(compile_threads=16)
    monkeypatch.setitem(sys.modules, "torch._inductor.config", config)
    monkeypatch.setenv(COMPILE_THREADS_ENV, "1")
    _compile_threads_from_env()
    assert config.compile_threads == 1


def test_every_op_kind_is_costed_and_has_a_virtual_rule():
    """The op registry is the one list of kinds: the cost model costs each, Phase 2 knows what a
    virtual member of each contributes (nccl_prune's rules, for exactly these kinds), and the backend's,
    matching's and virtual ranks' lists follow it."""
    from nccl_prune import KINDS
    from prism_megatron.calibration.costmodel import BUS_FACTOR, KIND_FAMILY
    from prism_megatron.ops import OPS, REDUCING_KINDS, op_kind

    assert {"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_list"} == REDUCING_KINDS
    assert set(KINDS) == set(OPS)
    for name, op in OPS.items():
        assert KIND_FAMILY[name] in BUS_FACTOR and KINDS[name].reducing == op.reducing
    with pytest.raises(ValueError, match="'median_reduce' is not supported"):
        op_kind("median_reduce")


def test_group_of_one_local_result_copies_and_premultiplies():
    from prism_megatron.ops import op_kind

    x, out = torch.tensor([1.0, 2.0]), torch.zeros(2)
    op_kind("all_reduce").local([x], [out], "premul_sum", 0.5)
    assert out.tolist() == [0.5, 1.0] and x.tolist() == [1.0, 2.0]
    op_kind("all_gather").local([x], [out], None, None)
    assert out.tolist() == [1.0, 2.0]
    y = torch.zeros(2)
    op_kind("broadcast").local([x], [y], None, None)  # the root of a broadcast of one receives nothing
    assert y.tolist() == [0.0, 0.0]


def test_group_table_sequences_collectives_and_refuses_a_group_created_with_other_ranks():
    import pytest

    from prism_megatron.runtime.groups import GroupMismatch, GroupTable
    from prism_megatron.runtime.recorder import OpRecord

    t = GroupTable()
    g0, new0 = t.declare(0, 0, "tp", [0, 1], False, "nccl")
    g1, new1 = t.declare(1, 0, "tp", [0, 1], False, "nccl")
    assert new0 and not new1 and g0 == g1
    assert t.declare(2, 0, "dp", [2], False, "nccl")[1]
    with pytest.raises(GroupMismatch, match=r"rank 1 created it with ranks \[1, 2\], rank 0 with ranks \[0, 1\]"):
        t.declare(1, 1, "tp", [1, 2], False, "nccl")
    assert [g.name for g in t] == ["tp", "dp"] and t.by_id[1].name == "dp"
    g = t.of(1, 0)

    def member(rank):
        rec = OpRecord(rank, 0, "barrier", g.id, -1, -1, -1, 0, "", "[]", "", False, 0.0, 0.0, 0.0, "")
        return Member(rank, g.grank[rank], {"kind": "barrier", "ins": [], "outs": []}, rec)

    one = member(1)
    assert t.post_collective(g, one) is None and one.record.seq == 0 and g.missing(0) == 1
    assert t.post_collective(g, member(1)) is None and g.missing(1) == 1  # rank 1 runs ahead
    zero = member(0)
    assert t.post_collective(g, zero) == [zero, one] and g.missing(0) == 0  # in group-rank order


def test_hang_detector_counts_only_blocked_ranks_and_waits_for_every_rank_to_connect():
    from prism_megatron.runtime.hang import HangDetector
    from prism_megatron.runtime.ranks import RankState, RankStatus

    d = HangDetector(0.0)
    ranks = {0: RankState(0, None, state=RankStatus.BLOCKED), 1: RankState(1, None, state=RankStatus.IDLE)}
    assert d.stalled(ranks, 2, awaiting_room=False) is None  # a sleeping rank will move again
    ranks[1].state = RankStatus.BLOCKED
    assert d.stalled(ranks, 3, awaiting_room=False) is None  # rank 2 may yet connect and post the ops
    assert d.stalled(ranks, 2, awaiting_room=False) >= 0.0
    ranks[1].state = RankStatus.QUEUED  # granted a slot, waiting for device memory no one can free
    assert d.stalled(ranks, 2, awaiting_room=False) is None and d.stalled(ranks, 2, awaiting_room=True) >= 0.0


def test_result_copies_bypass_the_programs_torch_modes():
    """Writing results (client._write) goes past the program's Python torch modes (CPU mode, byte
    accountant): through them each copy costs ~10x, times one result per member of a large all-gather."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from prism_megatron.runtime.client import _runtime_copies

    seen: list[str] = []

    class Function(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append("function")
            return func(*args, **(kwargs or {}))

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append("dispatch")
            return func(*args, **(kwargs or {}))

    out, raw = torch.zeros(4), torch.ones(4)
    with Function(), Dispatch():
        with _runtime_copies():
            out.copy_(raw.view(torch.uint8).view(out.dtype).view(out.shape))
        assert seen == []
        out.add_(1)  # the modes are back once the copies are done
    assert {"function", "dispatch"} <= set(seen)
    assert out.tolist() == [2.0] * 4


def test_gpu_ranks_start_as_fresh_interpreters_cpu_ranks_fork_and_rank_start_names_a_bad_value(tmp_path):
    """A rank forked from the launcher's template ran its program's host work slower on the GPU than a fresh
    interpreter (docs/measurements.md, "The fork from the launcher's template"): 'auto' execs GPU ranks and forks
    CPU ones (a fork shares the template's imports: many ranks, little memory), and either can be asked for."""
    from prism_megatron.launcher.config import LaunchConfig, LaunchError

    script = tmp_path / "s.py"
    script.write_text("")
    base = dict(script=script, world_size=2, trace_dir=tmp_path / "t")
    assert LaunchConfig(**base, devices=["0"]).starts_fresh
    assert not LaunchConfig(**base).starts_fresh
    assert not LaunchConfig(**base, devices=["0"], rank_start="fork").starts_fresh
    assert LaunchConfig(**base, rank_start="exec").starts_fresh
    # only a template that forks GPU ranks after importing a preload has its import checked for starting CUDA
    assert [LaunchConfig(**base, preload=["m"], **kw).template_preloads_on_gpu
            for kw in ({"devices": ["0"]}, {"devices": ["0"], "rank_start": "fork"}, {})] == [False, True, False]
    with pytest.raises(LaunchError, match=r"--rank-start must be auto, fork or exec, got 'spawn'"):
        LaunchConfig(**base, rank_start="spawn").validate()


@pytest.mark.parametrize("rank_start", ["fork", "exec"])
def test_a_rank_started_either_way_runs_the_program_to_the_same_results(tmp_path, monkeypatch, rank_start):
    """An exec'd rank is a fresh interpreter (none of the launcher's modules imported) that still finds prism
    through the launcher's module path, joins the job and computes what a forked rank does."""
    source = textwrap.dedent("""
        import json, os, sys
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(3) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        with open(os.path.join(os.environ["OUT_DIR"], f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"sum": t.tolist(), "template": "prism_megatron.launcher.launch" in sys.modules}, f)
        dist.destroy_process_group()
    """)
    from conftest import launch_source

    monkeypatch.setenv("OUT_DIR", str(tmp_path))
    trace = launch_source(tmp_path, source, rank_start=rank_start)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [g["sum"] for g in got] == [[3.0, 3.0, 3.0]] * 2
    assert [g["template"] for g in got] == [rank_start == "fork"] * 2
    assert trace.world_size == 2


def test_an_exec_d_rank_starts_whatever_the_size_of_its_launch_config(tmp_path, monkeypatch):
    """A large job's launch config is more than one argument may hold (128 KiB on Linux; the fold plan of
    llama31-405b-h100x8192 alone pickles to ~140 KB, ~280 KB as hex): the exec'd rank reads it from an inherited
    file instead of its argv."""
    from conftest import launch_source

    monkeypatch.setenv("OUT_DIR", str(tmp_path))
    source = textwrap.dedent("""
        import json, os, sys
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")]
        with open(os.path.join(os.environ["OUT_DIR"], "seen.json"), "w") as f:
            json.dump({"argv": sys.argv[1:], "fds": fds}, f)
    """)
    big = {"rank_map": list(range(100_000))}  # pickled ~300 KB, hex-encoded twice that
    launch_source(tmp_path, source, world_size=1, rank_start="exec", job_extra=big)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["argv"] == []  # the program's own arguments, not prism's
    tmp = tempfile.gettempdir()
    assert not [p for p in seen["fds"] if p.startswith(tmp) and p.endswith("(deleted)")]  # the file not held open
