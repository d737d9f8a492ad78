"""CPU stand-ins for the ``torch.cuda`` calls megatron-core makes, used by :mod:`.cpu_mode`.

Nothing here patches anything: :func:`cuda_stand_ins` only lists replacements, and
``cpu_mode`` installs them (and restores the originals). The stand-ins describe one
virtual device, index 0, backed by the host:

* RNG: the "CUDA generator" *is* ``torch.default_generator``. On CPU a random op on a
  tensor Megatron believes is on the GPU (dropout, ``init.normal_``) draws from the CPU
  default generator, so Megatron's CUDA RNG tracker only changes the numbers if its
  get/set/seed calls act on that generator.
* Streams and events: work runs eagerly on one host stream, so stream ordering is a no-op;
  ``Event.elapsed_time`` returns real wall time between two ``record()`` calls, in ms.
* Memory queries report no device memory (zeros); ``mem_get_info`` and the device's
  ``total_memory`` report host memory. Capability is (0, 0): no GPU-architecture feature
  (Hopper kernels, FP8) is claimed.
* Availability is the truth, the same on a CPU and a CUDA build of torch: there is no
  accelerator (``torch.cuda.is_available()`` and ``torch.accelerator.is_available()`` are
  False, ``torch.accelerator.current_accelerator()`` is None), so torch's own device-generic
  code (the optimizers' graph-capture check, the DataLoader's pin-memory thread, checkpointing)
  takes its host path. ``torch.accelerator``'s device-scoped calls (device index, current
  stream, synchronize) still answer the one virtual device: on a CUDA build they would
  otherwise initialise CUDA, which in a rank forked from a template is a fatal error.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import torch

DEVICE_NAME = "CPU (prism-megatron cpu mode)"


# --------------------------------------------------------------------------- streams / events
class CpuStream:
    """Stands in for ``torch.cuda.Stream``: host work is already ordered, so all waits are no-ops."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority
        self.cuda_stream = 0
        self.stream_id = id(self)

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event if event is not None else CpuEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False  # no CUDA graph is ever captured on the host

    def __repr__(self) -> str:
        return f"<CpuStream {self.stream_id:#x} (prism cpu mode)>"


class CpuEvent:
    """Stands in for ``torch.cuda.Event``; ``elapsed_time`` is real wall time in milliseconds."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: CpuEvent) -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("CpuEvent.elapsed_time: both events must be recorded first")
        return (end_event._time - self._time) * 1000.0


_DEFAULT_STREAM = CpuStream()
_current = threading.local()


def current_stream(device: Any = None) -> CpuStream:
    return getattr(_current, "stream", _DEFAULT_STREAM)


def default_stream(device: Any = None) -> CpuStream:
    return _DEFAULT_STREAM


def set_stream(stream: CpuStream) -> None:
    _current.stream = stream


class CpuStreamContext:
    """``torch.cuda.stream(s)`` / ``torch.cuda.StreamContext``: makes ``s`` the current stream while
    entered, so Megatron's stream comparisons hold. An object, like torch's: code that keeps one
    (``ctx = torch.cuda.stream(s)``) and enters it again and again gets the same effect each time;
    ``None`` selects nothing."""

    def __init__(self, stream: CpuStream | None) -> None:
        self.stream = stream
        self._previous: list[CpuStream] = []  # a stack: entering it again inside itself also restores

    def __enter__(self) -> None:
        if self.stream is not None:
            self._previous.append(current_stream())
            set_stream(self.stream)

    def __exit__(self, *exc: Any) -> bool:
        if self.stream is not None:
            set_stream(self._previous.pop())
        return False


def stream(stream: CpuStream | None) -> CpuStreamContext:
    """``torch.cuda.stream(s)``: a :class:`CpuStreamContext`, as torch returns a ``StreamContext``."""
    return CpuStreamContext(stream)


class CpuDeviceContext:
    """``torch.cuda.device(i)`` / ``device_of(t)``: there is one device, so selecting it does nothing."""

    def __init__(self, device: Any = None) -> None:
        self.idx = 0

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


# --------------------------------------------------------------------------- device queries
def _host_memory() -> tuple[int, int]:
    """(free, total) host memory in bytes."""
    page = os.sysconf("SC_PAGE_SIZE")
    return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


def current_device() -> int:
    return 0


def is_available() -> bool:
    return False


def current_accelerator(check_available: bool = False) -> None:
    return None


def accelerator_device_count() -> int:
    return 0


def device_count() -> int:
    return 1


def set_device(device: Any) -> None:
    pass


def synchronize(device: Any = None) -> None:
    pass


def is_current_stream_capturing() -> bool:
    return False


def get_device_name(device: Any = None) -> str:
    return DEVICE_NAME


def get_device_capability(device: Any = None) -> tuple[int, int]:
    return (0, 0)


def get_device_properties(device: Any = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name=DEVICE_NAME,
        major=0,
        minor=0,
        total_memory=_host_memory()[1],
        multi_processor_count=os.cpu_count() or 1,
        is_integrated=True,
        is_multi_gpu_board=False,
        uuid="prism-cpu-mode",
        L2_cache_size=0,
    )


# --------------------------------------------------------------------------- RNG
def get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.default_generator.set_state(new_state)


def set_rng_state_all(new_states: Any) -> None:
    for state in new_states:
        set_rng_state(state)


def manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. back into us.
    torch.default_generator.manual_seed(int(seed))


def seed() -> None:
    torch.default_generator.seed()


def initial_seed() -> int:
    return torch.default_generator.initial_seed()


# --------------------------------------------------------------------------- memory
def _zero(device: Any = None) -> int:
    return 0


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def memory_stats(device: Any = None) -> dict[str, int]:
    keys = ("allocated_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes", "allocation")
    stats = {f"{k}.all.{w}": 0 for k in keys for w in ("current", "peak", "allocated", "freed")}
    stats.update(num_alloc_retries=0, num_ooms=0, num_device_alloc=0, num_device_free=0)
    return stats


def mem_get_info(device: Any = None) -> tuple[int, int]:
    return _host_memory()


# --------------------------------------------------------------------------- nvtx
def range_push(msg: str) -> int:
    return 0


def range_start(msg: str) -> int:
    return 0


# --------------------------------------------------------------------------- the table
def cuda_stand_ins() -> dict[str, dict[str, Any]]:
    """Module name -> {attribute: stand-in}. Each name is patched where it exists in that module.

    ``torch.cuda.is_available`` answers the truth, False, pinned rather than left to torch: with
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (the launcher sets it) a CUDA build answers
    ``device_count() > 0``, and the ``device_count`` stand-in says 1. Megatron only uses it to
    enable GPU-only extras (straggler detector, TE, cache cleanup), and torch's own code branches
    on it into CUDA internals no stand-in covers.
    """
    rng = {
        "get_rng_state": get_rng_state,
        "get_rng_state_all": get_rng_state_all,
        "set_rng_state": set_rng_state,
        "set_rng_state_all": set_rng_state_all,
        "manual_seed": manual_seed,
        "manual_seed_all": manual_seed,
        "seed": seed,
        "seed_all": seed,
        "initial_seed": initial_seed,
    }
    memory = {
        "memory_allocated": _zero,
        "max_memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_reserved": _zero,
        "memory_cached": _zero,
        "max_memory_cached": _zero,
        "reset_peak_memory_stats": _noop,
        "reset_max_memory_allocated": _noop,
        "reset_max_memory_cached": _noop,
        "reset_accumulated_memory_stats": _noop,
        "memory_stats": memory_stats,
        "mem_get_info": mem_get_info,
        "empty_cache": _noop,
    }
    cuda = {
        "is_available": is_available,
        "current_device": current_device,
        "device_count": device_count,
        "set_device": set_device,
        "synchronize": synchronize,
        "get_device_name": get_device_name,
        "get_device_capability": get_device_capability,
        "get_device_properties": get_device_properties,
        "Stream": CpuStream,
        "Event": CpuEvent,
        "current_stream": current_stream,
        "default_stream": default_stream,
        "set_stream": set_stream,
        "stream": stream,
        "StreamContext": CpuStreamContext,
        "is_current_stream_capturing": is_current_stream_capturing,
        "device": CpuDeviceContext,
        "device_of": CpuDeviceContext,
        "default_generators": (torch.default_generator,),
        **rng,
        **memory,
    }
    nvtx = {
        "range_push": range_push,
        "range_pop": _noop,
        "range_start": range_start,
        "range_end": _noop,
        "mark": _noop,
    }
    accelerator = {
        "is_available": is_available,
        "current_accelerator": current_accelerator,
        "device_count": accelerator_device_count,
        "current_device_index": current_device,
        "current_device_idx": current_device,
        "set_device_index": set_device,
        "set_device_idx": set_device,
        "device_index": CpuDeviceContext,
        "current_stream": current_stream,
        "set_stream": set_stream,
        "synchronize": synchronize,
        **{name: memory[name] for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                                           "max_memory_reserved", "reset_peak_memory_stats",
                                           "reset_accumulated_memory_stats", "memory_stats", "empty_cache")},
    }
    return {
        "torch.cuda": cuda,
        "torch.cuda.random": rng,
        "torch.cuda.memory": memory,
        "torch.cuda.nvtx": nvtx,
        "torch.cuda.graphs": {"is_current_stream_capturing": is_current_stream_capturing},
        "torch.accelerator": accelerator,
    }


# --------------------------------------------------------------------------- triton stub
class _TritonKernelStub:
    """What ``@triton.jit`` returns in the stub: importable, but launching it fails loudly."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"triton kernel {self.__name__} was launched under prism cpu mode, where triton is "
            "a stub (triton is not installed); this Megatron feature cannot run on CPU"
        )

    __call__ = _fail

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        return self._fail


def _triton_decorator(*args: Any, **kwargs: Any) -> Any:
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return _TritonKernelStub(args[0])
    return _TritonKernelStub


class _TritonAny:
    """Any other triton attribute (``tl.constexpr``, ``triton.Config``...): inert placeholder."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> _TritonAny:
        if name.startswith("__"):
            raise AttributeError(name)
        return _TritonAny(f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> _TritonAny:
        return _TritonAny(f"{self._name}()")

    def __repr__(self) -> str:
        return f"<triton stub {self._name}>"


class _TritonStubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _TritonAny(f"{self.__name__}.{name}")


TRITON_STUB_MARK = "__prism_cpu_mode_stub__"


def make_triton_stub() -> dict[str, types.ModuleType]:
    """Modules ``triton``, ``triton.language`` and ``triton.runtime`` that import but cannot launch.

    The version is 0.0.0 so that Megatron's version gates treat triton as too old for
    its optional fused kernels (they then fall back, as when triton is missing).
    """
    import importlib.machinery

    modules: dict[str, types.ModuleType] = {}
    for name in ("triton", "triton.language", "triton.runtime"):
        module = _TritonStubModule(name, "prism cpu mode: stand-in for a missing triton")
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []  # a package, so submodule imports resolve through sys.modules
        setattr(module, TRITON_STUB_MARK, True)
        modules[name] = module
    triton = modules["triton"]
    triton.__version__ = "0.0.0"
    for decorator in ("jit", "autotune", "heuristics"):
        setattr(triton, decorator, _triton_decorator)
    triton.language = modules["triton.language"]
    triton.runtime = modules["triton.runtime"]
    return modules


def triton_stub_installed() -> bool:
    return getattr(sys.modules.get("triton"), TRITON_STUB_MARK, False)
