"""Qwen2-MoE (``Qwen2MoeForCausalLM``): a sigmoid-gated shared expert and q/k/v biases."""

from __future__ import annotations

from typing import Any

from lightning_titan.hf.family import (
    ANY,
    POSITIVE,
    Family,
    Refuse,
    check_switched_window,
    every_layer_sparse,
    refuse_dense_mlp_layers,
)
from lightning_titan.model.config import ModelConfig


class Qwen2Moe(Family):
    model_type = "qwen2_moe"
    class_name = "Qwen2MoeForCausalLM"
    title = "Qwen2-MoE"
    marker = ("shared_expert_dim", POSITIVE)
    signature = "a shared expert (shared_expert_dim > 0)"
    holds = {"qkv_bias": ANY, "router_norm_topk": ANY}

    def options_from(self, hf: dict[str, Any]) -> dict[str, tuple[Any, str]]:
        return {
            "shared_expert_dim": (
                hf.get("shared_expert_intermediate_size", 0),
                "shared_expert_intermediate_size",
            ),
            "qkv_bias": (bool(hf.get("qkv_bias", True)), "qkv_bias"),
            "router_norm_topk": (bool(hf.get("norm_topk_prob", False)), "norm_topk_prob"),
        }

    def check_window(self, hf: dict[str, Any], seq_len: int, refuse: Refuse) -> None:
        check_switched_window(hf, seq_len, refuse)

    def check_own(self, hf: dict[str, Any], refuse: Refuse) -> None:
        if not hf.get("shared_expert_intermediate_size", 0) > 0:
            refuse(
                "shared_expert_intermediate_size",
                "is not supported: a Qwen2-MoE shared expert has a positive hidden size",
            )
        refuse_dense_mlp_layers(hf, refuse)

    def config_json(self, config: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
        out = super().config_json(config, out)
        return {
            **out,
            **every_layer_sparse(),
            "qkv_bias": config.attention.qkv_bias,
            "sliding_window": 0,
            "max_window_layers": config.n_layers,
            "shared_expert_intermediate_size": config.experts.shared_dim,
        }


FAMILY = Qwen2Moe()
