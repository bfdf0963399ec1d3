"""The SwiGLU experts one rank owns, stacked so that a rank's experts are contiguous rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class GroupedExperts(nn.Module):
    """Global experts ``[start, end)`` of one MoE layer: ``y = (silu(x @ w1) * (x @ w3)) @ w2``.

    Layout (row ``e`` is global expert ``start + e``; ``y = x @ w``, so each slice is the transpose
    of the matching Hugging Face Mixtral ``nn.Linear.weight``):

    - ``w1`` (gate) [E_local, D, F]  -> ``block_sparse_moe.experts.{start+e}.w1.weight = w1[e].T``
    - ``w3`` (up)   [E_local, D, F]  -> ``... .w3.weight = w3[e].T``
    - ``w2`` (down) [E_local, F, D]  -> ``... .w2.weight = w2[e].T``
    """

    def __init__(self, d_model: int, ffn_dim: int, expert_range: tuple[int, int]) -> None:
        super().__init__()
        start, end = expert_range
        if not 0 <= start < end:
            raise ValueError(f"expert_range={expert_range} must satisfy 0 <= start < end")
        self.expert_range = (start, end)
        n_local = end - start
        self.w1 = nn.Parameter(torch.empty(n_local, d_model, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_local, d_model, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(n_local, ffn_dim, d_model))
        self.reset_parameters()

    @property
    def n_local(self) -> int:
        return self.expert_range[1] - self.expert_range[0]

    def reset_parameters(self, std: float = 0.02) -> None:
        # Placeholder values from the global RNG; StageModel.init_weights gives the layout-free ones.
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=std)

    def forward(self, x: Tensor, tokens_per_expert: list[int]) -> Tensor:
        """``x`` [N, D] holds the rows of local expert 0, then 1, ... with the given counts."""
        if len(tokens_per_expert) != self.n_local:
            raise ValueError(
                f"got {len(tokens_per_expert)} row counts for {self.n_local} local experts"
            )
        # Empty slices still run, so every expert weight gets a (zero) gradient on every rank.
        outputs = [
            (F.silu(rows @ self.w1[e]) * (rows @ self.w3[e])) @ self.w2[e]
            for e, rows in enumerate(torch.split(x, tokens_per_expert))
        ]
        return torch.cat(outputs)
