"""Target GPUs: how much memory a rank of the target job would have (``--prism-target-gpu``).

``capacity`` is the device's total as ``nvidia-smi`` reports it; ``context`` is what a training
process holds outside PyTorch's caching allocator (CUDA context, cuBLAS workspace, NCCL buffers), so
the allocator of each emulated rank is capped at ``usable = capacity - context``. Every figure says
where it comes from; a user whose cluster differs passes GiB (``--prism-target-gpu 79.5``) and/or
``--prism-target-context``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MiB = 1 << 20
GiB = 1 << 30

#: Non-allocator memory of a Megatron rank, used unless the user gives another figure; where it
#: comes from is DEFAULT_CONTEXT_SOURCE (shown in the report) and docs/history.md.
DEFAULT_CONTEXT = int(3.5 * GiB)
DEFAULT_CONTEXT_SOURCE = ("default 3.5 GiB, measured on 2 x H200 with torch 2.11 / NCCL 2.28 (CUDA context, "
                          "cuBLAS workspace, NCCL buffers: 2.9-3.9 GiB per rank; more communicators need more); "
                          "pass --prism-target-context GiB for your cluster's figure")


@dataclass(frozen=True)
class TargetGPU:
    name: str
    capacity: int  # bytes
    context: int  # bytes outside the caching allocator
    source: str

    @property
    def usable(self) -> int:
        """The per-rank cap of the caching allocator."""
        return self.capacity - self.context

    def as_dict(self) -> dict:
        return {**asdict(self), "usable": self.usable}


# name -> (total bytes as nvidia-smi reports it, where the figure comes from)
_TABLE: dict[str, tuple[int, str]] = {
    "h100-80gb": (81559 * MiB, "nvidia-smi total of H100 80GB HBM3 (NVIDIA/nccl#1264, modal-labs/modal-client#2797)"),
    "h100-nvl-94gb": (99961274368, "device total of 'NVIDIA H100 NVL' (fastfetch-cli/fastfetch#1658)"),
    "h200-141gb": (143771 * MiB, "nvidia-smi total of the H200 measured for this project (shared/device-notes.md)"),
    "a100-80gb": (81920 * MiB, "nvidia-smi total of A100 80GB (modal-labs/modal-client#2797)"),
    "a100-40gb": (40960 * MiB, "nvidia-smi total of A100 40GB (modal-labs/modal-client#2797)"),
    "l40s-48gb": (46068 * MiB, "nvidia-smi total of L40S (modal-labs/modal-client#2797)"),
    "b200-180gb": (183359 * MiB, "nvidia-smi total of 'NVIDIA B200' (NVIDIA/TensorRT-LLM#10278)"),
}
_ALIASES = {"h100": "h100-80gb", "h200": "h200-141gb", "a100": "a100-80gb", "b200": "b200-180gb",
            "h100-sxm": "h100-80gb", "l40s": "l40s-48gb"}


class TargetError(ValueError):
    """A bad ``--prism-target-gpu`` / ``--prism-target-context`` value; the message names it."""


def target_names() -> list[str]:
    return sorted(_TABLE)


def resolve_target(spec: str, context_gib: float | None = None) -> TargetGPU:
    """``spec`` is a name from the table (or an alias) or a capacity in GiB, e.g. ``'79.5'``."""
    key = spec.strip().lower()
    key = _ALIASES.get(key, key)
    if key in _TABLE:
        capacity, source = _TABLE[key]
        name = key
    else:
        try:
            gib = float(key)
        except ValueError:
            raise TargetError(f"--prism-target-gpu {spec!r} is neither a known GPU ({', '.join(target_names())}) "
                              "nor a capacity in GiB") from None
        if not gib > 0:
            raise TargetError(f"--prism-target-gpu {spec!r}: the capacity must be a positive number of GiB")
        capacity, name, source = int(gib * GiB), f"{gib:g} GiB", "given by the user"
    if context_gib is None:
        context, csource = DEFAULT_CONTEXT, DEFAULT_CONTEXT_SOURCE
    else:
        if not 0 <= context_gib:
            raise TargetError(f"--prism-target-context {context_gib!r} must be >= 0 GiB")
        context, csource = int(context_gib * GiB), "context given by the user"
    if context >= capacity:
        raise TargetError(f"--prism-target-context {context / GiB:g} GiB leaves nothing of {name}'s "
                          f"{capacity / GiB:.2f} GiB")
    return TargetGPU(name, capacity, context, f"{source}; context: {csource}")
