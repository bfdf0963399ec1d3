"""OLMoE (``OlmoeForCausalLM``): QK-norm over the whole q and k projections."""

from __future__ import annotations

from typing import Any

from lightning_titan.hf.family import ANY, Family, Refuse, equal, refuse_attention_bias
from lightning_titan.model.config import ModelConfig


class Olmoe(Family):
    model_type = "olmoe"
    class_name = "OlmoeForCausalLM"
    title = "OLMoE"
    marker = ("qk_norm", equal("full"))
    signature = "QK-norm over the whole projection (qk_norm='full')"
    holds = {"router_norm_topk": ANY}
    ffn_key = "intermediate_size"

    def options_from(self, hf: dict[str, Any]) -> dict[str, tuple[Any, str]]:
        return {
            "qk_norm": ("full", "model_type"),
            "router_norm_topk": (bool(hf.get("norm_topk_prob", False)), "norm_topk_prob"),
        }

    def check_own(self, hf: dict[str, Any], refuse: Refuse) -> None:
        refuse_attention_bias(hf, refuse)
        if hf.get("clip_qkv") is not None:
            refuse("clip_qkv", "is not supported: we do not clamp q, k and v")

    def config_json(self, config: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
        out = super().config_json(config, out)
        return {**out, "attention_bias": False, "clip_qkv": None, "pad_token_id": None}


FAMILY = Olmoe()
