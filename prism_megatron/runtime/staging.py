"""The rank's side of the data plane: op inputs staged into its shared-memory arena (or inlined),
descriptors of where outputs go, and the memory a tensor covers (to order ops that share it)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from prism_megatron.runtime import protocol as P
from prism_megatron.runtime.shm import Arena

# CUDA context + cuBLAS workspace of a process, beyond the caching allocator: what NVML showed for the
# ranks of a Megatron GPT on an H200 (bench/gpu/nvml_probe.py and its results). Where NVML can be read,
# the coordinator uses what the driver holds (runtime.nvml).
CONTEXT_BYTES = 810 << 20


@dataclass
class _TurnPeak:
    """The caching allocator's reserved bytes at the last report, and how many it had allocated as
    segments in all by then (``reserved_bytes.all.allocated``, a running sum). An instance, not class
    attributes: assigning to a class at every report invalidates the interpreter's caches that rest on it."""

    reserved: int = 0
    grown: int = 0


_TURN = _TurnPeak()


def footprint_and_peak() -> tuple[int, int]:
    """(GPU bytes this process holds now, the most it held since the last report): the report of a
    rank about to block, whose peak is the turn's that ends (runtime.peaks).

    The allocator's own peak (``max_memory_reserved``) is the program's figure and is never reset:
    the turn's peak is read from running sums instead. Reserved memory only grows by new segments,
    so the peak since the last report is at most reserved then plus the segment bytes allocated
    since, and exactly that unless the allocator released segments meanwhile (``empty_cache``, or its
    retry after a failed cudaMalloc): then it is an upper bound. Each call starts the next turn.
    0 before CUDA starts.

    PRISM_FOOTPRINT_BYTES (a constant) and PRISM_FAKE_DEVICE (runtime.fake_device, a counter test
    programs allocate through) stand in for the GPU in tests of the swap scheduling.
    """
    fake = os.environ.get("PRISM_FOOTPRINT_BYTES")
    if fake:
        return int(fake), int(fake)
    if os.environ.get("PRISM_FAKE_DEVICE"):
        from prism_megatron.runtime.fake_device import shared

        dev, rank = shared(), int(os.environ["RANK"])
        return dev.take_peak(rank)
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0, 0
    stats = torch.cuda.memory_stats()
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    grown = int(stats.get("reserved_bytes.all.allocated", 0))
    since = grown - _TURN.grown
    # a program that resets the accumulated stats restarts the running sum: then its peak since is the bound
    peak = _TURN.reserved + since if since >= 0 else int(stats.get("reserved_bytes.all.peak", reserved))
    _TURN.reserved, _TURN.grown = reserved, grown
    return reserved + CONTEXT_BYTES, max(peak, reserved) + CONTEXT_BYTES


def span(t: torch.Tensor) -> tuple[str, int, int]:
    """(device, first byte, end byte) of the memory ``t`` can touch (views: the extent of its strides)."""
    start = t.data_ptr()
    if t.numel() == 0:
        return str(t.device), start, start
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True) if n > 0)
    return str(t.device), start, start + extent * t.element_size()


def overlaps(a: tuple[str, int, int], b: tuple[str, int, int]) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_bytes(t: torch.Tensor) -> bytes:
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.contiguous().view(torch.uint8).numpy().tobytes()


def local_descs(tensors: list[torch.Tensor]) -> list[tuple]:
    return [(("l", nbytes(t)), P.dtype_name(t.dtype), list(t.shape)) for t in tensors]


def cuda_pin(address: int, nbytes: int, what: str = "staging memory") -> Callable[[], None]:
    """Page-lock host memory for the copy engine (cudaHostRegister, portable); returns the undo."""
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(address, nbytes, 1))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of {what} failed (cudaError {err}); "
                           "run with --staging pageable (--prism-staging pageable)")
    return lambda: cudart.cudaHostUnregister(address)


def typed(raw: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """View flat bytes as a tensor shaped like `like`."""
    if like.numel() == 0:
        return torch.empty(like.shape, dtype=like.dtype)
    return raw.view(like.dtype).view(like.shape)


def stage(arena: Arena, ins: list[torch.Tensor], outs: list[torch.Tensor],
          inplace: bool) -> tuple[list, list, list]:
    """Copy inputs into shared memory (or inline them); describe where outputs go. Returns the
    segments to free once the op is done, and the inputs' and outputs' descriptors (protocol.py)."""
    regions: list[str] = []
    in_descs = []
    for t in ins:
        n = nbytes(t)
        if n <= P.INLINE_LIMIT:
            in_descs.append((("i", host_bytes(t)), P.dtype_name(t.dtype), list(t.shape)))
        else:
            seg, off, view = arena.alloc(n)
            regions.append(seg)
            with torch.no_grad():
                typed(view, t).copy_(t.detach())
            in_descs.append((("s", seg, off, n), P.dtype_name(t.dtype), list(t.shape)))
    out_descs = []
    for i, t in enumerate(outs):
        n = nbytes(t)
        if inplace and in_descs[i][0][0] == "s":
            desc = in_descs[i][0]
        elif n <= P.INLINE_LIMIT:
            desc = ("r", n)
        else:
            seg, off, _ = arena.alloc(n)
            regions.append(seg)
            desc = ("s", seg, off, n)
        out_descs.append((desc, P.dtype_name(t.dtype), list(t.shape)))
    return regions, in_descs, out_descs
