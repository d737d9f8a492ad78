"""Megatron integration: the pieces that know megatron-core (each imports Megatron lazily).

- ``cpu_mode`` / ``cpu_cuda_stubs``: run Megatron's CUDA code paths on CPU (CI, this machine).
- ``megatron_lm``: make Megatron-LM's ``megatron.training`` importable beside the core wheel.
- ``flags``: the ``--prism-*`` flags (also added to Megatron's parser by ``patches.arguments``).
- ``run``: ``prism-megatron run``; ``preload`` (imported by the launcher's template before it
  forks) and ``emulate.rank_setup`` (run in every rank before the script).
- ``driver/pretrain_gpt_mini.py``: the small GPT entry for tests and the demo.

The seams hooked in Megatron itself live in ``prism_megatron.patches``, one module per seam.
"""
