"""Top-K routing over all E experts (Mixtral) and the per-sequence auxiliary losses.

The losses are computed per sequence so that their value does not depend on how sequences are
split across data ranks or microbatches: the global loss is a mean over sequences whatever the layout.
Under sequence parallelism each TP rank routes its slice of every sequence: the expert counts are
summed over the TP group (they carry no gradient), and each rank's losses are its tokens' share of
the sequence's, so the TP ranks' values sum to one process's.

Aux-loss-free balancing (DeepSeek-V3): a per-expert ``selection_bias`` shifts the scores that pick
the top-K experts only; the combine weights stay the unbiased probabilities of the chosen experts,
so the bias steers the load without entering the output or the gradient (``model/moe/balance.py``).

Score functions (``config.router.score``, the flat ``router_score``): ``softmax`` over the E logits (Mixtral, Qwen-MoE,
OLMoE) or an independent ``sigmoid`` per expert (DeepSeek-V3). ``norm_topk`` rescales the K chosen
scores to sum to 1 (Mixtral; Qwen/OLMoE ``norm_topk_prob``); off, they are the raw probabilities. The
load-balancing loss's P_e is always a distribution over experts: sigmoid scores are normalised per
token for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_titan.model.moe.groups import group_limited
from lightning_titan.model.options import ROUTER_SCORES


@dataclass
class Routing:
    """The router's decision for ``T = b * S`` tokens."""

    expert_ids: Tensor  # [T, K] long, global expert ids
    weights: Tensor  # [T, K] fp32, the chosen scores (renormalised to sum to 1 with norm_topk)
    load_balance: Tensor  # [b] fp32, E * sum_e f_e * P_e per sequence
    z_loss: Tensor  # [b] fp32, mean over the sequence's tokens of logsumexp(logits)^2


def route(
    logits: Tensor,
    top_k: int,
    sequence_group: ProcessGroup | None = None,
    selection_bias: Tensor | None = None,
    score: str = "softmax",
    norm_topk: bool = True,
    groups: tuple[int, int] = (1, 1),
    scaling: float = 1.0,
) -> Routing:
    """Route tokens given router ``logits`` [b, S, E] (any dtype; the softmax runs in fp32 as in Mixtral).

    ``sequence_group``: the ranks that hold the other slices of these sequences (sequence
    parallelism); the losses are then this slice's share (see the module doc).
    ``selection_bias`` [E] fp32: added to the probabilities for choosing the experts only.
    ``score``: "softmax" or "sigmoid"; ``norm_topk``: renormalise the chosen scores (module doc).
    ``groups`` (n_groups, topk_groups): group-limited choice (``groups.py``; (1, 1): off);
    ``scaling`` multiplies the combine weights (DeepSeek-V3's ``routed_scaling_factor``)."""
    b, s, n_experts = logits.shape
    parts = 1 if sequence_group is None else dist.get_world_size(sequence_group)
    seq_len = s * parts
    logits = logits.float()
    probs = scores(logits, score)
    if selection_bias is None and groups[0] == 1:
        weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    else:
        choice = probs if selection_bias is None else probs + selection_bias
        choice = group_limited(choice, *groups)
        expert_ids = torch.topk(choice, top_k, dim=-1).indices
        weights = probs.gather(-1, expert_ids)  # unbiased: the bias picks, it does not weigh
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling

    # f_e is a count, so it carries no gradient; P_e carries the gradient towards balance.
    assignments = torch.zeros(b, n_experts, device=logits.device, dtype=torch.float32)
    assignments.scatter_add_(
        1,
        expert_ids.reshape(b, s * top_k),
        torch.ones(b, s * top_k, device=logits.device, dtype=torch.float32),
    )
    if parts > 1:
        _sum_over(assignments, sequence_group)
    fraction = assignments / (seq_len * top_k)
    shares = probs if score == "softmax" else probs / probs.sum(dim=-1, keepdim=True)
    mean_prob = shares.sum(dim=1) / seq_len
    load_balance = n_experts * (fraction * mean_prob).sum(dim=-1)
    z_loss = torch.logsumexp(logits, dim=-1).square().sum(dim=-1) / seq_len
    return Routing(
        expert_ids=expert_ids.reshape(b * s, top_k),
        weights=weights.reshape(b * s, top_k),
        load_balance=load_balance,
        z_loss=z_loss,
    )


@torch.compiler.disable  # a graph break in a compiled route: the collective runs eagerly
def _sum_over(counts: Tensor, group: ProcessGroup) -> None:
    dist.all_reduce(counts, group=group)


def scores(logits: Tensor, score: str) -> Tensor:
    """Per-expert scores [..., E] fp32 of router ``logits`` [..., E]."""
    if score == "softmax":
        return torch.softmax(logits, dim=-1)
    if score == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"router_score={score!r} is not one of {ROUTER_SCORES}")
