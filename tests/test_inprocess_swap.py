"""In-process swaps (runtime.swap.InProcessSwapper, runtime.swap_space, the rank's P.SWAP handling) without a
GPU: the host region's extents, what a swapped-out rank still holds on its device, the coordinator's wait
for the rank's answer, and the rank's side with the stand-in segments. The GPU side (runtime.vmm) is
measured by bench/gpu/vmm_swap_probe.py; the whole path end to end by tests/test_admission.py."""

from __future__ import annotations

import ctypes
import os
import threading
from multiprocessing import Pipe

import pytest

from prism_megatron.launcher import config as launch_config
from prism_megatron.launcher.config import LaunchConfig, LaunchError
from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.memory import DeviceMemory, HostBudget
from prism_megatron.runtime.swap import InProcessSwapper, SwapNoRoom
from prism_megatron.runtime.swap_space import HostRegion, SwapSpace, SwapSpaceError

GIB = 2**30


def test_the_host_region_hands_out_disjoint_extents_first_fit_and_takes_them_back():
    space = SwapSpace(100)
    a, b = space.take(40), space.take(40)
    assert (a, b, space.take(30)) == (0, 40, None)  # 20 left, in one gap
    space.give(a)
    assert space.take(30) == 0 and space.take(20) == 80 and space.take(10) == 30  # the gaps, lowest first
    assert space.free() == 0 and space.take(1) is None
    spans = sorted((base, base + n) for base, n in space.taken.items())
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:], strict=False))
    space.close()


def test_a_region_whose_gaps_add_up_but_none_fits_is_compacted_and_the_swapped_state_moves_with_it():
    """First fit leaves gaps: ranks swapped out at 0 and 40 of 100, the one at 0 back in, 60 free but no gap of
    50. The swap out that needs 50 slides the other extent down, its bytes with it, and takes what is left;
    the rank whose extent moved is swapped in from where its bytes are now."""
    rank_side = _Rank(moves={0: 40, 1: 40, 2: 50})
    space = SwapSpace(100)
    sw = InProcessSwapper(space, rank_side)
    view = HostRegion(space.path_for_ranks)
    sw.checkpoint(0, 1000)
    sw.checkpoint(1, 1001)
    assert sw.extent == {0: (0, 40), 1: (40, 40)}
    ctypes.memmove(view.address(40, 40), b"r1" * 20, 40)  # rank 1's state
    sw.restore(0, 1000)
    assert space.take(50) is None and space.free() == 60  # no gap of 50: [0, 40) and [80, 100)
    sw.checkpoint(2, 1002)
    assert sw.extent == {1: (0, 40), 2: (40, 50)}
    assert ctypes.string_at(view.address(0, 40), 40) == b"r1" * 20  # moved with its extent
    assert sw.compacted and sw.compacted[0][0] == 40
    sw.restore(1, 1001)
    assert rank_side.asked[-1] == (1, "in", 0, 40)  # from where its bytes are now
    space.close()
    import os

    big = SwapSpace(64 * GIB)  # sparse: a stand-in's extents of GiBs hold a marker each; compacting copies that
    a, b = big.take(20 * GIB), big.take(20 * GIB)
    rank = HostRegion(big.path_for_ranks)  # kept: its mapping lives as long as the object
    ctypes.memmove(rank.address(b, 4), b"mark", 4)
    big.give(a)
    assert big.compact() == {b: 0} and big.taken == {0: 20 * GIB}
    assert ctypes.string_at(rank.address(0, 4), 4) == b"mark"
    assert os.fstat(big.fd).st_blocks * 512 < 64 << 20  # pages for the marker, not the 20 GiB
    big.close()


def test_a_rank_maps_the_coordinators_region_and_sees_what_was_written_there():
    space = SwapSpace(1 << 20)
    writer, reader = HostRegion(space.path_for_ranks), HostRegion(space.path_for_ranks)
    ctypes.memmove(writer.address(4096, 5), b"prism", 5)
    assert ctypes.string_at(reader.address(4096, 5), 5) == b"prism"  # one region, shared
    with pytest.raises(SwapSpaceError, match=r"extent \[1048570, 1048580\) is outside the swap region"):
        reader.address((1 << 20) - 6, 10)
    with pytest.raises(SwapSpaceError, match="the job's swap region /nonexistent/fd/3"):
        HostRegion("/nonexistent/fd/3")
    space.close()


class _Rank:
    """A rank's answers to P.SWAP, as its receiver gives them: moves ``moves`` bytes of ``holds``."""

    def __init__(self, moves: int | dict[int, int], fits: bool = True) -> None:
        self.moves, self.fits, self.asked = moves, fits, []

    def __call__(self, rank: int, msg: dict) -> dict:
        assert msg["t"] == P.SWAP
        self.asked.append((rank, msg["op"], msg["offset"], msg["nbytes"]))
        if msg["op"] == "in" and not self.fits:
            return {"ok": False, "no_room": True, "error": "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"}
        return {"ok": True, "bytes": self.moves[rank] if isinstance(self.moves, dict) else self.moves}


def test_a_swapped_out_rank_keeps_its_context_on_the_device_and_it_counts():
    """An in-process swap moves the allocator's segments; the CUDA context stays. Before a rank's first swap
    the device expects it to keep the context estimate; after, what its swap left."""
    rank_side = _Rank(moves=30 * GIB)
    sw = InProcessSwapper(SwapSpace(200 * GIB), rank_side, context=GIB)
    mem = DeviceMemory(100 * GIB, sw, host=HostBudget(200 * GIB))
    pids = {0: 1000, 1: 1001}
    mem.report(0, 32 * GIB)  # 30 GiB of segments + 2 GiB outside them
    mem.report(1, 60 * GIB)
    assert mem.make_resident(1, 69 * GIB, [0], pids, lambda r: r)  # 32 + 69 > 100: rank 0 goes out
    assert [a[:2] for a in rank_side.asked] == [(0, "size"), (0, "size"), (0, "out")]  # the host budget's, the swap's
    assert mem.swapped == {0} and mem.left[0] == 2 * GIB and mem.used() == 2 * GIB + 69 * GIB
    assert sw.extent[0] == (0, 30 * GIB)
    # 99 GiB for rank 1 would fit a device without rank 0's 2 GiB, but not this one
    mem.released(1)
    mem.report(1, 80 * GIB)
    assert not mem.make_resident(1, 99 * GIB, [], pids, lambda r: r)
    assert mem.make_resident(0, 32 * GIB, [1], pids, lambda r: r)  # rank 1 (80) out, rank 0 back
    assert mem.swapped == {1} and 0 in mem.resident and 0 not in sw.extent
    assert [a[:2] for a in rank_side.asked][-4:] == [(1, "size"), (1, "size"), (1, "out"), (0, "in")]
    assert mem.left == {1: 50 * GIB}  # it moved 30 of its 80 GiB


def test_host_memory_is_budgeted_by_the_blocks_a_swap_copies_not_by_what_the_rank_holds():
    """A rank blocked after its backward holds ~97 GiB of segments, mostly free cached blocks; its swap copies
    the 20 GiB in use. The host budget (100 GiB, 8 of them held by the other rank, which is out) must be
    judged by those 20, or the rank that is out waits forever for a device nobody may leave."""
    rank_side = _Rank(moves={0: 20 * GIB, 1: 8 * GIB})
    sw = InProcessSwapper(SwapSpace(100 * GIB), rank_side, context=GIB)
    mem = DeviceMemory(140 * GIB, sw, host=HostBudget(100 * GIB))
    pids = {0: 1000, 1: 1001}
    mem.report(1, 9 * GIB)
    mem.swap_out(1, pids[1])
    mem.report(0, 97 * GIB)
    assert mem.host.held == {1: 8 * GIB}  # its extent, not its 9 GiB on the device
    assert mem.make_resident(1, 95 * GIB, [0], pids, lambda r: r)
    assert mem.swapped == {0} and mem.host.held == {0: 20 * GIB} and 1 in mem.resident
    asked = [a[:2] for a in rank_side.asked]
    assert asked == [(1, "size"), (1, "out"), (0, "size"), (0, "size"), (0, "out"), (1, "in")]
    assert sw.extent[0][1] == 20 * GIB


def test_a_restore_without_room_leaves_the_rank_out_and_its_extent_taken():
    rank_side = _Rank(moves=10 * GIB, fits=False)
    sw = InProcessSwapper(SwapSpace(50 * GIB), rank_side)
    sw.checkpoint(3, 1003)
    with pytest.raises(SwapNoRoom, match="rank 3: cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"):
        sw.restore(3, 1003)
    assert 3 in sw.extent and sw.space.free() == 40 * GIB
    sw.forget(3)  # the rank ended
    assert sw.space.free() == 50 * GIB


def test_a_failed_swap_out_gives_its_extent_back_and_says_which_rank():
    def refuse(rank: int, msg: dict) -> dict:
        return {"ok": True, "bytes": GIB} if msg["op"] == "size" else {"ok": False, "error": "VmmError: boom"}

    sw = InProcessSwapper(SwapSpace(4 * GIB), refuse)
    with pytest.raises(RuntimeError, match="rank 2: in-process swap out failed: VmmError: boom"):
        sw.checkpoint(2, 1002)
    assert sw.space.free() == 4 * GIB and not sw.extent


def test_the_coordinator_waits_for_the_swap_answer_and_keeps_what_else_the_rank_sent_in_order():
    from prism_megatron.runtime.coordinator import Coordinator

    coord = Coordinator(world_size=1, num_devices=1, slots_per_device=1, device_of={0: 0},
                        device_names=["cuda:0"], hang_timeout=60.0, authkey=b"k" * 16)
    ours, theirs = Pipe()
    coord._dispatch(ours, {"t": P.HELLO, "rank": 0, "pid": 1000})

    def rank() -> None:
        msg = theirs.recv()
        theirs.send({"t": P.MARK, "name": "a"})
        theirs.send({"t": P.MARK, "name": "b"})
        theirs.send({"t": P.SWAPPED, "op": msg["op"], "ok": True, "bytes": 7})

    t = threading.Thread(target=rank)
    t.start()
    assert coord.exchange(0, {"t": P.SWAP, "op": "size", "offset": 0, "nbytes": 0})["bytes"] == 7
    t.join()
    assert [m["name"] for m in coord._deferred[ours]] == ["a", "b"]
    seen = []
    coord._dispatch = lambda conn, msg: seen.append(msg["name"])
    coord.conns[ours] = coord.ranks[0]
    coord._drain(ours, waiting=False)
    assert seen == ["a", "b"] and coord._deferred[ours] == []
    theirs.close()
    assert "connection closed" in coord.exchange(0, {"t": P.SWAP, "op": "size", "offset": 0, "nbytes": 0})["error"]


def test_swap_modes_resolve_to_who_moves_the_state_and_whether_gpu_timing_runs(tmp_path, monkeypatch):
    script = tmp_path / "s.py"
    script.write_text("")
    gpu = dict(script=script, world_size=2, trace_dir=tmp_path / "t", devices=["0"])
    monkeypatch.setattr(launch_config, "inprocess_available", lambda: True)
    auto = LaunchConfig(**gpu)
    assert (auto.swap_mode, auto.swapper, auto.times_gpu) == ("checkpoint", "inprocess", True)
    explicit = LaunchConfig(**gpu, swap="inprocess")
    assert (explicit.swap_mode, explicit.swapper, explicit.times_gpu) == ("checkpoint", "inprocess", True)
    driver = LaunchConfig(**gpu, swap="checkpoint")
    assert (driver.swap_mode, driver.swapper, driver.times_gpu) == ("checkpoint", "cuda", False)
    monkeypatch.setattr(launch_config, "inprocess_available", lambda: False)
    assert (LaunchConfig(**gpu).swap_mode, LaunchConfig(**gpu).swapper) == ("auto", "cuda")
    with pytest.raises(LaunchError, match="--swap inprocess needs torch's MemPool .* use --swap checkpoint"):
        LaunchConfig(**gpu, swap="inprocess").validate()
    with pytest.raises(LaunchError, match="--swap inprocess needs GPU --devices"):
        LaunchConfig(script=script, world_size=2, trace_dir=tmp_path / "t", swap="inprocess").validate()
    stand_in = LaunchConfig(script=script, world_size=2, trace_dir=tmp_path / "t", swap="budget-inprocess",
                            device_memory_gib=10).validate()
    assert (stand_in.swap_mode, stand_in.swapper, stand_in.host_memory) == ("checkpoint", "budget-inprocess", None)


def test_results_that_arrive_while_the_rank_is_out_are_written_once_it_is_back(tmp_path, monkeypatch):
    """The receiver writes an async op's results into the program's tensors as they arrive; while the
    rank's state is swapped out those tensors' memory is not mapped, so the write waits for the swap in."""
    from prism_megatron.runtime import client as client_mod
    from prism_megatron.runtime.fake_device import ENV, FakeDevice

    FakeDevice.create(tmp_path / "dev", 10 * GIB, 1)
    monkeypatch.setenv(ENV, str(tmp_path / "dev"))
    space = SwapSpace(GIB)
    monkeypatch.setenv(client_mod.SWAP_REGION_ENV, space.path_for_ranks)
    from prism_megatron.runtime import fake_device

    monkeypatch.setattr(fake_device, "_DEVICE", None)
    monkeypatch.setenv("RANK", "0")
    fake_device.alloc(GIB // 2)
    c = client_mod.RankClient.__new__(client_mod.RankClient)
    c.rank, c.segments, c._region, c._held_writes, c._awaiting_room = 0, fake_device.StandInSegments(0), None, [], False
    c._pending, c._pending_lock, c._pin_swaps = {}, threading.Lock(), False
    written = []
    c._write = lambda p: written.append(p)
    p = client_mod._Pending(work=None, outs=[], out_descs=[], eager=True)
    c._pending[5] = p
    assert c._swap({"op": "size"})["bytes"] == GIB // 2
    assert c._swap({"op": "out", "offset": 0, "nbytes": GIB // 2})["ok"]
    c._complete({"id": 5, "out": []})
    assert written == [] and c._held_writes == [p]
    assert c._swap({"op": "in", "offset": 0, "nbytes": GIB // 2}) == {
        "ok": True, "bytes": GIB // 2, "copied": GIB // 2, "seconds": pytest.approx(0, abs=5),
        "copy_s": pytest.approx(0, abs=5), "map_s": pytest.approx(0, abs=5)}
    assert written == [p] and c._held_writes == []
    # an extent another rank wrote over is found out at the swap in
    assert c._swap({"op": "out", "offset": 0, "nbytes": GIB // 2})["ok"]
    ctypes.memmove(c._region.address(0, 16), b"\0" * 16, 16)
    answer = c._swap({"op": "in", "offset": 0, "nbytes": GIB // 2})
    assert not answer["ok"] and "written over while it was swapped out" in answer["error"]


def test_a_rank_page_locks_the_region_granules_its_swaps_reach_once_and_says_why_where_it_cannot(
        tmp_path, monkeypatch, capsys):
    """Page-locked pages copy at the copy engine's speed (H200: 73.6 GB/s out, 71.4 in, against 20.0 / 9.5 for
    touched pageable ones; a second process may lock pages another holds locked: vmm-swap-probe results). A
    range may be registered only once per process, so the region is locked in granules, each once, as the
    rank's swaps first reach it; where registering fails the copies go on pageable and the job says so once."""
    from prism_megatron.runtime import client as client_mod
    from prism_megatron.runtime import fake_device, staging
    from prism_megatron.runtime.fake_device import ENV, FakeDevice
    from prism_megatron.runtime.swap_space import PIN_CHUNK
    from prism_megatron.trace.summary import _device_lines

    space = SwapSpace(3 * PIN_CHUNK + PIN_CHUNK // 2 - 100)  # sparse: no pages are made; not whole pages
    region = HostRegion(space.path_for_ranks)
    calls = []
    region.pin(PIN_CHUNK - 10, 20, lambda a, n: calls.append((a - region.base_address, n)))
    region.pin(PIN_CHUNK, PIN_CHUNK, lambda a, n: calls.append((a - region.base_address, n)))  # granule 1: done
    region.pin(3 * PIN_CHUNK + 5, 10, lambda a, n: calls.append((a - region.base_address, n)))
    assert calls == [(0, PIN_CHUNK), (PIN_CHUNK, PIN_CHUNK), (3 * PIN_CHUNK, PIN_CHUNK // 2)]  # last: to its page end

    def refuse(a: int, n: int, what: str = "") -> None:
        raise RuntimeError("cudaHostRegister of 1073741824 bytes of the swap region failed (cudaError 1)")

    region.pin(2 * PIN_CHUNK, 10, refuse)
    region.pin(2 * PIN_CHUNK, 10, lambda a, n: calls.append(a))  # not tried again
    assert "cudaError 1" in region.pin_error and region.pinned == {0, 1, 3} and len(calls) == 3

    # the rank's side: its swap answers carry the seconds, and the failure once
    FakeDevice.create(tmp_path / "dev", 10 * GIB, 1)
    monkeypatch.setenv(ENV, str(tmp_path / "dev"))
    monkeypatch.setenv(client_mod.SWAP_REGION_ENV, space.path_for_ranks)
    monkeypatch.setattr(fake_device, "_DEVICE", None)
    monkeypatch.setenv("RANK", "0")
    fake_device.alloc(GIB // 2)
    locked = []
    monkeypatch.setattr(staging, "cuda_pin", lambda a, n, what="": locked.append(what) or (lambda: None))
    c = client_mod.RankClient.__new__(client_mod.RankClient)
    c.rank, c.segments, c._region, c._held_writes, c._awaiting_room = 0, fake_device.StandInSegments(0), None, [], False
    c._pending, c._pending_lock, c._pin_swaps = {}, threading.Lock(), True
    out = c._swap({"op": "out", "offset": 0, "nbytes": GIB // 2})
    assert out["ok"] and out["pin_s"] >= 0 and "pin_error" not in out and locked == ["the swap region"]
    assert c._swap({"op": "in", "offset": 0, "nbytes": GIB // 2})["ok"] and len(locked) == 1  # granule 0 held
    # each granule is a registration of its own, and the driver refuses a copy across two (H200:
    # CUDA_ERROR_INVALID_VALUE): the copies are cut at the granules
    assert c.segments.grains == [(c._region.base_address, PIN_CHUNK)] * 2
    monkeypatch.setattr(staging, "cuda_pin", refuse)
    answers = [c._swap({"op": op, "offset": 2 * PIN_CHUNK, "nbytes": GIB // 2}) for op in ("out", "in")]
    assert all(a["ok"] for a in answers), answers
    assert "cudaError 1" in answers[0]["pin_error"] and "pin_error" not in answers[1]

    # the coordinator's side: the seconds per rank, the failure said once and kept for the trace's summary
    sw = InProcessSwapper(SwapSpace(GIB), lambda r, m: {})
    sw._count(3, {"copied": 5, "copy_s": 1.0, "map_s": 0.5, "pin_s": 2.0})
    sw._count(3, answers[0])
    sw._count(4, {"pin_error": "later"})
    assert sw.split[3][2] >= 2.0 and sw.pin_error.startswith("rank 3: cudaHostRegister")
    assert capsys.readouterr().err.count("the swap region is not page-locked") == 1
    lines = _device_lines({"swap_page_lock_error": sw.pin_error})
    assert any("swap region not page-locked, copies pageable: rank 3" in line for line in lines)
    space.close()


def test_prefaulting_gives_the_region_pages_without_touching_what_ranks_wrote():
    import os

    space = SwapSpace(64 << 20)
    rank = HostRegion(space.path_for_ranks)
    ctypes.memmove(rank.address(8 << 20, 6), b"stays!", 6)  # a swap under way
    t = space.prefault(48 << 20, chunk=4 << 20)
    t.join(30)
    done, why = t.result
    if why is not None:  # a kernel older than 5.14 has no MADV_POPULATE_WRITE: it says so and stops
        assert done == 0 and why == os.strerror(22)
    else:
        assert done == 48 << 20 and os.fstat(space.fd).st_blocks * 512 >= 48 << 20  # the pages are there
    assert ctypes.string_at(rank.address(8 << 20, 6), 6) == b"stays!"
    space.close()


def _readied(space: SwapSpace, nbytes: int) -> None:
    """The region's first ``nbytes`` given pages by the prefault thread (skips where the kernel cannot)."""
    t = space.prefault(nbytes, chunk=1 << 20)
    t.join(30)
    if t.result[1] is not None:
        pytest.skip(f"no MADV_POPULATE_WRITE here (Linux < 5.14): {t.result[1]}")
    assert space.resident() >= nbytes


def test_trimming_gives_back_readied_pages_of_granules_no_extent_was_given(monkeypatch):
    """Pages readied beyond the need go back to the host, whole granules at a time, except the granules an
    extent ever covered (a rank may have page-locked them) and what ranks wrote; the prefault goes no
    further, whether trim comes after it or while it runs."""
    from prism_megatron.runtime import swap_space

    monkeypatch.setattr(swap_space, "PIN_CHUNK", 4 << 20)
    space = SwapSpace(64 << 20)
    rank = HostRegion(space.path_for_ranks)
    at = space.take(6 << 20)  # granules 0 and 1
    ctypes.memmove(rank.address(at + (5 << 20), 6), b"stays!", 6)
    _readied(space, 48 << 20)
    space.give(at)  # back in the free list, but a rank may still hold its granules page-locked
    assert space.trim(2 << 20) == 40 << 20  # granules 2-11 (readied) go; 12-15 had no pages
    assert space.resident() == 8 << 20
    assert ctypes.string_at(rank.address(at + (5 << 20), 6), 6) == b"stays!"
    space.close()

    space = SwapSpace(64 << 20)
    t = space.prefault(64 << 20, chunk=1 << 20)
    space.trim(0)
    t.join(30)
    assert space.resident() == 0 and space.take(1 << 20) == 0  # the region still serves swaps
    space.close()


def test_readying_the_region_leaves_host_memory_to_the_ranks(monkeypatch, capsys):
    """The prefault stops where the host would have less available than it leaves to the ranks, and says so;
    the region still serves swaps past that point."""
    from prism_megatron.runtime import hostplan

    space = SwapSpace(64 << 20)
    monkeypatch.setattr(hostplan, "available_host_memory", lambda: (40 << 20) - space.resident())
    t = space.prefault(48 << 20, chunk=4 << 20, keep_free=24 << 20)
    t.join(30)
    done, why = t.result
    if done == 0 and why == os.strerror(22):
        pytest.skip("no MADV_POPULATE_WRITE here (Linux < 5.14)")
    assert done == 16 << 20 == space.resident()  # at 24 MiB available, one more chunk would leave 20
    assert "stopped there: the host had 24 MiB available, and the readying leaves 24 MiB to the ranks" in \
        capsys.readouterr().err
    assert space.take(32 << 20) == 0
    space.close()


def test_measured_peaks_that_need_no_swap_give_the_readied_host_region_back(monkeypatch, capsys):
    """Two ranks on one device readied the host region for their bounds (prism's estimates with headroom);
    once every rank's iteration-1 peak is in and the two fit the device together, its pages go back to the
    host: held through the run, they crowded the ranks' own host memory (a one-GPU-truth run slowed ~10x
    per iteration once 112 GiB of a 128 GiB host were readied for swaps that never came)."""
    from prism_megatron.runtime import swap_space
    from prism_megatron.runtime.governor import MemoryGovernor
    from prism_megatron.runtime.groups import GroupTable
    from prism_megatron.runtime.ranks import RankState
    from prism_megatron.runtime.slots import SlotScheduler

    monkeypatch.setattr(swap_space, "PIN_CHUNK", 4 << 20)
    ranks = {r: RankState(r, None) for r in (0, 1)}
    g = MemoryGovernor(2, ranks, SlotScheduler(1, 1), GroupTable(), ["cuda:0"], lambda *a: None, lambda *a: None)
    space = SwapSpace(64 << 20)
    g.enable_swap(InProcessSwapper(space, lambda r, m: {}), [140 * GIB], host_capacity=64 << 20)
    _readied(space, 32 << 20)
    for r, peak in ((0, 60 * GIB), (1, 70 * GIB)):
        g.mark(r, {"name": "iteration", "phase": "B"})
        g.note(ranks[r], {"mem": peak, "peak": peak})
    g.mark(0, {"name": "iteration", "phase": "E"})
    assert space.resident() >= 32 << 20  # rank 1's peak is not in yet
    g.mark(1, {"name": "iteration", "phase": "E"})
    assert space.resident() == 0
    err = capsys.readouterr().err
    assert "host region for swaps: 32 MiB of readied pages given back (the peaks measured by iteration 1 swap " \
        "out at most 0 MiB at once)" in err
    space.close()


def test_no_copy_spans_two_page_locked_granules():
    from prism_megatron.runtime.vmm import pieces

    base, size = 1000, 100
    assert pieces(1050, 30, (base, size)) == [(0, 30)]
    assert pieces(1050, 120, (base, size)) == [(0, 50), (50, 70)]
    assert pieces(1100, 250, (base, size)) == [(0, 100), (100, 100), (200, 50)]
    assert pieces(1050, 120, None) == [(0, 120)]
    parts = pieces(1234, 5678, (base, 512))
    assert sum(n for _, n in parts) == 5678 and all(
        (1234 + off - base) // 512 == (1234 + off + n - 1 - base) // 512 for off, n in parts)


def test_a_swap_copies_only_the_blocks_the_allocator_has_in_use():
    from prism_megatron.runtime.vmm import in_use

    snapshot = [{"address": 4096, "blocks": [
        {"address": 4096 + 1024, "size": 512, "state": "active_allocated"},  # out of order on purpose
        {"address": 4096, "size": 1024, "state": "inactive"},
        {"address": 4096 + 1536, "size": 256, "state": "active_pending_free"},  # another stream may still use it
        {"address": 4096 + 1792, "size": 256, "state": "inactive"},
        {"address": 4096 + 2048, "size": 2048, "state": "active_allocated"}]},
        {"address": 1 << 30, "blocks": [{"address": 1 << 30, "size": 4096, "state": "inactive"}]}]
    assert in_use(snapshot) == {4096: [(1024, 768), (2048, 2048)], 1 << 30: []}


def test_a_rank_nothing_is_measured_of_gets_the_device_less_the_contexts_the_others_keep_when_out():
    """The bound for a rank not yet measured is the device; with in-process swaps every other rank keeps its
    context when out, so the whole device can never be free: the bound is what eviction can give, or the
    rank would wait for room forever (a hang with the other rank queued and evictable)."""
    from conftest import two_ranks_asking_for_one_device

    sw = InProcessSwapper(SwapSpace(100 * GIB), _Rank(moves=9 * GIB), context=GIB)
    coord, granted, conns, mem = two_ranks_asking_for_one_device(sw, 100 * GIB, host_capacity=100 * GIB)
    assert granted == [0] and mem.reserve == {0: 100 * GIB}  # nothing else holds the device yet
    coord._dispatch(conns[0], {"t": P.RELEASE, "iteration": 1, "clk": 0.0, "mem": 10 * GIB, "peak": 12 * GIB})
    assert granted == [0, 1], "rank 1 must get the device less rank 0's context, not wait for all of it"
    assert mem.swapped == {0} and mem.left == {0: GIB} and mem.reserve == {1: 99 * GIB}
    assert mem.used() <= mem.capacity


def test_room_is_made_mid_turn_only_for_the_rank_in_its_turn_and_only_by_swapping_blocked_ranks_out():
    """P.ROOM: the running rank, 2 GiB short, gets the queued rank (5 GiB, 4 of them its blocks in use) swapped
    out and is told to retry; the same question from a rank not in its turn (another of its threads while it
    waits) is refused and moves nobody."""
    from conftest import two_ranks_asking_for_one_device

    sw = InProcessSwapper(SwapSpace(100 * GIB), _Rank(moves=4 * GIB), context=GIB)
    coord, granted, conns, mem = two_ranks_asking_for_one_device(sw, 100 * GIB, host_capacity=100 * GIB)
    mem.report(1, 5 * GIB)
    answers = []
    coord._send = lambda rs, msg: answers.append((rs.rank, msg))
    coord._dispatch(conns[1], {"t": P.ROOM, "nbytes": GIB, "free": 0})
    assert answers == [(1, {"t": P.ROOM_MADE, "ok": False})] and not mem.swapped
    coord._dispatch(conns[0], {"t": P.ROOM, "nbytes": 3 * GIB, "free": GIB})
    assert answers[-1] == (0, {"t": P.ROOM_MADE, "ok": True}) and mem.swapped == {1} and mem.left == {1: GIB}
    coord._dispatch(conns[0], {"t": P.ROOM, "nbytes": 3 * GIB, "free": GIB})  # nobody left to swap out
    assert answers[-1] == (0, {"t": P.ROOM_MADE, "ok": False})
    assert coord.governor.retried == {True: 1, False: 1}  # the refused thread's question counts for nothing


def test_an_allocation_waiting_for_room_stops_the_ranks_compute_clock_and_holds_results_back(monkeypatch):
    """While the coordinator swaps other ranks out for it, the waiting allocation's rank is not computing: its
    clock stops (else the swaps would count as its compute and inflate the prediction), and a result that
    arrives meanwhile is written only after the answer."""
    import time

    from prism_megatron.runtime import client as client_mod

    c = client_mod.RankClient.__new__(client_mod.RankClient)
    c._receiver, c._fatal, c._gpu, c._clock = threading.current_thread(), None, None, 0.0
    c._room_lock, c._room_event, c._room_answer, c._awaiting_room = threading.Lock(), threading.Event(), None, False
    c.segments, c._held_writes, c._pending, c._pending_lock = None, [], {}, threading.Lock()
    assert not c.ask_room(GIB, 0)  # never from the receiver thread: it must stay free for the answer
    c._receiver = object()
    written, asked = [], []
    c._write = lambda p: written.append(p)

    class Segments:
        swapped = False

    c.segments = Segments()
    p = client_mod._Pending(work=None, outs=[], out_descs=[], eager=True)
    c._pending[7] = p

    def coordinator(msg):  # answers from another thread after the swaps: 0.3 s
        asked.append(msg)

        def answer():
            c._complete({"id": 7, "out": []})
            assert written == []  # held while the allocation waits
            c._room_answer = {"t": P.ROOM_MADE, "ok": True}
            c._room_event.set()
            c._write_held()

        threading.Timer(0.3, answer).start()

    c._send = coordinator
    c._running_since = time.perf_counter()
    assert c.ask_room(3 * GIB, GIB)
    assert asked == [{"t": P.ROOM, "nbytes": 3 * GIB, "free": GIB}] and written == [p]
    assert c._running_since is not None  # computing again
    assert c._pause() < 0.2  # the 0.3 s wait is not on the rank's compute clock


def test_a_rank_whose_measured_peak_is_at_the_devices_edge_is_admitted_with_what_eviction_can_give():
    """A rank measured at 99.8 GiB (plus the admission margin) on a 100 GiB device where the other rank, out,
    keeps 1 GiB of context: admission holds the 99 GiB eviction can give instead of waiting forever for more."""
    from conftest import two_ranks_asking_for_one_device

    sw = InProcessSwapper(SwapSpace(100 * GIB), _Rank(moves=9 * GIB), context=GIB)
    coord, granted, conns, mem = two_ranks_asking_for_one_device(sw, 100 * GIB, host_capacity=100 * GIB)
    expected = coord.governor.peaks.expected
    coord.governor.peaks.expected = lambda r, held: (int(99.8 * GIB), "own") if r == 1 else expected(r, held)
    coord._dispatch(conns[0], {"t": P.RELEASE, "iteration": 1, "clk": 0.0, "mem": 10 * GIB, "peak": 12 * GIB})
    assert granted == [0, 1] and mem.swapped == {0} and mem.reserve == {1: 99 * GIB}
    assert coord.governor.need(1) == (99 * GIB, "own")
