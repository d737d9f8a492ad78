"""Compare per-rank peak memory: emulated on one GPU (trace marks) vs the real 2-GPU run (driver metrics).

Usage: python bench/gpu/memory_compare.py OUT_DIR   (the directory bench/gpu/memory_matrix.sh filled)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MiB = 1 << 20


def _last(path: Path) -> dict[int, dict]:
    """Per rank, the last iteration's record (peaks are cumulative)."""
    out: dict[int, dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["rank"] not in out or r["iteration"] >= out[r["rank"]]["iteration"]:
                out[r["rank"]] = r
    return out


def _marks(trace: Path) -> list[tuple[int, dict]]:
    from prism_megatron.trace import read_trace

    if not (trace / "manifest.json").exists():
        return []
    return [(m["rank"], json.loads(m["attrs"])) for m in read_trace(trace).marks.to_pylist()
            if m["name"] in ("memory", "oom")]


def main(out: Path) -> None:
    print(f"{'layout':8} {'rank':>4} {'real alloc MiB':>15} {'emu alloc MiB':>14} {'diff':>9} "
          f"{'real resv MiB':>14} {'emu resv MiB':>13} {'diff %':>7} {'loss real':>10} {'loss emu':>10}")
    for name in ("tp2", "pp2", "ep2"):
        real, emu = _last(out / f"real-{name}.jsonl"), _last(out / f"emu-{name}.jsonl")
        marks = _marks(out / f"trace-{name}")
        for rank in sorted(set(real) | set(emu)):
            r, e = real.get(rank, {}), emu.get(rank, {})
            ra, rr = r.get("max_allocated"), r.get("max_reserved")
            peaks = [a for rk, a in marks if rk == rank]
            ea = max((a["max_allocated"] for a in peaks), default=e.get("max_allocated"))
            er = max((a["max_reserved"] for a in peaks), default=e.get("max_reserved"))
            if None in (ra, rr, ea, er):
                print(f"{name:8} {rank:>4} missing figures (real {bool(r)}, emulated {bool(e)})")
                continue
            loss_r = next(iter(r.get("loss", {}).values()), float("nan"))
            loss_e = next(iter(e.get("loss", {}).values()), float("nan"))
            print(f"{name:8} {rank:>4} {ra / MiB:15.2f} {ea / MiB:14.2f} {(ea - ra) / MiB:+9.2f} {rr / MiB:14.2f} "
                  f"{er / MiB:13.2f} {100 * (er - rr) / rr:+7.2f} {loss_r:10.6f} {loss_e:10.6f}")
    for f in ("0.9", "1.1"):
        ooms = [(rk, a) for rk, a in _marks(out / f"trace-pp2-cap{f}") if "message" in a]
        said = "; ".join(f"OOM predicted on rank {rk}: {a['message'][:120]}" for rk, a in ooms)
        print(f"pp2 capped at {f}x rank 0's real peak: {said or 'no OOM predicted'}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
