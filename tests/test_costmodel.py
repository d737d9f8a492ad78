"""Collective cost model, cluster profiles and the nccl-tests fit."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import yaml

from prism_megatron.calibration import (
    CollectiveCostModel,
    ProfileError,
    fit_main,
    fit_profile_from_nccl_tests,
    link_for,
    load_profile,
    parse_profile,
    profile_names,
)
from prism_megatron.calibration import costmodel as cm
from prism_megatron.calibration.profiles import PROFILES_DIR, Figure
from prism_megatron.replay import GraphBuilder, replay


def _fig(value, basis="assumed"):
    return {"value": value, "basis": basis, "source": "test"}


def _profile_dict(**over):
    doc = {
        "version": 1,
        "name": "test",
        "gpus_per_node": _fig(8, "spec"),
        "intra_node": {"bandwidth_GBps": _fig(100), "latency_us": _fig(5)},
        "inter_node": {"nics_per_node": _fig(4), "nic_bandwidth_GBps": _fig(50), "latency_us": _fig(10)},
        "nccl": {
            "algorithm": "ring",
            "protocol": "simple",
            "protocols": {
                "simple": {"latency_factor": _fig(1.0), "bandwidth_factor": _fig(1.0)},
                "ll": {"latency_factor": _fig(0.25), "bandwidth_factor": _fig(0.5)},
                "ll128": {"latency_factor": _fig(0.5), "bandwidth_factor": _fig(0.9375)},
            },
        },
    }
    for path, value in over.items():
        node = doc
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[k]
        if value is ...:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value
    return doc


def _profile(**over):
    return parse_profile(yaml.safe_dump(_profile_dict(**over)), "test.yaml")


# ----------------------------------------------------------------------------- formulas


def test_ring_and_tree_formulas_on_hand_computed_numbers():
    S, a, B = 800e6, 5e-6, 100e9
    # ring all-reduce over 8: 2*7/8 * 800e6/100e9 = 0.014 s, plus 2*7 steps of 5 us
    assert cm.ring_all_reduce(S, 8, a, B) == pytest.approx(0.014 + 70e-6, rel=1e-12)
    # all-gather / reduce-scatter over 8: 7/8 * 8 ms + 7 * 5 us
    assert cm.ring_all_gather(S, 8, a, B) == pytest.approx(0.007 + 35e-6, rel=1e-12)
    assert cm.ring_reduce_scatter(S, 4, a, B) == pytest.approx(0.006 + 15e-6, rel=1e-12)
    # double binary tree over 8: 2*log2(8) = 6 steps, 2*S/B = 16 ms
    assert cm.tree_all_reduce(S, 8, a, B) == pytest.approx(0.016 + 30e-6, rel=1e-12)
    assert cm.chain_broadcast(S, 8, a, B) == pytest.approx(0.008 + 35e-6, rel=1e-12)
    assert cm.all_to_all(S, 8, a, B) == pytest.approx(0.007 + 35e-6, rel=1e-12)
    assert cm.p2p(S, a, B) == pytest.approx(0.008 + 5e-6, rel=1e-12)
    assert cm.ring_all_reduce(S, 1, a, B) == 0.0


def test_model_uses_intra_link_inside_a_node_and_bottleneck_across_nodes():
    p = _profile()
    model = CollectiveCostModel(p)
    S = 800e6
    assert model.time("all_reduce", S, range(8)) == pytest.approx(2 * 7 / 8 * S / 100e9 + 14 * 5e-6)
    # ranks 0 and 8 sit on nodes 0 and 1: per-GPU inter-node bandwidth 4 NICs * 50 GB/s / 8 GPUs = 25 GB/s
    link = link_for(p, (0, 8))
    assert (link.name, link.bandwidth) == ("inter", 25e9) and link.alpha == pytest.approx(10e-6)
    assert model.time("all_reduce", S, (0, 8, 16, 24)) == pytest.approx(2 * 3 / 4 * S / 25e9 + 6 * 10e-6)
    assert model.time("send", S, (7, 8)) == pytest.approx(10e-6 + S / 25e9)
    # k members per node use the NIC share of their k GPUs: 2 -> 50 GB/s, 4 -> 100 GB/s (= NVLink: bound there)
    assert link_for(p, (0, 1, 8, 9)).bandwidth == 50e9
    assert link_for(p, (0, 1, 2, 3, 8, 9, 10, 11)).bandwidth == 100e9
    assert link_for(p, (0, 1, 2, 8)).bandwidth == 25e9  # the node with fewest members bounds the ring
    assert model.time("send", S, (6, 7)) == pytest.approx(5e-6 + S / 100e9)
    assert model.time("all_gather_list", S, range(4)) == model.time("all_gather", S, range(4))
    assert model.time("all_reduce", S, (3,)) == 0.0
    with pytest.raises(ValueError, match="no cost formula for op kind 'fancy'"):
        model.time("fancy", 1, (0, 1))


def test_protocol_and_algorithm_choice():
    p = _profile()
    S = 800e6
    ll = CollectiveCostModel(p, protocol="ll").time("all_reduce", S, range(8))
    assert ll == pytest.approx(2 * 7 / 8 * S / 50e9 + 14 * 5e-6 * 0.25)
    auto = CollectiveCostModel(p, protocol="auto")
    assert auto.time("all_reduce", S, range(8)) == CollectiveCostModel(p).time("all_reduce", S, range(8))
    assert auto.time("all_reduce", 1024, range(8)) == pytest.approx(
        2 * 7 / 8 * 1024 / 50e9 + 14 * 5e-6 * 0.25)  # small messages: LL's latency wins
    tree = CollectiveCostModel(p, algorithm="tree").time("all_reduce", 8, range(64))
    ring = CollectiveCostModel(p, algorithm="ring").time("all_reduce", 8, range(64))
    both = CollectiveCostModel(p, algorithm="auto").time("all_reduce", 8, range(64))
    assert tree < ring and both == tree  # 64 ranks, tiny message: logarithmic latency wins
    big = CollectiveCostModel(p, algorithm="auto").time("all_reduce", 8e9, range(8))
    assert big == CollectiveCostModel(p, algorithm="ring").time("all_reduce", 8e9, range(8))


def test_cost_model_plugs_into_replay():
    model = CollectiveCostModel(_profile())
    gb = GraphBuilder()
    gb.group(0, list(range(16)))
    for r in range(16):
        gb.compute(r, 0.001 * r)
        gb.collective(r, "all_reduce", 0, 1 << 26)
    res = replay(gb.build(), model)
    assert res.makespan == pytest.approx(0.015 + model.time("all_reduce", 1 << 26, range(16)))


# ----------------------------------------------------------------------------- profiles


def test_shipped_profiles_every_figure_has_a_source():
    assert {"h100-nvlink-ib400", "h200-nvlink-ib400"} <= set(profile_names())
    for name in ("h100-nvlink-ib400", "h200-nvlink-ib400"):
        p = load_profile(name)
        assert p.name == name and p.path == str(PROFILES_DIR / f"{name}.yaml")
        assert (p.gpus_per_node.value, p.nics_per_node.value) == (8, 8)
        assert p.intra_bandwidth_GBps.value == 450 and p.intra_bandwidth_GBps.basis == "spec"
        assert p.nic_bandwidth_GBps.value == 50 and p.nic_bandwidth_GBps.basis == "spec"
        assert p.inter_bw_per_gpu == 50e9
        figures = [p.gpus_per_node, p.intra_bandwidth_GBps, p.intra_latency_us, p.nics_per_node,
                   p.nic_bandwidth_GBps, p.inter_latency_us]
        figures += [f for pf in p.protocols.values() for f in (pf.latency_factor, pf.bandwidth_factor)]
        assert all(f.source.strip() and f.basis in ("spec", "measured", "fitted", "assumed") for f in figures)
    assert load_profile(PROFILES_DIR / "h100-nvlink-ib400.yaml").name == "h100-nvlink-ib400"


@pytest.mark.parametrize("over,field,problem", [
    ({"intra_node.bandwith_GBps": _fig(1)}, "intra_node.bandwith_GBps", "is not a known key"),
    ({"intra_node.latency_us": ...}, "intra_node.latency_us", "is missing"),
    ({"inter_node.nic_bandwidth_GBps": _fig(-5)}, "inter_node.nic_bandwidth_GBps.value", "positive number"),
    ({"inter_node.nics_per_node": _fig(2.5)}, "inter_node.nics_per_node.value", "positive integer"),
    ({"gpus_per_node": 8}, "gpus_per_node", "expected a mapping"),
    ({"intra_node.latency_us": {"value": 3, "basis": "guess", "source": "x"}}, "intra_node.latency_us.basis",
     "expected one of spec, measured, fitted, assumed"),
    ({"intra_node.latency_us": {"value": 3, "basis": "spec", "source": ""}}, "intra_node.latency_us.source",
     "non-empty string"),
    ({"nccl.algorithm": "collnet"}, "nccl.algorithm", "expected one of ring, tree, pat, nvls, auto"),
    ({"nccl.nvls": {"value": 2, "basis": "spec", "source": "x"}}, "nccl.nvls.value", "expected 0 or 1"),
    ({"nccl.protocols.ll128": ...}, "nccl.protocols.ll128", "is missing"),
    ({"nccl.protocols.ll.bandwidth_factor": _fig(1.5)}, "nccl.protocols.ll.bandwidth_factor.value", "at most 1.0"),
    ({"version": 2}, "version", "supports cluster profile version 1"),
    ({"extra": 1}, "extra", "is not a known key"),
])
def test_profile_validation_errors_name_file_and_field(over, field, problem):
    with pytest.raises(ProfileError) as e:
        _profile(**over)
    assert e.value.field == field
    assert str(e.value).startswith(f"cluster profile test.yaml: {field} ")
    assert problem in str(e.value)


def test_profile_yaml_errors(tmp_path):
    with pytest.raises(ProfileError, match=r"cluster profile x.yaml: line 2 is not valid YAML: duplicate key"):
        parse_profile("version: 1\nversion: 1\n", "x.yaml")
    with pytest.raises(ProfileError, match="is not a shipped profile"):
        load_profile("no-such-cluster")
    bad = tmp_path / "c.yaml"
    bad.write_text(yaml.safe_dump(_profile_dict(**{"nccl.protocol": "fast"})))
    with pytest.raises(ProfileError, match=rf"cluster profile {bad}: nccl.protocol is 'fast'"):
        load_profile(bad)


# ----------------------------------------------------------------------------- nccl-tests fit


def synthetic_log(test="all_reduce", n=8, hosts=1, alpha=4e-6, B=150e9, root=True, name=True):
    """nccl-tests-formatted output for time(S) = steps * alpha + factor * S / B, printed as nccl-tests does."""
    family = {"alltoall": "all_to_all", "sendrecv": "p2p"}.get(test, test)
    factor = cm.BUS_FACTOR[family](n)
    steps = {"all_reduce": 2 * (n - 1), "p2p": 1}.get(family, n - 1)
    lines = []
    if name:
        lines.append(f"# Collective test starting: {test}_perf")
    lines.append("# nThread 1 nGpus 1 minBytes 8 maxBytes 8589934592 step: 2(factor) warmup iters: 5 iters: 20")
    lines.append("#\n# Using devices")
    per_host = n // hosts
    for r in range(n):
        lines.append(f"#  Rank {r:2d} Group  0 Pid {1000 + r:6d} on node{r // per_host:03d} device {r % per_host:2d} "
                     f"[0x{r:02x}] NVIDIA H100 80GB HBM3")
    rc = "    root" if root else ""
    lines.append("#                                                              out-of-place                       "
                 "in-place          ")
    lines.append(f"#       size         count      type   redop{rc}     time   algbw   busbw #wrong     time   "
                 "algbw   busbw #wrong")
    lines.append(f"#        (B)    (elements){'        ' if root else ''}                       (us)  (GB/s)  (GB/s)"
                 "            (us)  (GB/s)  (GB/s)       ")
    size = 1024
    while size <= 8 << 30:
        t = steps * alpha + factor * size / B
        us = t * 1e6
        algbw = size / t / 1e9
        tf = f"{us:8.1f}" if us < 10000 else f"{us:8.0f}"
        rv = "      -1" if root else ""
        lines.append(f"{size:12d}  {size // 4:12d}     float     sum{rv} {tf} {algbw:7.2f} {algbw * factor:7.2f}"
                     f"      0 {tf} {algbw:7.2f} {algbw * factor:7.2f}      0")
        size *= 4
    lines.append("# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 70.742 \n")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("test,n,hosts,root,name", [
    ("all_reduce", 8, 1, True, True),
    ("all_reduce", 16, 2, True, False),  # kind inferred from busbw/algbw
    ("all_gather", 8, 1, False, True),  # older table without the root column
    ("reduce_scatter", 4, 1, True, True),
    ("sendrecv", 2, 2, True, True),
])
def test_fit_recovers_alpha_and_bandwidth(test, n, hosts, root, name):
    alpha, B = 4e-6, 150e9
    fit = fit_profile_from_nccl_tests(synthetic_log(test, n, hosts, alpha, B, root, name))
    assert fit.nranks == n and fit.nhosts == hosts
    assert fit.link == ("inter_node" if hosts > 1 else "intra_node")
    if name:
        assert fit.family == {"sendrecv": "p2p"}.get(test, test)
    # printed times are rounded to 0.1 us, algbw to 0.01 GB/s: recover within a few percent
    assert fit.bandwidth == pytest.approx(B, rel=0.01)
    assert fit.alpha == pytest.approx(alpha, rel=0.05)


def _inter_node_fitted(log):
    """A profile of 8 NICs per node whose inter-node figures are fit_main's fragment for LOG."""
    fragment = yaml.safe_load(fit_main(log).split("profile fragment (inter_node):\n", 1)[1])
    doc = _profile_dict(**{"inter_node.nics_per_node": _fig(8)})
    doc["inter_node"].update(fragment["inter_node"])
    doc["intra_node"]["bandwidth_GBps"] = _fig(450)
    return parse_profile(yaml.safe_dump(doc), "fitted.yaml")


def test_fit_main_prints_a_profile_fragment_that_validates(tmp_path):
    log = tmp_path / "ar.log"
    log.write_text(synthetic_log("all_reduce", 8, 1, 3e-6, 360e9))
    text = fit_main(log)
    assert re.search(r"bus bandwidth 3(59\.9|60\.0)\d GB/s", text) and "x alpha 3.00" in text
    fragment = yaml.safe_load(text.split("profile fragment (intra_node):\n", 1)[1])
    doc = _profile_dict()
    doc["intra_node"] = fragment["intra_node"]
    p = parse_profile(yaml.safe_dump(doc), "fitted.yaml")
    assert p.intra_bandwidth_GBps.basis == "fitted" and "ar.log" in p.intra_bandwidth_GBps.source
    assert p.intra_bandwidth_GBps.value == pytest.approx(360, rel=0.01)
    assert math.isclose(p.intra_latency_us.value, 3.0, rel_tol=0.05)
    # across 2 nodes of 8: the group's bandwidth is 8 * nics * nic_bw / 8, so with one NIC per GPU
    # the fragment's NIC bandwidth reproduces the measured times through the cost model
    log.write_text(synthetic_log("all_reduce", 16, 2, 6e-6, 380e9))
    p = _inter_node_fitted(log)
    assert p.nic_bandwidth_GBps.value == pytest.approx(380 / 8, rel=0.01)
    model = CollectiveCostModel(p)
    S = 1 << 30
    assert model.time("all_reduce", S, range(16)) == pytest.approx(30 * 6e-6 + 2 * 15 / 16 * S / 380e9, rel=0.01)


def test_fit_rejects_non_nccl_tests_text():
    from prism_megatron.calibration.nccl_tests import NcclTestsParseError

    with pytest.raises(NcclTestsParseError, match="fewer than two result rows"):
        fit_profile_from_nccl_tests("hello\nworld\n")


# --- algorithm choice (what NCCL's tuner would run) ---------------------------------------------------


def test_algorithms_enabled_by_placement():
    one_node = {0: 8}
    spread = {n: 1 for n in range(64)}
    two_per_node = {n: 2 for n in range(8)}
    assert cm.algorithms_for("all_reduce", one_node, nvls=False) == ("ring",)
    assert cm.algorithms_for("all_reduce", one_node, nvls=True) == ("ring", "nvls")
    assert cm.algorithms_for("all_reduce", spread, nvls=True) == ("ring", "tree")
    assert cm.algorithms_for("all_gather", spread, nvls=False) == ("ring", "pat")
    assert cm.algorithms_for("reduce_scatter", two_per_node, nvls=False) == ("ring",)
    assert cm.algorithms_for("all_gather", one_node, nvls=True) == ("ring", "nvls")
    assert cm.algorithms_for("all_to_all", spread, nvls=True) == ("ring",)


def test_algorithm_choice_hand_computed():
    p = load_profile("h100-nvlink-ib400")  # NVLS off, Simple protocol
    model = CollectiveCostModel(p)
    S = 2**30
    a_in, b_in = 3.4e-6, 450e9
    a_out, b_out = 9.6e-6, 50e9  # one GPU per node: 8 NICs x 50 GB/s / 8 GPUs
    # TP group of 8 on one node: only ring is enabled (tree needs nodes, NVLS is off)
    assert model.choose("all_reduce", S, range(8)) == pytest.approx(("ring", "simple", 14 * a_in + 14 / 8 * S / b_in))
    # a DP group of 512 ranks, one per node: tree (2*9 steps) beats ring (2*511 steps)
    dp512 = range(0, 4096, 8)
    assert model.choose("all_reduce", S, dp512) == pytest.approx(("tree", "simple", 18 * a_out + 2 * S / b_out))
    # all-gather over 1,024 nodes, one rank each: PAT's 10 steps (plus NCCL's 2.8 us per rank) against
    # ring's 1,023 steps for 1 MiB; for 1 GiB ring's full bandwidth wins back (PAT runs at 0.75 of it)
    dp1024 = range(0, 8192, 8)
    pat = 10 * a_out / 3.5 + 1024 * 2.8e-6 + 1023 / 1024 * 2**20 / (0.75 * b_out)
    assert model.choose("all_gather", 2**20, dp1024) == pytest.approx(("pat", "simple", pat))
    ring = 1023 * a_out + 1023 / 1024 * S / b_out
    assert model.choose("all_gather", S, dp1024) == pytest.approx(("ring", "simple", ring))
    assert cm.pat_all_gather(S, 1024, a_out, b_out) > ring
    # two ranks per node: PAT is not enabled, ring runs (k=2 GPUs' NIC share)
    pairs = [r for n in range(8) for r in (8 * n, 8 * n + 1)]
    assert model.choose("reduce_scatter", S, pairs) == pytest.approx(
        ("ring", "simple", 15 * a_out + 15 / 16 * S / (2 * b_out)))
    # NVLS when the cluster enables it: the switch reduces, NCCL's 25 us + S/B (large messages only)
    from dataclasses import replace

    from prism_megatron.calibration.profiles import Figure
    nvls = CollectiveCostModel(replace(p, nvls_enabled=Figure(1, "test", "assumed")))
    assert _profile(**{"nccl.nvls": {"value": 1, "basis": "assumed", "source": "test"}}).nvls
    assert nvls.choose("all_reduce", S, range(8)) == pytest.approx(("nvls", "simple", 25e-6 + S / b_in))
    auto = CollectiveCostModel(replace(p, nvls_enabled=Figure(1, "test", "assumed")), protocol="auto")
    assert auto.choose("all_reduce", S, range(8))[:2] == ("nvls", "simple")
    # a small message: ring with LL (14 steps x 3.4 us x 0.14) beats NVLS's 25 us; NVLS has no LL
    assert auto.choose("all_reduce", 1024, range(8))[:2] == ("ring", "ll")
    # a fixed algorithm the placement does not allow falls back to ring, as NCCL does
    assert CollectiveCostModel(p, algorithm="tree").choose("all_reduce", S, range(8))[0] == "ring"


def test_placement_argument_changes_the_link():
    p = load_profile("h100-nvlink-ib400")
    S = 2**26
    packed = CollectiveCostModel(p).time("all_reduce", S, range(8))  # one node of 8
    four_per_node = CollectiveCostModel(p, gpus_per_node=4).time("all_reduce", S, range(8))  # two nodes
    assert four_per_node > packed
    with pytest.raises(ValueError, match="gpus_per_node 0"):
        CollectiveCostModel(p, gpus_per_node=0)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"])
def test_cost_is_monotonic_in_bytes_and_group_size(kind):
    model = CollectiveCostModel(load_profile("h100-nvlink-ib400"))
    for ranks in (range(8), range(0, 512 * 8, 8), range(0, 8192, 8), range(8192)):
        times = [model.time(kind, 2**e, ranks) for e in range(10, 33, 2)]
        assert times == sorted(times), (kind, len(ranks))
    for spread in (1, 8):  # one rank per node, and whole nodes
        sizes = [n for n in (2, 16, 64, 512, 1024, 8192) if n * spread <= 8192 * 8]
        times = [model.time(kind, 2**24, range(0, n * spread, spread)) for n in sizes]
        assert times == sorted(times), (kind, spread)


def test_async_dp_reduce_overlaps_compute_in_the_replay():
    """--overlap-grad-reduce makes DDP issue its bucket reduces async during backward and wait at the
    end: the replay overlaps an async op with the rank's compute by construction, so only the part
    of the cluster-costed reduce that outlasts the remaining compute is exposed."""
    from prism_megatron.replay import GraphBuilder, replay

    model = CollectiveCostModel(load_profile("h100-nvlink-ib400"))
    S = 2**28  # a 256 MiB bucket over DP ranks 0 and 8: two nodes, one rank each
    cost = model.time("all_reduce", S, [0, 8])
    for rest, async_op in ((cost / 2, True), (2 * cost, True), (cost / 2, False)):
        gb = GraphBuilder()
        gb.group(0, [0, 8])
        for r in (0, 8):
            gb.compute(r, 1.0)  # backward up to the bucket
            op = gb.collective(r, "all_reduce", 0, S, async_op=async_op)
            gb.compute(r, rest)  # the rest of backward
            if async_op:
                gb.wait(r, op)
        res = replay(gb.build(), model)
        overlapped = 1.0 + max(cost, rest)
        assert res.makespan == pytest.approx(overlapped if async_op else 1.0 + cost + rest, rel=1e-9)


# --- all-to-all across nodes (MoE expert-parallel dispatch and combine) -------------------------------


def test_all_to_all_across_nodes_sends_its_off_node_part_through_its_own_nic_share():
    """An EP group of 16 on two nodes of 8: each rank sends half its buffer across, through its own
    NIC (8 x 50 GB/s / 8 GPUs = 50 GB/s), and 7/16 over NVLink at the same time; not a ring, whose
    whole-node group would use the NIC share of all 8 GPUs."""
    p = load_profile("h100-nvlink-ib400")
    model = CollectiveCostModel(p)
    S = 4096 * 8 * 2048 * 2  # seq 4096 x top-8 token copies x hidden 2048 x bf16: 128 MiB
    a_in, b_in, a_out, share = 3.4e-6, 450e9, 9.6e-6, 50e9
    off, on = 8 / 16 * S / share, 7 / 16 * S / b_in
    assert off > on
    assert model.choose("all_to_all", S, range(16)) == pytest.approx(("ring", "simple", 15 * a_out + off))
    assert model.time("all_to_all", S, range(16)) == pytest.approx(1486.2e-6, abs=0.1e-6)
    # one node: NVLink only, as before
    assert model.time("all_to_all", S, range(8)) == pytest.approx(7 * a_in + 7 / 8 * S / b_in)
    # one rank per node: everything but its own part crosses, through its share (the ring's figure too)
    assert model.time("all_to_all", S, range(0, 128, 8)) == pytest.approx(15 * a_out + 15 / 16 * S / share)
    # uneven placement: the node with the fewest members sends the most off-node
    assert cm.all_to_all_link(p, (0, 1, 2, 8)).bandwidth == pytest.approx(share * 3 / 3)
    assert cm.all_to_all_link(p, (0, 1, 2, 8, 9, 10)).bandwidth == pytest.approx(share * 5 / 3)
    # NVLink bounds a group with many members per node and few elsewhere (k_max - 1 = 7 peers on NVLink)
    slow_nvlink = cm.all_to_all_link(replace(p, intra_bandwidth_GBps=Figure(20, "test", "assumed")), range(16))
    assert slow_nvlink.bandwidth == pytest.approx(min(share * 15 / 8, 20e9 * 15 / 7))
    # all-reduce over the same group still rings with the 8 GPUs' share (bounded by NVLink)
    assert link_for(p, range(16)).bandwidth == 400e9


def test_replay_charges_each_ep_all_to_all_its_cross_node_time():
    """A two-node EP group's dispatch and combine in a replayed graph: each is charged the time of its
    off-node half through one NIC, so a step of compute plus the two all-to-alls takes that long."""
    model = CollectiveCostModel(load_profile("h100-nvlink-ib400"))
    S = 1 << 27
    gb = GraphBuilder()
    gb.group(0, list(range(16)))
    for r in range(16):
        gb.compute(r, 0.001)
        gb.collective(r, "all_to_all", 0, S)  # dispatch
        gb.compute(r, 0.002)
        gb.collective(r, "all_to_all", 0, S)  # combine
    res = replay(gb.build(), model)
    each = 15 * 9.6e-6 + S / 2 / 50e9
    assert res.makespan == pytest.approx(0.003 + 2 * each)
    assert res.breakdown(0).exposed_comm == pytest.approx(2 * each)


def test_fit_of_an_all_to_all_across_nodes_reproduces_it_through_the_cost_model(tmp_path):
    log = tmp_path / "a2a.log"
    log.write_text(synthetic_log("alltoall", 16, 2, 8e-6, 90e9))
    p = _inter_node_fitted(log)
    assert p.nic_bandwidth_GBps.value == pytest.approx(90 * 8 / 15, rel=0.01)
    S = 1 << 30
    assert CollectiveCostModel(p).time("all_to_all", S, range(16)) == pytest.approx(
        15 * 8e-6 + 15 / 16 * S / 90e9, rel=0.01)
