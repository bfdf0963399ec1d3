"""gpt-oss (``GptOssForCausalLM``): its tensor names, its fused expert tensors and MXFP4 expert weights.

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

GPT_OSS = "gpt_oss"
# our name inside layer {i} -> gpt-oss's, where it differs from hf_arch.LAYER_NAMES
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


def expert_name(layer: str, ours: str) -> str:
    """The fused gpt-oss tensor that holds our expert tensor ``ours`` (w1, b3, ...) of ``layer``."""
    return f"model.layers.{layer}.mlp.experts.{FUSED[ours][0]}"


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
    blocks = blocks.to(torch.uint8)
    out = torch.empty(*blocks.shape[:-1], blocks.shape[-1] * 2, dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    out = torch.ldexp(out, (scales.to(torch.int32) - 127).unsqueeze(-1))
    e, rows, groups, per_group = out.shape
    return out.reshape(e, rows, groups * per_group).transpose(1, 2).contiguous()


def read_fused(
    f: Any, files: dict[str, Path], name: str, experts: tuple[int, int], dtype: torch.dtype
) -> tuple[Tensor, int]:
    """Rows ``experts`` of the fused tensor ``name`` (dequantized from MXFP4 where the folder stores
    ``name_blocks``), and the bytes read. ``f(path)`` opens a safetensors file."""
    start, end = experts
    if name in files:
        with f(files[name]) as handle:
            tensor = handle.get_slice(name)[start:end]
        return tensor, tensor.numel() * tensor.element_size()
    with f(files[f"{name}_blocks"]) as handle:
        blocks = handle.get_slice(f"{name}_blocks")[start:end]
    with f(files[f"{name}_scales"]) as handle:
        scales = handle.get_slice(f"{name}_scales")[start:end]
    return dequantize(blocks, scales, dtype), blocks.numel() + scales.numel()


def stored_names(fused: str, files: dict[str, Path]) -> list[str]:
    """The tensors a folder holds ``fused`` as: itself, or its MXFP4 blocks and scales."""
    short = fused.rsplit(".", 1)[-1]
    if fused not in files and short in QUANTIZED and f"{fused}_blocks" in files:
        return [f"{fused}_blocks", f"{fused}_scales"]
    return [fused]


def fuse(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """One layer's experts {w1, w3, b1, b3, w2, b2} -> gpt-oss's fused tensors (gate and up
    interleaved)."""
    return {
        "gate_up_proj": torch.stack([tensors["w1"], tensors["w3"]], dim=-1).flatten(-2),
        "gate_up_proj_bias": torch.stack([tensors["b1"], tensors["b3"]], dim=-1).flatten(-2),
        "down_proj": tensors["w2"],
        "down_proj_bias": tensors["b2"],
    }
