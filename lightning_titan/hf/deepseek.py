"""The DeepSeek-V3 family (``DeepseekV3ForCausalLM``; Kimi K2 and Moonlight have its architecture):
its tensor names, its config.json keys and what is refused. hf/arch.py holds the other families.

Our decoder with multi-head latent attention (``kv_lora_rank`` > 0, model/mla.py), sigmoid routing
with the expert bias (``e_score_correction_bias`` = our ``expert_bias``), group-limited top-K,
``routed_scaling_factor``, ungated shared experts and ``first_k_dense_replace`` dense layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

from lightning_titan.model.config import ModelConfig
from lightning_titan.model.yarn import YARN_KEYS

DEEPSEEK_V3 = "deepseek_v3"

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

# ModelConfig fields only DeepSeek-V3 has, at the value that turns each off
OWN_FIELDS = {
    "router_groups": 1,
    "router_topk_groups": 1,
    "routed_scaling": 1.0,
    "dense_layers": 0,
    "dense_ffn_dim": 0,
    "shared_expert_gated": True,
}


def refuse_unless_deepseek(config: ModelConfig) -> None:
    """A model without MLA that sets a field only DeepSeek-V3 has fits no family."""
    for name, off in OWN_FIELDS.items():
        if getattr(config, name) != off:
            raise ValueError(
                f"{name}={getattr(config, name)!r} without multi-head latent attention: only "
                f"DeepSeek-V3 (kv_lora_rank > 0) has it; set {name}={off!r} or kv_lora_rank > 0"
            )


def check_exportable(config: ModelConfig) -> None:
    """Raise ValueError naming the option a DeepSeek-V3 model (``config.mla``) cannot hold."""
    wrong = [
        (f, getattr(config, f), want)
        for f, want in (
            ("router_score", "sigmoid"),
            ("qk_norm", "none"),
            ("qkv_bias", False),
            ("capacity_factor", None),  # refused here rather than silently dropped
        )
        if getattr(config, f) != want
    ]
    if config.shared_expert_dim and config.shared_expert_gated:
        wrong.append(("shared_expert_gated", True, False))
    if config.shared_expert_dim % config.ffn_dim:
        wrong.append(("shared_expert_dim", config.shared_expert_dim, "a multiple of ffn_dim"))
    if not (config.router_expert_bias or config.router_bias_update_rate > 0):
        wrong.append(("router_expert_bias", False, True))
    if wrong:
        name, value, want = wrong[0]
        raise ValueError(
            f"{name}={value!r} with kv_lora_rank={config.kv_lora_rank} (multi-head latent "
            f"attention): DeepSeek-V3 needs {name}={want!r}"
        )


def options_from(hf: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig options a DeepSeek-V3 config.json sets: field -> (value, the key it came from)."""
    moe_dim = hf.get("moe_intermediate_size") or 0
    dense = hf.get("first_k_dense_replace") or 0
    return {
        "qk_norm": ("none", "model_type"),
        "qkv_bias": (False, "attention_bias"),
        "router_score": ("sigmoid", "model_type"),
        "router_norm_topk": (bool(hf.get("norm_topk_prob", True)), "norm_topk_prob"),
        "router_expert_bias": (True, "model_type"),
        "attn_head_dim": (None, "head_dim"),
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
        "routed_scaling": (float(hf.get("routed_scaling_factor", 1.0)), "routed_scaling_factor"),
        "dense_layers": (dense, "first_k_dense_replace"),
        "dense_ffn_dim": (hf.get("intermediate_size") if dense else 0, "intermediate_size"),
        "rope_yarn": (rope_yarn_of(hf), "rope_scaling"),
    }


def rope_yarn_of(hf: dict[str, Any]) -> dict[str, float | bool] | None:
    """Our ``rope_yarn`` from config.json's ``rope_parameters`` (transformers 5) or ``rope_scaling``
    (4, and DeepSeek's own files); None without YaRN."""
    for field in ("rope_parameters", "rope_scaling"):
        rope = hf.get(field) or {}
        if rope.get("rope_type", rope.get("type")) == "yarn":
            out = {k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}
            if "factor" not in out and out.get("original_max_position_embeddings"):
                out["factor"] = (
                    hf["max_position_embeddings"] / out["original_max_position_embeddings"]
                )
            return out
    return None


def check_supported(hf: dict[str, Any], refuse: Callable[[str, str], NoReturn]) -> None:
    """Refuse what our DeepSeek-V3 does not model (``refuse(field, why)``)."""
    yarn = rope_yarn_of(hf)
    if yarn is not None and not yarn.get("original_max_position_embeddings"):
        refuse("rope_scaling", "is not supported: YaRN needs original_max_position_embeddings")
    if hf.get("attention_bias", False):
        refuse("attention_bias", "is not supported: DeepSeek-V3's projections have no biases here")
    if hf.get("quantization_config"):
        refuse(
            "quantization_config",
            "is not supported: init_from reads unquantised weights (dequantise the FP8 checkpoint "
            "to bf16 first)",
        )
    for key in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim"):
        if not isinstance(hf.get(key), int) or hf[key] < (0 if key == "qk_nope_head_dim" else 1):
            refuse(key, "is not supported: multi-head latent attention needs a positive size")
    heads = hf.get("num_attention_heads")
    if hf.get("num_key_value_heads", heads) != heads:
        refuse("num_key_value_heads", f"is not supported: MLA expands {heads} key/value heads")


def hf_config(config: ModelConfig, common: dict[str, Any]) -> dict[str, Any]:
    """config.json for a DeepSeek-V3 ``config``, from the keys every family has (``common``)."""
    out = {k: v for k, v in common.items() if k not in ("rope_theta", "sliding_window")}
    out.pop("num_local_experts", None)
    out.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type=DEEPSEEK_V3,
        n_routed_experts=config.n_experts,
        moe_intermediate_size=config.ffn_dim,
        intermediate_size=config.dense_ffn_dim or config.ffn_dim,
        n_shared_experts=config.shared_expert_dim // config.ffn_dim,
        first_k_dense_replace=config.dense_layers,
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.q_lora_rank or None,
        qk_nope_head_dim=config.qk_nope_head_dim,
        qk_rope_head_dim=config.qk_rope_head_dim,
        head_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim,
        rope_interleave=config.rope_interleave,
        n_group=config.router_groups,
        topk_group=config.router_topk_groups,
        routed_scaling_factor=config.routed_scaling,
        norm_topk_prob=config.router_norm_topk,
        attention_bias=False,
        num_key_value_heads=config.n_heads,
        pad_token_id=None,
    )
    if config.rope_yarn:
        yarn = {"rope_type": "yarn", "rope_theta": config.rope_theta, **config.rope_yarn}
        out["rope_parameters"] = yarn
    return out
