"""Validation of the ModelConfig options that pretrained MoE families need (Qwen2-MoE, Qwen3-MoE,
OLMoE, DeepSeek-style routing); they train from scratch too. Each error names the field and value."""

from __future__ import annotations

from typing import Any

from lightning_titan.attention import QK_NORMS
from lightning_titan.moe.router import ROUTER_SCORES


def check_options(config: Any) -> None:
    """Raise ValueError naming the ModelConfig field whose value is not allowed."""
    if config.qk_norm not in QK_NORMS:
        raise ValueError(
            f"qk_norm={config.qk_norm!r} must be one of {QK_NORMS}: 'head' normalises each head "
            "(Qwen3-MoE), 'full' the whole q/k projection (OLMoE)"
        )
    if config.router_score not in ROUTER_SCORES:
        raise ValueError(f"router_score={config.router_score!r} must be one of {ROUTER_SCORES}")
    for name in ("qkv_bias", "router_norm_topk"):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name}={getattr(config, name)!r} must be True or False")
    shared = config.shared_expert_dim
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
        raise ValueError(f"shared_expert_dim={shared!r} must be an int >= 0 (0: no shared expert)")
    head_dim = config.attn_head_dim
    if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 1):
        raise ValueError(
            f"attn_head_dim={head_dim!r} must be a positive int or None (= d_model / n_heads)"
        )
