"""Fold-plan build time and size at target scale (Megatron's RankGenerator groups, the fold check).

  python bench/fold_plan.py [W ...]     (default: 1024 8192 65536, dense TP2·PP4 and MoE TP2·PP4·EP8·ETP1)

Prints, per layout and fold depth (class: dense only; replica): seconds to build the plan (after
megatron-core is imported), live ranks, classes, and the size of its JSON (what the trace's manifest
carries).
"""

from __future__ import annotations

import json
import sys
import time

from prism_megatron.megatron.fold import TargetLayout, build_fold_plan, import_megatron


def main(worlds: list[int]) -> None:
    t0 = time.perf_counter()
    import_megatron()
    print(f"megatron-core import: {time.perf_counter() - t0:.2f} s")
    print(f"{'layout':<44} {'depth':<8} {'build s':>8} {'live':>6} {'classes':>8} {'JSON MiB':>9}")
    for world in worlds:
        for layout in (TargetLayout(world_size=world, tp=2, pp=4, num_layers=8),
                       TargetLayout(world_size=world, tp=2, pp=4, ep=8, etp=1, num_experts=16, num_layers=8)):
            for depth in ("replica",) if layout.num_experts else ("class", "replica"):
                t = time.perf_counter()
                plan = build_fold_plan(layout, depth)
                took = time.perf_counter() - t
                size = len(json.dumps(plan.to_json())) / (1 << 20)
                print(f"{layout.describe():<44} {depth:<8} {took:>8.2f} {len(plan.live):>6} {len(plan.classes):>8} "
                      f"{size:>9.2f}")


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]] or [1024, 8192, 65536])
