"""DeepSeek-V3's group-limited routing: the E experts form ``n_groups`` groups of consecutive ids; a
token ranks the groups by the sum of the top-2 (biased) scores in each, keeps the best
``topk_groups``, and picks its top-K experts inside those only (transformers' ``DeepseekV3TopkRouter``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_limited(choice_scores: Tensor, n_groups: int, topk_groups: int) -> Tensor:
    """``choice_scores`` [..., E] with the experts outside each token's best ``topk_groups`` groups
    set to -inf (so that a top-K over the result picks inside them)."""
    if n_groups == 1:
        return choice_scores
    *lead, n_experts = choice_scores.shape
    grouped = choice_scores.view(*lead, n_groups, n_experts // n_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [..., G]
    best = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice_scores)
