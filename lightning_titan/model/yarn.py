"""YaRN RoPE scaling as DeepSeek-V3 and gpt-oss use it (transformers' ``_compute_yarn_parameters``
and ``yarn_apply_mscale``), from ``ModelConfig.rope_yarn`` (the keys of Hugging Face's
``rope_scaling`` / ``rope_parameters``).

The rotation frequencies blend interpolated (``1 / factor``) and original ones across a ramp between
the channels that turn ``beta_fast`` and ``beta_slow`` times over ``original_max_position_embeddings``;
the ramp's ends are rounded outwards unless ``truncate`` is false (gpt-oss); cos and sin are
multiplied by ``attention_factor``; and multi-head latent attention multiplies its
softmax scale by ``mscale(factor, mscale_all_dim)**2`` (all channels, not only the rotated ones).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
)


def mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's ``0.1 * m * ln(scale) + 1`` (1 when the context is not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def softmax_scale_factor(yarn: dict[str, float | bool] | None) -> float:
    """What the softmax scale is multiplied by (``yarn_apply_mscale``)."""
    if not yarn or not yarn.get("mscale_all_dim"):
        return 1.0
    return mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2


def inv_freq_and_factor(
    dim: int, theta: float, yarn: dict[str, float | bool]
) -> tuple[Tensor, float]:
    """([dim / 2] inverse frequencies, the factor cos and sin are multiplied by)."""
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]
    attention = yarn.get("attention_factor")
    if attention is None:
        m, m_all = yarn.get("mscale"), yarn.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = yarn.get("beta_fast") or 32, yarn.get("beta_slow") or 1

    def channel(rotations: float) -> float:  # the channel that turns ``rotations`` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel(beta_fast), channel(beta_slow)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    powers = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)
    keep = 1 - ramp.clamp(0, 1)  # 1: the original frequency (fast channels), 0: interpolated
    inv_freq = (1.0 / (factor * powers)) * (1 - keep) + (1.0 / powers) * keep
    return inv_freq, float(attention)


def rope_cos_sin_yarn(
    seq_len: int, dim: int, theta: float, yarn: dict[str, float | bool], device: torch.device
) -> tuple[Tensor, Tensor]:
    """[S, dim] fp32 tables like ``attention.rope_cos_sin``, with YaRN's frequencies and factor."""
    inv_freq, attention = inv_freq_and_factor(dim, theta, yarn)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).to(device)
    return emb.cos() * attention, emb.sin() * attention
