"""YaRN RoPE (gpt-oss): the rotary frequencies interpolated by ``factor`` below a band of dimensions
and kept above it, with a linear ramp between, and cos/sin scaled by an attention factor.

Follows transformers' ``_compute_yarn_parameters`` (``modeling_rope_utils.py``) for the keys gpt-oss
uses: ``factor``, ``beta_fast``, ``beta_slow``, ``original_max_position_embeddings``, ``truncate``
and ``attention_factor`` (None: ``0.1 * ln(factor) + 1``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def yarn_inv_freq(
    head_dim: int,
    theta: float,
    factor: float,
    beta_fast: float,
    beta_slow: float,
    original_max_positions: int,
    truncate: bool,
) -> Tensor:
    """[head_dim / 2] fp32 inverse frequencies."""

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength turns ``rotations`` times over the original context
        return (head_dim * math.log(original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: divided by factor
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn_attention_factor(factor: float, attention_factor: float | None) -> float:
    if attention_factor is not None:
        return attention_factor
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def yarn_cos_sin(
    seq_len: int, inv_freq: Tensor, scale: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """[S, head_dim] fp32 tables (halves duplicated, as ``attention.rope_cos_sin``) times ``scale``."""
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).to(device)
    return emb.cos() * scale, emb.sin() * scale
