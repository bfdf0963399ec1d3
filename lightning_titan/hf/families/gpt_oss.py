"""gpt-oss (``GptOssForCausalLM``): attention sinks, window layers, biased projections, a clamped
SwiGLU, YaRN; its tensor names, its fused expert tensors and MXFP4 expert weights.

gpt-oss keeps a layer's experts in four stacked tensors rather than one ``nn.Linear`` per expert:
``mlp.experts.gate_up_proj`` [E, D, 2F] with gate and up interleaved in the last dim (gate the even
columns, up the odd: ``GptOssExperts._apply_gate``), ``gate_up_proj_bias`` [E, 2F], ``down_proj``
[E, F, D] and ``down_proj_bias`` [E, D]. They are ``x @ w`` like ours, so expert ``e`` of our
``w1`` is ``gate_up_proj[e, :, 0::2]``, with no transpose. A rank reads rows ``[start, end)`` only.

Released checkpoints store ``gate_up_proj`` and ``down_proj`` in MXFP4: ``<name>_blocks`` [E, rows,
G, 16] uint8 (two e2m1 values a byte, the low nibble first) and ``<name>_scales`` [E, rows, G] uint8
(an e8m0 exponent, bias 127, per block of 32 values), ``rows`` being the output dim. ``dequantize``
is transformers' ``convert_moe_packed_tensors`` (``integrations/mxfp4.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_titan.hf import folder as hf_folder
from lightning_titan.hf.family import (
    ANY,
    GIVEN,
    Family,
    Refuse,
    equal,
    rope_yarn_of,
)
from lightning_titan.model.config import ModelConfig

# our name inside layer {i} -> gpt-oss's, where it differs from hf.family.LAYER_NAMES
LAYER_NAMES = {
    "attn.wo.bias": "self_attn.o_proj.bias",
    "attn.sinks.weight": "self_attn.sinks",
    "moe.router.weight": "mlp.router.weight",
    "moe.router.bias": "mlp.router.bias",
}
# our stacked expert tensor -> (the fused tensor holding it, the columns it takes: even, odd, all)
FUSED = {
    "w1": ("gate_up_proj", slice(0, None, 2)),
    "w3": ("gate_up_proj", slice(1, None, 2)),
    "b1": ("gate_up_proj_bias", slice(0, None, 2)),
    "b3": ("gate_up_proj_bias", slice(1, None, 2)),
    "w2": ("down_proj", slice(None)),
    "b2": ("down_proj_bias", slice(None)),
}
QUANTIZED = ("gate_up_proj", "down_proj")  # the tensors an MXFP4 checkpoint stores as blocks/scales
# the e2m1 value of each 4-bit code: sign bit, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4_VALUES = [sign * v for sign in (1.0, -1.0) for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)]


def fused_shape(fused: str, n_experts: int, d_model: int, ffn_dim: int) -> tuple[int, ...]:
    return {
        "gate_up_proj": (n_experts, d_model, 2 * ffn_dim),
        "gate_up_proj_bias": (n_experts, 2 * ffn_dim),
        "down_proj": (n_experts, ffn_dim, d_model),
        "down_proj_bias": (n_experts, d_model),
    }[fused]


def mxfp4_shapes(fused: str, n_experts: int, d_model: int, ffn_dim: int) -> dict[str, tuple]:
    """The ``_blocks`` and ``_scales`` shapes of a quantized fused tensor: its rows are the output
    dim, its 32-value blocks cut the input dim."""
    rows, inputs = (2 * ffn_dim, d_model) if fused == "gate_up_proj" else (d_model, ffn_dim)
    return {
        f"{fused}_blocks": (n_experts, rows, inputs // 32, 16),
        f"{fused}_scales": (n_experts, rows, inputs // 32),
    }


def dequantize(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """MXFP4 ``blocks`` [E, rows, G, 16] uint8 and ``scales`` [E, rows, G] uint8 -> [E, G*32, rows]
    in ``dtype`` (each value ``lut[nibble] * 2**(scale - 127)``; the low nibble is the even value)."""
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks of shape {list(blocks.shape)} and scales {list(scales.shape)} do not "
            "match: blocks must be [E, rows, G, 16] and scales [E, rows, G]"
        )
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    out = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1))
    e, rows, groups, per_group = out.shape
    return out.reshape(e, rows, groups * per_group).transpose(1, 2).contiguous()


def check_mxfp4(
    files: dict[str, Path], name: str, blocks: Tensor, scales: Tensor, start: int
) -> None:
    """Raise unless ``name``'s MXFP4 ``blocks`` and ``scales`` (experts ``start`` on) are uint8, as
    the format stores them (another dtype would be cast, wrapping modulo 256), and no scale is 255,
    the e8m0 code for NaN."""
    for part, tensor in (("blocks", blocks), ("scales", scales)):
        if tensor.dtype != torch.uint8:
            raise ValueError(
                f"{files[f'{name}_{part}'].name}: {name}_{part} is {tensor.dtype}, not "
                "torch.uint8: MXFP4 stores its blocks and scales as bytes; write them as uint8 "
                "(or store the dequantized tensor under its own name)"
            )
    nan = (scales == 255).nonzero()
    if len(nan):
        where = [start + int(nan[0, 0]), *nan[0, 1:].tolist()]
        raise ValueError(
            f"{files[f'{name}_scales'].name}: {name}_scales holds {len(nan)} e8m0 scale(s) of 255 "
            f"(NaN in MXFP4), the first at [expert, row, block] = {where}: the checkpoint is "
            f"damaged; {hf_folder.REDOWNLOAD}"
        )


def read_fused(
    f: Any, files: dict[str, Path], name: str, experts: tuple[int, int], dtype: torch.dtype
) -> tuple[Tensor, int]:
    """Rows ``experts`` of the fused tensor ``name`` (dequantized from MXFP4 where the folder stores
    ``name_blocks``), and the bytes read. ``f(path)`` opens a safetensors file."""
    start, end = experts
    if name in files:
        with f(files[name]) as handle:
            tensor = handle.get_slice(name)[start:end]
        hf_folder.check_finite(files[name], name, tensor)
        return tensor, tensor.numel() * tensor.element_size()
    with f(files[f"{name}_blocks"]) as handle:
        blocks = handle.get_slice(f"{name}_blocks")[start:end]
    with f(files[f"{name}_scales"]) as handle:
        scales = handle.get_slice(f"{name}_scales")[start:end]
    check_mxfp4(files, name, blocks, scales, start)
    # a scale of 254 puts values >= 2 past float32's (and bfloat16's) range: inf
    out = dequantize(blocks, scales, dtype)
    hf_folder.check_finite(files[f"{name}_scales"], f"{name} dequantized from MXFP4", out)
    return out, blocks.numel() + scales.numel()


def stored_names(fused: str, files: dict[str, Path]) -> list[str]:
    """The tensors a folder holds ``fused`` as: itself, or its MXFP4 blocks and scales."""
    short = fused.rsplit(".", 1)[-1]
    if fused not in files and short in QUANTIZED and f"{fused}_blocks" in files:
        return [f"{fused}_blocks", f"{fused}_scales"]
    return [fused]


def fuse(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """One layer's experts {w1, w3, b1, b3, w2, b2}, or those of some of its fused tensors (the
    export makes one at a time) -> gpt-oss's fused tensors (gate and up interleaved)."""
    out = {}
    for short, (gate, up) in (("gate_up_proj", ("w1", "w3")), ("gate_up_proj_bias", ("b1", "b3"))):
        if gate in tensors:
            out[short] = torch.stack([tensors[gate], tensors[up]], dim=-1).flatten(-2)
    for short, ours in (("down_proj", "w2"), ("down_proj_bias", "b2")):
        if ours in tensors:
            out[short] = tensors[ours]
    return out


# the rope_scaling / rope_parameters keys of a YaRN we apply
CONFIG_YARN_KEYS = (
    "rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow", "truncate",
    "original_max_position_embeddings", "attention_factor",
)  # fmt: skip


class GptOss(Family):
    model_type = "gpt_oss"
    class_name = "GptOssForCausalLM"
    title = "gpt-oss"
    marker = ("attn_sinks", equal(True))
    signature = "attn_sinks=True (attention sinks)"
    holds = {
        "qkv_bias": ANY, "attn_out_bias": ANY, "sliding_window": ANY,
        "expert_proj_bias": equal(True), "router_bias": equal(True), "swiglu_limit": GIVEN,
        "rope_yarn": ANY, "attn_head_dim": ANY,
    }  # fmt: skip
    ffn_key = "intermediate_size"
    experts_keys = ("num_local_experts", "num_experts")
    layer_names = LAYER_NAMES
    fused_experts = True

    def refusals(self, config: ModelConfig) -> list[str]:
        attention = config.attention
        if attention.qkv_bias == attention.out_bias:
            return []
        return [
            f"attn_sinks=True with qkv_bias={attention.qkv_bias!r}: gpt-oss, the family with "
            f"attention sinks, has one attention_bias: qkv_bias=attn_out_bias={attention.out_bias!r}"
        ]

    def options_from(self, hf: dict[str, Any]) -> dict[str, tuple[Any, str]]:
        bias = bool(hf.get("attention_bias", True))
        sliding = "sliding_attention" in (hf.get("layer_types") or [])
        heads, hidden, head_dim = (
            hf.get("num_attention_heads"),
            hf.get("hidden_size"),
            hf.get("head_dim"),
        )
        out: dict[str, Any] = {
            "attn_sinks": (True, "model_type"),
            "qkv_bias": (bias, "attention_bias"),
            "attn_out_bias": (bias, "attention_bias"),
            "sliding_window": (
                int(hf.get("sliding_window") or 0) if sliding else 0,
                "sliding_window",
            ),
            "expert_proj_bias": (True, "model_type"),
            "router_bias": (True, "model_type"),
            "swiglu_limit": (float(hf.get("swiglu_limit", 7.0)), "swiglu_limit"),
            "swiglu_alpha": (float(hf.get("swiglu_alpha", 1.702)), "swiglu_alpha"),
            # kept None when it is the default, so that a config round-trips equal
            "attn_head_dim": (
                head_dim if head_dim is not None and heads and head_dim * heads != hidden else None,
                "head_dim",
            ),
        }
        if yarn := rope_yarn_of(hf):
            out["rope_yarn"] = (yarn, "rope_parameters")
        return out

    def check_rope(self, rope: dict[str, Any], kind: str, key: str, refuse: Refuse) -> None:
        if kind != "yarn":
            return super().check_rope(rope, kind, key, refuse)
        unknown = sorted(set(rope) - set(CONFIG_YARN_KEYS))
        if unknown:
            refuse(
                key,
                f"is not supported: of YaRN's keys we apply {list(CONFIG_YARN_KEYS)}, not {unknown}",
            )
        if "factor" not in rope or "original_max_position_embeddings" not in rope:
            refuse(
                key, "is not supported: YaRN needs 'factor' and 'original_max_position_embeddings'"
            )

    def check_window(self, hf: dict[str, Any], seq_len: int, refuse: Refuse) -> None:
        """gpt-oss's window layers are the even ones (transformers' default ``layer_types``)."""
        n, types = hf.get("num_hidden_layers", 0), hf.get("layer_types")
        alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        if types is not None and types not in (alternating, ["full_attention"] * n):
            refuse(
                "layer_types",
                "is not supported: gpt-oss layers here alternate sliding_attention (even layers) "
                "and full_attention, or are all full_attention",
            )
        if (
            "sliding_attention" in (types or alternating)
            and not (hf.get("sliding_window") or 0) > 0
        ):
            refuse("sliding_window", "is not supported: sliding_attention layers need a window > 0")

    def check_own(self, hf: dict[str, Any], refuse: Refuse) -> None:
        quant = hf.get("quantization_config")
        if quant is not None and quant.get("quant_method") != "mxfp4":
            refuse("quantization_config", "is not supported: of quantized experts only MXFP4 loads")

    def expert_names(self, prefix: str, ours: str, expert_range: tuple[int, int]) -> list[str]:
        return [f"{prefix}mlp.experts.{FUSED[ours][0]}"]  # one fused tensor of every expert

    def fused_shapes(
        self, hf_name: str, config: ModelConfig, files: dict[str, Path]
    ) -> dict[str, tuple[int, ...]]:
        short, sizes = (
            hf_name.rsplit(".", 1)[-1],
            (config.n_experts, config.d_model, config.ffn_dim),
        )
        if stored_names(hf_name, files) == [hf_name]:
            return {hf_name: fused_shape(short, *sizes)}
        block = hf_name.rsplit(".", 1)[0]
        return {f"{block}.{k}": v for k, v in mxfp4_shapes(short, *sizes).items()}

    def read_fused_experts(
        self, ours: str, hf_name: str, p: Tensor, expert_range: tuple[int, int], files: Any
    ) -> int:
        """Our ``ours`` takes the even, odd or all columns of rows ``expert_range`` of ``hf_name``,
        read once for each of its halves: gate and up share it."""
        rows, read = read_fused(hf_folder.open_safetensors, files, hf_name, expert_range, p.dtype)
        p.copy_(rows[..., FUSED[ours][1]])
        return read // 2 if ours in ("w1", "w3", "b1", "b3") else read

    def fuse_experts(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return fuse(tensors)

    def config_json(self, config: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
        out.pop("rope_theta")  # transformers 5 reads rope_parameters
        attention, experts, yarn = config.attention, config.experts, config.position.yarn
        if yarn:
            out["rope_parameters"].update(rope_type="yarn", **yarn)
        window = attention.sliding_window
        out.update(
            sliding_window=window or None,
            layer_types=[
                "sliding_attention" if attention.sliding(i) else "full_attention"
                for i in range(config.n_layers)
            ],
            attention_bias=attention.qkv_bias,
            swiglu_limit=experts.swiglu_limit,
            swiglu_alpha=experts.swiglu_alpha,
            pad_token_id=None,
        )
        return out


FAMILY = GptOss()
