"""The launcher: starts the coordinator and the logical ranks, forked from a template with torch imported or (GPU
ranks) each a fresh interpreter."""

import os

#: what makes `torch.cuda.is_available()` ask NVML: set in the launcher's process, inherited by its ranks
FORK_SAFE_CUDA_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def fork_safe_cuda_checks() -> None:
    """Make `torch.cuda.is_available()` ask NVML instead of the CUDA runtime in this process.

    The runtime query poisons fork (torch marks children "bad fork" and they cannot use CUDA), and
    any code in the template — ours, a preload, Megatron, the `run` front end — may ask: ranks forked
    after such a check fail with "Cannot re-initialize CUDA in forked subprocess".
    """
    for name, value in FORK_SAFE_CUDA_ENV.items():
        os.environ.setdefault(name, value)
