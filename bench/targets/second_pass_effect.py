"""What a serial run's second pass changes (issue 20: DeepSeek-V3's six extra takes cost 7 of its 15 device
minutes): each class's takes compared in order, take by take and first against latest, on what the report
rests on: the routing (every all-to-all's split sizes: tokens per expert), the small reductions' recorded
inputs (grad norm, aux losses), the peak memory per iteration and the rank's compute per iteration.

Reads a serial run's captures folder (``TRACE.captures``: ``capture-I-rank-L`` and its later takes
``capture-I-rank-L-take-N``; on the GPU machine run_target.sh keeps it with KEEP_CAPTURES=1):

    python bench/targets/second_pass_effect.py TRACE.captures
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.parquet as pq

TAKE = re.compile(r"^capture-(\d+)-rank-(\d+)(?:-take-(\d+))?$")


@dataclass
class Take:
    """One capture's trace, reduced to what the comparison needs."""

    path: Path
    index: int
    rank: int
    take: int
    splits: list[list] = field(default_factory=list)  # every all-to-all's [input splits, output splits], in order
    received: dict[int, int] = field(default_factory=dict)  # iteration -> most bytes one all-to-all received
    reductions: list[str] = field(default_factory=list)  # recorded inputs of the small reductions, in order
    peak: dict[int, int] = field(default_factory=dict)  # iteration -> max allocated (bytes)
    compute: dict[int, float] = field(default_factory=dict)  # iteration -> the rank's compute clock across it (s)


def takes(root: Path) -> dict[int, list[Take]]:
    """The captures under ``root`` by capture index, each class's takes in order; a take whose trace did not
    complete is left out (it is not what was merged)."""
    out: dict[int, list[Take]] = {}
    for p in sorted(root.iterdir()):
        m = TAKE.match(p.name)
        if not m or not p.is_dir() or not (p / "manifest.json").exists():
            continue
        manifest = json.loads((p / "manifest.json").read_text(encoding="utf-8"))
        if manifest.get("complete") is False:
            continue
        t = Take(p, int(m[1]), int(m[2]), int(m[3] or 1))
        _read(t)
        out.setdefault(t.index, []).append(t)
    for v in out.values():
        v.sort(key=lambda t: t.take)
    return out


def _read(t: Take) -> None:
    marks = pq.read_table(t.path / "marks.parquet", columns=["rank", "name", "phase", "t", "compute_clock",
                                                              "attrs"]).to_pylist()
    spans: list[tuple[int, float, float]] = []  # (iteration, t begin, t end)
    begin: tuple[int, float, float] | None = None  # the open iteration: (number, t, compute clock)
    for m in marks:
        if m["rank"] != t.rank:
            continue
        attrs = json.loads(m["attrs"] or "{}")
        if m["name"] == "iteration":
            if m["phase"] == "B":
                begin = (int(attrs["iteration"]), m["t"], m["compute_clock"])
            elif begin is not None:  # an end mark closes the open iteration (it carries no number)
                spans.append((begin[0], begin[1], m["t"]))
                t.compute[begin[0]] = m["compute_clock"] - begin[2]
                begin = None
        elif m["name"] == "memory" and attrs.get("iteration") is not None and "max_allocated" in attrs:
            t.peak[int(attrs["iteration"])] = int(attrs["max_allocated"])
    ops = pq.read_table(t.path / "ops.parquet", columns=["rank", "index", "kind", "splits", "payload", "t_issue",
                                                          "reduce_op"]).to_pylist()
    ops = sorted((o for o in ops if o["rank"] == t.rank), key=lambda o: o["index"])
    for o in ops:
        if o["kind"].startswith("all_to_all") and o["splits"]:
            s = json.loads(o["splits"])
            t.splits.append(s)
            it = next((i for i, b, e in spans if b <= o["t_issue"] <= e), 0)
            got = sum(s[1]) if s and isinstance(s[1], list) else 0
            t.received[it] = max(t.received.get(it, 0), got)
        elif o["kind"] == "all_reduce" and o["payload"]:
            t.reductions.append(o["payload"])


def _flat(s: list) -> list[int]:
    return [int(x) for part in s for x in (part if isinstance(part, list) else [part])]


def compare(a: Take, b: Take) -> dict[str, object]:
    """Take ``b`` against take ``a`` of the same class."""
    row: dict[str, object] = {"class": a.index + 1, "rank": a.rank, "takes": f"{a.take} -> {b.take}"}
    if len(a.splits) != len(b.splits):
        row["routing"] = f"all-to-all counts differ ({len(a.splits)} vs {len(b.splits)}): not the same program"
    else:
        differ = sum(x != y for x, y in zip(a.splits, b.splits, strict=True))
        moved = total = 0
        for x, y in zip(a.splits, b.splits, strict=True):
            fx, fy = _flat(x), _flat(y)
            moved += sum(abs(p - q) for p, q in zip(fx, fy, strict=False))
            total += sum(fx)
        row["routing"] = (f"{differ} of {len(a.splits)} all-to-alls differ; {100 * moved / max(total, 1):.3f} % of "
                          "the bytes moved between destinations")
    peaks = [(i, a.peak[i], b.peak[i]) for i in sorted(a.peak) if i in b.peak]
    row["peak"] = ", ".join(f"it {i}: {(y - x) / 2**20:+.1f} MiB" for i, x, y in peaks) or "-"
    most = [(i, a.received[i], b.received[i]) for i in sorted(a.received) if i in b.received and i]
    row["most received"] = ", ".join(f"it {i}: {100 * (y - x) / max(x, 1):+.2f} %" for i, x, y in most) or "-"
    comp = [(i, a.compute[i], b.compute[i]) for i in sorted(a.compute) if i in b.compute]
    row["compute"] = ", ".join(f"it {i}: {100 * (y - x) / max(x, 1e-9):+.1f} %" for i, x, y in comp) or "-"
    same = sum(x == y for x, y in zip(a.reductions, b.reductions, strict=False))
    row["reductions"] = f"{same} of {max(len(a.reductions), len(b.reductions))} recorded inputs equal"
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("captures", type=Path, help="a serial run's TRACE.captures folder")
    args = ap.parse_args(argv)
    if not args.captures.is_dir():
        print(f"second_pass_effect: {args.captures} is not a folder", file=sys.stderr)
        return 2
    found = takes(args.captures)
    if not found:
        print(f"second_pass_effect: no complete capture-I-rank-L trace under {args.captures}", file=sys.stderr)
        return 2
    print(f"{args.captures}: {sum(len(v) for v in found.values())} complete takes of {len(found)} captures")
    for index, ts in sorted(found.items()):
        pairs = list(zip(ts, ts[1:], strict=False)) + ([(ts[0], ts[-1])] if len(ts) > 2 else [])
        if not pairs:
            print(f"capture {index + 1} (rank {ts[0].rank}): one take")
        for a, b in pairs:
            row = compare(a, b)
            print(f"capture {row['class']} (rank {row['rank']}), take {row['takes']}:")
            for key in ("routing", "most received", "peak", "compute", "reductions"):
                print(f"  {key:14} {row[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
