"""The `prism` torch.distributed backend: a Python ProcessGroup that hands every op to the coordinator.

Registered with `extended_api=True` for cpu and cuda, a `ProcessGroup` subclass becomes the whole
group (torch returns it as the group object). Every op torch can call on a process group is
either implemented here or fails with an error that names it — never a hang, never a wrong answer.
Ranks in messages are group ranks; the coordinator knows each group's global ranks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from prism_megatron.ops import P2P_KINDS
from prism_megatron.runtime import local_fold
from prism_megatron.runtime.client import RankClient
from prism_megatron.runtime.work import PrismWork

BACKEND_NAME = "prism"

_REDOPS = {
    dist.ReduceOp.RedOpType.SUM: "sum",
    dist.ReduceOp.RedOpType.AVG: "avg",
    dist.ReduceOp.RedOpType.MIN: "min",
    dist.ReduceOp.RedOpType.MAX: "max",
    dist.ReduceOp.RedOpType.PRODUCT: "product",
    dist.ReduceOp.RedOpType.PREMUL_SUM: "premul_sum",
    dist.ReduceOp.RedOpType.BAND: "band",
    dist.ReduceOp.RedOpType.BOR: "bor",
    dist.ReduceOp.RedOpType.BXOR: "bxor",
}


def _premul_factor(op: Any) -> float:
    """The scalar of a PREMUL_SUM op; older torch exposes it only through the op's pickle state."""
    try:
        return float(op.factor)
    except (AttributeError, RuntimeError):
        state = op.__getstate__()
        if len(state) > 1 and isinstance(state[1], (int, float)):
            return float(state[1])
        raise NotImplementedError("prism backend: PREMUL_SUM with a tensor factor is not supported") from None


def _redop(opts: Any) -> dict:
    op = opts.reduceOp
    kind = op.op if isinstance(op, dist.ReduceOp) else dist.ReduceOp.RedOpType(op)
    name = _REDOPS.get(kind)
    if name is None:
        raise NotImplementedError(f"prism backend: reduce op {kind} is not supported")
    return {"redop": name, "factor": _premul_factor(op) if name == "premul_sum" else None}


#: torch's profiler titles of the ops (``<backend>:<title>``, as ProcessGroupGloo/NCCL record them)
_TITLES = {"all_reduce": "all_reduce", "reduce": "reduce", "broadcast": "broadcast", "all_gather_list": "all_gather",
           "all_gather": "all_gather_into_tensor", "reduce_scatter_list": "reduce_scatter",
           "reduce_scatter": "reduce_scatter_tensor", "gather": "gather", "scatter": "scatter",
           "all_to_all": "all_to_all", "all_to_all_list": "all_to_all", "barrier": "barrier", "send": "send",
           "recv": "recv"}

_LABEL = threading.local()
# bench knob (bench/runtime.py solo): stage ops of a group of one through the coordinator, as before
_STAGE_GROUPS_OF_ONE = os.environ.get("PRISM_STAGE_GROUPS_OF_ONE") == "1"


@contextlib.contextmanager
def op_label(label: str) -> Iterator[None]:
    """Ops this thread submits inside the block carry ``label`` in the trace (innermost label wins).

    Integrations (e.g. Megatron's p2p communicator, DDP buckets) name their ops with it; the
    runtime attaches no meaning to the text.
    """
    previous = getattr(_LABEL, "value", None)
    _LABEL.value = label
    try:
        yield
    finally:
        _LABEL.value = previous


class PrismProcessGroup(dist.ProcessGroup):
    """One communicator of a logical rank. `ranks` are the global ranks, in group-rank order."""

    def __init__(self, client: RankClient, rank: int, size: int, ranks: list[int], name: str,
                 requested_backend: str, timeout: timedelta | None = None, world: bool = False,
                 rep: list[int] | None = None, untranslate: Callable[[int, int], int] | None = None,
                 class_rep: list[int] | None = None) -> None:
        super().__init__(rank, size)
        self._client = client
        self._ranks = ranks
        # a folded job's group with virtual members (rep[r] != r): the coordinator answers for them and
        # needs what a virtual member cannot send (kept all_gather chunks, a virtual root's data)
        self._rep = rep if rep is not None and any(rep[r] != r for r in ranks) else None
        # a folded group whose only live member is this rank: its collectives are answered here (local_fold)
        self._lone = local_fold.lone_plan(ranks, self._rep, rank, untranslate)
        # a serial capture's group with members of another class: its small reductions go to the coordinator
        self._records = local_fold.records(self._lone, class_rep)
        # a group of one: the rank computes each op's result itself (RankClient.submit); fixed per group
        self._local = len(ranks) == 1 and not _STAGE_GROUPS_OF_ONE
        self._name = name
        self._desc = "undefined"
        self._coalescing: list[PrismWork] | None = None
        self.requested_backend = requested_backend
        self._barrier_tensor: torch.Tensor | None = None
        self._handle = client.register_group(name, ranks, requested_backend, world,
                                             timeout.total_seconds() if timeout else None)

    # ---- identity torch queries ---------------------------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    @property
    def global_ranks(self) -> list[int]:
        return list(self._ranks)

    # ---- plumbing ------------------------------------------------------------------------------
    def _op(self, kind: str, ins: list[torch.Tensor], outs: list[torch.Tensor], opts: Any = None,
            title: str | None = None, **params: Any) -> PrismWork:
        sparse = next((t for t in (*ins, *outs) if t.layout != torch.strided), None)
        if sparse is not None:  # gloo sums sparse COO tensors, NCCL (the target's backend) refuses them
            raise ValueError(f"prism: {kind} of a {sparse.layout} tensor is not supported (gloo sums sparse "
                             "tensors, NCCL and prism do not): call .to_dense() before the collective")
        async_op = bool(getattr(opts, "asyncOp", True)) if opts is not None else True
        label = getattr(_LABEL, "value", None)
        if label and "label" not in params:
            params["label"] = label
        if self._local and kind not in P2P_KINDS:
            params["local"] = True
        elif self._lone is not None and local_fold.answerable(self._lone, kind, ins, outs, params, self._records):
            # a partial, not a closure over params (which would hold it: a cycle keeping the op's tensors
            # alive until the cyclic GC runs, and the rank's memory above the target's)
            params["answer"] = functools.partial(
                local_fold.answer, self._lone, kind, ins, outs, redop=params.get("redop"),
                factor=params.get("factor"), in_place=bool(params.get("in_place")), current=params.get("current"),
                in_splits=params.get("in_splits"))
        if torch._C._autograd._profiler_enabled():  # the event a real backend records, ended at completion
            backend = BACKEND_NAME if self.requested_backend == "undefined" else self.requested_backend
            # (a recv's event carries the receiving tensor, as gloo's does)
            if title is None:
                title = "recvAnySource" if kind == "recv" and params.get("peer") is None else _TITLES[kind]
            handle = torch._C._autograd._record_function_with_args_enter(f"{backend}:{title}", *(ins or outs))
            try:
                work = self._client.submit(self._handle, kind, ins, outs, async_op=async_op, profiled=handle,
                                           **params)
            except BaseException:
                torch._C._autograd._record_function_with_args_exit(handle)
                raise
        else:
            work = self._client.submit(self._handle, kind, ins, outs, async_op=async_op, **params)
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    def _start_coalescing(self, device: Any = None) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: Any = None) -> PrismWork | None:
        works, self._coalescing = self._coalescing or [], None
        return _AllWork(self._client, works) if works else None

    # ---- reductions ----------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> PrismWork:
        if not isinstance(tensors, list):
            tensors = [tensors]
        opts = opts or dist.AllreduceOptions()
        return self._op("all_reduce", tensors, tensors, opts, inplace=True, **_redop(opts))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> PrismWork:
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._op("all_reduce", tensors, tensors, opts, inplace=True, **_redop(opts))

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> PrismWork:
        outs = tensors if opts.rootRank == self.rank() else []
        return self._op("reduce", tensors, outs, opts, inplace=True, root=opts.rootRank, **_redop(opts))

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> PrismWork:
        opts = opts or dist.ReduceScatterOptions()
        _single(output_tensors, "reduce_scatter")
        return self._op("reduce_scatter_list", list(input_tensors[0]), output_tensors, opts, **_redop(opts))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PrismWork:
        opts = opts or dist.ReduceScatterOptions()
        return self._op("reduce_scatter", [input], [output], opts, **_redop(opts))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> PrismWork:
        opts = opts or dist.ReduceScatterOptions()
        return self._op("reduce_scatter", list(inputs), list(outputs), opts, **_redop(opts))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- gathers and scatters ------------------------------------------------------------------
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> PrismWork:
        _single(input_tensors, "allgather")
        outs = list(output_tensors[0])
        return self._op("all_gather_list", input_tensors, outs, opts, result=[outs],
                        **self._keep([outs], input_tensors))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> PrismWork:
        return self._op("all_gather", [input], [output], opts, **self._keep([output], [input]))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> PrismWork:
        return self._op("all_gather", list(inputs), list(outputs), opts, **self._keep(list(outputs), list(inputs)))

    def _keep(self, outputs: list, inputs: list[torch.Tensor]) -> dict:
        """On a folded group, an in-place all_gather (the input is this member's own chunk of the output,
        as the distributed optimizer's parameter gather does) sends its output as it stands: virtual
        members' chunks keep it (nccl_prune's *keep*)."""
        if self._rep is None or not inputs:
            return {}
        from nccl_prune import is_in_place_all_gather

        me = self.rank()
        if not all(is_in_place_all_gather(o, i, me) for o, i in zip(outputs, inputs, strict=True)):
            return {}
        current = [t for o in outputs for t in (o if isinstance(o, list) else [o])]
        return {"in_place": True, "current": current}

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> PrismWork:
        """``output_lists[r][j]`` gets member r's ``input_list[j]``. Run as gloo runs it: one coalesced
        all_gather (one trace record, as the coalescing manager's), each input gathered into a flat
        buffer, whose chunks are copied into the output lists once the op's results are written."""
        _check_gather_coalesced(output_lists, input_list, self.size())
        flats = [torch.empty(self.size() * x.numel(), dtype=x.dtype, device=x.device) for x in input_list]

        def unflatten() -> None:
            for j, (x, flat) in enumerate(zip(input_list, flats, strict=True)):
                for out, chunk in zip((o[j] for o in output_lists), flat.view(self.size(), *x.shape), strict=True):
                    out.copy_(chunk)
            if flats[0].is_cuda:  # complete before the Work is (as _write's copies of the results)
                torch.cuda.current_stream().synchronize()

        return self._op("all_gather", list(input_list), flats, opts, title="all_gather",
                        result=[t for o in output_lists for t in o], after=unflatten)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> PrismWork:
        root = opts.rootRank
        me = self.rank() == root
        extra = {}
        if self._rep is not None and self._rep[self._ranks[root]] == self._ranks[self.rank()] and not me:
            extra["current"] = list(tensors)  # the root is virtual and mirrors this rank: its data is ours
        return self._op("broadcast", tensors if me else [], [] if me else tensors, opts, root=root,
                        result=tensors, **extra)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any) -> PrismWork:
        _single(input_tensors, "gather")
        outs = list(output_tensors[0]) if self.rank() == opts.rootRank else []
        return self._op("gather", input_tensors, outs, opts, root=opts.rootRank, result=[outs])

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any) -> PrismWork:
        _single(output_tensors, "scatter")
        ins = list(input_tensors[0]) if self.rank() == opts.rootRank else []
        return self._op("scatter", ins, output_tensors, opts, root=opts.rootRank)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> PrismWork:
        return self._op("all_to_all_list", list(input_tensors), list(output_tensors), opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> PrismWork:
        n = self.size()
        in_splits = _split_bytes(input, input_split_sizes, n, "input")
        out_splits = _split_bytes(output, output_split_sizes, n, "output")
        return self._op("all_to_all", [input], [output], opts, in_splits=in_splits, out_splits=out_splits)

    # ---- point to point ------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> PrismWork:  # noqa: N803
        _single(tensors, "send")
        return self._op("send", tensors, [], peer=dstRank, tag=tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> PrismWork:  # noqa: N803
        _single(tensors, "recv")
        return self._op("recv", [], tensors, peer=srcRank, tag=tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> PrismWork:
        _single(tensors, "recv_anysource")
        return self._op("recv", [], tensors, peer=None, tag=tag)

    def barrier(self, opts: Any = None) -> PrismWork:
        if (self.requested_backend == "nccl" and self._barrier_tensor is None and torch.cuda.is_available()
                and torch.cuda.is_initialized()):
            # ProcessGroupNCCL keeps a one-float device tensor for its barriers for the group's life (one
            # 512-byte block): the target's ranks hold it, so ours do, and peak memory matches to the byte
            self._barrier_tensor = torch.zeros(1, device=torch.cuda.current_device())
        return self._op("barrier", [], [], opts)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()

    # ---- anything else torch may call ----------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        # AttributeError, so torch's hasattr() probes (e.g. for `new_group`) see "absent"
        raise UnsupportedOp(f"prism backend: ProcessGroup.{name} is not supported")


class UnsupportedOp(AttributeError, NotImplementedError):
    """An op torch may call on a process group that prism does not implement."""


class _AllWork(PrismWork):
    """The Work of a coalesced block: complete when every op in it is."""

    def __init__(self, client: RankClient, works: list[PrismWork]) -> None:
        result = [t for w in works for t in w._result]
        super().__init__(client, -1, result)
        self._works = works
        self._chained = False
        self._future._ops = [w._op for w in works]  # waiting on the future waits for the block's ops

    def _settle_all(self) -> None:
        error = next((w.exception() for w in self._works if w.exception() is not None), None)
        if not self._done.is_set():
            self._finish(error)

    def wait(self, timeout: Any = None) -> bool:
        self._client.wait([w._op for w in self._works])
        self._settle_all()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        if not self._done.is_set() and all(w.is_completed() for w in self._works):
            self._settle_all()
        return self._done.is_set()

    def get_future(self) -> Any:
        """Completes when the block's ops have (their futures chained; results written as they arrive)."""
        if not self._chained:
            self._chained = True
            me = weakref.ref(self)  # the futures' callbacks must not keep this Work (and its tensors) alive

            def on_all(fut: Any) -> None:
                work = me()
                if work is not None and not work._done.is_set():
                    work._settle_all()

            torch.futures.collect_all([w.get_future() for w in self._works]).then(on_all)
        return self._future


def _single(tensors: list[torch.Tensor], op: str) -> None:
    if len(tensors) != 1:
        raise ValueError(f"prism backend: {op} takes exactly one tensor per rank, got {len(tensors)}")


def _check_gather_coalesced(output_lists: Any, input_list: Any, size: int) -> None:
    """gloo's checks of allgather_coalesced: one output list per member, each like the inputs."""
    if not input_list:
        raise ValueError("prism backend: allgather_coalesced needs a non-empty input tensor list")
    if len(output_lists) != size:
        raise ValueError(f"prism backend: allgather_coalesced got {len(output_lists)} output lists for a group "
                         f"of {size}")
    for r, outs in enumerate(output_lists):
        if len(outs) != len(input_list):
            raise ValueError(f"prism backend: allgather_coalesced output list {r} holds {len(outs)} tensors, "
                             f"the input list {len(input_list)}")
        for j, (o, x) in enumerate(zip(outs, input_list, strict=True)):
            if o.shape != x.shape or o.dtype != x.dtype:
                raise ValueError(f"prism backend: allgather_coalesced output [{r}][{j}] is {o.dtype} "
                                 f"{list(o.shape)}, its input {x.dtype} {list(x.shape)}")


def _split_bytes(t: torch.Tensor, splits: Any, n: int, what: str) -> list[int]:
    """Bytes per peer of an all_to_all_single buffer (splits along dim 0; empty = equal).

    Callers pass lists, tuples, tensors or numpy arrays (megatron-core 0.19's MoE dispatcher does).
    """
    splits = [int(s) for s in (splits.tolist() if hasattr(splits, "tolist") else splits or [])]
    row = t.element_size()
    for d in t.shape[1:]:
        row *= d
    if not splits:
        if t.dim() == 0 or t.shape[0] % n:
            raise ValueError(f"prism backend: all_to_all_single {what} of shape {list(t.shape)} "
                             f"does not split evenly over {n} ranks")
        return [t.shape[0] // n * row] * n
    if len(splits) != n or sum(splits) != t.shape[0]:
        raise ValueError(f"prism backend: all_to_all_single {what} split sizes {list(splits)} do not "
                         f"match {n} ranks and dim 0 = {t.shape[0]}")
    return [s * row for s in splits]


_installed: RankClient | None = None
_stands_for_last = False  # a folded job whose last rank is virtual: this rank is its representative


def stands_for_last_rank() -> bool:
    """Whether this process prints what the job's last rank prints (Megatron's iteration lines): in a
    folded job whose last rank is virtual, the live rank that mirrors it does."""
    return _stands_for_last


def logs_as_last_rank() -> bool:
    """Whether this process logs as the job's last rank (Megatron's iteration lines, and the live
    prediction they carry): it is the last rank, or stands for it (``stands_for_last_rank``)."""
    import torch.distributed as dist

    return _stands_for_last or (dist.is_initialized() and dist.get_rank() == dist.get_world_size() - 1)


def idle(seconds: float) -> None:
    """Let ``seconds`` pass without holding a compute slot (RankClient.idle); a plain sleep outside prism.

    The one runtime call a program that replays recorded compute needs (calibration's virtual ranks).
    """
    if _installed is None:
        import time

        time.sleep(max(seconds, 0.0))
    else:
        _installed.idle(seconds)


def install(client: RankClient, rep: list[int] | None = None,
            untranslate: Callable[[int, int], int] | None = None, class_rep: list[int] | None = None) -> None:
    """Make every process group of this process a prism group, whatever backend the program asks for.

    torch creates every group (init_process_group, new_group, new_subgroups) in
    `_new_process_group_helper`; we route that one seam to `prism` and then record the backend
    the program asked for, so `dist.get_backend()` answers what it would on the target job and
    code that branches on it takes the same path. ``rep``: a folded job's representative of every rank;
    ``untranslate``: its translation by coordinates (``folding.untranslation``), for the groups this rank
    answers alone (runtime.local_fold); ``class_rep``: a serial capture's class representative of every rank
    (its small reductions over other classes are the coordinator's: nccl_prune.RECORDED_REDUCTION_RULE).
    """
    global _installed, _stands_for_last
    from torch.distributed import distributed_c10d as c10d

    _stands_for_last = rep is not None and rep[-1] != len(rep) - 1 and rep[-1] == client.rank

    if _installed is not None:
        raise RuntimeError("prism backend is already installed in this process")
    _installed = client
    requested: list[str] = []

    def creator(opts: Any, backend_options: Any = None) -> PrismProcessGroup:
        ranks = list(opts.global_ranks_in_group)
        world = not ranks  # torch passes no ranks for the default group only (init_process_group)
        return PrismProcessGroup(client, opts.group_rank, opts.group_size, ranks or list(range(opts.group_size)),
                                 str(opts.group_id), requested[-1] if requested else BACKEND_NAME, opts.timeout, world,
                                 rep=rep, untranslate=untranslate, class_rep=class_rep)

    dist.Backend.register_backend(BACKEND_NAME, creator, extended_api=True, devices=["cpu", "cuda"])
    original = c10d._new_process_group_helper

    def helper(group_size, group_rank, global_ranks_in_group, backend, store, group_name, *args, **kwargs):
        asked = str(backend) if backend not in (None, dist.Backend.UNDEFINED) else "undefined"
        kwargs.pop("device_id", None)  # binding a device would ask the backend to split communicators
        if len(args) >= 4:  # backend_options, timeout, pg_tag, device_id, ...: drop device_id positionally
            args = args[:3] + (None,) + args[4:]
        requested.append(asked)
        try:
            pg, prefix_store = original(group_size, group_rank, global_ranks_in_group, BACKEND_NAME, store,
                                        group_name, *args, **kwargs)
        finally:
            requested.pop()
        if isinstance(pg, PrismProcessGroup):
            c10d._world.pg_map[pg] = (asked if asked != "undefined" else BACKEND_NAME, prefix_store)
        return pg, prefix_store

    helper.__wrapped__ = original  # type: ignore[attr-defined]
    c10d._new_process_group_helper = helper
    # The env var makes init_process_group wait on a store barrier while holding a slot: with
    # fewer slots than ranks that never completes. Our first collective synchronises anyway.
    import os

    os.environ["TORCH_DIST_INIT_BARRIER"] = "0"
