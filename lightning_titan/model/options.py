"""The options of the pretrained families as typed groups: attention, router, experts, position.

``ModelConfig`` keeps them as flat fields (``qk_norm``, ``router_groups``, ``swiglu_limit``, ...): the
form YAML files, CLI flags (``--model.model.qk_norm=head``) and saved checkpoints spell, which stays
stable. ``config.attention``, ``config.router``, ``config.experts`` and ``config.position`` build the
groups from those fields; the model, the FLOP count, the planner and the Hugging Face mapping read
the groups. Each group checks its own values where it is built (``__post_init__``, and ``fits`` for
what depends on the model's sizes), and its errors name the flat field a user sets: the value and the
fix.

Every group field records the flat field it is read from (``flat("qk_norm")``), so ``of(config)``
builds a group and ``FLAT_FIELDS`` lists every family option.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from lightning_titan.model.yarn import YARN_KEYS

QK_NORMS = ("none", "head", "full")
ROUTER_SCORES = ("softmax", "sigmoid")
STANDARD, LATENT = "standard", "latent"  # the kinds of attention
YARN_MAY_BE_ZERO = ("mscale", "mscale_all_dim")  # 0: that scale off (model/yarn.py)


def flat(name: str) -> Any:
    """A group field read from ModelConfig's flat field ``name``."""
    return field(metadata={"flat": name})


def nested(group: type[Group]) -> Any:
    """A group field that is itself a ``group``, read from flat fields of its own."""
    return field(metadata={"group": group})


G = TypeVar("G", bound="Group")


class Group:
    """A frozen dataclass of options, each read from one flat ModelConfig field."""

    @classmethod
    def of(cls: type[G], config: Any) -> G:
        """The group of ``config`` (a ModelConfig, or anything with its flat fields)."""
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            group = f.metadata.get("group")
            values[f.name] = group.of(config) if group else getattr(config, f.metadata["flat"])
        return cls(**values)

    @classmethod
    def flat_fields(cls) -> tuple[str, ...]:
        """The flat ModelConfig fields this group (and the groups inside it) is read from."""
        out: list[str] = []
        for f in fields(cls):  # type: ignore[arg-type]
            group = f.metadata.get("group")
            out += group.flat_fields() if group else [f.metadata["flat"]]
        return tuple(out)


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")


def _finite(value: Any) -> bool:
    """A real number (not a bool) that is neither NaN nor infinite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _size(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")


@dataclass(frozen=True)
class LatentAttention(Group):
    """DeepSeek-V3's multi-head latent attention (model/mla.py); ``kv_rank`` 0: plain attention."""

    kv_rank: int = flat("kv_lora_rank")  # the joint KV compression's rank
    q_rank: int = flat("q_lora_rank")  # the low-rank query's; 0: one q projection
    nope_dim: int = flat("qk_nope_head_dim")  # per-head q/k channels without RoPE
    rope_dim: int = flat("qk_rope_head_dim")  # per-head q channels with RoPE (the key's shared)
    v_dim: int = flat("v_head_dim")  # per-head value channels
    interleave: bool = flat("rope_interleave")  # RoPE pairs (2i, 2i+1), not (i, i + half)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "interleave":
                _size(f.metadata["flat"], getattr(self, f.name))
        _flag("rope_interleave", self.interleave)
        if not self.kv_rank:
            return
        for name, value in (("qk_rope_head_dim", self.rope_dim), ("v_head_dim", self.v_dim)):
            if value < 1:
                raise ValueError(f"{name}=0 with kv_lora_rank={self.kv_rank} (MLA): give it > 0")
        if self.rope_dim % 2:
            raise ValueError(
                f"qk_rope_head_dim={self.rope_dim} is odd; RoPE rotates pairs of channels"
            )


@dataclass(frozen=True)
class AttentionOptions(Group):
    """Which attention a layer runs and its options: standard (model/attention.py) or latent
    (model/mla.py, ``latent.kv_rank`` > 0)."""

    head_dim: int | None = flat("attn_head_dim")  # None: d_model / n_heads (ModelConfig.head_dim)
    qkv_bias: bool = flat("qkv_bias")  # biases on the q, k, v projections
    out_bias: bool = flat("attn_out_bias")  # a bias on the o projection (added once under TP)
    qk_norm: str = flat("qk_norm")  # "head": RMSNorm per head; "full": over the whole q / k
    sinks: bool = flat("attn_sinks")  # a learned per-head sink logit in the softmax
    sliding_window: int = flat("sliding_window")  # > 0: the even layers see this many back
    latent: LatentAttention = nested(LatentAttention)

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORMS:
            raise ValueError(
                f"qk_norm={self.qk_norm!r} must be one of {QK_NORMS}: 'head' normalises each head "
                "(Qwen3-MoE), 'full' the whole q/k projection (OLMoE)"
            )
        for name, value in (
            ("qkv_bias", self.qkv_bias),
            ("attn_sinks", self.sinks),
            ("attn_out_bias", self.out_bias),
        ):
            _flag(name, value)
        head_dim = self.head_dim
        if head_dim is not None and (not isinstance(head_dim, int) or head_dim < 1):
            raise ValueError(
                f"attn_head_dim={head_dim!r} must be a positive int or None (= d_model / n_heads)"
            )
        window = self.sliding_window
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise ValueError(
                f"sliding_window={window!r} must be an int >= 0 (0: every layer sees all)"
            )
        if self.kind == LATENT:
            plain: tuple[tuple[str, Any, Any], ...] = (
                ("qk_norm", self.qk_norm, "none"),
                ("qkv_bias", self.qkv_bias, False),
                ("attn_head_dim", self.head_dim, None),
            )
            for name, value, off in plain:
                if value != off:
                    raise ValueError(
                        f"{name}={value!r} with kv_lora_rank={self.latent.kv_rank}: multi-head "
                        f"latent attention has no such option; set {name}={off!r}"
                    )

    @property
    def kind(self) -> str:
        """``LATENT`` (multi-head latent attention) or ``STANDARD``."""
        return LATENT if self.latent.kv_rank > 0 else STANDARD

    def sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` sees only ``sliding_window`` positions back (gpt-oss: the even
        layers)."""
        return bool(self.sliding_window) and layer % 2 == 0

    def window_layers(self, n_layers: int) -> int:
        """How many of ``n_layers`` layers are sliding-window layers."""
        return sum(self.sliding(layer) for layer in range(n_layers))


@dataclass(frozen=True)
class RouterOptions(Group):
    """How a token picks its experts and weighs them (model/moe/router.py, groups.py)."""

    score: str = flat("router_score")  # "softmax" over the experts, or a "sigmoid" each
    norm_topk: bool = flat("router_norm_topk")  # renormalise the top-K scores to sum to 1
    groups: int = flat("router_groups")  # the experts in this many groups ...
    topk_groups: int = flat("router_topk_groups")  # ... of which a token picks from this many
    scaling: float = flat("routed_scaling")  # multiplies the routed experts' combine weights
    bias: bool = flat("router_bias")  # a bias on the router's logits
    expert_bias: bool = flat("router_expert_bias")  # keep an expert bias even when not trained

    def __post_init__(self) -> None:
        if self.score not in ROUTER_SCORES:
            raise ValueError(f"router_score={self.score!r} must be one of {ROUTER_SCORES}")
        for name, value in (
            ("router_norm_topk", self.norm_topk),
            ("router_bias", self.bias),
            ("router_expert_bias", self.expert_bias),
        ):
            _flag(name, value)
        groups, topk = self.groups, self.topk_groups
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"router_groups={groups!r} must be a positive int")
        if not isinstance(topk, int) or not 1 <= topk <= groups:
            raise ValueError(
                f"router_topk_groups={topk!r} must be an int in 1..router_groups={groups}"
            )
        if not self.scaling > 0:
            raise ValueError(f"routed_scaling={self.scaling!r} must be > 0 (1.0: unscaled)")

    def fits(self, n_experts: int, top_k: int) -> None:
        """Raise unless the groups cut ``n_experts`` evenly and leave ``top_k`` experts to pick."""
        groups, topk = self.groups, self.topk_groups
        if n_experts % groups:
            raise ValueError(
                f"router_groups={groups!r} must be a positive int dividing n_experts={n_experts}"
            )
        if groups > 1 and n_experts // groups < 2:
            raise ValueError(
                f"router_groups={groups} leaves {n_experts // groups} expert per group: a group "
                "is ranked by its top-2 scores; use router_groups <= n_experts / 2"
            )
        if groups > 1 and topk * n_experts // groups < top_k:
            raise ValueError(
                f"router_topk_groups={topk} groups of {n_experts // groups} experts hold fewer "
                f"than top_k={top_k}; raise router_topk_groups"
            )


@dataclass(frozen=True)
class ExpertOptions(Group):
    """The experts' activation and biases, the shared expert, and the dense first layers."""

    proj_bias: bool = flat("expert_proj_bias")  # biases on the gate, up and down projections
    swiglu_limit: float | None = flat("swiglu_limit")  # gpt-oss's clamp; None: plain SwiGLU
    swiglu_alpha: float = flat("swiglu_alpha")  # gpt-oss's sigmoid gain (with swiglu_limit)
    shared_dim: int = flat("shared_expert_dim")  # a shared expert's hidden size; 0: none
    shared_gated: bool = flat("shared_expert_gated")  # scaled by a sigmoid gate, or added as is
    dense_layers: int = flat("dense_layers")  # the first this many layers are a dense SwiGLU
    dense_ffn_dim: int = flat("dense_ffn_dim")  # their hidden size

    def __post_init__(self) -> None:
        shared = self.shared_dim
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError(
                f"shared_expert_dim={shared!r} must be an int >= 0 (0: no shared expert)"
            )
        _flag("expert_proj_bias", self.proj_bias)
        _flag("shared_expert_gated", self.shared_gated)
        limit = self.swiglu_limit
        if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
            raise ValueError(
                f"swiglu_limit={limit!r} must be a number > 0, or None for plain SwiGLU"
            )
        _size("dense_layers", self.dense_layers)
        _size("dense_ffn_dim", self.dense_ffn_dim)
        if self.dense_layers and self.dense_ffn_dim < 1:
            raise ValueError(
                f"dense_layers={self.dense_layers} with dense_ffn_dim=0: give the dense layers' "
                "hidden size"
            )

    def fits(self, n_layers: int) -> None:
        if self.dense_layers > n_layers:
            raise ValueError(f"dense_layers={self.dense_layers} > n_layers={n_layers}")

    def is_dense(self, layer: int) -> bool:
        """Whether layer ``layer`` is a dense SwiGLU (the first ``dense_layers``), not an MoE layer."""
        return layer < self.dense_layers


@dataclass(frozen=True)
class PositionOptions(Group):
    """RoPE, and its YaRN scaling (model/yarn.py: the keys of Hugging Face's ``rope_scaling`` /
    ``rope_parameters``; None: plain RoPE)."""

    theta: float = flat("rope_theta")
    yarn: dict[str, float | bool] | None = flat("rope_yarn")

    def __post_init__(self) -> None:
        if not self.theta > 0:
            raise ValueError(f"rope_theta={self.theta!r} must be > 0")
        yarn = self.yarn
        if yarn is None:
            return
        unknown = sorted(set(yarn) - set(YARN_KEYS)) if isinstance(yarn, dict) else []
        if not isinstance(yarn, dict) or unknown:
            raise ValueError(
                f"rope_yarn={yarn!r} must be None or a dict of {YARN_KEYS} (Hugging Face's "
                "rope_scaling / rope_parameters of rope_type 'yarn')"
            )
        for key in ("factor", "original_max_position_embeddings"):
            if key not in yarn:
                raise ValueError(f"rope_yarn[{key!r}]=None must be a finite number > 0")
        for key, value in yarn.items():
            if key == "truncate":
                _flag("rope_yarn['truncate']", value)
            elif not _finite(value) or not (value >= 0 if key in YARN_MAY_BE_ZERO else value > 0):
                least = ">= 0 (0: off)" if key in YARN_MAY_BE_ZERO else "> 0"
                raise ValueError(f"rope_yarn[{key!r}]={value!r} must be a finite number {least}")
        # the defaults are model/yarn.py's
        fast, slow = yarn.get("beta_fast", 32), yarn.get("beta_slow", 1)
        if not fast > slow:
            raise ValueError(
                f"rope_yarn beta_fast={fast!r} <= beta_slow={slow!r}: a channel turning more than "
                "beta_fast times over the original context keeps its frequency, one turning fewer "
                "than beta_slow times is interpolated; give beta_fast > beta_slow (Hugging Face's "
                "defaults: 32 and 1)"
            )


GROUPS: dict[str, type[Group]] = {
    "attention": AttentionOptions,
    "router": RouterOptions,
    "experts": ExpertOptions,
    "position": PositionOptions,
}
# every family option: the flat ModelConfig fields the groups are read from
FLAT_FIELDS = tuple(name for group in GROUPS.values() for name in group.flat_fields())
