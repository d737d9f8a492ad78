"""Seam: ``megatron.core.transformer.moe.experts.SequentialMLP`` - the local experts as grouped GEMMs.

A target job that asks ``--moe-grouped-gemm`` trains its local experts with Transformer Engine's
grouped GEMM (``TEGroupedMLP``); without TE, megatron-core trains them only with ``SequentialMLP``, a
Python loop over the local experts (one fc1, activation and fc2 per expert), whose launch cost, not its
GEMMs, sets the time a host-bound emulating GPU measures. With ``--prism-experts grouped`` the same
module computes fc1 -> activation -> fc2 of all its local experts with one ``torch.nn.functional.
grouped_mm`` per linear (two per linear in the backward) over the parameters ``SequentialMLP`` holds:
each expert's own ``linear_fc1.weight`` / ``linear_fc2.weight``, so parameter count and names,
optimizer state, DDP buffers and checkpoints are Megatron's.

A grouped GEMM reads the experts' weights as one [E, out, in] tensor. That tensor is a strided *view*,
never a copy: it exists only where a linear's E weights lie in one storage at a uniform stride.
- At construction the seam places each linear's E expert weights in one [E, out, in] allocation (the
  same values and bytes; for a moment at construction, the linear's expert weights twice) and makes
  each parameter a view of its slice. Without the distributed optimizer DDP leaves parameters where
  they are, so that layout holds.
- With the distributed optimizer DDP moves every parameter into its contiguous buffer in reverse order
  (``params[::-1]``, each start padded to 64 values, each bucket's end to lcm(DP, 128): 0.16's
  ``_ParamAndGradBuffer``, 0.19's ``DistributedOptimizer._compute_per_buffer_param_layout``), which would
  leave a linear's E weights in descending expert order, and the grouped GEMM would need the tokens
  regrouped to match: a copy of the experts' input and of their output, and of their gradients in the
  backward, that Transformer Engine's grouped GEMM never makes (a class near the cap would run out of memory
  at an allocation the target does not have). So the seam hands that layout each linear's
  expert weights in its own positions of the list in reverse expert order (:func:`ascending_experts`): they
  land in ascending order, and since a linear's expert weights have one size, every offset, padding and
  bucket boundary of the layout is Megatron's; only which expert occupies which of its linear's slots
  differs. A layout that still leaves them in another order (another layout function) is run over the
  experts in buffer order with the tokens regrouped, as said; a padded bucket end between two of them is
  refused (below).
- Any other layout (a padded bucket end between two experts, weights in separate storages) is refused
  at the call that meets it, naming the linear and why. Nothing falls back silently.

The loop calls each expert and its linears as modules; the grouped GEMM does not, so the seam runs
their forward pre-hooks itself (those of each expert and its ``linear_fc1`` before the grouped fc1,
``linear_fc2``'s before fc2), as megatron-core 0.19's fused ``TEGroupedMLP`` does for its linears: DDP
with ``--overlap-param-gather`` finishes each parameter's all-gather there, and without them the
experts' all-gathers are never waited on (the next iteration's dispatch asserts) or never issued. A
pre-hook that returns a value (it would change an input the grouped GEMM never hands the module) and
a forward or backward hook after the call (the grouped GEMM cannot honour it) are refused by name.

Weight gradients leave the backward as one gradient per expert weight (views of one grouped result),
so autograd's accumulation and Megatron's DDP hooks (``main_grad``, ``grad_added_to_main_grad``) see
what ``SequentialMLP`` gives them; the memory difference is that a linear's E weight gradients exist
at once for a moment where the loop makes one expert's at a time. An expert without tokens gets a zero
gradient written explicitly (not every grouped kernel writes empty groups), a rank without any token
skips the grouped calls. The activation (with the router's per-token probabilities) is Megatron's own
``MLP.forward`` code run with identity linears over all local tokens at once (elementwise: the same
values). Refused at the first call, by name: expert biases, FP8/FP4, ``moe_apply_probs_on_input``,
gradient-accumulation fusion, delayed weight-gradient compute, CPU offloading, expert linears that
communicate inside themselves, experts that are not Megatron's ``MLP``, and on CUDA any dtype but
bfloat16 (torch's grouped_mm takes only that there). Checked against the supported releases
(``megatron.versions``).
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table

#: ``--prism-experts`` reaches the ranks as this variable ('grouped' installs the seam).
ENV_VAR = "PRISM_EXPERTS"

#: set on each expert weight the seam homes: (its linear's key, its expert's index), read by the layout seam
SLOT_ATTR = "_prism_grouped_expert_slot"

__all__ = ["CHECKED", "ENV_VAR", "SLOT_ATTR", "UnsupportedExperts", "ascending_experts", "install", "stacked_view"]


class UnsupportedExperts(RuntimeError):
    """Local experts ``--prism-experts grouped`` cannot compute as Megatron's SequentialMLP would."""


def _refuse(why: str) -> UnsupportedExperts:
    return UnsupportedExperts(f"prism: --prism-experts grouped does not take {why}; run with "
                              "--prism-experts megatron")


def stacked_view(weights: list[Any], what: str) -> tuple[Any, list[int]]:
    """The E weights as one [E, out, in] view of their common storage, in storage order, and that
    order (``order[g]`` is the expert whose weight is group ``g``); :class:`UnsupportedExperts` naming
    ``what`` and why where no uniform stride exists (a stacked copy would not be Megatron's memory)."""
    first = weights[0]
    shape, dtype, device = tuple(first.shape), first.dtype, first.device
    for w in weights:
        if tuple(w.shape) != shape or w.dtype != dtype or w.device != device:
            raise _refuse(f"{what}: experts' weights of different shapes, dtypes or devices")
        if not w.is_contiguous():
            raise _refuse(f"{what}: a non-contiguous expert weight (strides {tuple(w.stride())})")
        if w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            raise _refuse(f"{what}: experts' weights in different storages (no uniform stride to view "
                          "them as one [experts, out, in] tensor; a stacked copy would change memory)")
    order = sorted(range(len(weights)), key=lambda e: weights[e].storage_offset())
    offsets = [weights[e].storage_offset() for e in order]
    steps = {b - a for a, b in zip(offsets[:-1], offsets[1:], strict=True)}
    numel = first.numel()
    if len(steps) > 1:
        raise _refuse(f"{what}: experts' weights at uneven distances in their buffer ({sorted(steps)} "
                      "values apart: DDP's bucket padding between them)")
    step = steps.pop() if steps else numel
    if step < numel or (step * first.element_size()) % 16:
        raise _refuse(f"{what}: experts' weights {step} values apart (overlapping, or not 16-byte aligned "
                      "as grouped_mm needs)")
    base = weights[order[0]].detach()
    if base.data_ptr() % 16:
        raise _refuse(f"{what}: the first expert's weight not 16-byte aligned (grouped_mm needs it)")
    view = base.as_strided((len(weights), *shape), (step, *first.stride()), base.storage_offset())
    return view, order


class _GroupedLinear:
    """``y[g] = x[g] @ W[g]^T`` over token groups, as an autograd function of each expert's weight."""

    fn: Any = None  # the torch.autograd.Function, built at install (torch is imported there)

    @staticmethod
    def build() -> Any:
        import torch
        from torch.nn.functional import grouped_mm

        class GroupedLinear(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: Any, offs: Any, counts: list[int], what: str, *weights: Any) -> Any:
                w3, order = stacked_view(list(weights), what)
                ctx.save_for_backward(x, offs, *weights)
                ctx.what, ctx.order, ctx.counts = what, order, counts
                if x.size(0) == 0:  # no token for any local expert: grouped_mm takes no empty operand
                    return x.new_empty((0, w3.size(1)))
                return grouped_mm(x, w3.transpose(1, 2), offs=offs)

            @staticmethod
            def backward(ctx: Any, dy: Any) -> Any:
                x, offs, *weights = ctx.saved_tensors
                w3, order = stacked_view(weights, ctx.what)
                if order != ctx.order:
                    raise _refuse(f"{ctx.what}: experts' weights moved between forward and backward")
                dx = dw = None
                if x.size(0) == 0:
                    dx = x.new_zeros(x.shape) if ctx.needs_input_grad[0] else None
                    dw = w3.new_zeros(w3.shape)
                else:
                    dy = dy.contiguous()
                    dx = grouped_mm(dy, w3, offs=offs) if ctx.needs_input_grad[0] else None
                    dw = grouped_mm(dy.t(), x, offs=offs)  # [E, out, in], group g = expert order[g]
                    for g, count in enumerate(ctx.counts):
                        if count == 0:  # an expert without tokens gets zeros (not every kernel writes them)
                            dw[g].zero_()
                grads: list[Any] = [None] * len(weights)
                for g, e in enumerate(order):
                    grads[e] = dw[g]
                return (dx, None, None, None, *grads)

        return GroupedLinear


class _Pass:
    """Stands for a linear inside ``MLP.forward`` when only its activation code is wanted."""

    module: Any = None

    @classmethod
    def get(cls) -> Any:
        if cls.module is None:
            import torch

            class Pass(torch.nn.Module):  # megatron-core 0.19's apply_module() asks for a Module
                def forward(self, x: Any) -> tuple[Any, None]:
                    return x, None

            cls.module = Pass()
        return cls.module


class _ActivationOnly:
    """What ``MLP.forward`` reads of its module, with identity linears: runs only Megatron's activation."""

    __slots__ = ("config", "activation_func", "linear_fc1", "linear_fc2")

    def __init__(self, expert: Any) -> None:
        self.config = expert.config
        self.activation_func = expert.activation_func
        self.linear_fc1 = self.linear_fc2 = _Pass.get()


def _refusal(module: Any) -> str | None:
    config = module.config
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        return "FP8/FP4 experts"
    if getattr(config, "moe_apply_probs_on_input", False):
        return "moe_apply_probs_on_input"
    if getattr(config, "delay_wgrad_compute", False):
        return "delay_wgrad_compute (deferred expert weight gradients)"
    if getattr(config, "cpu_offloading", False):
        return "CPU offloading"
    tp = module.tp_group.size() if module.tp_group is not None else 1
    for e, expert in enumerate(module.local_experts):
        for name in ("linear_fc1", "linear_fc2"):
            linear = getattr(expert, name)
            where = f"local_experts.{e}.{name}"
            if getattr(linear, "bias", None) is not None:
                return f"expert biases ({where}.bias)"
            if getattr(linear, "gradient_accumulation_fusion", False):
                return f"gradient-accumulation fusion ({where})"
            if getattr(linear, "gather_output", False) or not getattr(linear, "input_is_parallel", True):
                return f"an expert linear that gathers or scatters across tensor-parallel ranks ({where})"
            if not getattr(linear, "explicit_expert_comm", False) and tp > 1:
                return f"an expert linear that communicates inside itself ({where}, expert TP {tp})"
            if getattr(linear, "weight", None) is None:
                return f"an expert linear without its own weight ({where})"
    return None


def _run_pre_hooks(modules: list[Any], where: str) -> None:
    """The forward pre-hooks that calling each of ``modules`` would run (torch's global ones, then the
    module's), in that order, given no input; :class:`UnsupportedExperts` where a hook returns a value."""
    from torch.nn.modules import module as torch_module

    for m in modules:
        calls = [(hook, False) for hook in torch_module._global_forward_pre_hooks.values()]
        calls += [(hook, key in m._forward_pre_hooks_with_kwargs) for key, hook in m._forward_pre_hooks.items()]
        for hook, with_kwargs in calls:
            if (hook(m, (), {}) if with_kwargs else hook(m, ())) is not None:
                raise _refuse(f"a forward pre-hook that changes the input of {where} "
                              f"({type(m).__name__}: the grouped GEMM never hands it one)")


def _hook_refusal(module: Any) -> str | None:
    """Hooks the loop would run after or around an expert's call, which the grouped GEMM cannot."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_backward_hooks:
        return "torch's global module forward or backward hooks"
    for e, expert in enumerate(module.local_experts):
        for name, m in expert.named_modules():
            if m._forward_hooks or m._backward_hooks or m._backward_pre_hooks:
                return f"a forward or backward hook on local_experts.{e}{'.' + name if name else ''}"
    return None


def _regroup(t: Any, counts: list[int], order: list[int]) -> Any:
    """``t``'s rows, grouped by expert in ``counts`` order, regrouped into ``order`` (autograd-tracked)."""
    import torch

    parts = torch.split(t, counts)
    return torch.cat([parts[e] for e in order])


def _home_weights(module: Any) -> None:
    """Each linear's expert weights into one [E, out, in] allocation, each parameter a view of its slice."""
    import torch

    for name in ("linear_fc1", "linear_fc2"):
        params = [getattr(expert, name).weight for expert in module.local_experts]
        if any(p is None for p in params) or len({(tuple(p.shape), p.dtype, p.device) for p in params}) != 1:
            continue  # refused at the first call, by name
        home = torch.empty((len(params), *params[0].shape), dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for e, p in enumerate(params):
                home[e].copy_(p)
                p.data = home[e]
                setattr(p, SLOT_ATTR, (id(module), name, e))


def ascending_experts(params: list[Any], param: Any = None) -> list[Any]:
    """``params`` with each homed linear's expert weights (``SLOT_ATTR``) in the positions they hold, in
    descending expert order: a layout that walks the list backwards lays them out ascending. Every other
    item keeps its position; the list itself where none is homed. ``param``: the parameter of an item
    (items may be (parameter, name) pairs)."""
    param = param or (lambda item: item)
    positions: dict[tuple, list[int]] = {}
    for i, item in enumerate(params):
        slot = getattr(param(item), SLOT_ATTR, None)
        if slot is not None:
            positions.setdefault(slot[:2], []).append(i)
    if not positions:
        return params
    out = list(params)
    for where in positions.values():
        members = sorted((params[i] for i in where), key=lambda item: getattr(param(item), SLOT_ATTR)[2], reverse=True)
        for i, item in zip(where, members, strict=True):
            out[i] = item
    return out


def _install_layout() -> None:
    """DDP's buffers under the distributed optimizer given ``ascending_experts`` of their parameters: the layout
    (0.19 computes it before the buffer) and the buffer, which walks its list to assign buckets in layout order."""
    import inspect

    dopt = seam("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", CHECKED)
    if "_compute_per_buffer_param_layout" in vars(dopt):
        compute = seam(dopt, "_compute_per_buffer_param_layout", CHECKED, ("params", "param_indices"))

        @functools.wraps(compute)
        def layout(params: list[Any], *args: Any, **kwargs: Any) -> Any:
            return compute(ascending_experts(list(params)), *args, **kwargs)  # param_indices: read by parameter

        dopt._compute_per_buffer_param_layout = staticmethod(layout)
    buffer = seam("megatron.core.distributed.param_and_grad_buffer", "_ParamAndGradBuffer", CHECKED)
    init = seam(buffer, "__init__", CHECKED, ("param_indices",))
    signature = inspect.signature(init)
    listed = next((n for n in ("params_with_names", "params") if n in signature.parameters), None)  # 0.19, 0.16
    if listed is None:
        seam(buffer, "__init__", CHECKED, ("params_with_names",))  # raises SeamMoved, naming the list lost

    @functools.wraps(init)
    def __init__(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        items = list(bound.arguments[listed])
        param = (lambda item: item[0]) if listed == "params_with_names" else None
        order = ascending_experts(items, param)
        if order is not items:  # param_indices runs beside the list: the same permutation
            index = dict(zip(map(id, items), bound.arguments["param_indices"], strict=True))
            bound.arguments["param_indices"] = [index[id(item)] for item in order]
            bound.arguments[listed] = order
        init(*bound.args, **bound.kwargs)

    buffer.__init__ = __init__


@once
def install() -> None:
    import torch
    from megatron.core.transformer.moe import experts

    cls = seam(experts, "SequentialMLP", CHECKED)
    original_init = seam(cls, "__init__", CHECKED, ("num_local_experts", "config", "submodules"))
    original_forward = seam(cls, "forward", CHECKED, ("permuted_local_hidden_states", "tokens_per_expert",
                                                      "permuted_probs"))
    mlp = seam("megatron.core.transformer.mlp", "MLP", CHECKED)
    activation = seam(mlp, "forward", CHECKED, ("hidden_states", "per_token_scale"))
    linear = _GroupedLinear.build()
    _install_layout()

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if self.num_local_experts > 1:
            _home_weights(self)

    @functools.wraps(original_forward)
    def forward(self: Any, permuted_local_hidden_states: Any, tokens_per_expert: Any, permuted_probs: Any) -> Any:
        if self.num_local_experts == 1:  # one GEMM per linear already
            return original_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        why = _refusal(self) or _hook_refusal(self)
        if why is None and type(self.local_experts[0]).forward is not activation:
            why = f"experts of class {type(self.local_experts[0]).__name__} (only Megatron's MLP)"
        x = permuted_local_hidden_states
        if why is None and x.is_cuda and x.dtype != torch.bfloat16:
            why = f"{x.dtype} experts on CUDA (torch's grouped_mm takes bfloat16 there)"
        if why is not None:
            raise _refuse(why)
        experts_ = list(self.local_experts)
        fc1 = [m.linear_fc1.weight for m in experts_]
        fc2 = [m.linear_fc2.weight for m in experts_]
        _, order = stacked_view(fc1, "linear_fc1")
        _, order2 = stacked_view(fc2, "linear_fc2")
        if order != order2:
            raise _refuse("fc1 and fc2 expert weights in different orders in their buffer")
        counts = tokens_per_expert.tolist()  # SequentialMLP splits by the same host list
        probs = permuted_probs
        identity = order == sorted(order)
        if not identity:  # the weights lie in another expert order (DDP's reversed buffer): regroup tokens
            x, probs = _regroup(x, counts, order), _regroup(probs, counts, order)
        grouped = [counts[e] for e in order]
        offs = torch.tensor(grouped, dtype=torch.int64).cumsum(0).to(device=x.device, dtype=torch.int32)
        _run_pre_hooks([m for expert in experts_ for m in (expert, *expert.linear_fc1.modules())],
                       "an expert or its linear_fc1")
        h = linear.apply(x, offs, grouped, "linear_fc1", *fc1)
        h, _ = activation(_ActivationOnly(experts_[0]), h, probs)
        _run_pre_hooks([m for expert in experts_ for m in expert.linear_fc2.modules()], "an expert's linear_fc2")
        y = linear.apply(h, offs, grouped, "linear_fc2", *fc2)
        if not identity:
            y = _regroup(y, grouped, sorted(range(len(order)), key=order.__getitem__))
        return y, None

    cls.__init__ = __init__
    cls.forward = forward
