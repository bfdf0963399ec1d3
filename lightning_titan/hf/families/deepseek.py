"""The DeepSeek-V3 family (``DeepseekV3ForCausalLM``; Kimi K2 and Moonlight have its architecture):
its tensor names, its config.json keys and what is refused.

Our decoder with multi-head latent attention (``kv_lora_rank`` > 0, model/mla.py), sigmoid routing
with the expert bias (``e_score_correction_bias`` = our ``expert_bias``), group-limited top-K,
``routed_scaling_factor``, ungated shared experts and ``first_k_dense_replace`` dense layers.
"""

from __future__ import annotations

from typing import Any

from lightning_titan.hf.family import (
    ANY,
    POSITIVE,
    Family,
    Refuse,
    equal,
    rope_yarn_of,
)
from lightning_titan.model.config import ModelConfig

# our name inside layer {i} -> the Hugging Face name, where it differs from the other families'
LAYER_NAMES = {
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.q_a_proj.weight": "self_attn.q_a_proj.weight",
    "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn.q_b_proj.weight": "self_attn.q_b_proj.weight",
    "attn.kv_a_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn.kv_b_proj.weight": "self_attn.kv_b_proj.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",  # a dense layer's SwiGLU
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
    "shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight",
    "shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.expert_bias": "mlp.gate.e_score_correction_bias",
}


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class DeepseekV3(Family):
    model_type = "deepseek_v3"
    class_name = "DeepseekV3ForCausalLM"
    title = "DeepSeek-V3"
    marker = ("kv_lora_rank", POSITIVE)
    signature = "multi-head latent attention (kv_lora_rank > 0)"
    holds = {
        "q_lora_rank": ANY, "qk_nope_head_dim": ANY,
        "qk_rope_head_dim": ANY, "v_head_dim": ANY, "rope_interleave": ANY,
        "router_score": equal("sigmoid"), "router_norm_topk": ANY, "router_groups": ANY,
        "router_topk_groups": ANY, "routed_scaling": ANY, "router_expert_bias": ANY,
        "shared_expert_dim": ANY, "shared_expert_gated": ANY, "dense_layers": ANY,
        "dense_ffn_dim": ANY, "rope_yarn": ANY,
    }  # fmt: skip
    experts_keys = ("n_routed_experts", "num_local_experts")
    layer_names = LAYER_NAMES
    keeps_expert_bias = True

    def refusals(self, config: ModelConfig) -> list[str]:
        experts, router = config.experts, config.router
        wrong: list[tuple[str, Any, Any]] = []
        if config.capacity_factor is not None:  # refused here rather than silently dropped
            wrong.append(("capacity_factor", config.capacity_factor, None))
        if experts.shared_dim and experts.shared_gated:
            wrong.append(("shared_expert_gated", True, False))
        if experts.shared_dim % config.ffn_dim:
            wrong.append(("shared_expert_dim", experts.shared_dim, "a multiple of ffn_dim"))
        if not (router.expert_bias or config.router_bias_update_rate > 0):
            wrong.append(("router_expert_bias", False, True))
        return [
            f"{name}={value!r} with kv_lora_rank={config.kv_lora_rank} (multi-head latent "
            f"attention): DeepSeek-V3 needs {name}={want!r}"
            for name, value, want in wrong
        ]

    def options_from(self, hf: dict[str, Any]) -> dict[str, tuple[Any, str]]:
        moe_dim = hf.get("moe_intermediate_size") or 0
        dense = hf.get("first_k_dense_replace") or 0
        return {
            "router_score": ("sigmoid", "model_type"),
            "router_norm_topk": (bool(hf.get("norm_topk_prob", True)), "norm_topk_prob"),
            "router_expert_bias": (True, "model_type"),
            "shared_expert_dim": ((hf.get("n_shared_experts") or 0) * moe_dim, "n_shared_experts"),
            "shared_expert_gated": (False, "model_type"),
            "kv_lora_rank": (hf.get("kv_lora_rank"), "kv_lora_rank"),
            "q_lora_rank": (hf.get("q_lora_rank") or 0, "q_lora_rank"),
            "qk_nope_head_dim": (hf.get("qk_nope_head_dim"), "qk_nope_head_dim"),
            "qk_rope_head_dim": (hf.get("qk_rope_head_dim"), "qk_rope_head_dim"),
            "v_head_dim": (hf.get("v_head_dim"), "v_head_dim"),
            "rope_interleave": (bool(hf.get("rope_interleave", True)), "rope_interleave"),
            "router_groups": (hf.get("n_group") or 1, "n_group"),
            "router_topk_groups": (hf.get("topk_group") or 1, "topk_group"),
            "routed_scaling": (
                float(hf.get("routed_scaling_factor", 1.0)),
                "routed_scaling_factor",
            ),
            "dense_layers": (dense, "first_k_dense_replace"),
            "dense_ffn_dim": (hf.get("intermediate_size") if dense else 0, "intermediate_size"),
            "rope_yarn": (rope_yarn_of(hf), "rope_scaling"),
        }

    def check_head_dim(self, hf: dict[str, Any], refuse: Refuse) -> None:
        """Its head_dim is qk_rope_head_dim: ``check_own`` checks the latent sizes."""

    def check_rope(self, rope: dict[str, Any], kind: str, key: str, refuse: Refuse) -> None:
        if kind != "yarn":  # its YaRN is modelled (rope_yarn_of)
            super().check_rope(rope, kind, key, refuse)

    def check_own(self, hf: dict[str, Any], refuse: Refuse) -> None:
        yarn = rope_yarn_of(hf)
        if yarn is not None and not yarn.get("original_max_position_embeddings"):
            refuse("rope_scaling", "is not supported: YaRN needs original_max_position_embeddings")
        if hf.get("attention_bias", False):
            refuse(
                "attention_bias", "is not supported: DeepSeek-V3's projections have no biases here"
            )
        if hf.get("quantization_config"):
            refuse(
                "quantization_config",
                "is not supported: init_from reads unquantised weights (dequantise the FP8 "
                "checkpoint to bf16 first)",
            )
        for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim"):
            least = 0 if key == "qk_nope_head_dim" else 1
            if not isinstance(hf.get(key), int) or hf[key] < least:
                refuse(key, "is not supported: multi-head latent attention needs a positive size")
        heads = hf.get("num_attention_heads")
        if hf.get("num_key_value_heads", heads) != heads:
            refuse("num_key_value_heads", f"is not supported: MLA expands {heads} key/value heads")
        q_rank = hf.get("q_lora_rank")
        if q_rank is not None and not (is_int(q_rank) and q_rank >= 1):
            refuse(
                "q_lora_rank",
                "is not supported: give the low-rank query's rank (an int >= 1), or null for one "
                "q_proj",
            )
        self.check_groups(hf, refuse)

    def check_groups(self, hf: dict[str, Any], refuse: Refuse) -> None:
        """Group-limited routing: ``n_group`` groups cut the experts evenly, a token picks
        ``topk_group`` of them, and those hold at least ``num_experts_per_tok`` experts (null: one
        group, as ``options_from`` reads it)."""
        key = next((k for k in self.experts_keys if hf.get(k) is not None), self.experts_keys[0])
        experts: Any = hf.get(key)
        top_k: Any = hf.get("num_experts_per_tok")
        groups: Any = 1 if hf.get("n_group") is None else hf["n_group"]
        topk: Any = 1 if hf.get("topk_group") is None else hf["topk_group"]
        if not (is_int(experts) and experts >= 1):
            refuse(key, "is not supported: give the routed experts' count, an int >= 1")
        if not (is_int(groups) and groups >= 1 and experts % groups == 0):
            refuse(
                "n_group",
                f"is not supported: give an int >= 1 dividing {key}={experts} (1: no groups)",
            )
        if groups > 1 and experts // groups < 2:
            refuse(
                "n_group",
                f"is not supported: it leaves {experts // groups} expert per group, and a group is "
                f"ranked by its top-2 scores; give n_group <= {key} / 2 = {experts // 2}",
            )
        if not (is_int(topk) and 1 <= topk <= groups):
            refuse("topk_group", f"is not supported: give an int in 1..n_group={groups}")
        if not (is_int(top_k) and 1 <= top_k <= experts):
            refuse(
                "num_experts_per_tok",
                f"is not supported: give an int in 1..{key}={experts}",
            )
        if topk * (experts // groups) < top_k:
            refuse(
                "topk_group",
                f"is not supported: {topk} group(s) of {experts // groups} experts hold fewer than "
                f"num_experts_per_tok={top_k}; give topk_group >= "
                f"{-(-top_k // (experts // groups))}",
            )

    def config_json(self, config: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in out.items() if k not in ("rope_theta", "sliding_window")}
        latent, router, experts = config.attention.latent, config.router, config.experts
        out.update(
            n_routed_experts=config.n_experts,
            moe_intermediate_size=config.ffn_dim,
            intermediate_size=experts.dense_ffn_dim or config.ffn_dim,
            n_shared_experts=experts.shared_dim // config.ffn_dim,
            first_k_dense_replace=experts.dense_layers,
            kv_lora_rank=latent.kv_rank,
            q_lora_rank=latent.q_rank or None,
            qk_nope_head_dim=latent.nope_dim,
            qk_rope_head_dim=latent.rope_dim,
            head_dim=latent.rope_dim,
            v_head_dim=latent.v_dim,
            rope_interleave=latent.interleave,
            n_group=router.groups,
            topk_group=router.topk_groups,
            routed_scaling_factor=router.scaling,
            norm_topk_prob=router.norm_topk,
            attention_bias=False,
            num_key_value_heads=config.n_heads,
            pad_token_id=None,
        )
        if yarn := config.position.yarn:
            out["rope_parameters"] = {"rope_type": "yarn", "rope_theta": config.rope_theta, **yarn}
        return out


FAMILY = DeepseekV3()
