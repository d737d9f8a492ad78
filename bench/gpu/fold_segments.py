"""Where two captures' host times part, segment by segment: a folded capture against the full one (or
two ranks of one capture against each other), over one iteration measured on two clocks.

Segment k of an iteration is matched with segment k of the other (Megatron repeats an iteration's
ops, the GPU timer pairs them the same way); each is named by the op issued just before it (the rank's
compute clock at issue: the sum of the ops' ``compute_before``). Printed: the segments whose host time
differs most, and the sum of the differences over the segments that follow an op of a group with a
virtual member (a folded collective: the prism work done for virtual ranks) against all the others.

    python bench/gpu/fold_segments.py A_TRACE A_RANK B_TRACE B_RANK [--iteration 3] [--top 8]

e.g. the full capture's rank 1 against the fold's rank 1, or the full capture's rank 1 against its rank 3
(two members of one class: the noise of one capture).
"""

from __future__ import annotations

import argparse
import bisect
import json
from pathlib import Path


def segments(trace_dir: str, rank: int, iteration: int) -> list[dict]:
    """The rank's GPU-timed segments inside ``iteration`` (1-based), each with the op issued before it."""
    from prism_megatron.trace import read_trace

    t = read_trace(trace_dir)
    marks = [m for m in t.marks.to_pylist() if m["rank"] == rank and m["name"] == "iteration"]
    begins = [m["compute_clock"] for m in marks if m["phase"] == "B"]
    ends = [m["compute_clock"] for m in marks if m["phase"] == "E"]
    if iteration > min(len(begins), len(ends)):
        raise SystemExit(f"{trace_dir}: rank {rank} has {min(len(begins), len(ends))} iterations, not {iteration}")
    b, e = begins[iteration - 1], ends[iteration - 1]
    ops = sorted((o for o in t.ops.to_pylist() if o["rank"] == rank), key=lambda o: o["index"])
    issue, clock = [], 0.0
    for o in ops:
        clock += o["compute_before"]
        issue.append(clock)
    manifest = json.loads((Path(trace_dir) / "manifest.json").read_text())
    fold = manifest["job"].get("fold")
    live = set(fold["rep"]) if fold else None
    folded = {g["id"] for g in manifest["groups"] if live is not None and set(g["ranks"]) - live}
    out = []
    for row in sorted((r for r in t.gpu.to_pylist() if r["rank"] == rank), key=lambda r: r["clock_start"]):
        if not (b - 1e-9 <= row["clock_start"] and row["clock_end"] <= e + 1e-9):
            continue
        k = bisect.bisect_right(issue, row["clock_start"] + 1e-6) - 1
        op = ops[k] if k >= 0 else None
        out.append({**row, "after": f"{op['kind']} {op['label'] or ''} g{op['group']}".strip() if op else "start",
                    "after_folded": bool(op and op["group"] in folded)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a_trace")
    ap.add_argument("a_rank", type=int)
    ap.add_argument("b_trace")
    ap.add_argument("b_rank", type=int)
    ap.add_argument("--iteration", type=int, default=3, help="1-based; 2.. are measured on two clocks")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    sa, sb = segments(a.a_trace, a.a_rank, a.iteration), segments(a.b_trace, a.b_rank, a.iteration)
    if len(sa) != len(sb):
        raise SystemExit(f"iteration {a.iteration}: {len(sa)} segments against {len(sb)}: not the same program")
    rows = [(y["cpu"] - x["cpu"], k, x, y) for k, (x, y) in enumerate(zip(sa, sb, strict=True))]
    print(f"iteration {a.iteration}, {len(rows)} segments; host ms A {sum(x['cpu'] for x in sa) * 1e3:.2f}, "
          f"B {sum(y['cpu'] for y in sb) * 1e3:.2f}; device ms A {sum(x['gpu'] for x in sa) * 1e3:.2f}, "
          f"B {sum(y['gpu'] for y in sb) * 1e3:.2f}")
    for d, k, x, y in sorted(rows, key=lambda r: -abs(r[0]))[:a.top]:
        print(f"  seg {k:4d} after {y['after']:36} host A {x['cpu'] * 1e3:7.2f} B {y['cpu'] * 1e3:7.2f} "
              f"(B - A {d * 1e3:+7.2f}) device A {x['gpu'] * 1e3:6.2f} B {y['gpu'] * 1e3:6.2f}")
    after = sum(d for d, _, _, y in rows if y["after_folded"])
    print(f"B - A host ms: after a folded collective {after * 1e3:+.2f} "
          f"({sum(y['after_folded'] for y in sb)} segments); elsewhere {(sum(r[0] for r in rows) - after) * 1e3:+.2f}")


if __name__ == "__main__":
    main()
