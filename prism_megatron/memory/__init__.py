"""Memory: each rank's peak measured where it runs, capped at the target GPU's, OOM as a prediction."""

from .accountant import ByteAccountant, untracked
from .probe import MemoryProbe, requested_bytes
from .targets import TargetError, TargetGPU, resolve_target, target_names

__all__ = ["ByteAccountant", "MemoryProbe", "TargetError", "TargetGPU", "requested_bytes", "resolve_target",
           "target_names", "untracked"]
