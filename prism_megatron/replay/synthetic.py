"""Megatron-shaped execution graphs made in Python: TP·PP·DP ranks running 1F1B, for replay at scale.

Benchmarks and tests need the graph of a 1,024- or 8,192-rank job without running one. This builds
what such a job's trace holds, in Megatron's rank order (tp fastest, then dp, then pp:
``rank = tp + TP * (dp + DP * pp)``): per microbatch and stage, each layer's compute followed by
its tensor-parallel all-reduce, pipeline sends/receives posted together and then awaited (as
``batch_isend_irecv``), and per iteration the data-parallel gradient reduce-scatter and parameter
all-gather, a loss all-reduce over data-parallel ranks and a grad-norm all-reduce over the
model-parallel group; each forward and backward of a microbatch is a scheduling unit (``forward`` /
``backward`` markers with iteration, microbatch and chunk, as Megatron's traces carry them). Stages
differ in compute (embedding on the first, loss on the last), so a graph has one class of ranks per
stage and tensor-parallel rank; every data-parallel replica is the same, which makes the graph
symmetric under the fold to replica 0 (:func:`replica_fold`).

Every stage runs its own 1F1B schedule (stage p: ``min(pp - p - 1, M)`` warm-up forwards, as
Megatron's), so middle stages are not translates of each other: a class-depth fold
(:func:`class_fold`, middle stages folded onto the lowest one) gives synthesis the schedule's warm-up
counts, with which it rebuilds each folded stage's own order of units (replay.stage_schedule).

With ``vpp`` > 1 every stage runs Megatron's interleaved schedule instead (``vpp`` model chunks per
stage, microbatch groups of ``group``, default PP as Megatron-LM's): the units and p2p calls of
replay.stage_schedule.interleaved_steps, embedding on chunk 0 of the first stage and loss on the
last chunk of the last; :func:`class_fold` then names the interleaved schedule and its parameters.

With ``overlap_grad`` (and DP > 1) the data-parallel ops are issued within the schedule as megatron-core's
DDP issues them under ``--overlap-grad-reduce --overlap-param-gather`` with the distributed optimizer and
Megatron-LM's aligned grad sync: each chunk's parameter all-gathers (two buckets) in its first forward,
each awaited at once (1F1B) or, interleaved (aligned param gather), dispatched by the schedule (chunks 0
and 1 at its start, chunk c + 1 right before forward k when k + stage is chunk c's first) and awaited in
the chunk's first forward; the grad reduce-scatters asynchronously, in the first stage's last backward (1F1B)
or, interleaved, after backward k when k - stage is a chunk's last backward, the rest after the
schedule; all awaited at the iteration's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .graph import Graph, GraphBuilder
from .stage_schedule import RECV_NEXT, RECV_PREV, SEND_NEXT, SEND_PREV, interleaved_steps, schedule_table


@dataclass(frozen=True)
class Shape:
    """A job's parallel layout and schedule size; times in seconds, sizes in bytes."""

    tp: int = 2
    pp: int = 4
    dp: int = 8
    microbatches: int = 8
    layers_per_stage: int = 4
    iterations: int = 3
    layer_forward: float = 1e-3
    activation_bytes: int = 16 << 20
    grad_bytes: int = 256 << 20
    gpu_times: bool = False  # two clocks: host time is a third of the device's
    vpp: int = 1  # model chunks per stage (> 1: Megatron's interleaved schedule)
    group: int = 0  # microbatch_group_size_per_vp_stage (0: PP, Megatron-LM's default)
    overlap_p2p: bool = False  # interleaved: overlap_p2p_comm (steady p2p awaited later, as Megatron's)
    wait_sends: bool = False  # interleaved with overlap: each steady forward's send waited at once
    overlap_grad: bool = False  # DP ops issued within the schedule (overlap-grad-reduce, overlap-param-gather)

    @property
    def vp_group(self) -> int:
        return self.group or self.pp

    def warmup(self, p: int) -> int:
        """Megatron's warm-up count of stage p before its cap (get_pp_rank_microbatches)."""
        if self.vpp > 1:
            return (self.pp - p - 1) * 2 + (self.vpp - 1) * self.vp_group
        return self.pp - p - 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)


def replica_fold(shape: Shape) -> list[int]:
    """rep of the fold to data-parallel replica 0 (Megatron's v1 sandbox for a dense model)."""
    return [shape.rank(r % shape.tp, 0, r // (shape.tp * shape.dp)) for r in range(shape.world_size)]


def class_fold(shape: Shape) -> dict[str, Any]:
    """``fold_graph`` keywords of the class-depth fold of ``shape``: one live rank per class (tp = dp =
    0; stage 0, the lowest middle stage 1 for every middle stage, the last stage), with the version-2
    coordinates (tp, cp, dp, pp) of this module's rank order (tp fastest, then dp, then pp) and the
    schedule's warm-up forwards per stage (Megatron's; with ``vpp`` > 1 the interleaved schedule's, its
    chunks and microbatch group)."""
    s = shape

    def stage_class(p: int) -> int:
        return 1 if 0 < p < s.pp - 1 else p

    coords = [(r % s.tp, 0, (r // s.tp) % s.dp, r // (s.tp * s.dp)) for r in range(s.world_size)]
    return {"rep": [s.rank(0, 0, stage_class(c[3])) for c in coords], "depth": "class",
            "axes": ("tp", "cp", "dp", "pp"), "sizes": (s.tp, 1, s.dp, s.pp), "coords": coords,
            "schedule": "interleaved" if s.vpp > 1 else "1f1b", "warmup": [s.warmup(p) for p in range(s.pp)],
            **({"chunks": s.vpp, "group": s.vp_group, "overlap_p2p": s.overlap_p2p,
                 "wait_sends": s.wait_sends} if s.vpp > 1 else {})}


def megatron_1f1b(shape: Shape) -> Graph:
    """The graph of ``shape`` (see the module docstring)."""
    s = shape
    b = GraphBuilder()
    gid = iter(range(1 << 30))
    world = b.group(next(gid), range(s.world_size), "world")
    tp_g, dp_g, pp_g, mp_g = {}, {}, {}, {}
    for p in range(s.pp):
        for d in range(s.dp):
            tp_g[(d, p)] = b.group(next(gid), [s.rank(t, d, p) for t in range(s.tp)], "tp")
    for p in range(s.pp):
        for t in range(s.tp):
            dp_g[(t, p)] = b.group(next(gid), [s.rank(t, d, p) for d in range(s.dp)], "dp")
    for d in range(s.dp):
        for t in range(s.tp):
            pp_g[(t, d)] = b.group(next(gid), [s.rank(t, d, p) for p in range(s.pp)], "pp")
        mp_g[d] = b.group(next(gid), [s.rank(t, d, p) for p in range(s.pp) for t in range(s.tp)], "mp")
    del world  # every rank is a member; no op of this schedule uses it

    for p in range(s.pp):
        first, last = p == 0, p == s.pp - 1
        extra_f = (0.5 if first else 0.0) + (1.0 if last else 0.0)  # embedding, loss
        for d in range(s.dp):
            for t in range(s.tp):
                r = s.rank(t, d, p)
                ring = s.vpp > 1  # interleaved: the first stage's chunks > 0 receive from the last stage
                prv = s.rank(t, d, (p - 1) % s.pp) if ring or not first else None
                nxt = s.rank(t, d, (p + 1) % s.pp) if ring or not last else None
                _rank_program(b, s, r, p, tp_g[(d, p)], dp_g[(t, p)], pp_g[(t, d)], mp_g[d], prv, nxt, extra_f)
    vpp = f", vpp={s.vpp}" if s.vpp > 1 else ""
    return b.build(f"megatron_1f1b(tp={s.tp}, pp={s.pp}{vpp}, dp={s.dp}, m={s.microbatches})")


def _rank_program(b: GraphBuilder, s: Shape, r: int, p: int, tp: int, dp: int, pp: int, mp: int,
                  prv: int | None, nxt: int | None, extra_f: float) -> None:
    f = s.layer_forward

    def compute(seconds: float, label: str) -> None:
        b.compute(r, seconds / 3 if s.gpu_times else seconds, label, gpu=seconds if s.gpu_times else None)

    overlap = s.overlap_grad and s.dp > 1
    grads: list = []  # the iteration's async grad reduce-scatters, awaited at its end

    def grad_sync(buckets: int = 1) -> None:
        for bucket in range(buckets):
            grads.append(b.collective(r, "reduce_scatter", dp, s.grad_bytes // 2, async_op=True,
                                      label=f"dp.grads {bucket}"))

    gathers: dict[int, list] = {}  # chunk -> its dispatched param all-gathers (aligned param gather)

    def param_sync(chunk: int) -> None:  # start_param_sync of a chunk: one async all-gather per bucket
        gathers[chunk] = [b.collective(r, "all_gather", dp, s.grad_bytes // 4, async_op=True,
                                       label=f"dp.params {bucket}") for bucket in range(2)]

    def layers(direction: str, it: int, mb: int, chunk: int = 0) -> None:
        b.mark(r, direction, "B", iteration=it, microbatch=mb, chunk=chunk)
        if overlap and direction == "forward" and mb == 0 and s.vpp == 1:
            for bucket in range(2):  # the forward pre-hook dispatches each bucket's gather and awaits it
                b.wait(r, b.collective(r, "all_gather", dp, s.grad_bytes // 4, async_op=True,
                                       label=f"dp.params {bucket}"))
        elif overlap and direction == "forward" and mb == 0:  # the pre-hook awaits the aligned gathers
            for ref in gathers.pop(chunk):
                b.wait(r, ref)
        scale = 1.0 if direction == "forward" else 2.0
        edge = (p == 0 and chunk == 0) or (p == s.pp - 1 and chunk == s.vpp - 1)  # the chunk with embedding/loss
        if direction == "forward" and extra_f and edge:
            compute(extra_f * f, "embedding/loss")
        for layer in range(s.layers_per_stage):
            compute(scale * f, f"{direction} layer {layer}")
            if s.tp > 1:
                b.collective(r, "all_reduce", tp, s.activation_bytes, label=f"tp.{direction}")
        if overlap and s.vpp == 1 and p == 0 and direction == "backward" and mb == m - 1:
            grad_sync(2)  # the first stage's last backward: the grad hooks start each bucket's reduce-scatter
        b.mark(r, direction, "E")

    def p2p(*ops: tuple[str, int | None], wait: bool = True) -> list:
        refs = []
        for kind, peer in ops:
            if peer is None:
                continue
            refs.append((b.send if kind == "send" else b.recv)(r, peer, pp, s.activation_bytes, async_op=True,
                                                                 label=f"pp.{kind}"))
        if refs and wait:
            b.wait(r, *refs)
        return refs

    m = s.microbatches
    warmup = min(s.pp - p - 1, m)
    peer = {RECV_PREV: ("recv", prv), SEND_PREV: ("send", prv), SEND_NEXT: ("send", nxt), RECV_NEXT: ("recv", nxt)}
    if s.vpp > 1:
        table = schedule_table(m, s.vpp, s.vp_group)
        steps = interleaved_steps(s.pp, p, s.vpp, s.vp_group, m, s.warmup(p), s.overlap_p2p, s.wait_sends)
    for it in range(s.iterations):
        b.mark(r, "iteration", "B", iteration=it)
        grads.clear()
        if s.vpp > 1:
            _interleaved(s, steps, table, lambda *ops: p2p(*(peer[x] for x in ops), wait=False),
                         lambda d, mb, c, it=it: layers(d, it, mb, c), lambda *refs: b.wait(r, *refs),
                         grad_sync if overlap else None, p, param_sync if overlap else None)
        for i in range(warmup if s.vpp == 1 else 0):
            p2p(("recv", prv))
            layers("forward", it, i)
            p2p(("send", nxt))
        if m > warmup and s.vpp == 1:
            p2p(("recv", prv))
        for i in range(m - warmup if s.vpp == 1 else 0):
            layers("forward", it, warmup + i)
            p2p(("send", nxt), ("recv", nxt))
            layers("backward", it, i)
            p2p(("send", prv), *((("recv", prv),) if i < m - warmup - 1 else ()))
        for i in range(m - warmup, m) if s.vpp == 1 else ():
            p2p(("recv", nxt))
            layers("backward", it, i)
            p2p(("send", prv))
        if overlap:  # the stages and chunks not yet synchronised start theirs after the schedule
            grad_sync(max(0, (2 if s.vpp == 1 else s.vpp) - len(grads)))
            b.wait(r, *grads)  # finalize_model_grads
        if s.dp > 1:
            for bucket in range(0 if overlap else 2):
                b.collective(r, "reduce_scatter", dp, s.grad_bytes // 2, label=f"dp.grads {bucket}")
            b.collective(r, "all_reduce", dp, 4, label="dp.loss")
        b.collective(r, "all_reduce", mp, 4, label="mp.grad_norm")
        compute(2 * f, "optimizer")
        if s.dp > 1 and not overlap:
            b.collective(r, "all_gather", dp, s.grad_bytes // 2, label="dp.params")
        if s.gpu_times:
            b.cpu_sync(r)  # Megatron's timers synchronise at the iteration's end
        b.mark(r, "iteration", "E")


def _interleaved(s: Shape, steps: list, table: list[tuple[int, int]], post: Any, layers: Any, wait: Any,
                 grad_sync: Any = None, stage: int = 0, param_sync: Any = None) -> None:
    """One iteration of a stage's interleaved program: its units, calls and waits (``steps``); with
    ``grad_sync``, Megatron's aligned grad sync: after backward k, the sync of the chunk whose last backward
    is k - stage (backward_step_helper_postprocess); with ``param_sync``, its aligned param gather: chunks 0
    and 1 before the first receive, chunk c + 1 > 1 right before forward k when k + stage is chunk c's first
    (forward_step_helper_preprocess)."""
    refs: dict[tuple[str, int], Any] = {}
    if param_sync is not None:
        param_sync(0)
        param_sync(1)
    last = {}  # chunk -> the virtual microbatch of its last backward
    for k, (_, chunk) in enumerate(table):
        last[s.vpp - 1 - chunk] = max(last.get(s.vpp - 1 - chunk, -1), k)
    for step in steps:
        if step[0] == "call":
            refs.update(zip(step[1], post(*(x for x, _ in step[1])), strict=True))
        elif step[0] == "wait":
            wait(*(refs[x] for x in step[1]))
        else:
            mb, chunk = table[step[1]]
            forward = step[0] == "F"
            ahead = step[1] + stage
            if param_sync is not None and forward and ahead < len(table) and table[ahead][0] == 0 \
                    and 1 < table[ahead][1] + 1 < s.vpp:
                param_sync(table[ahead][1] + 1)
            layers("forward" if forward else "backward", mb, chunk if forward else s.vpp - 1 - chunk)
            if grad_sync is not None and not forward and step[1] - stage in last.values():
                grad_sync()
