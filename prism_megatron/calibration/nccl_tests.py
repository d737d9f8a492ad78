"""Fit a link's latency (alpha) and bus bandwidth (B) from nccl-tests output.

Users run e.g. ``all_reduce_perf -b 8 -e 8G -f 2`` on their own cluster and hand us the log
(``prism-megatron cluster fit LOG``); we fit time(S) = steps * alpha + factor * S / B over all
sizes, in nccl-tests' bus-bandwidth convention (see ``costmodel``), so the fitted B and alpha
drop straight into a cluster profile.

The fit minimises *relative* squared error (weights 1/t^2): with plain least squares the large
sizes dominate and the latency intercept, which small sizes determine, comes out wrong.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from .costmodel import BUS_FACTOR, inter_share_from_all_to_all

#: test binary name -> cost-model family
TEST_FAMILY = {
    "all_reduce": "all_reduce",
    "all_gather": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "sendrecv": "p2p",
}


class NcclTestsParseError(ValueError):
    """The text is not nccl-tests output we understand; the message says which line."""


@dataclass(frozen=True)
class Row:
    size: int  # bytes (nccl-tests "size")
    time_us: float  # out-of-place time
    algbw: float
    busbw: float


@dataclass(frozen=True)
class NcclFit:
    """Result of a fit. ``alpha`` is per algorithm step, ``bandwidth`` the bus bandwidth per rank."""

    family: str
    nranks: int
    nhosts: int
    steps: int
    latency: float  # seconds, total constant term (= steps * alpha)
    alpha: float  # seconds per step
    bandwidth: float  # bytes/s
    rows: int
    rel_rms: float  # root-mean-square relative residual of the fit
    sizes: tuple[int, int]

    @property
    def link(self) -> str:
        return "inter_node" if self.nhosts > 1 else "intra_node"


def steps_for(family: str, n: int) -> int:
    """Number of latency-paying steps of the ring/chain algorithm for ``family`` over n ranks."""
    if family == "p2p":
        return 1
    if family == "all_reduce":
        return 2 * (n - 1)
    return n - 1


def parse_rows(text: str) -> tuple[list[Row], bool]:
    """Data rows of the results table; also whether the table has a ``root`` column."""
    has_root = None
    rows: list[Row] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s.startswith("#"):
            if re.search(r"\bsize\b.*\bcount\b.*\btype\b", s):
                has_root = " root " in f" {s} "
            continue
        parts = s.split()
        if len(parts) < 7 or not parts[0].isdigit() or not parts[1].isdigit():
            continue
        if has_root is None:
            raise NcclTestsParseError(f"line {lineno}: a data row before the table header "
                                      "('#  size  count  type  redop ...')")
        i = 5 if has_root else 4  # size count type redop [root] time algbw busbw #wrong ...
        try:
            time_us, algbw, busbw = float(parts[i]), float(parts[i + 1]), float(parts[i + 2])
        except (ValueError, IndexError):
            raise NcclTestsParseError(f"line {lineno}: expected time, algbw, busbw in columns "
                                      f"{i + 1}-{i + 3}: {s!r}") from None
        rows.append(Row(int(parts[0]), time_us, algbw, busbw))
    return rows, bool(has_root)


def _ranks_and_hosts(text: str) -> tuple[int, int]:
    hosts = re.findall(r"^#\s*Rank\s+\d+\s+Group\s+\d+\s+Pid\s+\d+\s+on\s+(\S+)", text, flags=re.M)
    return len(hosts), len(set(hosts))


def _family(text: str, rows: list[Row], n: int) -> str:
    m = re.search(r"\b(all_reduce|all_gather|reduce_scatter|alltoall|broadcast|reduce|sendrecv)_perf", text)
    if m:
        return TEST_FAMILY[m.group(1)]
    ratios = [r.busbw / r.algbw for r in rows if r.algbw >= 1.0]
    if not ratios or n < 2:
        raise NcclTestsParseError("cannot tell which collective this is: name the test (e.g. all_reduce_perf) "
                                  "in the log or pass kind=")
    ratio = statistics.median(ratios)
    fam = min(("all_reduce", "all_gather", "broadcast"), key=lambda f: abs(BUS_FACTOR[f](n) - ratio))
    return fam


def _weighted_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x minimising sum(((a + b x) - y) / y)^2."""
    ws = [1.0 / (y * y) for y in ys]
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs, strict=True))
    sy = sum(w * y for w, y in zip(ws, ys, strict=True))
    sxx = sum(w * x * x for w, x in zip(ws, xs, strict=True))
    sxy = sum(w * x * y for w, x, y in zip(ws, xs, ys, strict=True))
    det = sw * sxx - sx * sx
    if det <= 0:
        raise NcclTestsParseError("need at least two distinct sizes to fit latency and bandwidth")
    b = (sw * sxy - sx * sy) / det
    a = (sy - b * sx) / sw
    return a, b


def fit_profile_from_nccl_tests(log_text: str, kind: str | None = None, nranks: int | None = None) -> NcclFit:
    """Fit alpha (per step) and bus bandwidth B from an nccl-tests log (out-of-place times).

    ``kind`` (a test name such as ``all_reduce`` or a cost-model family) and ``nranks`` override
    what the log says (the test name if present, the ``#  Rank N ... on HOST`` lines).
    """
    rows, _ = parse_rows(log_text)
    rows = [r for r in rows if r.size > 0 and r.time_us > 0]
    if len(rows) < 2:
        raise NcclTestsParseError("found fewer than two result rows: is this nccl-tests output?")
    n_found, hosts = _ranks_and_hosts(log_text)
    n = nranks or n_found
    if not n:
        raise NcclTestsParseError("cannot tell the number of ranks (no '#  Rank N ... on HOST' lines); pass nranks=")
    family = TEST_FAMILY.get(kind, kind) if kind else _family(log_text, rows, n)
    if family not in BUS_FACTOR:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(sorted(TEST_FAMILY))}")
    factor = BUS_FACTOR[family](n)
    xs = [r.size * factor for r in rows]
    ys = [r.time_us * 1e-6 for r in rows]
    a, b = _weighted_line(xs, ys)
    if b <= 0:
        raise NcclTestsParseError("the fitted time does not grow with size: cannot derive a bandwidth")
    steps = steps_for(family, n)
    latency = max(a, 0.0)
    rel = math.sqrt(sum(((a + b * x) - y) ** 2 / y ** 2 for x, y in zip(xs, ys, strict=True)) / len(xs))
    return NcclFit(family, n, max(hosts, 1), steps, latency, latency / steps, 1.0 / b, len(rows), rel,
                   (rows[0].size, rows[-1].size))


def fit_main(path: str | Path) -> str:
    """`prism-megatron cluster fit LOG`: the fit as text plus the profile fragment to paste."""
    path = Path(path)
    fit = fit_profile_from_nccl_tests(path.read_text(encoding="utf-8", errors="replace"))
    src = (f"fitted from {path.name}: nccl-tests {fit.family}, {fit.nranks} ranks on {fit.nhosts} host(s), "
           f"sizes {fit.sizes[0]}-{fit.sizes[1]} B, rel. rms residual {fit.rel_rms:.2%}")
    lines = [
        f"nccl-tests fit of {path}",
        f"  collective {fit.family}, {fit.nranks} ranks on {fit.nhosts} host(s), {fit.rows} sizes",
        f"  latency {fit.latency * 1e6:.2f} us total = {fit.steps} steps x alpha {fit.alpha * 1e6:.3f} us",
        f"  bus bandwidth {fit.bandwidth / 1e9:.2f} GB/s per rank; relative rms residual {fit.rel_rms:.2%}",
        "",
        f"profile fragment ({fit.link}):",
    ]
    if fit.link == "intra_node":
        lines += [
            "intra_node:",
            f"  bandwidth_GBps: {{value: {fit.bandwidth / 1e9:.4g}, basis: fitted, source: \"{src}\"}}",
            f"  latency_us: {{value: {fit.alpha * 1e6:.4g}, basis: fitted, source: \"{src}\"}}",
        ]
    else:
        per_host = max(fit.nranks // fit.nhosts, 1)
        if fit.family == "all_to_all":  # each rank's off-node part through its own NIC (costmodel)
            nic = inter_share_from_all_to_all(fit.bandwidth, fit.nranks, per_host)
            how = f"(n-1)/(n-{per_host}) * nics_per_node * nic_bandwidth_GBps / gpus_per_node"
        else:  # a ring crosses each node boundary once, with the NIC share of the node's members
            nic = fit.bandwidth / per_host
            how = f"{per_host} * nics_per_node * nic_bandwidth_GBps / gpus_per_node"
        lines += [
            "inter_node:",
            f"  # the fit gives {fit.bandwidth / 1e9:.4g} GB/s for a group with {per_host} GPU(s) on each node",
            f"  # (= {how}, see costmodel); below",
            f"  # assumes gpus_per_node = {per_host} and nics_per_node = {per_host} (one NIC per GPU)",
            f"  nic_bandwidth_GBps: {{value: {nic / 1e9:.4g}, basis: fitted, "
            f"source: \"{src}; assumes one NIC per GPU, {per_host} per node\"}}",
            f"  latency_us: {{value: {fit.alpha * 1e6:.4g}, basis: fitted, source: \"{src}\"}}",
        ]
    return "\n".join(lines)
