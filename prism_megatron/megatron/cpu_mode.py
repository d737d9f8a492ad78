"""CPU execution mode: run unmodified megatron-core code on a machine without a GPU.

megatron-core assumes CUDA everywhere (``device=torch.cuda.current_device()``, ``.cuda()``,
streams, events, a CUDA RNG tracker). This module redirects those requests to the host so CI
can exercise the real Megatron code paths. It is a redirection layer, not a fork: no Megatron
file is edited; everything is undone by :func:`disable_cpu_mode`.

What it does while active:

* A ``TorchFunctionMode`` rewrites ``cuda`` device requests to ``cpu``: ``device=`` keyword
  arguments of any torch function (``'cuda'``, ``'cuda:1'``, ``torch.device('cuda', 0)`` and
  bare integers, which torch reads as CUDA indices), ``Tensor.to(...)``, ``Tensor.cuda()``
  (returns the tensor), ``pin_memory`` (needs CUDA: dropped). ``Tensor.record_stream`` becomes a
  no-op on the class (torch rejects a stand-in stream before a mode could see the call).
* ``Tensor.type()`` reports ``'torch.cuda.FloatTensor'``-style names, because Megatron's
  optimizer and grad clipping assert on them; ``Tensor.type('torch.cuda.X')`` converts on CPU.
  ``Tensor.is_cuda`` and ``Tensor.device`` stay truthful: Megatron uses them to decide whether
  a device-to-host copy (with ``record_stream``) is needed, and on CPU none is.
* The mode stays active inside autograd's backward: torch pops a mode while it handles
  ``Tensor.backward``/``torch.autograd.backward``/``grad``, so the engine entry point
  (``torch.autograd._engine_run_backward``) is wrapped to push it back.
* ``torch.cuda`` and ``torch.accelerator`` calls get the stand-ins of :mod:`.cpu_cuda_stubs`
  (one virtual device 0; the "CUDA" RNG is ``torch.default_generator``). Both say no
  accelerator is available, on a CPU and on a CUDA build of torch alike, so torch's optimizers
  and DataLoader take their host paths; a rank never initialises CUDA (in a forked rank that is
  "Cannot re-initialize CUDA in forked subprocess").
* ``torch.compile`` runs eagerly (``torch._dynamo.config.disable``): dynamo would trace through the
  stand-ins (which alias torch.cuda's functions: its device registry refuses them) and Inductor build
  C++ kernels in every rank, seconds each, after probing for a real GPU. Megatron's ``jit_fuser``
  functions and a script's own compiled ones run op by op, in prism's ranks and in a real process
  under this mode alike.
* Megatron seams (patched only with ``patch_megatron=True``; checked against the supported
  releases of :mod:`.versions`, failing loudly when one moved):
  - ``tensor_parallel.random``: its module-level ``_lazy_call`` (bound at import) queues
    callbacks forever on a CPU build, so ``_set_cuda_rng_state`` and thus the RNG tracker's
    ``add``/``fork`` silently did nothing; it now runs callbacks at once. Its "CPU RNG
    state changed within GPU RNG context" warning is filtered: here they are one generator.
  - ``moe_utils.maybe_move_tensor_to_cpu`` (and its copy in ``token_dispatcher``) only
    converts split sizes to numpy for CUDA tensors; on CPU it converts every tensor, so the
    alltoall dispatcher gets host split sizes as on a GPU.
  - ``torch_norm.WrappedTorchNorm`` refuses ``sequence_parallel``; it builds the torch norm
    with its parameters marked for the TP gradient all-reduce (:mod:`prism_megatron.patches.norm`,
    the same seam an emulated rank on a GPU gets; here undone on disable).
  - triton: megatron-core 0.19 imports triton at module level (MoE paged stash). Only if
    importing a seam fails because triton is missing is a stub installed (importable,
    launching a kernel raises); it is removed from ``sys.modules`` on disable.

Limits: the torch-function mode is thread-local (threads other than the one that enabled the
mode, except autograd's, see no redirection); legacy constructors such as
``torch.cuda.FloatTensor(n)``, CUDA graphs, memory pools and NCCL are not emulated.

Safety: :func:`enable_cpu_mode` refuses (``RuntimeError``, nothing patched) whenever the real
``torch.cuda`` - captured when this module is imported, before any patch - NVML, or
``/proc/driver/nvidia/gpus`` sees a GPU, whatever ``CUDA_VISIBLE_DEVICES`` says (a GPU hidden
from this process still makes it a GPU machine; checked on a GPU machine with and without
``CUDA_VISIBLE_DEVICES=``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from prism_megatron.megatron import cpu_cuda_stubs as stubs
from prism_megatron.megatron.versions import checked_versions
from prism_megatron.patches import norm

__all__ = ["cpu_mode", "cpu_mode_active", "disable_cpu_mode", "enable_cpu_mode"]


# The real torch.cuda, captured before anything here can patch it.
_REAL_IS_AVAILABLE = torch.cuda.is_available
_REAL_DEVICE_COUNT = torch.cuda.device_count
_REAL_IS_INITIALIZED = torch.cuda.is_initialized
_REAL_ENGINE_RUN_BACKWARD = torch.autograd.graph._engine_run_backward

_CPU = torch.device("cpu")
_RNG_WARNING = "CPU RNG state changed within GPU RNG context"


def _gpu_present() -> bool:
    """True if this process can see, or sits on a machine with, an NVIDIA GPU."""
    try:
        if _REAL_IS_AVAILABLE() or _REAL_DEVICE_COUNT() > 0 or _REAL_IS_INITIALIZED():
            return True
    except Exception:  # a broken driver still means a GPU machine
        return True
    try:  # NVML counts devices regardless of CUDA_VISIBLE_DEVICES
        if torch.cuda._raw_device_count_nvml() > 0:
            return True
    except Exception:
        pass  # no libnvidia-ml: no NVIDIA driver
    gpus = "/proc/driver/nvidia/gpus"
    return os.path.isdir(gpus) and bool(os.listdir(gpus))


# --------------------------------------------------------------------------- patch bookkeeping
_MISSING = object()


class _Patches:
    """Records every replaced attribute / dict entry / entered context so disable can put the originals back."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []  # run last first

    def setattr(self, target: Any, name: str, value: Any) -> None:
        old = target.__dict__.get(name, _MISSING)
        self._undo.append(lambda: delattr(target, name) if old is _MISSING else setattr(target, name, old))
        setattr(target, name, value)

    def setitem(self, target: dict, key: str, value: Any) -> None:
        old = target.get(key, _MISSING)
        self._undo.append(lambda: target.pop(key, None) if old is _MISSING else target.__setitem__(key, old))
        target[key] = value

    def enter(self, context: contextlib.AbstractContextManager) -> None:
        context.__enter__()
        self._undo.append(lambda: context.__exit__(None, None, None))

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


# --------------------------------------------------------------------------- device redirection
def _is_cuda_device(device: Any) -> bool:
    kind = type(device)
    if kind is torch.device:
        return device.type == "cuda"
    if kind is str:
        return device == "cuda" or device.startswith("cuda:")
    return kind is int  # torch reads a bare int as a CUDA device index


def _to(func: Any, args: tuple, kwargs: dict) -> Any:
    if len(args) > 1 and _is_cuda_device(args[1]):
        args = (args[0], _CPU, *args[2:])
    return func(*args, **kwargs)


def _cuda(func: Any, args: tuple, kwargs: dict) -> Any:
    memory_format = kwargs.get("memory_format", torch.preserve_format)
    if memory_format is torch.preserve_format:
        return args[0]
    return args[0].contiguous(memory_format=memory_format)


def _self(func: Any, args: tuple, kwargs: dict) -> Any:
    return args[0]


def _type(func: Any, args: tuple, kwargs: dict) -> Any:
    tensor = args[0]
    dtype = args[1] if len(args) > 1 else kwargs.pop("dtype", None)
    if dtype is None:  # a query: report the CUDA name Megatron asserts on
        name = func(tensor, **kwargs)
        if tensor.device.type == "cpu" and name.startswith("torch."):
            return "torch.cuda." + name[len("torch.") :]
        return name
    if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
        dtype = "torch." + dtype[len("torch.cuda.") :]
    elif isinstance(dtype, type) and dtype.__module__ == "torch.cuda":
        dtype = getattr(torch, dtype.__name__)
    return func(tensor, dtype, *args[2:], **kwargs)


_SPECIAL = {
    torch.Tensor.to: _to,
    torch.Tensor.cuda: _cuda,
    torch.Tensor.pin_memory: _self,
    torch.Tensor.type: _type,
}


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests of every torch call made on this thread to CPU ones."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None):
        if kwargs:
            if _is_cuda_device(kwargs.get("device")) or kwargs.get("pin_memory"):
                kwargs = dict(kwargs)
                if _is_cuda_device(kwargs.get("device")):
                    kwargs["device"] = _CPU
                if kwargs.get("pin_memory"):
                    kwargs["pin_memory"] = False
        else:
            kwargs = {}
        special = _SPECIAL.get(func)
        if special is not None:
            return special(func, args, kwargs)
        return func(*args, **kwargs)


def _engine_run_backward_in_mode(*args: Any, **kwargs: Any) -> Any:
    """Autograd's engine entry, with the mode pushed back if torch popped it to handle backward."""
    mode = _STATE.mode
    if mode is not None and not any(m is mode for m in _get_current_function_mode_stack()):
        with mode:
            return _REAL_ENGINE_RUN_BACKWARD(*args, **kwargs)
    return _REAL_ENGINE_RUN_BACKWARD(*args, **kwargs)


# --------------------------------------------------------------------------- megatron seams
def _call_now(callable_: Any, **kwargs: Any) -> None:
    """``torch.cuda._lazy_call`` replacement: there is no CUDA init to wait for."""
    callable_()


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _move_tensor_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """``moe_utils.maybe_move_tensor_to_cpu`` treating every tensor as a device tensor."""
    if torch.is_tensor(tensor):
        tensor = tensor.to(_CPU)
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


class _DropRngWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _RNG_WARNING


def _import_with_triton_fallback(name: str, patches: _Patches) -> ModuleType:
    """Import ``name``; if that fails only because triton is missing, install the stub and retry."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if not (error.name == "triton" or (error.name or "").startswith("triton.")):
            raise
        if stubs.triton_stub_installed():
            raise
    for module_name, module in stubs.make_triton_stub().items():
        patches.setitem(sys.modules, module_name, module)
    return importlib.import_module(name)


def _seam(module: ModuleType, name: str) -> Any:
    if not hasattr(module, name):
        from megatron.core.package_info import __version__

        raise RuntimeError(
            f"prism cpu mode: megatron seam {module.__name__}.{name} is gone in megatron-core "
            f"{__version__} (checked against {', '.join(checked_versions())}); update cpu_mode"
        )
    return getattr(module, name)


def _patch_megatron(patches: _Patches) -> None:
    mc = "megatron.core."
    random = _import_with_triton_fallback(mc + "tensor_parallel.random", patches)
    fsdp_utils = sys.modules.get(mc + "distributed.fsdp.src.megatron_fsdp.utils")  # optional copy
    lazy = {"_lazy_call": _call_now, "_lazy_init": _noop, "device_ctx_manager": stubs.CpuDeviceContext}
    for name, value in lazy.items():
        _seam(random, name)
        patches.setattr(random, name, value)
        if fsdp_utils is not None and hasattr(fsdp_utils, name):
            patches.setattr(fsdp_utils, name, value)
    rng_filter = _DropRngWarning()
    logging.getLogger(random.__name__).addFilter(rng_filter)
    _STATE.log_filter = rng_filter

    moe_utils = _import_with_triton_fallback(mc + "transformer.moe.moe_utils", patches)
    dispatcher = _import_with_triton_fallback(mc + "transformer.moe.token_dispatcher", patches)
    for module in (moe_utils, dispatcher):
        _seam(module, "maybe_move_tensor_to_cpu")
        patches.setattr(module, "maybe_move_tensor_to_cpu", _move_tensor_to_host)
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1 leaves it undefined without TE
        patches.setattr(moe_utils, "te_general_gemm", None)

    norm_cls = _seam(_import_with_triton_fallback(mc + "transformer.torch_norm", patches), "WrappedTorchNorm")
    patches.setattr(norm_cls, "__new__", staticmethod(norm.sequence_parallel_new(norm_cls.__new__)))


# --------------------------------------------------------------------------- public API
class _State:
    def __init__(self) -> None:
        self.mode: _CudaToCpuMode | None = None
        self.patches: _Patches | None = None
        self.log_filter: logging.Filter | None = None
        self.megatron_patched = False


_STATE = _State()
_LOCK = threading.Lock()


def cpu_mode_active() -> bool:
    """Whether CPU mode is enabled in this process."""
    return _STATE.mode is not None


def enable_cpu_mode(patch_megatron: bool = True) -> None:
    """Redirect CUDA to the host for the calling thread (and autograd); idempotent.

    ``patch_megatron`` also imports megatron-core and patches its seams (module docstring);
    without it only torch is redirected (a later call with it adds the seams). Raises
    ``RuntimeError`` on a machine with a GPU, before anything is patched.
    """
    with _LOCK:
        if _STATE.mode is not None:
            if patch_megatron and not _STATE.megatron_patched:
                assert _STATE.patches is not None
                _patch_megatron(_STATE.patches)
                _STATE.megatron_patched = True
            return
        if _gpu_present():
            raise RuntimeError(
                "prism cpu mode refused: a GPU is present (torch.cuda or NVML sees one). CPU mode "
                "redirects CUDA to the host and must never run where a GPU is used."
            )
        patches = _Patches()
        mode = _CudaToCpuMode()
        try:
            import torch._dynamo  # before the stand-ins: dynamo registers torch.cuda's functions as it loads

            patches.enter(torch._dynamo.config.patch(disable=True))
            for module_name, stand_ins in stubs.cuda_stand_ins().items():
                module = sys.modules.get(module_name)  # torch.accelerator: torch >= 2.6
                for name, value in stand_ins.items() if module is not None else ():
                    if hasattr(module, name):
                        patches.setattr(module, name, value)
            for module in (torch.autograd, torch.autograd.graph):
                patches.setattr(module, "_engine_run_backward", _engine_run_backward_in_mode)
            # torch parses record_stream's Stream argument before any torch-function mode sees it
            patches.setattr(torch.Tensor, "record_stream", _noop)
            _STATE.mode = mode  # before megatron imports, so import-time code is redirected too
            mode.__enter__()
            if patch_megatron:
                _patch_megatron(patches)
                _STATE.megatron_patched = True
        except BaseException:
            if _STATE.mode is mode:
                mode.__exit__(None, None, None)
            _STATE.mode = None
            _STATE.megatron_patched = False
            _remove_log_filter()
            patches.restore()
            raise
        _STATE.patches = patches


def _remove_log_filter() -> None:
    if _STATE.log_filter is not None:
        logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_STATE.log_filter)
        _STATE.log_filter = None


def disable_cpu_mode() -> None:
    """Undo :func:`enable_cpu_mode` (call it from the enabling thread); a no-op when inactive."""
    with _LOCK:
        mode = _STATE.mode
        if mode is None:
            return
        stack = _get_current_function_mode_stack()
        if not stack or stack[-1] is not mode:
            raise RuntimeError(
                "prism cpu mode: cannot disable, its torch-function mode is not the innermost one "
                "on this thread (disable from the enabling thread, after leaving inner modes)"
            )
        mode.__exit__(None, None, None)
        _STATE.mode = None
        _STATE.megatron_patched = False
        _remove_log_filter()
        assert _STATE.patches is not None
        _STATE.patches.restore()
        _STATE.patches = None


@contextlib.contextmanager
def cpu_mode(patch_megatron: bool = True) -> Iterator[None]:
    """``with cpu_mode(): ...``; leaves an already-active CPU mode active on exit."""
    was_active = cpu_mode_active()
    enable_cpu_mode(patch_megatron)
    try:
        yield
    finally:
        if not was_active:
            disable_cpu_mode()
