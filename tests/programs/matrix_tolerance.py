"""How op_matrix.py results compare between runs: bitwise, except where reduction order may differ."""

import torch

# results of reductions whose value depends on the order of accumulation (prism: member order; gloo:
# ring order; NCCL: its own): equal within float tolerance, not bitwise
ORDER_DEPENDENT = ("all_reduce/SUM", "all_reduce/PRODUCT", "all_reduce/big", "all_reduce/future", "all_reduce/AVG",
                   "all_reduce/PREMUL", "coalesced/all_reduce", "coalesced/reduce_scatter", "reduce_scatter",
                   "group/parity_sum", "funcol/all_reduce", "reduce", "group/local_sync_pair")


def tolerance(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-5
