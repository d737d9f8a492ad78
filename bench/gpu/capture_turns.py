"""Where a capture's wall goes, from its trace alone: per iteration, the slots' time split into
computing, the runtime's work inside turns and idle (`trace show`'s figures), and how much of the
runtime work sat in the turns that issued large ops of groups of one (Megatron's gradient
all_reduce over a data-parallel group of one), which ranks now do themselves.

  python bench/gpu/capture_turns.py TRACE_DIR_OR_TAR_GZ ...

Traces of older runs (before the rank did those ops itself) show what the change removes; the
turns' runtime work is an upper bound of it (a turn may also hold other ops' staging).
"""

from __future__ import annotations

import statistics
import sys
import tarfile
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from prism_megatron.trace import read_trace  # noqa: E402
from prism_megatron.trace.summary import capture_efficiency, slot_time  # noqa: E402

LARGE = 100 << 20  # bytes: an op whose staging shows in a turn


def _open(path: Path, work: Path) -> Path:
    if path.is_dir():
        return path
    with tarfile.open(path) as tar:
        tar.extractall(work / path.name, filter="data")
    return next((work / path.name).rglob("manifest.json")).parent


def analyse(path: Path) -> str:
    t = read_trace(path)
    eff, shares = capture_efficiency(t), slot_time(t)
    if not eff or not shares:
        return f"{path}: fewer than two iteration ends on every rank"
    sizes = {g["id"]: len(g["ranks"]) for g in t.manifest["groups"]}
    solo = [o for o in t.ops.to_pylist() if sizes[o["group"]] == 1 and o["bytes"] >= LARGE]
    clock: dict[int, float] = defaultdict(float)
    in_solo_turns = 0.0
    per_turn = []
    for s in sorted(t.slots.to_pylist(), key=lambda s: s["t_grant"]):
        work = s["t_release"] - s["t_grant"] - (s["compute_clock"] - clock[s["rank"]])
        clock[s["rank"]] = s["compute_clock"]
        per_turn.append(work)
        if any(o["rank"] == s["rank"] and s["t_grant"] <= o["t_issue"] <= s["t_release"] for o in solo):
            in_solo_turns += work
    wall = statistics.median(w for _, w, _ in eff)
    limit = statistics.median(lim for _, _, lim in eff)
    c, r, i = (statistics.median(x[j] for x in shares) for j in (1, 2, 3))
    iterations = max(len(eff) + 1, 1)
    sizes_gb = sorted({round(o["bytes"] / 1e9, 2) for o in solo})
    return (f"{path.name}: wall {wall:.3f} s per iteration, physical limit {limit:.3f} s, ratio {wall / limit:.2f}; "
            f"slots {c:.0%} computing, {r:.0%} runtime work, {i:.0%} idle; runtime work per turn median "
            f"{statistics.median(per_turn) * 1e3:.2f} ms over {len(per_turn)} turns; {len(solo)} ops of groups of one "
            f">= 100 MiB ({sizes_gb} GB), runtime work in their turns {in_solo_turns:.1f} s over the run "
            f"(~{in_solo_turns / iterations:.2f} s per iteration)")


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    with tempfile.TemporaryDirectory() as d:
        for arg in sys.argv[1:]:
            print(analyse(_open(Path(arg), Path(d))), flush=True)


if __name__ == "__main__":
    main()
