"""Collective cost model: time of one NCCL op on the target cluster, from a cluster profile.

Used for what the physical machine cannot exhibit (inter-node links of the target). The model is
the alpha-beta model in nccl-tests' "bus bandwidth" convention (nccl-tests doc/PERFORMANCE.md):
S is the buffer size nccl-tests calls ``size`` (all-reduce: the tensor; all-gather: the gathered
output; reduce-scatter: the input; all-to-all: one rank's whole send buffer), B the bus bandwidth
per rank, alpha the latency of one algorithm step. nccl-tests reports busbw = algbw * factor with

    all_reduce 2(n-1)/n;  all_gather, reduce_scatter, all_to_all (n-1)/n;  broadcast, reduce,
    send/recv 1

so that busbw is comparable to the link bandwidth; hence time = steps * alpha + factor * S / B:

- ring all-reduce       2(n-1) alpha + 2(n-1)/n * S/B    (reduce-scatter then all-gather)
- ring all-gather / reduce-scatter   (n-1) alpha + (n-1)/n * S/B
- broadcast / reduce (pipelined chain)  (n-1) alpha + S/B
- all-to-all            (n-1) alpha + (n-1)/n * S/B    (n-1 concurrent exchanges)
- send/recv             alpha + S/B
- tree all-reduce (NCCL's double binary tree, NCCL 2.4 blog "Massively Scale Your Deep Learning
  Training with NCCL 2.4"): 2 log2(n) alpha + 2 * S/B — reduce up, broadcast down, each rank
  sends and receives about 2S in total over the two trees, so the bandwidth term matches the
  ring's for large n and the latency grows logarithmically.

Placement: ranks live on node ``rank // gpus_per_node`` (the profile's node size, or the target's
placement when the job is packed differently, e.g. a folded trace's ``gpus_per_node``). A group inside one node uses the
intra-node link; a group spanning nodes is bounded by its slowest link. Every GPU of a node is
assumed to communicate off-node at the same time (all DP groups reduce together), so each GPU's
share of the node's NICs is nics * nic_bw / gpus_per_node; a group with k members on each node
crosses each node boundary once per ring and can use the share of its k GPUs, so its bandwidth is
min(intra_bw, k * nics * nic_bw / gpus_per_node) (k = 1: one GPU per node, the typical DP group
under intra-node TP; k = gpus_per_node: a whole-node group uses every NIC). Every step pays the
inter-node latency (a ring's steps are synchronous, so the slow hop sets the pace).

An all-to-all is no ring: every member sends S/n to every other member at once (NCCL runs it as
grouped send/recv), so a member on a node holding k of the n members sends (n-k)/n S off its node
through its own NIC share and (k-1)/n S over NVLink, both at the same time. Its time is the slower of
the two, which the bus-bandwidth formula gives with the group bandwidth (:func:`all_to_all_link`)

    min(share * (n-1)/(n-k_min), intra_bw * (n-1)/(k_max-1))

(k_min, k_max: the fewest and most members on one node; one node: intra_bw). One member per node is
the ring's figure (the share); a whole-node group is not k times it, as a ring's would be: an EP
group of 16 on two nodes sends half its buffer across, 15/8 of the share, not 8 times.

Algorithm choice (``auto``): NCCL's tuner predicts each enabled (algorithm, protocol) pair's time
from its own alpha-beta tables and runs the fastest; we do the same over the pairs NCCL enables for
the op and the group's placement (:func:`algorithms_for`):

- all-reduce: ring; tree (double binary tree) for a group spanning nodes; NVLS (NVLink SHARP: the
  NVSwitch reduces) for a group inside one node when the profile enables it;
- all-gather / reduce-scatter: ring; PAT (NCCL >= 2.23, Bruck-like: log2(n) steps) for a group with
  exactly one rank per node, the only placement NCCL runs PAT on; NVLS inside one node when enabled
  (across nodes NCCL runs NVLS for these only through CollNet/SHARP, not modelled);
- broadcast / reduce: ring (pipelined chain); all-to-all and send/recv: point-to-point.

The NVLS formulas (an idealisation: the switch reduces, so each GPU sends S and reads the reduced S
back where ring moves 2(n-1)/n S; no shipped profile enables NVLS, as no published recipe runs it):
all-reduce ``25 us + S/B``, all-gather / reduce-scatter ``25 us + (n-1)/n S/B``, with NCCL's NVLS
latency and the Simple protocol only.
PAT, as NCCL's tuner models it: ``ceil(log2 n) alpha / 3.5 + n * 2.8 us + (n-1)/n S / (0.75 B)``
(logarithmic steps but a linear term and less bandwidth: PAT wins for small and mid-size messages
over many nodes, ring for large ones). Inside one node NCCL's tree is a chain (2(n-1) steps like
ring, less bandwidth), so it never wins there and is left out. Not modelled: SHARP and CollNet across nodes, NVLS-tree
(NVLS inside nodes with a tree across), link contention between concurrent ops, and NCCL's
hierarchical tree across nodes (which sends about S rather than 2S per node through the NICs: the
flat tree formula is conservative there). A profile fitted from nccl-tests output with
``algorithm: ring`` reproduces the measured times whatever algorithm NCCL picked, because the fit
uses the same bus-bandwidth convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from prism_megatron.ops import OPS

from .profiles import ALGORITHMS, PROTOCOLS, ClusterProfile

#: trace op kinds -> the formula family that costs them (each kind's own field, prism_megatron.ops); the
#: replay's matched send and receive ("send/recv") are one transfer
KIND_FAMILY = {**{k.name: k.cost_family for k in OPS.values()}, "send/recv": "p2p"}

#: nccl-tests busbw / algbw for each family, as a function of n (doc/PERFORMANCE.md)
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}


# --- the published formulas (S bytes, n ranks, alpha seconds, B bytes/s) ----------------------------
def ring_all_reduce(S: float, n: int, alpha: float, B: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * S / B


def ring_all_gather(S: float, n: int, alpha: float, B: float) -> float:
    return 0.0 if n <= 1 else (n - 1) * alpha + (n - 1) / n * S / B


ring_reduce_scatter = ring_all_gather


def chain_broadcast(S: float, n: int, alpha: float, B: float) -> float:
    return 0.0 if n <= 1 else (n - 1) * alpha + S / B


chain_reduce = chain_broadcast


def all_to_all(S: float, n: int, alpha: float, B: float) -> float:
    return 0.0 if n <= 1 else (n - 1) * alpha + (n - 1) / n * S / B


def p2p(S: float, alpha: float, B: float) -> float:
    return alpha + S / B


def tree_all_reduce(S: float, n: int, alpha: float, B: float) -> float:
    return 0.0 if n <= 1 else 2 * math.ceil(math.log2(n)) * alpha + 2 * S / B


#: NCCL's NVLS latency on NVLink, Simple protocol (NVIDIA/nccl src/graph/tuning.cc hwLatencies);
#: NVLS runs only the Simple protocol.
NVLS_LATENCY_S = 25e-6


def nvls_all_reduce(S: float, n: int, alpha: float, B: float) -> float:
    return 0.0 if n <= 1 else NVLS_LATENCY_S + S / B


def nvls_all_gather(S: float, n: int, alpha: float, B: float) -> float:
    return 0.0 if n <= 1 else NVLS_LATENCY_S + (n - 1) / n * S / B


#: NCCL's own PAT model (NVIDIA/nccl src/graph/tuning.cc): latency log2(nodes) * inter-node latency / 3.5
#: plus a linear 2.8 us per rank, bus bandwidth 0.75 of the ring's.
PAT_LATENCY_DIVISOR = 3.5
PAT_PER_RANK_S = 2.8e-6
PAT_BANDWIDTH_FACTOR = 0.75


def pat_all_gather(S: float, n: int, alpha: float, B: float) -> float:
    if n <= 1:
        return 0.0
    latency = math.ceil(math.log2(n)) * alpha / PAT_LATENCY_DIVISOR + n * PAT_PER_RANK_S
    return latency + (n - 1) / n * S / (PAT_BANDWIDTH_FACTOR * B)


#: (family, algorithm) -> formula(S, n, alpha, B); what each algorithm costs where NCCL runs it
FORMULAS = {
    ("all_reduce", "ring"): ring_all_reduce,
    ("all_reduce", "tree"): tree_all_reduce,
    ("all_reduce", "nvls"): nvls_all_reduce,
    ("all_gather", "ring"): ring_all_gather,
    ("all_gather", "pat"): pat_all_gather,
    ("all_gather", "nvls"): nvls_all_gather,
    ("reduce_scatter", "ring"): ring_reduce_scatter,
    ("reduce_scatter", "pat"): pat_all_gather,
    ("reduce_scatter", "nvls"): nvls_all_gather,
    ("broadcast", "ring"): chain_broadcast,
    ("reduce", "ring"): chain_reduce,
    ("all_to_all", "ring"): all_to_all,
}


def algorithms_for(family: str, per_node: dict[int, int], nvls: bool) -> tuple[str, ...]:
    """The algorithms NCCL enables for ``family`` on a group placed ``per_node`` (node -> members).

    ``nvls``: whether the cluster runs NVLink SHARP (NCCL_NVLS_ENABLE and an NVSwitch that supports it).
    """
    one_node = len(per_node) <= 1
    if family == "all_reduce":
        return ("ring",) + (("nvls",) if one_node and nvls else ()) + (() if one_node else ("tree",))
    if family in ("all_gather", "reduce_scatter"):
        pat = not one_node and all(k == 1 for k in per_node.values())
        return ("ring",) + (("nvls",) if one_node and nvls else ()) + (("pat",) if pat else ())
    return ("ring",)


# --- placement -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """The link class that bounds a group: latency per step (s) and bandwidth per rank (bytes/s)."""

    name: str
    alpha: float
    bandwidth: float


def members_per_node(ranks: tuple[int, ...] | list[int], gpus_per_node: int) -> dict[int, int]:
    """How many of ``ranks`` each node holds, with global ranks packed gpus_per_node to a node."""
    counts: dict[int, int] = {}
    for r in set(ranks):
        counts[r // gpus_per_node] = counts.get(r // gpus_per_node, 0) + 1
    return counts


def link_for(profile: ClusterProfile, ranks: tuple[int, ...] | list[int], gpus_per_node: int | None = None) -> Link:
    """Intra-node link for a group on one node; the bottleneck inter-node link for a spanning group.

    ``gpus_per_node`` places the ranks (default: the profile's node size); each GPU's share of its
    node's NICs stays the profile's (its NICs over its GPUs).
    """
    per_node = members_per_node(ranks, gpus_per_node or profile.node_size)
    if len(per_node) <= 1:
        return Link("intra", profile.intra_alpha, profile.intra_bw)
    k = min(per_node.values())  # the node with the fewest members has the least NIC share
    return Link("inter", profile.inter_alpha, min(profile.intra_bw, k * profile.inter_bw_per_gpu))


def all_to_all_link(profile: ClusterProfile, ranks: tuple[int, ...] | list[int],
                    gpus_per_node: int | None = None) -> Link:
    """The group bandwidth an all-to-all among ``ranks`` runs at, in the bus-bandwidth convention:
    each member's off-node part through its NIC share and its on-node part over NVLink, concurrently
    (module docstring); the inter-node latency per step once the group spans nodes."""
    per_node = members_per_node(ranks, gpus_per_node or profile.node_size)
    n = sum(per_node.values())
    if len(per_node) <= 1:
        return Link("intra", profile.intra_alpha, profile.intra_bw)
    k_min, k_max = min(per_node.values()), max(per_node.values())
    off = profile.inter_bw_per_gpu * (n - 1) / (n - k_min)
    on = profile.intra_bw * (n - 1) / (k_max - 1) if k_max > 1 else math.inf
    return Link("inter", profile.inter_alpha, min(off, on))


def inter_share_from_all_to_all(bandwidth: float, n: int, per_node: int) -> float:
    """A GPU's NIC share from the bus bandwidth an all-to-all of ``n`` ranks, ``per_node`` on each node,
    ran at (the inverse of :func:`all_to_all_link` where the NICs bound it): for fitting a profile."""
    if not 1 <= per_node < n:
        raise ValueError(f"an all-to-all of {n} ranks with {per_node} per node does not cross nodes")
    return bandwidth * (n - per_node) / (n - 1)


# --- the model -----------------------------------------------------------------------------------
class CollectiveCostModel:
    """Cost of ops on a target cluster; callable on anything with ``kind``, ``nbytes``, ``ranks``.

    An instance plugs straight into ``prism_megatron.replay.replay(graph, cost=model)``.
    """

    def __init__(self, profile: ClusterProfile, algorithm: str | None = None, protocol: str | None = None,
                 gpus_per_node: int | None = None) -> None:
        """``gpus_per_node``: the target's placement (rank r on node r // gpus_per_node); default the
        profile's node size."""
        if gpus_per_node is not None and (isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int)
                                          or gpus_per_node < 1):
            raise ValueError(f"gpus_per_node {gpus_per_node!r}: expected a positive integer")
        self.profile = profile
        self.gpus_per_node = gpus_per_node or profile.node_size
        self._links: dict[tuple, Link] = {}  # a group's link, by (all-to-all?, its ranks) (large groups recur)
        self._times: dict[tuple, float] = {}  # replay costs the same op of every iteration again
        self.algorithm = algorithm or profile.algorithm
        self.protocol = protocol or profile.protocol
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm {self.algorithm!r}: expected {', '.join(ALGORITHMS)}")
        if self.protocol not in (*PROTOCOLS, "auto"):
            raise ValueError(f"protocol {self.protocol!r}: expected simple, ll, ll128 or auto")

    def _one(self, family: str, S: float, n: int, link: Link, algorithm: str, protocol: str) -> float:
        f = self.profile.protocols[protocol]
        a = link.alpha * f.latency_factor.value
        B = link.bandwidth * f.bandwidth_factor.value
        if family == "p2p":
            return p2p(S, a, B)
        return FORMULAS[(family, algorithm)](S, n, a, B)

    def choose(self, kind: str, nbytes: int, ranks: tuple[int, ...] | list[int]) -> tuple[str, str, float]:
        """(algorithm, protocol, seconds) NCCL would run for op ``kind`` of ``nbytes`` among global ``ranks``.

        ``auto`` picks the fastest of the pairs NCCL enables there (:func:`algorithms_for`); a fixed
        algorithm the placement does not allow (tree inside a node, PAT with two ranks on a node)
        falls back to ring, as NCCL does.
        """
        family = KIND_FAMILY.get(kind)
        if family is None:
            raise ValueError(f"no cost formula for op kind {kind!r} (known: {', '.join(sorted(KIND_FAMILY))})")
        ranks = tuple(ranks)
        if (family == "p2p" and len(set(ranks)) <= 1) or (family != "p2p" and len(ranks) <= 1):
            return ("none", "none", 0.0)
        per_node = members_per_node(ranks, self.gpus_per_node)
        a2a = family == "all_to_all"
        link = self._links.get((a2a, ranks))
        if link is None:
            link = self._links[(a2a, ranks)] = (all_to_all_link if a2a else link_for)(
                self.profile, ranks, self.gpus_per_node)
        protocols = PROTOCOLS if self.protocol == "auto" else (self.protocol,)
        if family == "p2p":
            algorithms: tuple[str, ...] = ("p2p",)
        else:
            enabled = algorithms_for(family, per_node, self.profile.nvls)
            algorithms = enabled if self.algorithm == "auto" else (
                (self.algorithm,) if self.algorithm in enabled else ("ring",))
        best = min(((self._one(family, float(nbytes), len(ranks), link, a, p), a, p)
                    for a in algorithms for p in protocols if a != "nvls" or p == "simple"),
                   key=lambda x: x[0])
        return best[1], best[2], best[0]

    def time(self, kind: str, nbytes: int, ranks: tuple[int, ...] | list[int]) -> float:
        """Seconds for op ``kind`` moving ``nbytes`` (trace convention) among global ``ranks``."""
        return self.choose(kind, nbytes, ranks)[2]

    def __call__(self, spec: Any) -> float:
        key = (spec.kind, spec.nbytes, spec.ranks)
        t = self._times.get(key)
        if t is None:
            t = self._times[key] = self.time(spec.kind, spec.nbytes, spec.ranks)
        return t
