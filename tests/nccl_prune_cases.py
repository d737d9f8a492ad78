"""Random folded groups and their full (unpruned) reference, shared by the nccl_prune tests.

The reference is the meaning of *mirror*: the full op over all members, each virtual member holding its
mirror's inputs (its pieces of a personalised exchange re-addressed by the A2A rule), computed with the
runtime's own host collectives.
"""

from __future__ import annotations

import random

import torch

from nccl_prune.plan import GroupPlan, plan_group

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int8, torch.int32, torch.int64, torch.uint8)
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.bfloat16: 2.0 ** -8,
                 torch.float16: 2.0 ** -11}


def random_plan(rng: random.Random, max_size: int = 7) -> tuple[GroupPlan, list[int]]:
    """A group of 1..max_size members of a world of 64 ranks, a random non-empty live subset, every
    virtual member mirroring a random live member of the group."""
    world = 64
    n = rng.randint(1, max_size)
    ranks = rng.sample(range(world), n)
    live = rng.sample(ranks, rng.randint(1, n))
    rep = list(range(world))
    for r in ranks:
        if r not in live:
            rep[r] = rng.choice(live)
    plan = plan_group(ranks, rep)
    assert plan is not None
    return plan, rep


def ops_for(dtype: torch.dtype) -> list[str]:
    if dtype == torch.bool:
        return ["sum", "min", "max", "product", "band", "bor", "bxor", "avg"]
    if dtype in FLOATS:
        return ["sum", "avg", "min", "max", "product", "premul_sum"]
    return ["sum", "avg", "min", "max", "product", "band", "bor", "bxor"]


def random_tensor(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, op: str = "sum") -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in FLOATS:
        if op == "product":  # magnitudes near 1: a product of up to 7 stays in range
            return (torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dtype)
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, shape, generator=g).to(dtype)


def full_inputs(plan: GroupPlan, live_inputs: dict[int, list]) -> list:
    """Every member's inputs: a virtual member holds its mirror's."""
    return [live_inputs[plan.mirror[p]] for p in range(plan.size)]


def a2a_full_pieces(plan: GroupPlan, live_pieces: dict[int, list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """Every member's pieces of an all_to_all: a virtual member v addresses to live member l its mirror's
    piece for l's counterpart (the A2A rule); to virtual members its mirror's piece of the same index."""
    out = []
    for q in range(plan.size):
        m = plan.mirror[q]
        if m == q:
            out.append(live_pieces[q])
            continue
        out.append([live_pieces[m][plan.counterpart(j, q) if plan.is_live(j) else j] for j in range(plan.size)])
    return out


def assert_reduced_close(got: torch.Tensor, want: torch.Tensor, terms: list[torch.Tensor], op: str,
                         factor: float | None, what: str) -> None:
    """Exact for integer/bool dtypes and for min/max; for float sums within (2n+1)·u·Σ|x|·|factor|: both
    sides add the same n values (m copies of one value are one product on the pruned side) in the
    tensors' dtype, each addition rounding by at most u (unit roundoff) of a partial sum bounded by
    Σ|x|, plus one rounding of m·x (two for premul_sum); products within 4·n·u relative for the same
    reason."""
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    dt = want.dtype
    if dt not in UNIT_ROUNDOFF or op in ("min", "max"):
        assert torch.equal(got, want), f"{what}: {got} != {want}"
        return
    u, n = UNIT_ROUNDOFF[dt], len(terms)
    g64, w64 = got.double(), want.double()
    if op == "product":
        bound = 4 * n * u * w64.abs() + 1e-300
    else:
        mag = torch.stack([t.double().abs().reshape(want.shape) for t in terms]).sum(0) * abs(factor or 1.0)
        bound = (2 * n + 1) * u * mag + 1e-300
        if op == "avg":
            bound = bound / n + 2 * u * w64.abs()
    bad = (g64 - w64).abs() > bound
    assert not bad.any(), f"{what}: max error {(g64 - w64).abs().max().item()} over bound at {bad.nonzero()[:4]}"
