"""Prints what an expert-parallel rank's local experts receive at each token dispatch (issue 20's MoE
peaks under Megatron's ``--fake-process-group``). Loaded by Python at start when this directory is on
PYTHONPATH; it wraps megatron-core's MoEAlltoAllTokenDispatcher as the module is imported and prints one
``MOE-ROUTE`` line per dispatch to stderr: the rows the local experts receive, per local expert, the
tokens this rank routes to its own experts and to each EP rank, and the dispatch's output splits.

  PYTHONPATH=bench/targets/moe_routing_probe python bench/targets/fake_pg_peak.py NAME --ranks 0 ...
"""

import importlib.abc
import importlib.machinery
import sys

TARGET = "megatron.core.transformer.moe.token_dispatcher"


def _instrument(module) -> None:
    import torch

    cls = module.MoEAlltoAllTokenDispatcher
    preprocess, postprocess = cls.preprocess, cls.dispatch_postprocess
    count = [0]

    def probed_preprocess(self, routing_map):
        own = routing_map.sum(dim=0).long()  # tokens this rank routes to each expert
        out = preprocess(self, routing_map)
        first, n = self.local_expert_indices[0], self.num_local_experts
        splits = None if self.output_splits is None else [int(x) for x in torch.as_tensor(self.output_splits)]
        self._route = {"own_to_local": int(own[first:first + n].sum()),
                       "own_to_each_rank": own.reshape(self.ep_size, n).sum(1).tolist(), "output_splits": splits}
        return out

    def probed_postprocess(self, hidden_states, probs):
        rows, tokens_per_expert, p = postprocess(self, hidden_states, probs)
        count[0] += 1
        per_expert = [int(x) for x in torch.as_tensor(tokens_per_expert)]
        print(f"MOE-ROUTE dispatch={count[0]} received={rows.shape[0]} per_local_expert={per_expert} "
              f"{getattr(self, '_route', {})}", file=sys.stderr, flush=True)
        return rows, tokens_per_expert, p

    cls.preprocess, cls.dispatch_postprocess = probed_preprocess, probed_postprocess


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _instrument(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
