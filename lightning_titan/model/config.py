"""The model's configuration: every size and option of the decoder, validated where it is given.

Each error names the field, the value and the fix. ``validate_layout(pp, ep, tp, cp)`` adds what a layout needs
(whole layers per stage, whole experts per EP rank, whole heads per TP rank, whole positions per rank).

The options of the pretrained families are flat fields here (the stable form of YAML files, CLI flags
and checkpoints: ``vars(config)`` is the flat dict) and typed groups to the code that reads them:
``config.attention``, ``config.router``, ``config.experts`` and ``config.position``
(``model/options.py``), built from the fields on each access and checked as they are built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

from lightning_titan.model.moe.capacity import expert_capacity
from lightning_titan.model.options import (
    STANDARD,
    AttentionOptions,
    ExpertOptions,
    PositionOptions,
    RouterOptions,
)
from lightning_titan.parallel.pipeline.split import StageSplit

# activation_checkpointing's values, spelled out (``ModelConfig.recompute``)
Recompute = Literal["none", "full", "selective"]
NONE: Final = "none"
FULL: Final = "full"
SELECTIVE: Final = "selective"


@dataclass
class ModelConfig:
    vocab_size: int = 257  # byte tokenizer: 256 bytes + end-of-document
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None = n_heads; fewer = grouped-query attention (Mixtral)
    ffn_dim: int = 128  # per-expert SwiGLU hidden size
    n_experts: int = 8
    top_k: int = 2
    seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    aux_loss_coef: float = 0.01  # load-balancing loss coefficient, 0 = off
    z_loss_coef: float = 0.0  # router z-loss coefficient, 0 = off
    # aux-loss-free balancing (DeepSeek-V3, model/moe/balance.py): a per-expert bias on the scores that
    # pick the top-K (not on the combine weights); works with the aux loss on or off
    router_bias_update_rate: float = 0.0  # expert-bias step per optimizer step, e.g. 1e-3; 0 = off
    init_std: float = 0.02
    # recompute in the backward instead of keeping: False / "none"; True / "full": each block (only
    # its input kept); "selective": the norms and the experts' gated activations (model/recompute.py)
    activation_checkpointing: bool | Recompute = False
    # expert capacity (model/moe/capacity.py): the assignments over it are dropped (the residual passes)
    capacity_factor: float | None = None  # <= floor(factor*S*K/E) per sequence; None: dropless
    # options of pretrained MoE families: the code reads them as groups (model/options.py:
    # config.attention, .router, .experts, .position); each family's hf/families/ file maps them
    attn_head_dim: int | None = None  # None = d_model / n_heads; Qwen3-MoE sets it apart
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2-MoE)
    qk_norm: str = "none"  # "head": RMSNorm per head (Qwen3-MoE); "full": whole q/k (OLMoE)
    router_score: str = "softmax"  # or "sigmoid": independent per-expert scores (DeepSeek-V3)
    router_norm_topk: bool = True  # renormalise the top-K scores to sum to 1 (Mixtral)
    shared_expert_dim: int = 0  # hidden size of a sigmoid-gated shared expert (Qwen2-MoE); 0 = none
    # gpt-oss (model/sinks.py, model/moe/activation.py; its YaRN RoPE is rope_yarn below)
    attn_sinks: bool = False  # a learned per-head sink logit in the attention softmax
    attn_out_bias: bool = False  # a bias on the o projection (added once under TP)
    sliding_window: int = 0  # > 0: the even layers (0, 2, ...) see only this many positions back
    expert_proj_bias: bool = False  # biases on the experts' gate, up and down projections
    router_bias: bool = False  # a bias on the router's logits
    swiglu_limit: float | None = None  # clamp of gpt-oss's SwiGLU; None: plain SwiGLU
    swiglu_alpha: float = 1.702  # gpt-oss's sigmoid gain (used with swiglu_limit)
    # DeepSeek-V3 (Kimi K2, Moonlight): multi-head latent attention (model/mla.py), group-limited
    # routing (model/moe/groups.py), dense first layers, an ungated shared expert
    kv_lora_rank: int = 0  # rank of the joint KV compression; 0 = plain attention, > 0 = MLA
    q_lora_rank: int = (
        0  # rank of the low-rank query (MLA); 0 = one q projection (DeepSeek-V2-Lite)
    )
    qk_nope_head_dim: int = 0  # MLA: per-head q/k channels without RoPE
    qk_rope_head_dim: int = 0  # MLA: per-head q channels with RoPE (the key's are shared by heads)
    v_head_dim: int = 0  # MLA: per-head value channels
    rope_interleave: bool = False  # MLA: RoPE pairs channels (2i, 2i+1), not (i, i + half)
    router_groups: int = 1  # experts in this many groups; a token picks from router_topk_groups
    router_topk_groups: int = 1  # ... groups, ranked by the sum of their top-2 biased scores
    routed_scaling: float = 1.0  # multiplies the routed experts' combine weights
    dense_layers: int = 0  # the first this many layers are a dense SwiGLU, no router or experts
    dense_ffn_dim: int = 0  # the dense layers' hidden size
    shared_expert_gated: bool = True  # False: the shared expert is added ungated (DeepSeek-V3)
    router_expert_bias: bool = False  # keep expert_bias even with router_bias_update_rate=0
    # YaRN RoPE scaling (model/yarn.py): the keys of Hugging Face's rope_scaling / rope_parameters
    # (DeepSeek-V3, gpt-oss); None: plain RoPE
    rope_yarn: dict[str, float | bool] | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "ffn_dim",
            "n_experts",
            "top_k",
            "seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.n_kv_heads is not None and (
            not isinstance(self.n_kv_heads, int) or self.n_kv_heads < 1
        ):
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads!r} must be a positive int or None (= n_heads)"
            )
        for name in ("norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be > 0")
        for name in ("aux_loss_coef", "z_loss_coef", "router_bias_update_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 0 (0 turns it off)")
        if self.activation_checkpointing not in (False, True, NONE, FULL, SELECTIVE):
            raise ValueError(
                f"activation_checkpointing={self.activation_checkpointing!r} is unknown; choose "
                f"{NONE!r} (or False), {FULL!r} (or True: each block) or {SELECTIVE!r} (the norms "
                "and the experts' activations)"
            )
        if self.top_k > self.n_experts:
            raise ValueError(
                f"top_k={self.top_k} > n_experts={self.n_experts}; use top_k <= n_experts"
            )
        # each group checks its options as it is built (model/options.py)
        attention = self.attention
        self.router.fits(self.n_experts, self.top_k)
        self.experts.fits(self.n_layers)
        PositionOptions.of(self)
        if (
            attention.kind == STANDARD
            and attention.head_dim is None
            and self.d_model % self.n_heads
        ):
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "pick n_heads dividing d_model"
            )
        if self.n_heads % self.kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.kv_heads}; "
                "each KV head must serve a whole number of query heads"
            )
        if attention.kind == STANDARD and self.head_dim % 2:
            which = "attn_head_dim" if self.attn_head_dim else "head_dim = d_model / n_heads = "
            which += "" if self.attn_head_dim else f"{self.d_model} / {self.n_heads}"
            raise ValueError(
                f"{which} = {self.head_dim} is odd; "
                "RoPE rotates pairs of channels, so choose an even head_dim"
            )
        check_capacity(self)

    @staticmethod
    def spelled_out(fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` (a config as a dict) with each None that stands for a value computed from others
        written out, so that ``n_kv_heads=None`` and ``n_kv_heads=n_heads`` compare equal."""
        out = dict(fields)
        if out.get("n_kv_heads") is None and "n_heads" in out:
            out["n_kv_heads"] = out["n_heads"]
        if out.get("attn_head_dim") is None and out.get("n_heads") and "d_model" in out:
            out["attn_head_dim"] = out["d_model"] // out["n_heads"]
        return out

    @property
    def recompute(self) -> Recompute:
        """What the backward recomputes: ``"none"``, ``"full"`` (each block) or ``"selective"``."""
        value = self.activation_checkpointing
        if isinstance(value, bool):
            return FULL if value else NONE
        return value

    @property
    def attention(self) -> AttentionOptions:
        """The attention's kind and options (built from the flat fields, checked as it is built)."""
        return AttentionOptions.of(self)

    @property
    def router(self) -> RouterOptions:
        return RouterOptions.of(self)

    @property
    def experts(self) -> ExpertOptions:
        return ExpertOptions.of(self)

    @property
    def position(self) -> PositionOptions:
        return PositionOptions.of(self)

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The channels RoPE rotates per head."""
        latent = self.attention.latent
        return latent.rope_dim if latent.kv_rank else self.head_dim

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def validate_layout(
        self,
        pp: int,
        ep: int,
        tp: int = 1,
        cp: int = 1,
        split: StageSplit | None = None,
        *,
        fold_ep: bool = False,
    ) -> None:
        """Check that ``pp`` stages (cut as ``split`` says; None: evenly), ``ep`` expert ranks,
        ``tp`` tensor ranks and ``cp`` context ranks split this model; ``fold_ep``: the experts split
        over ep * cp * tp ranks (MoE Parallel Folding, ``parallel/mesh.py``)."""
        for name, value in (("pp", pp), ("ep", ep), ("tp", tp), ("cp", cp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        (split or StageSplit()).counts(self.n_layers, pp)
        if fold_ep and self.n_experts % (ep * cp * tp):
            raise ValueError(
                f"n_experts={self.n_experts} is not divisible by ep*cp*tp = {ep}*{cp}*{tp}: with "
                f"fold_ep the experts split over the ep, cp and tp ranks of a stage; choose degrees "
                f"whose product divides {self.n_experts}, or fold_ep=False"
            )
        if self.n_experts % ep:
            raise ValueError(
                f"n_experts={self.n_experts} is not divisible by ep={ep}; choose ep dividing "
                f"{self.n_experts} or change n_experts to a multiple of {ep}"
            )
        for name in ("n_heads", "kv_heads"):
            value = getattr(self, name)
            if value % tp:
                field = "n_kv_heads" if name == "kv_heads" else name
                raise ValueError(
                    f"{field}={value} is not divisible by tp={tp}: tensor parallelism splits the "
                    f"heads evenly; choose tp dividing {value} or change {field} to a multiple of {tp}"
                )
        # CP: 2*cp chunks (rank r holds r and 2cp-1-r); TP then splits a rank's positions again
        chunks = (2 * cp if cp > 1 else 1) * tp
        if self.seq_len % chunks:
            raise ValueError(
                f"seq_len={self.seq_len} is not divisible by {'2 * cp * tp' if cp > 1 else 'tp'} = "
                f"{chunks} (cp={cp}, tp={tp}): every rank holds as many positions of each sequence; "
                f"use a seq_len that is a multiple of {chunks}"
            )


def check_capacity(config: ModelConfig) -> None:
    """Raise ValueError for a capacity factor that is not a positive number, that leaves an expert
    no room at all, or that could never drop anything (an expert already takes a whole sequence)."""
    factor = config.capacity_factor
    if factor is None:
        return
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise ValueError(
            f"capacity_factor={factor!r} must be a number > 0 (e.g. 1.25), or None for dropless "
            "routing (every assignment kept)"
        )
    per_expert = config.seq_len * config.top_k / config.n_experts
    if expert_capacity(factor, config.seq_len, config.top_k, config.n_experts) < 1:
        raise ValueError(
            f"capacity_factor={factor!r} gives each expert {factor * per_expert:.3g} < 1 of a "
            f"sequence's assignments (seq_len={config.seq_len} x top_k={config.top_k} / "
            f"n_experts={config.n_experts} = {per_expert:g} per expert at factor 1): every token "
            f"would be dropped; use capacity_factor >= {1 / per_expert:.4g}"
        )
    if factor * config.top_k >= config.n_experts:
        raise ValueError(
            f"capacity_factor={factor!r} >= n_experts / top_k = {config.n_experts / config.top_k:g}: "
            "an expert could take a whole sequence, so nothing is ever dropped; use "
            "capacity_factor=None (dropless) or a smaller factor"
        )
