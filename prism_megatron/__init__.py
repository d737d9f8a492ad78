"""prism-megatron: emulate a large Megatron-Core job's ranks on a few devices."""

__version__ = "0.1.0"
