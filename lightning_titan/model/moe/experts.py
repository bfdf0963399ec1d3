"""The SwiGLU experts one rank owns, stacked so that a rank's experts are contiguous rows.

Two ways to run them, equal within float rounding: one grouped GEMM per weight over all local experts
(``torch._grouped_mm`` with the row offsets, as torchtitan and Megatron do), or a Python loop of
per-expert matmuls. ``grouped_mm=None`` picks the grouped one where this build runs it (probed once
per device, dtype and shape: torch 2.13 does fp32 and bf16 on CPU) and not under autocast (whose
casts it does not take part in); the loop otherwise.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@functools.cache
def grouped_mm_supported(
    device: torch.device, dtype: torch.dtype, d_model: int, ffn_dim: int
) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here (a tiny probe, once per key)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        # cached for the process: the first forward may run under no_grad (an eval, a logits
        # check), where the probe's backward would fail and turn grouped GEMMs off for good
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(2, d_model, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, d_model, ffn_dim, device=device, dtype=dtype, requires_grad=True)
            offsets = torch.tensor([1, 2], device=device, dtype=torch.int32)
            out = torch._grouped_mm(x, w, offs=offsets)
            out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming grad contiguous: ``_grouped_mm``'s backward rejects
    an expanded (stride-0) grad, e.g. that of ``out.sum()``, even with zero rows (which
    ``contiguous()`` leaves as they are)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return (
            grad.contiguous()
            if grad.numel()
            else torch.zeros_like(grad, memory_format=torch.contiguous_format)
        )


class GroupedExperts(nn.Module):
    """Global experts ``[start, end)`` of one MoE layer: ``y = (silu(x @ w1) * (x @ w3)) @ w2``.

    Layout (row ``e`` is global expert ``start + e``; ``y = x @ w``, so each slice is the transpose
    of the matching Hugging Face Mixtral ``nn.Linear.weight``):

    - ``w1`` (gate) [E_local, D, F]  -> ``block_sparse_moe.experts.{start+e}.w1.weight = w1[e].T``
    - ``w3`` (up)   [E_local, D, F]  -> ``... .w3.weight = w3[e].T``
    - ``w2`` (down) [E_local, F, D]  -> ``... .w2.weight = w2[e].T``
    """

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        expert_range: tuple[int, int],
        grouped_mm: bool | None = None,
    ) -> None:
        super().__init__()
        self.grouped_mm = grouped_mm  # None: where supported (see the module doc); False: the loop
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
        if sum(tokens_per_expert) != x.shape[0]:
            raise ValueError(
                f"the row counts {tokens_per_expert} sum to {sum(tokens_per_expert)}, not to the "
                f"{x.shape[0]} rows of x"
            )
        if self.uses_grouped_mm(x):
            return self._grouped(x, tokens_per_expert)
        # Empty slices still run, so every expert weight gets a (zero) gradient on every rank.
        outputs = [
            (F.silu(rows @ self.w1[e]) * (rows @ self.w3[e])) @ self.w2[e]
            for e, rows in enumerate(torch.split(x, tokens_per_expert))
        ]
        return torch.cat(outputs)

    def uses_grouped_mm(self, x: Tensor) -> bool:
        """Whether ``forward(x, ...)`` takes the grouped GEMMs."""
        if self.grouped_mm is not None:
            return self.grouped_mm
        if torch.is_autocast_enabled(x.device.type) or x.dtype != self.w1.dtype:
            return False
        d_model, ffn_dim = self.w1.shape[1:]
        return grouped_mm_supported(x.device, x.dtype, d_model, ffn_dim)

    def _grouped(self, x: Tensor, tokens_per_expert: list[int]) -> Tensor:
        # the end row of each local expert's block (an empty expert: the same end as the one before;
        # its weights get a zero gradient, as in the loop)
        ends = list(itertools.accumulate(tokens_per_expert))
        offsets = torch.tensor(ends, dtype=torch.int32, device=x.device)
        x = x.contiguous()
        gate = torch._grouped_mm(x, self.w1, offs=offsets)
        up = torch._grouped_mm(x, self.w3, offs=offsets)
        return _ContiguousGrad.apply(torch._grouped_mm(F.silu(gate) * up, self.w2, offs=offsets))
