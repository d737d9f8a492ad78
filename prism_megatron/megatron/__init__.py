"""Megatron integration: the pieces that know megatron-core (imported lazily by each module)."""
