"""Compare op_matrix results of two runs (e.g. prism on CUDA vs gloo on CPU); prints a verdict line.

usage: compare_matrix.py DIR_A DIR_B WORLD
Bitwise for ops whose result cannot depend on reduction order, float tolerance otherwise.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from programs.matrix_tolerance import ORDER_DEPENDENT, tolerance  # noqa: E402

a_dir, b_dir, world = sys.argv[1], sys.argv[2], int(sys.argv[3])
checked = bitwise = bad = 0
for r in range(world):
    a, b = torch.load(f"{a_dir}/rank-{r}.pt"), torch.load(f"{b_dir}/rank-{r}.pt")
    if a.keys() != b.keys():
        print(f"rank {r}: different keys {set(a) ^ set(b)}")
        bad += 1
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        checked += 1
        if x.dtype != y.dtype or x.shape != y.shape:
            print(f"rank {r} {k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
            bad += 1
        elif torch.equal(x, y):
            bitwise += 1
        elif not k.startswith(ORDER_DEPENDENT) or not torch.allclose(x.double(), y.double(), rtol=tolerance(x.dtype)):
            print(f"rank {r} {k}: {x.flatten()[:4].tolist()} vs {y.flatten()[:4].tolist()}")
            bad += 1
print(f"compared {checked} results over {world} ranks: {bitwise} bitwise equal, {bad} mismatches -> "
      f"{'PASS' if bad == 0 and checked else 'FAIL'}")
sys.exit(1 if bad or not checked else 0)
