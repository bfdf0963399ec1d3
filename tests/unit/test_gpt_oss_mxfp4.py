"""gpt-oss's MXFP4 experts: a folder storing ``gate_up_proj`` and ``down_proj`` as ``_blocks`` and
``_scales`` (as released checkpoints do) imports to the weights transformers' own dequantization
gives (``transformers.integrations.mxfp4.convert_moe_packed_tensors``), each EP rank reading only its
experts' rows. The blocks are random bytes: every byte is two valid e2m1 values."""

from __future__ import annotations

import json

import pytest
import torch
from hf_tiny import build
from safetensors import safe_open
from safetensors.torch import save_file

from lightning_titan.hf import load as hf_load
from lightning_titan.hf.families.gpt_oss import mxfp4_shapes
from lightning_titan.model.decoder import ModelConfig, StageModel

D, F, E = 32, 64, 4  # the 32-value blocks cut D (gate_up) and F (down)


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("mxfp4")
    build("gpt_oss", root / "plain", shard=False, hidden_size=D, intermediate_size=F)
    with safe_open(str(root / "plain" / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    g = torch.Generator().manual_seed(0)
    for layer in range(4):
        for fused in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{fused}"
            del tensors[name]
            blocks, scales = mxfp4_shapes(fused, E, D, F).values()
            tensors[f"{name}_blocks"] = torch.randint(0, 256, blocks, generator=g).to(torch.uint8)
            tensors[f"{name}_scales"] = torch.randint(122, 130, scales, generator=g).to(torch.uint8)
    (root / "q").mkdir()
    save_file(tensors, str(root / "q" / "model.safetensors"))
    config = json.loads((root / "plain" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (root / "q" / "config.json").write_text(json.dumps(config))
    return root / "q", tensors


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_mxfp4_experts_import_as_transformers_dequantizes_them(mxfp4_folder, ep_rank):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder, tensors = mxfp4_folder
    config = hf_load.config_from_folder(folder, ModelConfig(seq_len=16))
    model = StageModel(config, ep_rank=ep_rank, ep=2)
    read = hf_load.load_stage(model, folder)
    start, end = model.expert_range
    for layer in range(4):
        name = f"model.layers.{layer}.mlp.experts."
        experts = model.layers[str(layer)].moe.experts

        def theirs(fused: str, name: str = name) -> torch.Tensor:
            blocks, scales = tensors[f"{name}{fused}_blocks"], tensors[f"{name}{fused}_scales"]
            return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[start:end]

        gate_up = theirs("gate_up_proj")  # [E, D, 2F], gate and up interleaved
        assert gate_up.abs().max() > 0
        assert torch.equal(experts.w1, gate_up[..., 0::2])
        assert torch.equal(experts.w3, gate_up[..., 1::2])
        assert torch.equal(experts.w2, theirs("down_proj"))
        assert torch.equal(experts.b1, tensors[f"{name}gate_up_proj_bias"][start:end, 0::2])
    # the packed bytes of this rank's two experts, not of all four (nor the dequantized floats)
    quantized = sum(t.numel() for k, t in tensors.items() if k.endswith(("_blocks", "_scales")))
    rest = sum(
        p.numel() * p.element_size()
        for n, p in model.named_parameters()
        if not n.endswith(("experts.w1", "experts.w3", "experts.w2"))
    )
    assert read == rest + quantized // 2


def _edited(folder, tmp_path, name, edit):
    """``folder`` again, with tensor ``name`` replaced by ``edit(it)``."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name] = edit(tensors[name])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    return tmp_path


GATE_UP = "model.layers.2.mlp.experts.gate_up_proj"


def _scale_at(value: int):
    def edit(scales: torch.Tensor) -> torch.Tensor:
        scales = scales.clone()
        scales[3, 5, 0] = value  # expert 3, row 5, block 0
        return scales

    return edit


@pytest.mark.parametrize(
    "name,edit,match",
    [
        # as floats or int64 the bytes would be cast, int64 ones wrapping modulo 256
        (f"{GATE_UP}_blocks", lambda t: t.long() + 256, rf"{GATE_UP}_blocks is torch.int64, not torch.uint8"),
        (f"{GATE_UP}_scales", lambda t: t.float(), rf"{GATE_UP}_scales is torch.float32, not torch.uint8"),
        # e8m0's 255 is NaN, not 2**128; the index is the global expert's
        (f"{GATE_UP}_scales", _scale_at(255), rf"{GATE_UP}_scales holds 1 e8m0 scale\(s\) of 255 \(NaN in MXFP4\), the first at \[expert, row, block\] = \[3, 5, 0\]"),
        # 254 is a scale, 2**127, but its values >= 2 are past float32's range
        (f"{GATE_UP}_scales", _scale_at(254), rf"'{GATE_UP} dequantized from MXFP4' holds \d+ non-finite"),
    ],
)  # fmt: skip
def test_mxfp4_bytes_that_are_not_mxfp4_are_refused_by_name(
    mxfp4_folder, tmp_path, name, edit, match
):
    folder = _edited(mxfp4_folder[0], tmp_path, name, edit)
    config = hf_load.config_from_folder(folder, ModelConfig(seq_len=16))
    with pytest.raises(ValueError, match=match):
        hf_load.load_stage(StageModel(config, ep_rank=1, ep=2), folder)


def test_an_unquantized_fused_expert_tensor_holding_nan_is_refused_by_name(mxfp4_folder, tmp_path):
    plain, name = mxfp4_folder[0].parent / "plain", "model.layers.1.mlp.experts.down_proj"
    folder = _edited(plain, tmp_path, name, lambda t: t.index_fill(0, torch.tensor([3]), torch.nan))
    config = hf_load.config_from_folder(folder, ModelConfig(seq_len=16))
    with pytest.raises(ValueError, match=rf"'{name}' holds {F * D} non-finite value\(s\)"):
        hf_load.load_stage(StageModel(config, ep_rank=1, ep=2), folder)
