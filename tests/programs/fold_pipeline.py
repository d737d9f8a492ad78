"""A 4-stage pipeline (ranks 0-3, one stage each, no Megatron) in 1F1B order with batched p2p, as
Megatron's schedule issues it (torch.distributed.batch_isend_irecv of P2POps, then wait on all).

Stage s adds (s + 1) * 1000 going forward; the last stage turns its input x into the gradient
2 * x + 40000; stage s adds (s + 1) * 10000 to the gradient going backward. A stage that sent a
tensor overwrites it at once (a pipeline reuses its buffers): what the receiver gets must be the
value at the send. Each rank saves what it received, per micro-batch, to OUT_DIR/rank-R.pt.

Usage: fold_pipeline.py OUT_DIR MICRO_BATCHES [mismatch|norms]
  mismatch: the last stage posts its forward receives transposed (same bytes, another shape).
  norms: after the iteration, three small reductions over the pipeline group whose inputs differ by stage, as
    Megatron's grad norm (a sum of squares, float64: 1.5 (s + 1)^2), num-zeros count (int64: s + 1) and found-inf
    flag (max: 1 on the last stage) are; their results go to the saved file as "norms".
"""
import sys
import time
from collections import deque
from pathlib import Path

import torch
import torch.distributed as dist

from prism_megatron.trace import span

out_dir, M = Path(sys.argv[1]), int(sys.argv[2])
mismatch = len(sys.argv) > 3 and sys.argv[3] == "mismatch"
norms = len(sys.argv) > 3 and sys.argv[3] == "norms"
dist.init_process_group("nccl")
s, P = dist.get_rank(), dist.get_world_size()
pp = dist.new_group(list(range(P)))
prev, nxt = s - 1, s + 1
first, last = s == 0, s == P - 1
SHAPE = (128, 160)  # 80 KiB: through shared memory, not inline
got = {"fwd": [], "bwd": []}


def p2p(send_prev=None, recv_prev=False, send_next=None, recv_next=False):
    """Megatron's _batched_p2p_ops: the ops in its order, issued as one batch, then waited on."""
    ops, rp, rn = [], None, None
    if send_prev is not None:
        ops.append(dist.P2POp(dist.isend, send_prev, prev, group=pp))
    if recv_prev:
        rp = torch.empty(SHAPE[::-1] if mismatch and last else SHAPE)
        ops.append(dist.P2POp(dist.irecv, rp, prev, group=pp))
    if send_next is not None:
        ops.append(dist.P2POp(dist.isend, send_next, nxt, group=pp))
    if recv_next:
        rn = torch.empty(SHAPE)
        ops.append(dist.P2POp(dist.irecv, rn, nxt, group=pp))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    for t in (send_prev, send_next):
        if t is not None:
            t.fill_(-7.0)  # the buffer is reused once its send completed
    if rp is not None:
        got["fwd"].append(rp.clone())
    if rn is not None:
        got["bwd"].append(rn.clone())
    return rp, rn


def forward(x, mb):
    if first:
        x = (torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32) % 7).reshape(SHAPE) + 100.0 * mb
    inputs.append(x)
    return x.reshape(SHAPE) + (s + 1) * 1000.0


def backward(g):
    x = inputs.popleft()
    return (x.reshape(SHAPE) * 2 + 40000.0) if last else g + (s + 1) * 10000.0


inputs: deque = deque()
if last:
    time.sleep(0.3)  # the first stages run ahead: their sends into the virtual stage are kept for a while
with span("iteration", iteration=0):
    warm = min(P - s - 1, M)
    for i in range(warm):
        x, _ = p2p(recv_prev=not first)
        p2p(send_next=forward(x, i))
    x = p2p(recv_prev=not first)[0] if M > warm else None
    for i in range(M - warm):
        y = forward(x, warm + i)
        _, g = p2p(send_next=None if last else y, recv_next=not last)
        d = backward(g)
        if i == M - warm - 1:
            p2p(send_prev=None if first else d)
        else:
            x, _ = p2p(send_prev=None if first else d, recv_prev=not first)
    for _ in range(warm):
        _, g = p2p(recv_next=not last)
        p2p(send_prev=None if first else backward(g))
saved = {k: torch.stack(v) if v else torch.empty(0) for k, v in got.items()}
if norms:
    sq = torch.tensor([1.5 * (s + 1) ** 2], dtype=torch.float64)
    count = torch.tensor([s + 1], dtype=torch.int64)
    found_inf = torch.tensor([float(last)])
    dist.all_reduce(sq, group=pp)
    dist.all_reduce(count, group=pp)
    dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=pp)
    saved["norms"] = torch.cat([sq, count.double(), found_inf.double()])
out_dir.mkdir(parents=True, exist_ok=True)
torch.save(saved, out_dir / f"rank-{s}.pt")
dist.destroy_process_group()
