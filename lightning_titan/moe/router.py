"""Top-K routing over all E experts (Mixtral) and the per-sequence auxiliary losses.

The losses are computed per sequence so that their value does not depend on how sequences are
split across data ranks or microbatches: the global loss is a mean over sequences whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Routing:
    """The router's decision for ``T = b * S`` tokens."""

    expert_ids: Tensor  # [T, K] long, global expert ids
    weights: Tensor  # [T, K] fp32, renormalised to sum to 1 per token
    load_balance: Tensor  # [b] fp32, E * sum_e f_e * P_e per sequence
    z_loss: Tensor  # [b] fp32, mean over the sequence's tokens of logsumexp(logits)^2


def route(logits: Tensor, top_k: int) -> Routing:
    """Route tokens given router ``logits`` [b, S, E] (any dtype; the softmax runs in fp32 as in Mixtral)."""
    b, s, n_experts = logits.shape
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)

    # f_e is a count, so it carries no gradient; P_e carries the gradient towards balance.
    assignments = torch.zeros(b, n_experts, device=logits.device, dtype=torch.float32)
    assignments.scatter_add_(
        1, expert_ids.reshape(b, s * top_k), torch.ones(b, s * top_k, device=logits.device)
    )
    fraction = assignments / (s * top_k)
    mean_prob = probs.mean(dim=1)
    load_balance = n_experts * (fraction * mean_prob).sum(dim=-1)
    z_loss = torch.logsumexp(logits, dim=-1).square().mean(dim=-1)
    return Routing(
        expert_ids=expert_ids.reshape(b * s, top_k),
        weights=weights.reshape(b * s, top_k),
        load_balance=load_balance,
        z_loss=z_loss,
    )
