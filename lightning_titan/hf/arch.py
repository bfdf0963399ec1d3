"""The Hugging Face MoE families we load and export: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and
gpt-oss (its fused expert tensors and MXFP4 weights: hf/gpt_oss.py).

Each is our decoder with some ModelConfig options on (model/config.py). ``architecture_of`` reads the
family off those options, so a model loaded from a folder exports as the family it came from and a
model trained from scratch exports as the one family that holds its options (or an error says none
does). Per family: the tensor names, the config.json keys of our fields, and what is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_titan.hf import deepseek, gpt_oss
from lightning_titan.hf.deepseek import DEEPSEEK_V3
from lightning_titan.hf.gpt_oss import GPT_OSS
from lightning_titan.model.decoder import ModelConfig

MIXTRAL, QWEN2_MOE, QWEN3_MOE, OLMOE = "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"


@dataclass(frozen=True)
class Architecture:
    model_type: str
    class_name: str
    moe: str  # the MoE block's module name in a layer
    experts: dict[str, str]  # our expert weight -> its Hugging Face linear
    ffn_key: str  # the config.json key of the routed experts' hidden size
    experts_keys: tuple[str, ...]  # config.json keys of the number of experts, tried in order


SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
ARCHITECTURES = {
    MIXTRAL: Architecture(MIXTRAL, "MixtralForCausalLM", "block_sparse_moe",
                          {"w1": "w1", "w3": "w3", "w2": "w2"}, "intermediate_size",
                          ("num_local_experts",)),
    QWEN2_MOE: Architecture(QWEN2_MOE, "Qwen2MoeForCausalLM", "mlp", SWIGLU,
                            "moe_intermediate_size", ("num_experts", "num_local_experts")),
    QWEN3_MOE: Architecture(QWEN3_MOE, "Qwen3MoeForCausalLM", "mlp", SWIGLU,
                            "moe_intermediate_size", ("num_experts", "num_local_experts")),
    OLMOE: Architecture(OLMOE, "OlmoeForCausalLM", "mlp", SWIGLU, "intermediate_size",
                        ("num_experts", "num_local_experts")),
    GPT_OSS: Architecture(GPT_OSS, "GptOssForCausalLM", "mlp", {}, "intermediate_size",
                          ("num_local_experts", "num_experts")),
    DEEPSEEK_V3: Architecture(DEEPSEEK_V3, "DeepseekV3ForCausalLM", "mlp", SWIGLU,
                              "moe_intermediate_size", ("n_routed_experts", "num_local_experts")),
}  # fmt: skip
# a family's own names, where they differ from LAYER_NAMES
FAMILY_NAMES = {DEEPSEEK_V3: deepseek.LAYER_NAMES}

# our name inside layer {i} -> the Hugging Face name ("{moe}" is the family's MoE block)
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "moe_norm.weight": "post_attention_layernorm.weight",
    "moe.router.weight": "{moe}.gate.weight",
    "shared_expert.w1.weight": "{moe}.shared_expert.gate_proj.weight",
    "shared_expert.w3.weight": "{moe}.shared_expert.up_proj.weight",
    "shared_expert.w2.weight": "{moe}.shared_expert.down_proj.weight",
    "shared_expert.gate.weight": "{moe}.shared_expert_gate.weight",
}
TOP_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def architecture_of(config: ModelConfig) -> Architecture:
    """The one Hugging Face family that holds ``config``'s options; ValueError naming the option if
    none does."""
    if config.attn_sinks:
        return _gpt_oss(config)
    if config.mla:
        deepseek.check_exportable(config)
        return ARCHITECTURES[DEEPSEEK_V3]
    if set_options := [f for f in GPT_OSS_OPTIONS if getattr(config, f) != GPT_OSS_OPTIONS[f]]:
        raise ValueError(
            f"{set_options[0]}={getattr(config, set_options[0])!r} without attn_sinks: only "
            "gpt-oss has it, and gpt-oss has attention sinks; set attn_sinks=True or "
            f"{set_options[0]}={GPT_OSS_OPTIONS[set_options[0]]!r}"
        )
    deepseek.refuse_unless_deepseek(config)
    if config.router_score != "softmax":
        raise ValueError(
            f"router_score={config.router_score!r}: none of {sorted(ARCHITECTURES)} routes with it; "
            "only router_score='softmax' models export to Hugging Face"
        )
    if config.qk_norm != "none":
        clash = [f for f in ("qkv_bias", "shared_expert_dim") if getattr(config, f)]
        if config.qk_norm == "full" and config.attn_head_dim not in (
            None,
            config.d_model // config.n_heads,
        ):
            clash.append("attn_head_dim")
        if clash:
            raise ValueError(
                f"qk_norm={config.qk_norm!r} with {clash[0]}={getattr(config, clash[0])!r}: no "
                "Hugging Face family has both (Qwen3-MoE / OLMoE have QK-norm, Qwen2-MoE the other)"
            )
        return ARCHITECTURES[QWEN3_MOE if config.qk_norm == "head" else OLMOE]
    if config.qkv_bias and not config.shared_expert_dim:
        raise ValueError(
            "qkv_bias=True without a shared expert (shared_expert_dim=0): Qwen2-MoE, the family with "
            "q/k/v biases, always has one; set shared_expert_dim > 0 or qkv_bias=False"
        )
    if config.shared_expert_dim:
        if config.attn_head_dim not in (None, config.d_model // config.n_heads):
            raise ValueError(
                f"attn_head_dim={config.attn_head_dim} with a shared expert or qkv_bias: Qwen2-MoE "
                "has head_dim = hidden_size / num_attention_heads"
            )
        return ARCHITECTURES[QWEN2_MOE]
    if config.attn_head_dim not in (None, config.d_model // config.n_heads):
        raise ValueError(
            f"attn_head_dim={config.attn_head_dim} without QK-norm: of the families only Qwen3-MoE "
            "(qk_norm='head') has a head_dim other than hidden_size / num_attention_heads"
        )
    if not config.router_norm_topk:
        raise ValueError(
            "router_norm_topk=False without QK-norm or a shared expert: Mixtral always renormalises "
            "the top-K; set qk_norm='head' (Qwen3-MoE) or router_norm_topk=True"
        )
    return ARCHITECTURES[MIXTRAL]


# gpt-oss's options other than attn_sinks, at their values of the other families
GPT_OSS_OPTIONS: dict[str, Any] = {
    "attn_out_bias": False, "sliding_window": 0, "expert_proj_bias": False, "router_bias": False,
    "swiglu_limit": None, "rope_yarn": None,  # (DeepSeek-V3's YaRN goes with its latent attention)
}  # fmt: skip


def _gpt_oss(config: ModelConfig) -> Architecture:
    need = {
        "router_score": "softmax", "router_norm_topk": True, "qk_norm": "none",
        "shared_expert_dim": 0, "expert_proj_bias": True, "router_bias": True,
        "qkv_bias": config.attn_out_bias,
    }  # fmt: skip
    for field, value in need.items():
        if getattr(config, field) != value:
            raise ValueError(
                f"attn_sinks=True with {field}={getattr(config, field)!r}: gpt-oss, the family with "
                f"attention sinks, has {field}={value!r}"
            )
    if config.swiglu_limit is None:
        raise ValueError(
            "attn_sinks=True with swiglu_limit=None: gpt-oss clamps its SwiGLU; set swiglu_limit "
            "(gpt-oss: 7.0)"
        )
    return ARCHITECTURES[GPT_OSS]


def hf_names(name: str, expert_range: tuple[int, int], arch: Architecture) -> list[str]:
    """The Hugging Face tensors that hold our parameter ``name``: one name, or for stacked experts one
    per row (row r is global expert ``expert_range[0] + r``; each the row's transpose)."""
    parts = name.split(".")
    if parts[0] != "layers":
        return [TOP_NAMES[name]]
    layer, rest = parts[1], ".".join(parts[2:])
    prefix = f"model.layers.{layer}."
    if arch.model_type == GPT_OSS and rest.startswith("moe.experts."):
        return [gpt_oss.expert_name(layer, parts[-1])]  # one fused tensor of every expert
    if arch.model_type == GPT_OSS and rest in gpt_oss.LAYER_NAMES:
        return [prefix + gpt_oss.LAYER_NAMES[rest]]
    if rest.startswith("moe.experts."):
        w = arch.experts[parts[-1]]
        return [f"{prefix}{arch.moe}.experts.{e}.{w}.weight" for e in range(*expert_range)]
    names = FAMILY_NAMES.get(arch.model_type, {})
    return [prefix + (names[rest] if rest in names else LAYER_NAMES[rest]).format(moe=arch.moe)]


def hf_tensors(model: Any) -> list[tuple[str, Any]]:
    """(our name, tensor) of every tensor of ``model`` a Hugging Face folder of its family holds: the
    parameters, and the expert biases where the family keeps them (DeepSeek-V3)."""
    out = list(model.named_parameters())
    if architecture_of(model.config).model_type in FAMILY_NAMES:
        out += [(n, b) for n, b in model.named_buffers() if n.endswith("moe.expert_bias")]
    return out


def rope_theta_of(hf: dict[str, Any]) -> float | None:
    value = hf.get("rope_theta")
    if value is None:
        value = (hf.get("rope_parameters") or {}).get("rope_theta")
    return value


def options_from(hf: dict[str, Any], arch: Architecture) -> dict[str, Any]:
    """The ModelConfig options the family's config.json sets: field -> (value, the key it came from)."""
    if arch.model_type == DEEPSEEK_V3:
        return deepseek.options_from(hf)
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    head_dim = hf.get("head_dim") if arch.model_type in (QWEN3_MOE, GPT_OSS) else None
    out: dict[str, Any] = {
        "qk_norm": ({QWEN3_MOE: "head", OLMOE: "full"}.get(arch.model_type, "none"), "model_type"),
        "router_norm_topk": (
            True if arch.model_type == MIXTRAL else bool(hf.get("norm_topk_prob", False)),
            "norm_topk_prob",
        ),
        "qkv_bias": (arch.model_type == QWEN2_MOE and bool(hf.get("qkv_bias", True)), "qkv_bias"),
        "shared_expert_dim": (
            hf.get("shared_expert_intermediate_size", 0) if arch.model_type == QWEN2_MOE else 0,
            "shared_expert_intermediate_size",
        ),
        # kept None when it is the default, so that a config round-trips equal
        "attn_head_dim": (
            head_dim if head_dim is not None and heads and head_dim * heads != hidden else None,
            "head_dim",
        ),
    }
    if arch.model_type == GPT_OSS:
        out.update(gpt_oss_options(hf))
    return out


def gpt_oss_options(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's ModelConfig options from its config.json: field -> (value, the key it came from)."""
    bias = bool(hf.get("attention_bias", True))
    sliding = "sliding_attention" in (hf.get("layer_types") or [])
    out: dict[str, Any] = {
        "attn_sinks": (True, "model_type"),
        "qkv_bias": (bias, "attention_bias"),
        "attn_out_bias": (bias, "attention_bias"),
        "sliding_window": (int(hf.get("sliding_window") or 0) if sliding else 0, "sliding_window"),
        "expert_proj_bias": (True, "model_type"),
        "router_bias": (True, "model_type"),
        "swiglu_limit": (float(hf.get("swiglu_limit", 7.0)), "swiglu_limit"),
        "swiglu_alpha": (float(hf.get("swiglu_alpha", 1.702)), "swiglu_alpha"),
        "router_norm_topk": (True, "model_type"),  # softmax over the top-K = renormalised top-K
    }
    if yarn := deepseek.rope_yarn_of(hf):
        out["rope_yarn"] = (yarn, "rope_parameters")
    return out


def hf_config(config: ModelConfig, eos_token_id: int | None = None) -> dict:
    """config.json for ``config`` in the family ``architecture_of`` picks."""
    arch = architecture_of(config)
    out = {
        "architectures": [arch.class_name],
        "model_type": arch.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        arch.experts_keys[0]: config.n_experts,
        "num_experts_per_tok": config.top_k,
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "router_aux_loss_coef": config.aux_loss_coef,
        "output_router_logits": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": config.init_std,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
    }
    if arch.model_type == DEEPSEEK_V3:
        return deepseek.hf_config(config, out)
    if arch.model_type == GPT_OSS:
        return gpt_oss_config(config, out)
    if arch.model_type == MIXTRAL:
        out.pop("rope_parameters")  # as the Mixtral export has always written it
        return out
    out.pop("rope_theta")  # transformers 5 reads rope_parameters; a second copy only confuses
    out[arch.ffn_key] = config.ffn_dim
    out["norm_topk_prob"] = config.router_norm_topk
    if arch.model_type in (QWEN2_MOE, QWEN3_MOE):  # every layer sparse
        out.update(decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False)
    if arch.model_type == QWEN2_MOE:
        out.update(
            qkv_bias=config.qkv_bias,
            sliding_window=0,
            max_window_layers=config.n_layers,
            shared_expert_intermediate_size=config.shared_expert_dim,
        )
    else:
        out.update(attention_bias=False)
    if arch.model_type == OLMOE:
        out.update(clip_qkv=None, pad_token_id=None)
    return out


def gpt_oss_config(config: ModelConfig, out: dict[str, Any]) -> dict:
    """gpt-oss's config.json: ``out`` (the keys every family writes) and its own."""
    out.pop("rope_theta")  # transformers 5 reads rope_parameters
    if config.rope_yarn:
        out["rope_parameters"].update(rope_type="yarn", **config.rope_yarn)
    window = config.sliding_window
    out.update(
        sliding_window=window or None,
        layer_types=[
            "sliding_attention" if window and i % 2 == 0 else "full_attention"
            for i in range(config.n_layers)
        ],
        attention_bias=config.qkv_bias,
        swiglu_limit=config.swiglu_limit,
        swiglu_alpha=config.swiglu_alpha,
        pad_token_id=None,
    )
    return out
