"""Where two runs' peak memory differs: what is live at each run's peak, grouped by Python stack.

Usage: python bench/gpu/snapshot_diff.py A.pickle B.pickle [--names A,B]
The pickles are ``torch.cuda.memory._dump_snapshot`` dumps, as ``PRISM_MEMORY_SNAPSHOT=PREFIX``
writes them (``prism_megatron.memory.snapshot``: prism's drivers, so an emulated rank, a real process
under torchrun, or a rank under Megatron's fake process group through ``bench/targets/fake_pg_peak.py``
with ``--script driver``). Two peaks, each with the stacks whose bytes differ most between the runs:
- allocated: the blocks live at the peak of allocated bytes (how the Work <-> Future reference cycle,
  +80..176 MiB on TP2, was found);
- reserved: the allocator's segments held at the peak of reserved bytes, each under the stack of the
  allocation that made the allocator reserve it — where one run had to grow its cache and the other not;
  before both, each run's segments reserved and released and its reserved bytes over the recording (a
  run whose reserved fell released its cache: ``empty_cache``, or a retry under a full device or cap);
- after both, every segment each run reserved over its recording by stack, released or not;
- last, where the two runs' request sequences (each allocation and free asked of the allocator: its
  size and stream, stacks aside since the runs' wrappers differ) first part, with the requests around it
  and the segments each run had reserved by then: both run one program, so up to there a difference in
  reserved bytes is the allocator's placement, not the requests.
A history holds at most its recording's last events (``snapshot.MAX_ENTRIES``): a trace of that length
may have lost its start, said below.
"""

from __future__ import annotations

import argparse
import collections
import pickle
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

MiB = 1 << 20
KINDS = {  # peak kind -> (actions that add the event's bytes, actions that remove the block at its address)
    "allocated": (("alloc",), ("free_requested",)),
    "reserved": (("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")),
}


def load(path: str) -> list[dict]:
    """The device trace of the one GPU the dump recorded."""
    with open(path, "rb") as f:
        traces = [t for t in pickle.load(f)["device_traces"] if t]
    if len(traces) != 1:
        raise SystemExit(f"snapshot_diff: {path}: {len(traces)} devices with events, expected 1")
    return traces[0]


def peak(trace: list[dict], kind: str) -> tuple[int, int, dict[int, dict]]:
    """(peak bytes, index of the event that reached it, the blocks live then by address)."""
    adds, removes = KINDS[kind]
    live: dict[int, dict] = {}
    cur = best = best_i = 0
    best_live: dict[int, dict] = {}
    for i, e in enumerate(trace):
        if e["action"] in adds:
            live[e["addr"]] = e
            cur += e["size"]
            if cur > best:
                best, best_i, best_live = cur, i, dict(live)
        elif e["action"] in removes and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    return best, best_i, best_live


def segments(trace: list[dict], points: int = 10) -> str:
    """The allocator's own moves over the recording: segments reserved and released (a release is
    ``empty_cache`` or the allocator freeing its cache to retry an allocation that found the device or
    its cap full), allocations that failed, and the reserved bytes at ``points`` even steps of it."""
    adds, removes = KINDS["reserved"]
    live: dict[int, int] = {}
    counts: collections.Counter = collections.Counter()
    cur, curve = 0, []
    marks = {max(0, round(len(trace) * k / points) - 1) for k in range(1, points + 1)}
    for i, e in enumerate(trace):
        if e["action"] in adds:
            live[e["addr"]] = e["size"]
            cur += e["size"]
            counts["reserved"] += 1
            counts["reserved_bytes"] += e["size"]
        elif e["action"] in removes and e["addr"] in live:
            size = live.pop(e["addr"])
            cur -= size
            counts["released"] += 1
            counts["released_bytes"] += size
        elif e["action"] == "oom":
            counts["oom"] += 1
        if i in marks:
            curve.append(cur)
    return (f"segments reserved {counts['reserved']} ({counts['reserved_bytes'] / MiB:.0f} MiB), released "
            f"{counts['released']} ({counts['released_bytes'] / MiB:.0f} MiB); failed allocations {counts['oom']}; "
            f"reserved MiB at each tenth of the recording: {' '.join(f'{c / MiB:.0f}' for c in curve)}")


def stack(e: dict, depth: int = 4) -> str:
    frames = [f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in e.get("frames", [])
              if f["filename"].endswith(".py")]
    return " < ".join(frames[:depth]) or "(no Python frames)"


def compare(traces: dict[str, list[dict]], kind: str, rows: int = 12) -> str:
    """Both runs' peak of ``kind`` and the stacks whose bytes at the peak differ most (second - first)."""
    out, by_stack = [f"== {kind}"], {}
    for name, trace in traces.items():
        best, i, live = peak(trace, kind)
        where = stack(trace[i]) if trace else "-"
        out.append(f"{name}: peak {best / MiB:.2f} MiB in {len(live)} block(s) at event {i} of {len(trace)} ({where})")
        totals: collections.Counter = collections.Counter()
        for e in live.values():
            totals[stack(e)] += e["size"]
        by_stack[name] = totals
    return "\n".join(out + differences(by_stack, rows))


def differences(by_stack: dict[str, collections.Counter], rows: int) -> list[str]:
    """The stacks whose bytes differ most between the two runs (second - first), a line each."""
    a, b = by_stack
    keys = set(by_stack[a]) | set(by_stack[b])
    ranked = sorted(((by_stack[b][k] - by_stack[a][k], k) for k in keys), key=lambda r: (-abs(r[0]), r[1]))
    return [f"{diff / MiB:+10.2f} MiB  {a} {by_stack[a][k] / MiB:9.2f}  {b} {by_stack[b][k] / MiB:9.2f}  {k[:200]}"
            for diff, k in ranked[:rows] if diff]


def reservations(traces: dict[str, list[dict]], rows: int = 12) -> str:
    """Every segment each run reserved over its whole recording, by the stack of the allocation that made
    it, released or not: where one run asked the device for memory the other did not (a staging buffer,
    a collective's output), which the peaks alone do not show once such segments were reused."""
    totals = {}
    for name, trace in traces.items():
        c: collections.Counter = collections.Counter()
        for e in trace:
            if e["action"] in KINDS["reserved"][0]:
                c[stack(e)] += e["size"]
        totals[name] = c
    return "\n".join(["== segments reserved over the recording (released or not)", *differences(totals, rows)])


REQUESTS = ("alloc", "free_requested")  # what the program asks of the allocator (the rest is the allocator's)


#: the caching allocator's small-request limit: requests up to it come from its small pool (2 MiB segments), which
#: never shares a segment with the large pool's, so only larger requests place the large blocks
SMALL_SIZE = 1 << 20


def _stream_order(trace: list[dict]) -> dict[int, int]:
    """Each stream of a run by the order it first appears (the default stream, 0, stays 0): a side stream's id is
    its address in that process, so two runs of one program name the same stream differently."""
    order = {0: 0}
    for e in trace:
        order.setdefault(e.get("stream", 0), len(order))
    return order


def divergence(traces: dict[str, list[dict]], context: int = 3, min_size: int = 0) -> str:
    """Where the two runs' requests (action, size, stream) first differ, the requests around it in each, and
    each run's segments reserved before it; ``min_size``: only requests above it (the large pool's). Streams
    compare by the order each run first used them."""
    (a, ta), (b, tb) = traces.items()
    idx = {name: [i for i, e in enumerate(t) if e["action"] in REQUESTS and e["size"] > min_size]
           for name, t in traces.items()}
    order = {name: _stream_order(t) for name, t in traces.items()}
    key = {name: [(t[i]["action"], t[i]["size"], order[name][t[i].get("stream", 0)]) for i in idx[name]]
           for name, t in traces.items()}
    shared = min(len(key[a]), len(key[b]))  # the shorter run's requests (the rest of the longer differ)
    n = next((i for i in range(shared) if key[a][i] != key[b][i]), shared)
    pool = f", requests above {min_size / MiB:g} MiB only" if min_size else ""
    out = [f"== first divergence of the request sequences (allocations and frees: action, size, stream{pool})"]
    if n == len(key[a]) == len(key[b]):
        return "\n".join(out + [f"{a} and {b}: the same {n} requests"])
    out.append(f"{a} and {b} agree on their first {n} requests (of {len(key[a])} and {len(key[b])})")
    for name, t in traces.items():
        upto = idx[name][n] if n < len(idx[name]) else len(t)
        reserved = [e["size"] for e in t[:upto] if e["action"] in KINDS["reserved"][0]]
        out.append(f"{name}: {len(reserved)} segment(s), {sum(reserved) / MiB:.0f} MiB reserved before it; "
                   f"requests {max(0, n - context)}-{n + context}:")
        for j in range(max(0, n - context), min(len(idx[name]), n + context + 1)):
            e = t[idx[name][j]]
            mark = ">" if j == n else " "
            out.append(f"  {mark} {j:7d} {e['action']:14s} {e['size'] / MiB:10.2f} MiB  stream {e.get('stream', 0)}  "
                       f"{stack(e)[:160]}")
    return "\n".join(out)


def extra_requests(traces: dict[str, list[dict]], rows: int = 12) -> str:
    """Allocations one run asked for more often than the other, by size and stack (count and bytes, second -
    first): a request only one program makes (a check, a staging buffer) shifts every placement after it."""
    counts = {}
    for name, trace in traces.items():
        c: collections.Counter = collections.Counter()
        for e in trace:
            if e["action"] == "alloc":
                c[(e["size"], stack(e))] += 1
        counts[name] = c
    a, b = counts
    keys = set(counts[a]) | set(counts[b])
    ranked = sorted(((counts[b][k] - counts[a][k], k) for k in keys), key=lambda r: (-abs(r[0] * r[1][0]), r[1]))
    out = [f"== allocations by size and stack, counted in each run ({b} - {a})"]
    out += [f"{n:+7d} x {size / MiB:10.3f} MiB = {n * size / MiB:+10.1f} MiB  {a} {counts[a][(size, k)]:6d}  "
            f"{b} {counts[b][(size, k)]:6d}  {k[:160]}" for n, (size, k) in ranked[:rows] if n]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from prism_megatron.memory.snapshot import MAX_ENTRIES

    ap = argparse.ArgumentParser(prog="snapshot_diff.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("first", help="a dump (e.g. the reference: real process or fake process group)")
    ap.add_argument("second", help="a dump (e.g. prism's emulated rank)")
    ap.add_argument("--names", default="first,second", help="the two runs' names in the output (default first,second)")
    a = ap.parse_args(argv)
    names = a.names.split(",")
    if len(names) != 2 or len(set(names)) != 2:
        raise SystemExit(f"snapshot_diff: --names {a.names!r}: expected two different names, comma-separated")
    traces = {names[0]: load(a.first), names[1]: load(a.second)}
    for name, trace in traces.items():
        if len(trace) >= MAX_ENTRIES:
            print(f"{name}: {len(trace)} events, the recording's limit: its start may be lost")
    for name, trace in traces.items():
        print(f"{name}: {segments(trace)}")
    print(compare(traces, "allocated"))
    print(compare(traces, "reserved"))
    print(reservations(traces))
    print(extra_requests(traces))
    print(divergence(traces))
    print(divergence(traces, min_size=SMALL_SIZE))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
