"""Compare two ``host_profile.py`` outputs (real vs emulated) for one rank: per op, self CPU time.

Read the ops that do no communication (aten::mm, copies, the optimizer...): the same work at another
speed points at the machine, extra ops at our runtime. Ops that issue a collective (Megatron's
autograd Functions around TP all-reduces, c10d::*) include the wait for it, which differs by design:
NCCL returns at once, the emulated rank waits for the coordinator (on CPU both wait).

  python bench/gpu/host_diff.py REAL_DIR EMULATED_DIR [RANK]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    real_dir, emu_dir = Path(sys.argv[1]), Path(sys.argv[2])
    rank = sys.argv[3] if len(sys.argv) > 3 else "0"
    real = json.loads((real_dir / f"rank-{rank}.json").read_text())
    emu = json.loads((emu_dir / f"rank-{rank}.json").read_text())
    total = {k: sum(v[1] for v in d["ops"].values()) / 1e3 for k, d in (("real", real), ("emu", emu))}
    print(f"rank {rank}, iteration {real['iteration']}: wall real {real['wall_s'] * 1e3:.1f} ms, emulated "
          f"{emu['wall_s'] * 1e3:.1f} ms; ops' self CPU real {total['real']:.1f} ms, emulated {total['emu']:.1f} ms")
    for k in real.get("probe", {}):
        print(f"probe {k}: real {real['probe'][k]:.2f}, emulated {emu['probe'].get(k, float('nan')):.2f}")
    names = set(real["ops"]) | set(emu["ops"])
    rows = []
    for n in names:
        rc, rt = real["ops"].get(n, [0, 0.0])
        ec, et = emu["ops"].get(n, [0, 0.0])
        rows.append((et - rt, n, rc, rt / 1e3, ec, et / 1e3))
    print(f"{'op':60} {'real n':>7} {'real ms':>9} {'emu n':>7} {'emu ms':>9} {'emu/real':>8}")
    for _diff, n, rc, rt, ec, et in sorted(rows, key=lambda r: -abs(r[0]))[:30]:
        ratio = f"{et / rt:.2f}" if rt else "-"
        print(f"{n[:60]:60} {rc:7d} {rt:9.2f} {ec:7d} {et:9.2f} {ratio:>8}")


if __name__ == "__main__":
    main()
