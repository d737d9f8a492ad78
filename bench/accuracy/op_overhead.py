"""Back-to-back all_reduces with no compute between them, for a prism run: the runtime's cost per op.

Run under ``prism-megatron launch -w 2 --slots-per-device 1``. The bare trace counts a rank's slot-
holding time as compute; here the program computes nothing between ops, so each op's
``compute_before`` is what one op costs the emulated rank itself (the grant reaching the rank,
the result copied back, the next input staged, the messages): time the prediction counts as
compute although the target does not spend it. ``run.py`` reads the median from the trace.

  prism-megatron launch -w 2 --devices cpu --trace-dir T bench/accuracy/op_overhead.py cpu NBYTES [DTYPE]
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

OPS = 120


def main(device: str, nbytes: int, dtype: str) -> None:
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    where = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    kind = getattr(torch, dtype)
    x = torch.ones(nbytes // kind.itemsize, dtype=kind, device=where)
    for _ in range(OPS):
        dist.all_reduce(x)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "float32")
