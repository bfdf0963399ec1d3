"""Our decoder as a Hugging Face family: which family a config is, its tensor names, its config.json.

The families are one file each in ``hf/families/`` (``hf/family.py`` says what a family holds).
``architecture_of`` reads the family off a config's options, so a model loaded from a folder exports
as the family it came from and a model trained from scratch exports as the one family that holds its
options (or an error names the option and the families that have it).
"""

from __future__ import annotations

from typing import Any

from lightning_titan.hf.families import FAMILIES
from lightning_titan.hf.family import DEFAULTS, OPTION_ORDER, TOP_NAMES, Family
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.lora import is_adapter

# the family of a config that sets no family's marker (Mixtral)
PLAIN = next(family for family in FAMILIES.values() if family.marker is None)


def _marker_order(family: Family) -> int:
    return OPTION_ORDER.index(family.marker[0]) if family.marker else -1


# the families in the order of their markers among ModelConfig's fields (ties: model_type)
BY_MARKER = sorted(FAMILIES.values(), key=_marker_order)


def architecture_of(config: ModelConfig) -> Family:
    """The one Hugging Face family that holds ``config``'s options; ValueError naming the option if
    none does.

    A config that sets no family's marker is the plain family's; otherwise it is the marked family
    with the fewest options it cannot hold (ties: the marker first in ModelConfig's order)."""
    marked = [f for f in BY_MARKER if f.marks(config)]
    if not marked:
        family = PLAIN
        if misfits := family.misfits(config):
            raise ValueError(_without(config, misfits[0]))
    else:  # the nearest marked family (min keeps the first of a tie)
        family = min(marked, key=lambda f: len(f.misfits(config)) + len(f.refusals(config)))
        if misfits := family.misfits(config):
            raise ValueError(_with(config, family, misfits[0]))
    if refusals := family.refusals(config):
        raise ValueError(refusals[0])
    return family


def _with(config: ModelConfig, family: Family, name: str) -> str:
    """Why marked ``family`` cannot hold option ``name``."""
    assert family.marker is not None
    marker, need = family.marker[0], family.need(name)
    said = need.said if need else f"={DEFAULTS[name]!r}"
    return (
        f"{marker}={getattr(config, marker)!r} with {name}={getattr(config, name)!r}: "
        f"{family.title} has {name}{said}"
    )


def _without(config: ModelConfig, name: str) -> str:
    """Why the plain family cannot hold option ``name``, and the families that can."""
    value, default = getattr(config, name), DEFAULTS[name]
    holders = [f for f in BY_MARKER if (need := f.need(name)) and need.test(value)]
    if not holders:
        return (
            f"{name}={value!r}: no Hugging Face family of {sorted(FAMILIES)} has it; only "
            f"{name}={default!r} models export to Hugging Face"
        )
    who = _listed([f.title for f in holders], "and")
    return (
        f"{name}={value!r} without {_listed([f.signature for f in holders], 'or')}: only {who} "
        f"{'has' if len(holders) == 1 else 'have'} it; set "
        f"{'that' if len(holders) == 1 else 'one of those'}, or {name}={default!r}"
    )


def _listed(items: list[str], conjunction: str) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {conjunction} {items[-1]}"


def hf_names(name: str, expert_range: tuple[int, int], family: Family) -> list[str]:
    """The Hugging Face tensors that hold our parameter ``name``: one name, or for stacked experts one
    per row (row r is global expert ``expert_range[0] + r``; each the row's transpose), or the
    family's fused tensor (gpt-oss)."""
    parts = name.split(".")
    if parts[0] != "layers":
        return [TOP_NAMES[name]]
    layer, rest = parts[1], ".".join(parts[2:])
    prefix = f"model.layers.{layer}."
    if rest.startswith("moe.experts."):
        return family.expert_names(prefix, parts[-1], expert_range)
    return [prefix + family.layer_name(rest)]


def hf_tensors(model: Any) -> list[tuple[str, Any]]:
    """(our name, tensor) of every tensor of ``model`` a Hugging Face folder of its family holds: the
    parameters (not the LoRA adapters: ``hf/adapter.py``), and the expert biases where the family
    keeps them (DeepSeek-V3)."""
    out = [(n, p) for n, p in model.named_parameters() if not is_adapter(n)]
    if architecture_of(model.config).keeps_expert_bias:
        out += [(n, b) for n, b in model.named_buffers() if n.endswith("moe.expert_bias")]
    return out


def rope_theta_of(hf: dict[str, Any]) -> float | None:
    value = hf.get("rope_theta")
    if value is None:
        value = (hf.get("rope_parameters") or {}).get("rope_theta")
    return value


def hf_config(config: ModelConfig, eos_token_id: int | None = None) -> dict:
    """config.json for ``config`` in the family ``architecture_of`` picks: the keys every family
    writes, then the family's own (``Family.config_json``)."""
    family = architecture_of(config)
    out = {
        "architectures": [family.class_name],
        "model_type": family.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        family.experts_keys[0]: config.n_experts,
        "num_experts_per_tok": config.top_k,
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.position.theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.position.theta},
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
    return family.config_json(config, out)
