"""Phase 1 runtime: the `prism` backend, the coordinator, slots. Serves any torch.distributed program.

Nothing here imports Megatron (see ARCHITECTURE.md, dependency rules).
"""
