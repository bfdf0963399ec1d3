"""What a Hugging Face MoE family is to us, and the parts the families share.

A family is one file in ``hf/families/`` (``hf/families/__init__.py`` finds them) defining
``FAMILY``, an instance of a ``Family`` subclass that says:

- which of our options it holds: ``marker``, the option that tells a config is this family (Qwen3-MoE:
  ``qk_norm='head'``), and ``holds``, the values it takes our other family options at (Qwen3-MoE: any
  ``attn_head_dim``). Every family option (``model/options.py``) not in ``holds`` it holds only at
  ModelConfig's default. ``hf/arch.py`` picks a config's family from these; ``refusals`` adds what a
  family needs across options (gpt-oss: ``qkv_bias == attn_out_bias``);
- how its config.json sets our options (``options_from``) and what in it we refuse
  (``check_supported``, built of the checks below: a family overrides those it differs in);
- its tensor names where they differ from ``LAYER_NAMES`` (``layer_names``, ``moe``, ``experts``;
  ``fused_experts`` for gpt-oss's stacked expert tensors);
- its config.json on export (``config_json``), from the keys every family writes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar, NoReturn

from torch import Tensor

from lightning_titan.model.config import ModelConfig
from lightning_titan.model.options import FLAT_FIELDS
from lightning_titan.model.yarn import YARN_KEYS

# refuse(config.json key, why): raise naming the key and its value
Refuse = Callable[[str, str], NoReturn]


@dataclass(frozen=True)
class Need:
    """The values a family holds one of our options at: ``test(value)``, said as ``said`` after the
    option's name in a message (``"='head'"``, ``" > 0"``)."""

    test: Callable[[Any], bool]
    said: str


def equal(value: Any) -> Need:
    return Need(lambda v: v == value, f"={value!r}")


ANY = Need(lambda v: True, " at any value")
POSITIVE = Need(lambda v: v > 0, " > 0")
GIVEN = Need(lambda v: v is not None, " set (not None)")

# options every family holds at any value
FREE = {"rope_theta": ANY, "swiglu_alpha": ANY}
# the family options in ModelConfig's order: the order their refusals are looked for in
OPTION_ORDER = tuple(f.name for f in fields(ModelConfig) if f.name in FLAT_FIELDS)
DEFAULTS = {f.name: f.default for f in fields(ModelConfig)}

SWIGLU = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
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


def at_default(config: ModelConfig, name: str) -> bool:
    """Whether option ``name`` of ``config`` is at ModelConfig's default, spelled out
    (``attn_head_dim=None`` is ``d_model / n_heads``)."""
    sizes = {"d_model": config.d_model, "n_heads": config.n_heads}
    spelled = ModelConfig.spelled_out({**sizes, name: getattr(config, name)})
    return spelled[name] == ModelConfig.spelled_out({**sizes, name: DEFAULTS[name]})[name]


class Family:
    """One Hugging Face family: the class attributes say what it is, the methods what it does
    differently from the common case (the module doc)."""

    model_type: ClassVar[str]
    class_name: ClassVar[str]
    title: ClassVar[str]  # its name in messages: "Qwen2-MoE"
    # the option that tells a config is this family (None: the plain one, a config with no marker
    # set), and how a message says it: "QK-norm per head (qk_norm='head')"
    marker: ClassVar[tuple[str, Need] | None] = None
    signature: ClassVar[str] = ""
    holds: ClassVar[Mapping[str, Need]] = {}  # the other options it holds away from their defaults
    moe: ClassVar[str] = "mlp"  # the MoE block's module name in a layer
    experts: ClassVar[Mapping[str, str]] = SWIGLU  # our expert weight -> its linear
    ffn_key: ClassVar[str] = "moe_intermediate_size"  # the routed experts' hidden size
    experts_keys: ClassVar[tuple[str, ...]] = ("num_experts", "num_local_experts")  # tried in order
    layer_names: ClassVar[Mapping[str, str]] = {}  # where they differ from LAYER_NAMES
    keeps_expert_bias: ClassVar[bool] = False  # its folders hold our expert_bias (DeepSeek-V3)
    fused_experts: ClassVar[bool] = False  # a layer's experts in stacked tensors (gpt-oss)

    # -- which configs it holds -------------------------------------------------------------------
    def marks(self, config: ModelConfig) -> bool:
        """Whether ``config`` sets this family's marker."""
        return self.marker is not None and self.marker[1].test(getattr(config, self.marker[0]))

    def need(self, name: str) -> Need | None:
        """The values this family holds option ``name`` at; None: its default only."""
        if self.marker is not None and name == self.marker[0]:
            return self.marker[1]
        return self.holds.get(name) or FREE.get(name)

    def misfits(self, config: ModelConfig) -> list[str]:
        """The family options ``config`` sets to a value this family does not hold, in
        ModelConfig's order."""
        out = []
        for name in OPTION_ORDER:
            need = self.need(name)
            if not (need.test(getattr(config, name)) if need else at_default(config, name)):
                out.append(name)
        return out

    def refusals(self, config: ModelConfig) -> list[str]:
        """What this family needs across options that ``config`` lacks, each a message."""
        return []

    # -- config.json -> ours ----------------------------------------------------------------------
    def options_from(self, hf: dict[str, Any]) -> dict[str, tuple[Any, str]]:
        """The options this family's config.json sets: field -> (value, the key it came from). The
        family options left out (and not in ``holds``) are their defaults."""
        return {}

    def check_supported(self, hf: dict[str, Any], seq_len: int, refuse: Refuse) -> None:
        """Refuse what our decoder does not model in a config.json of this family."""
        if hf.get("tie_word_embeddings", False):
            refuse(
                "tie_word_embeddings", "is not supported: our lm_head is untied from the embedding"
            )
        if hf.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "is not supported: our experts are SwiGLU with silu")
        self.check_head_dim(hf, refuse)
        for key in ("rope_scaling", "rope_parameters"):  # transformers 4 / 5 spell it differently
            rope = hf.get(key) or {}
            kind = rope.get("rope_type", rope.get("type", "default"))
            if kind != "default":
                self.check_rope(rope, kind, key, refuse)
        for key in ("router_jitter_noise", "attention_dropout"):
            if hf.get(key, 0.0):
                refuse(key, "is not supported: we model it as 0.0")
        self.check_window(hf, seq_len, refuse)
        self.check_own(hf, refuse)

    def check_head_dim(self, hf: dict[str, Any], refuse: Refuse) -> None:
        if "attn_head_dim" in self.holds:
            return
        head_dim, heads = hf.get("head_dim"), hf.get("num_attention_heads", 0)
        if head_dim is not None and head_dim * heads != hf.get("hidden_size"):
            refuse("head_dim", "is not supported: ours is hidden_size / num_attention_heads")

    def check_rope(self, rope: dict[str, Any], kind: str, key: str, refuse: Refuse) -> None:
        """A ``rope_scaling`` / ``rope_parameters`` of a ``rope_type`` other than "default"."""
        refuse(key, "is not supported: we apply plain RoPE (rope_type 'default')")

    def check_window(self, hf: dict[str, Any], seq_len: int, refuse: Refuse) -> None:
        refuse_window(hf.get("sliding_window"), seq_len, refuse)

    def check_own(self, hf: dict[str, Any], refuse: Refuse) -> None:
        """The keys only this family has."""

    # -- tensor names -----------------------------------------------------------------------------
    def layer_name(self, ours: str) -> str:
        """The Hugging Face name of our tensor ``ours`` inside a layer (after ``model.layers.{i}.``)."""
        name = self.layer_names[ours] if ours in self.layer_names else LAYER_NAMES[ours]
        return name.format(moe=self.moe)

    def expert_names(self, prefix: str, ours: str, expert_range: tuple[int, int]) -> list[str]:
        """The tensors that hold our stacked expert tensor ``ours`` (w1, ...) of the layer named
        ``prefix``: one per row (row r is expert ``expert_range[0] + r``, each the row transposed)."""
        linear = self.experts[ours]
        return [f"{prefix}{self.moe}.experts.{e}.{linear}.weight" for e in range(*expert_range)]

    # a fused_experts family also defines these (hf/load.py and hf/export.py call them)
    def fused_shapes(
        self, hf_name: str, config: ModelConfig, files: dict[str, Path]
    ) -> dict[str, tuple[int, ...]]:
        """The tensors a folder holds the fused ``hf_name`` as, and their shapes."""
        raise NotImplementedError(f"{self.title} keeps a linear per expert")

    def read_fused_experts(
        self, ours: str, hf_name: str, p: Tensor, expert_range: tuple[int, int], files: Any
    ) -> int:
        """Fill ``p`` (our stacked ``ours`` of experts ``expert_range``) from ``hf_name``; the bytes
        read."""
        raise NotImplementedError(f"{self.title} keeps a linear per expert")

    def fuse_experts(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """One layer's stacked expert tensors {w1, ...} -> the family's fused tensors: those made of
        the tensors given (the export gives one fused tensor's at a time)."""
        raise NotImplementedError(f"{self.title} keeps a linear per expert")

    # -- ours -> config.json ----------------------------------------------------------------------
    def config_json(self, config: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
        """config.json from ``out``, the keys every family writes (``hf.arch.hf_config``)."""
        out.pop("rope_theta")  # transformers 5 reads rope_parameters; a second copy only confuses
        out[self.ffn_key] = config.ffn_dim
        out["norm_topk_prob"] = config.router.norm_topk
        return out


# -- parts the families share --------------------------------------------------------------------
def refuse_window(window: int | None, seq_len: int, refuse: Refuse) -> None:
    """A sliding window over every layer: harmless only if it is no shorter than a sequence."""
    if window is not None and window < seq_len:
        refuse(
            "sliding_window",
            f"< seq_len={seq_len}: we attend to the whole sequence; train with seq_len <= {window}",
        )


def check_switched_window(hf: dict[str, Any], seq_len: int, refuse: Refuse) -> None:
    """Qwen's window, which applies only with ``use_sliding_window``."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    if window is None and any(t != "full_attention" for t in hf.get("layer_types") or []):
        refuse("layer_types", "is not supported: every layer attends to the whole sequence here")
    refuse_window(window, seq_len, refuse)


def refuse_dense_mlp_layers(hf: dict[str, Any], refuse: Refuse) -> None:
    """Qwen's dense layers (``mlp_only_layers``, ``decoder_sparse_step``): every layer here is sparse."""
    if hf.get("mlp_only_layers"):
        refuse(
            "mlp_only_layers",
            "is not supported: dense MLP layers are not modelled, every layer here is an MoE layer",
        )
    step, n = hf.get("decoder_sparse_step", 1), hf.get("num_hidden_layers", 0)
    dense = [i for i in range(n) if (i + 1) % step]
    if dense:
        refuse(
            "decoder_sparse_step",
            f"is not supported: it makes layers {dense} dense MLP "
            "layers; every layer here is an MoE layer (decoder_sparse_step=1)",
        )


def every_layer_sparse() -> dict[str, Any]:
    """Qwen's config.json keys that make every layer an MoE layer with full attention."""
    return {"decoder_sparse_step": 1, "mlp_only_layers": [], "use_sliding_window": False}


def refuse_attention_bias(hf: dict[str, Any], refuse: Refuse) -> None:
    if hf.get("attention_bias", False):
        refuse("attention_bias", "is not supported: only Qwen2-MoE's q/k/v biases are (qkv_bias)")


def rope_yarn_of(hf: dict[str, Any]) -> dict[str, float | bool] | None:
    """Our ``rope_yarn`` from config.json's ``rope_parameters`` (transformers 5) or ``rope_scaling``
    (4, and DeepSeek's own files); None without YaRN."""
    for key in ("rope_parameters", "rope_scaling"):
        rope = hf.get(key) or {}
        if rope.get("rope_type", rope.get("type")) == "yarn":
            out = {k: rope[k] for k in YARN_KEYS if rope.get(k) is not None}
            if "factor" not in out and out.get("original_max_position_embeddings"):
                out["factor"] = (
                    hf["max_position_embeddings"] / out["original_max_position_embeddings"]
                )
            return out
    return None
