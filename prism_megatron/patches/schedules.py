"""Seam: ``megatron.core.pipeline_parallel.schedules.forward_step`` / ``backward_step`` - scheduling units.

Every schedule in ``schedules.py`` (no pipelining, 1F1B, interleaved 1F1B) runs a microbatch's
forward and backward through these two module-level functions, looked up at call time, so
wrapping them sees every unit without touching the schedules. Each call becomes a span
``forward`` / ``backward`` with attributes ``iteration`` (set by ``patches.training_loop``),
``microbatch`` and ``chunk`` (the virtual-pipeline model chunk, 0 without VPP); forward units of
an evaluation also carry ``eval=True``.

``forward_step`` is told the microbatch (``current_microbatch``) and chunk (``vp_stage``);
``backward_step`` is not, so the forward remembers them under its output tensor, which the
schedule hands back to ``backward_step`` (kept alive until then).

The combined-1F1B schedules (``combined_1f1b.py``, used with ``--overlap-moe-expert-parallel-comm``)
run a forward and another microbatch's backward as one ``combined_forward_backward_step`` (looked up
in that module at call time); each call becomes one unit: ``forward`` or ``backward`` when it runs
only one of them (the first and last steps), else ``forward_backward`` with the forward's
``microbatch``/``chunk`` and the backward's ``backward_microbatch``/``backward_chunk``. A microbatch
thus appears in one forward unit (or forward_backward) and one backward unit (or forward_backward).
Checked against megatron-core 0.16.1 and 0.19.2: with 0.19.2 on CPU, an EP2 MoE job with
``--overlap-moe-expert-parallel-comm`` entered Megatron's combined schedule through this hook, then
stopped inside Megatron where it frees an input's storage (a CPU storage that cannot be resized;
on a GPU that path is the normal one, not run there yet).
"""

from __future__ import annotations

import functools
from typing import Any

from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import once, seam
from prism_megatron.trace.markers import span

CHECKED = checked_versions()  # prism_megatron.megatron.versions: the supported table
_MODULE = "megatron.core.pipeline_parallel.schedules"
_COMBINED = "megatron.core.pipeline_parallel.combined_1f1b"
_COMBINED_PARAMS = ("f_model", "b_model", "b_output_tensor", "f_model_chunk_id", "current_microbatch")
_SCHEDULES = ("forward_backward_no_pipelining", "forward_backward_pipelining_without_interleaving",
              "forward_backward_pipelining_with_interleaving")


class _State:
    """Per-process: the iteration in progress and the forward units awaiting their backward."""

    def __init__(self) -> None:
        self.iteration = 0
        self.pending: dict[int, tuple[int | None, int]] = {}  # id(output tensor) -> (microbatch, chunk)
        self.evaluating = False  # set by patches.training_loop around Megatron's evaluate()

    def begin_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.pending.clear()


STATE = _State()


def _arg(args: tuple, kwargs: dict, name: str, index: int) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _key(output_tensor: Any) -> int:
    if isinstance(output_tensor, (list, tuple)):
        output_tensor = output_tensor[0] if output_tensor else None
    return id(output_tensor)


@once
def install() -> None:
    import importlib
    import inspect

    sched = importlib.import_module(_MODULE)
    for name in _SCHEDULES:
        seam(sched, name, CHECKED)
    original_forward = seam(sched, "forward_step", CHECKED, ("current_microbatch", "vp_stage", "input_tensor"))
    params = list(inspect.signature(original_forward).parameters)
    at_microbatch, at_chunk = params.index("current_microbatch"), params.index("vp_stage")  # positional slots
    original_backward = seam(sched, "backward_step", CHECKED, ("input_tensor", "output_tensor", "output_tensor_grad"))

    @functools.wraps(original_forward)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        microbatch = _arg(args, kwargs, "current_microbatch", at_microbatch)
        chunk = _arg(args, kwargs, "vp_stage", at_chunk) or 0
        attrs = {"eval": True} if STATE.evaluating else {}
        with span("forward", iteration=STATE.iteration, microbatch=microbatch, chunk=chunk, **attrs):
            result = original_forward(*args, **kwargs)
        if not STATE.evaluating:  # forward-only units get no backward
            STATE.pending[_key(result[0])] = (microbatch, chunk)
        return result

    @functools.wraps(original_backward)
    def backward_step(input_tensor: Any, output_tensor: Any, *args: Any, **kwargs: Any) -> Any:
        microbatch, chunk = STATE.pending.pop(_key(output_tensor), (None, None))
        with span("backward", iteration=STATE.iteration, microbatch=microbatch, chunk=chunk):
            return original_backward(input_tensor, output_tensor, *args, **kwargs)

    sched.forward_step = forward_step
    sched.backward_step = backward_step
    try:
        combined = importlib.import_module(_COMBINED)
    except ImportError:  # a version without the combined schedules: nothing to hook
        return
    if hasattr(combined, "combined_forward_backward_step"):
        original = seam(combined, "combined_forward_backward_step", CHECKED, _COMBINED_PARAMS)
        combined.combined_forward_backward_step = wrap_combined(original)


def wrap_combined(original: Any) -> Any:
    """``combined_forward_backward_step`` emitting one scheduling unit per call (see the module doc)."""
    import inspect

    params = list(inspect.signature(getattr(original, "__wrapped__", original)).parameters)
    at = {name: params.index(name) for name in _COMBINED_PARAMS}

    @functools.wraps(original)
    def combined_forward_backward_step(*args: Any, **kwargs: Any) -> Any:
        def get(name: str) -> Any:
            return _arg(args, kwargs, name, at[name])

        forward, backward = get("f_model") is not None, get("b_model") is not None
        microbatch, chunk = get("current_microbatch"), get("f_model_chunk_id") or 0
        b_microbatch, b_chunk = STATE.pending.pop(_key(get("b_output_tensor")), (None, None)) if backward \
            else (None, None)
        if forward and backward:
            name, attrs = "forward_backward", {"microbatch": microbatch, "chunk": chunk,
                                               "backward_microbatch": b_microbatch, "backward_chunk": b_chunk}
        elif forward:
            name, attrs = "forward", {"microbatch": microbatch, "chunk": chunk}
        else:
            name, attrs = "backward", {"microbatch": b_microbatch, "chunk": b_chunk}
        with span(name, iteration=STATE.iteration, **attrs):
            result = original(*args, **kwargs)
        if forward and not STATE.evaluating:
            STATE.pending[_key(result[0])] = (microbatch, chunk)
        return result

    return combined_forward_backward_step
