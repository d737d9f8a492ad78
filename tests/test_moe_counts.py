"""The router's per-expert count reductions of a class-depth MoE fold (``patches.moe_counts``).

Ground truth from Megatron's own rank generators: each member of the live rank's reduce group (the
dense tensor-and-context and tensor-data-and-context groups) has an EP index (its position in its
expert-parallel group) and, under the translated mirror, routes the live rank's counts with its blocks
of local experts shifted by that index's digits relative to the live rank's (``moe_fold``'s
translation). Their sum must equal what the seam makes of the coordinator's mirrored sum (N x the live
rank's counts), exactly, in integers and in float32.
"""

from __future__ import annotations

import pytest
import torch

from prism_megatron.patches.moe_counts import INNER, WHOLE, translated_sum

pytestmark = pytest.mark.megatron  # Megatron's RankGenerator is the ground truth of the groups

# (TP, ETP, EP, PP, world): ETP = TP; ETP < TP (EP digits inside TP: inner 2, 4); expert DP > 1
LAYOUTS = [(1, 1, 4, 2, 8), (2, 1, 4, 2, 16), (2, 2, 2, 1, 8), (4, 1, 8, 1, 8), (2, 1, 8, 1, 16)]


def _translate(counts: list[int], e: int, live: int, ep: int, inner: int, local: int) -> list[int]:
    """What a peer at EP index e routes, where the live rank (EP index ``live``) routes ``counts``: block p's
    counts land in block ((p mod inner + a) mod inner) + inner·((p div inner + b) mod outer)."""
    outer = ep // inner
    a, b = (e % inner - live % inner) % inner, (e // inner - live // inner) % outer
    out = [0] * len(counts)
    for p in range(ep):
        q = (p % inner + a) % inner + inner * ((p // inner + b) % outer)
        out[q * local:(q + 1) * local] = counts[p * local:(p + 1) * local]
    return out


@pytest.mark.parametrize("tp, etp, ep, pp, world", LAYOUTS)
def test_the_seams_sum_is_the_members_translated_counts(tp, etp, ep, pp, world):
    from megatron.core.parallel_state import RankGenerator

    dp = world // (tp * pp)
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp", rank_offset=0)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp",
                           rank_offset=0)
    ep_index = {r: i for g in expert.get_ranks("ep") for i, r in enumerate(g)}
    experts, inner = 2 * ep, max(tp // etp, 1)
    gen = torch.Generator().manual_seed(tp * 100 + ep)
    for token, orbit in (("tp-dp-cp", WHOLE), ("tp-cp", INNER)):
        for group in dense.get_ranks(token):
            for live in (group[0], group[-1]):  # the seam's answer does not depend on which member is live
                counts = torch.randint(0, 50, (3, experts), generator=gen)  # 3: layers, or sequences
                members = torch.tensor([[_translate(row, ep_index[m], ep_index[live], ep, inner, experts // ep)
                                         for row in counts.tolist()] for m in group]).sum(0)
                mirrored = counts * len(group)
                got = translated_sum(mirrored, experts, ep, inner, orbit)
                assert got.dtype == torch.int64 and torch.equal(got, members), (token, group, live)
                as_float = translated_sum(mirrored.float().view(-1), experts, ep, inner, orbit)  # one flat vector
                assert torch.equal(as_float, members.float().view(-1))
                if orbit == WHOLE or inner > 1:  # the plain mirror keeps the live rank's imbalance
                    assert not torch.equal(mirrored, members)
                else:  # ETP = TP: a TP group's members share one EP index, so the mirror was already exact
                    assert torch.equal(got, mirrored) and torch.equal(mirrored, members)


def test_bad_shapes_and_orbits_are_refused_by_name():
    with pytest.raises(ValueError, match="do not split into 4 EP blocks of 8 experts"):
        translated_sum(torch.zeros(6), 8, 4, 1, WHOLE)
    with pytest.raises(ValueError, match="orbit must be"):
        translated_sum(torch.zeros(8), 8, 4, 1, "all")
