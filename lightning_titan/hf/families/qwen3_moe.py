"""Qwen3-MoE (``Qwen3MoeForCausalLM``): QK-norm per head, a head_dim of its own."""

from __future__ import annotations

from typing import Any

from lightning_titan.hf.family import (
    ANY,
    Family,
    Refuse,
    check_switched_window,
    equal,
    every_layer_sparse,
    refuse_attention_bias,
    refuse_dense_mlp_layers,
)
from lightning_titan.model.config import ModelConfig


class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    class_name = "Qwen3MoeForCausalLM"
    title = "Qwen3-MoE"
    marker = ("qk_norm", equal("head"))
    signature = "QK-norm per head (qk_norm='head')"
    holds = {"attn_head_dim": ANY, "router_norm_topk": ANY}

    def options_from(self, hf: dict[str, Any]) -> dict[str, tuple[Any, str]]:
        heads, hidden, head_dim = (
            hf.get("num_attention_heads"),
            hf.get("hidden_size"),
            hf.get("head_dim"),
        )
        return {
            "qk_norm": ("head", "model_type"),
            "router_norm_topk": (bool(hf.get("norm_topk_prob", False)), "norm_topk_prob"),
            # kept None when it is the default, so that a config round-trips equal
            "attn_head_dim": (
                head_dim if head_dim is not None and heads and head_dim * heads != hidden else None,
                "head_dim",
            ),
        }

    def check_window(self, hf: dict[str, Any], seq_len: int, refuse: Refuse) -> None:
        check_switched_window(hf, seq_len, refuse)

    def check_own(self, hf: dict[str, Any], refuse: Refuse) -> None:
        refuse_attention_bias(hf, refuse)
        refuse_dense_mlp_layers(hf, refuse)

    def config_json(self, config: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
        out = super().config_json(config, out)
        return {**out, **every_layer_sparse(), "attention_bias": False}


FAMILY = Qwen3Moe()
