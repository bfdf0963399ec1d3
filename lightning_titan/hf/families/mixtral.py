"""Mixtral (``MixtralForCausalLM``): the plain family, our decoder with no family option set."""

from __future__ import annotations

from typing import Any

from lightning_titan.hf.family import Family
from lightning_titan.model.config import ModelConfig


class Mixtral(Family):
    model_type = "mixtral"
    class_name = "MixtralForCausalLM"
    title = "Mixtral"
    moe = "block_sparse_moe"
    experts = {"w1": "w1", "w3": "w3", "w2": "w2"}
    ffn_key = "intermediate_size"
    experts_keys = ("num_local_experts",)

    def config_json(self, config: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
        out.pop("rope_parameters")  # as the Mixtral export has always written it
        return out


FAMILY = Mixtral()
