"""The MoE feed-forward: router over all E experts, dispatch to owners, local experts, combine."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_titan.moe.balance import recomputing
from lightning_titan.moe.dispatch import combine, dispatch, ep_size
from lightning_titan.moe.experts import GroupedExperts
from lightning_titan.moe.router import route


class MoELayer(nn.Module):
    """Mixtral's sparse MoE block, with this rank's experts ``expert_range`` of ``n_experts``.

    ``router`` is replicated (maps to HF ``block_sparse_moe.gate``); ``experts`` is sharded over the
    EP group. ``tokens_per_expert`` holds the last forward's [E] assignment counts of this rank's tokens.
    ``sequence_group``: the TP group under sequence parallelism, whose ranks hold the other slices of
    the sequences this rank routes (for the per-sequence aux losses).

    ``bias_update_rate`` > 0 turns on aux-loss-free balancing (``moe/balance.py``): a persistent
    ``expert_bias`` [E] fp32 steers the top-K choice, and ``step_tokens_per_expert`` [E] sums this
    rank's assignments over the training forwards of a step (not the recompute of activation
    checkpointing) until ``balance.update_expert_bias`` spends them.
    """

    expert_bias: Tensor | None
    step_tokens_per_expert: Tensor

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        n_experts: int,
        top_k: int,
        *,
        expert_range: tuple[int, int] | None = None,
        ep_group: ProcessGroup | None = None,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        sequence_group: ProcessGroup | None = None,
        bias_update_rate: float = 0.0,
        router_score: str = "softmax",
        norm_topk: bool = True,
    ) -> None:
        super().__init__()
        expert_range = expert_range or (0, n_experts)
        n_local = expert_range[1] - expert_range[0]
        if not bias_update_rate >= 0:
            raise ValueError(
                f"bias_update_rate={bias_update_rate!r} must be >= 0 (0 turns the expert bias off)"
            )
        if ep_group is not None and n_local * ep_size(ep_group) != n_experts:
            raise ValueError(
                f"{n_local} local experts x EP group of {ep_size(ep_group)} ranks != n_experts="
                f"{n_experts}; give each EP rank n_experts / ep experts"
            )
        self.n_experts = n_experts
        self.top_k = top_k
        self.ep_group = ep_group
        self.sequence_group = sequence_group
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.router_score, self.norm_topk = router_score, norm_topk  # moe/router.py
        self.experts = GroupedExperts(d_model, ffn_dim, expert_range)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(n_experts, dtype=torch.long), persistent=False
        )
        self.bias_update_rate = bias_update_rate
        balancing = bias_update_rate > 0
        # None when off: no key in the state dict, so checkpoints without balancing load as before
        self.register_buffer(
            "expert_bias", torch.zeros(n_experts, dtype=torch.float32) if balancing else None
        )
        self.register_buffer(
            "step_tokens_per_expert", torch.zeros(n_experts, dtype=torch.long), persistent=False
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` [b, S, D] -> (output [b, S, D], aux [b] fp32 already weighted by the coefficients)."""
        b, s, d = x.shape
        if self.ep_group is None and self.experts.n_local != self.n_experts:
            raise ValueError(
                f"this MoE layer holds {self.experts.n_local} of {self.n_experts} experts but has no "
                "ep_group to reach the others; pass the EP process group"
            )
        routing = route(
            self.router(x), self.top_k, self.sequence_group, self.expert_bias,
            score=self.router_score, norm_topk=self.norm_topk,
        )  # fmt: skip
        tokens = x.reshape(b * s, d)
        expert_in, plan = dispatch(tokens, routing.expert_ids, self.n_experts, self.ep_group)
        expert_out = self.experts(expert_in, plan.tokens_per_local_expert)
        out = combine(expert_out, routing.weights, plan)
        self.tokens_per_expert = plan.tokens_per_expert.detach()
        if self.expert_bias is not None and self.training and torch.is_grad_enabled():
            if not recomputing():
                self.step_tokens_per_expert += plan.tokens_per_expert
        aux = self.aux_loss_coef * routing.load_balance + self.z_loss_coef * routing.z_loss
        return out.view(b, s, d), aux
