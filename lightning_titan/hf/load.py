"""Start from a pretrained Hugging Face MoE folder (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss;
hf/arch.py):
its config becomes our ModelConfig, and each rank reads only its own stage's tensors and its own
experts, memory-mapped from the safetensors files.

titan fit --config configs/dp_pp_ep.yaml --model.init_from=path/to/Mixtral-8x7B-v0.1
# or: TitanLM(init_from="path/to/Mixtral-8x7B-v0.1")

A ModelConfig field counts as given when its value differs from the dataclass default; a given field
must equal the folder's value (an error names both). Fields at their default take the folder's value.
The training fields (seq_len, aux_loss_coef, z_loss_coef, init_std, activation_checkpointing) are ours.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from lightning_titan.hf import deepseek, gpt_oss
from lightning_titan.hf import folder as hf_folder
from lightning_titan.hf.arch import (
    ARCHITECTURES,
    GPT_OSS,
    OLMOE,
    QWEN2_MOE,
    QWEN3_MOE,
    Architecture,
    architecture_of,
    hf_names,
    hf_tensors,
    options_from,
    rope_theta_of,
)
from lightning_titan.hf.export import is_stacked_experts
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.tensor_parallel import real_size, tp_shards

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# our field -> the Hugging Face config key it is read from, in every family (rope_theta may sit in
# rope_parameters); ffn_dim and n_experts have a key per family (hf_arch.Architecture)
HF_CONFIG_KEYS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "top_k": "num_experts_per_tok",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
}
# transformers' config defaults, for keys a config.json may leave out
HF_DEFAULTS = {"rope_theta": 1e6, "rms_norm_eps": 1e-5}


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"init_from={str(folder)!r} has no config.json: pass a Hugging Face model folder "
            "(config.json + *.safetensors), e.g. one written by save_pretrained()"
        )
    return hf_folder.read_json(path)


def check_supported(hf: dict[str, Any], seq_len: int, folder: str | Path) -> Architecture:
    """The folder's family; refuse what our decoder does not model, naming the config.json field and
    its value."""

    def refuse(field: str, why: str) -> NoReturn:
        raise ValueError(f"{folder}/config.json: {field}={hf.get(field)!r} {why}")

    arch = ARCHITECTURES.get(str(hf.get("model_type")))
    if arch is None:
        refuse(
            "model_type", f"is not supported: init_from loads model_type {sorted(ARCHITECTURES)}"
        )
    if (hf.get("architectures") or [arch.class_name]) != [arch.class_name]:
        refuse(
            "architectures",
            f"is not supported: init_from loads [{arch.class_name!r}] for "
            f"model_type {arch.model_type!r}",
        )
    if hf.get("tie_word_embeddings", False):
        refuse("tie_word_embeddings", "is not supported: our lm_head is untied from the embedding")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "is not supported: our experts are SwiGLU with silu")
    head_dim, heads = hf.get("head_dim"), hf.get("num_attention_heads", 0)
    if arch.model_type == deepseek.DEEPSEEK_V3:  # head_dim there is qk_rope_head_dim
        deepseek.check_supported(hf, refuse)
    elif (
        arch.model_type not in (QWEN3_MOE, GPT_OSS)
        and head_dim is not None
        and head_dim * heads != hf.get("hidden_size")
    ):
        refuse("head_dim", "is not supported: ours is hidden_size / num_attention_heads")
    for field in ("rope_scaling", "rope_parameters"):  # transformers 4 / 5 spell it differently
        rope = hf.get(field) or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "yarn" and arch.model_type == deepseek.DEEPSEEK_V3:
            continue  # its YaRN is modelled (deepseek.rope_yarn_of)
        if arch.model_type == GPT_OSS and kind == "yarn":
            _check_gpt_oss_yarn(rope, field, refuse)
        elif kind != "default":
            refuse(field, "is not supported: we apply plain RoPE (rope_type 'default')")
    for field in ("router_jitter_noise", "attention_dropout"):
        if hf.get(field, 0.0):
            refuse(field, "is not supported: we model it as 0.0")
    _check_attention(hf, arch, seq_len, refuse)
    _check_sparse_layers(hf, arch, refuse)
    return arch


def _check_gpt_oss_yarn(
    rope: dict[str, Any], field: str, refuse: Callable[[str, str], NoReturn]
) -> None:
    unknown = sorted(set(rope) - set(YARN_KEYS))
    if unknown:
        refuse(field, f"is not supported: of YaRN's keys we apply {list(YARN_KEYS)}, not {unknown}")
    if "factor" not in rope or "original_max_position_embeddings" not in rope:
        refuse(
            field, "is not supported: YaRN needs 'factor' and 'original_max_position_embeddings'"
        )


YARN_KEYS = (
    "rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow", "truncate",
    "original_max_position_embeddings", "attention_factor",
)  # fmt: skip


def _check_gpt_oss(hf: dict[str, Any], refuse: Callable[[str, str], NoReturn]) -> None:
    """gpt-oss's window layers are the even ones (transformers' default ``layer_types``)."""
    n, types = hf.get("num_hidden_layers", 0), hf.get("layer_types")
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    if types is not None and types not in (alternating, ["full_attention"] * n):
        refuse(
            "layer_types",
            "is not supported: gpt-oss layers here alternate sliding_attention (even layers) and "
            "full_attention, or are all full_attention",
        )
    if "sliding_attention" in (types or alternating) and not (hf.get("sliding_window") or 0) > 0:
        refuse("sliding_window", "is not supported: sliding_attention layers need a window > 0")
    quant = hf.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "mxfp4":
        refuse("quantization_config", "is not supported: of quantized experts only MXFP4 loads")


def _check_attention(
    hf: dict[str, Any], arch: Architecture, seq_len: int, refuse: Callable[[str, str], NoReturn]
) -> None:
    if arch.model_type == GPT_OSS:
        return _check_gpt_oss(hf, refuse)
    window = hf.get("sliding_window")
    if arch.model_type in (QWEN2_MOE, QWEN3_MOE):  # the window applies only when this is on
        window = window if hf.get("use_sliding_window", False) else None
        if window is None and any(t != "full_attention" for t in hf.get("layer_types") or []):
            refuse(
                "layer_types", "is not supported: every layer attends to the whole sequence here"
            )
    if window is not None and window < seq_len:
        refuse(
            "sliding_window",
            f"< seq_len={seq_len}: we attend to the whole sequence; train with seq_len <= {window}",
        )
    if arch.model_type in (QWEN3_MOE, OLMOE) and hf.get("attention_bias", False):
        refuse("attention_bias", "is not supported: only Qwen2-MoE's q/k/v biases are (qkv_bias)")
    if arch.model_type == OLMOE and hf.get("clip_qkv") is not None:
        refuse("clip_qkv", "is not supported: we do not clamp q, k and v")


def _check_sparse_layers(
    hf: dict[str, Any], arch: Architecture, refuse: Callable[[str, str], NoReturn]
) -> None:
    if arch.model_type == QWEN2_MOE and not hf.get("shared_expert_intermediate_size", 0) > 0:
        refuse(
            "shared_expert_intermediate_size",
            "is not supported: a Qwen2-MoE shared expert has a positive hidden size",
        )
    if arch.model_type not in (QWEN2_MOE, QWEN3_MOE):
        return
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


def folder_fields(hf: dict[str, Any], folder: str | Path, arch: Architecture) -> dict[str, Any]:
    """Our ModelConfig fields read from a config.json: field -> (value, the key it came from)."""
    values = {}
    keys = {**HF_CONFIG_KEYS, "ffn_dim": arch.ffn_key, "n_experts": arch.experts_keys[0]}
    for ours, key in keys.items():
        value = rope_theta_of(hf) if key == "rope_theta" else hf.get(key)
        if ours == "n_experts":
            key = next((k for k in arch.experts_keys if hf.get(k) is not None), key)
            value = hf.get(key)
        if key == "num_key_value_heads" and value is None:
            value = hf.get("num_attention_heads")  # transformers' rule
        if value is None:
            value = HF_DEFAULTS.get(key)
        if value is None:
            raise ValueError(
                f"{folder}/config.json has no {key!r}: it is not a complete {arch.class_name} config"
            )
        values[ours] = (float(value) if ours in ("rope_theta", "norm_eps") else value, key)
    return {**values, **options_from(hf, arch)}


def config_from_folder(folder: str | Path, given: ModelConfig | None = None) -> ModelConfig:
    """``given`` (default: ModelConfig()) with the model's shape and options read from ``folder``'s
    config.json.

    A field of ``given`` that is not at its default is explicit: it must equal the folder's value."""
    given = given if given is not None else ModelConfig()
    hf = read_hf_config(folder)
    arch = check_supported(hf, given.seq_len, folder)
    values = folder_fields(hf, folder, arch)
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    for name, (value, key) in values.items():
        mine = getattr(given, name)
        if mine != defaults[name] and mine != value:
            shown = hf.get(key) if key in hf else value
            raise ValueError(
                f"ModelConfig {name}={mine!r} (--model.model.{name}) disagrees with "
                f"{folder}/config.json {key}={shown!r} (our {name}={value!r}): leave {name} at its "
                "default to take the folder's value, or choose another init_from"
            )
    return dataclasses.replace(given, **{name: value for name, (value, _) in values.items()})


def tensor_files(folder: str | Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it (sharded index or one file)."""
    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        weight_map = hf_folder.read_json(folder / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(
                f"{folder / INDEX_FILE} has no weight_map (tensor name -> file); "
                f"{hf_folder.REDOWNLOAD}"
            )
        for name, file in weight_map.items():
            escaped = hf_folder.outside(folder, file)
            if escaped is not None:
                raise ValueError(
                    f"{folder / INDEX_FILE}: weight_map[{name!r}] = {file!r} leads out of the folder "
                    f"(to {escaped}); its entries must name files inside {folder}: put the file "
                    "there and name it relative to the folder (e.g. model-00001-of-00002.safetensors)"
                )
        return {name: folder / file for name, file in weight_map.items()}
    if (folder / SINGLE_FILE).is_file():
        with hf_folder.open_safetensors(folder / SINGLE_FILE) as f:
            return dict.fromkeys(f.keys(), folder / SINGLE_FILE)
    raise FileNotFoundError(
        f"init_from={str(folder)!r} has neither {INDEX_FILE} nor {SINGLE_FILE}: only safetensors "
        "folders load (save with save_pretrained(..., safe_serialization=True))"
    )


def hf_shapes(
    model: StageModel, files: dict[str, Path] | None = None
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every Hugging Face tensor ``model`` holds -> (our parameter name, the shape it must have);
    ``files``: the folder's tensors (gpt-oss's experts may be stored as MXFP4 blocks and scales)."""
    out, cut = {}, tp_shards(model)
    arch = architecture_of(model.config)
    c = model.config
    for name, p in hf_tensors(model):
        names = hf_names(name, model.expert_range, arch)
        if arch.model_type == GPT_OSS and is_stacked_experts(name):  # whole fused tensors
            fused, short = names[0], names[0].rsplit(".", 1)[-1]
            shapes = {fused: gpt_oss.fused_shape(short, c.n_experts, c.d_model, c.ffn_dim)}
            if gpt_oss.stored_names(fused, files or {}) != [fused]:
                shapes = gpt_oss.mxfp4_shapes(short, c.n_experts, c.d_model, c.ffn_dim)
                shapes = {f"{fused.rsplit('.', 1)[0]}.{k}": v for k, v in shapes.items()}
            out.update({k: (name, v) for k, v in shapes.items()})
            continue
        shape = tuple(p.shape[1:])[::-1] if is_stacked_experts(name) else tuple(p.shape)
        if id(p) in cut:  # a TP rank's part of a weight: the file holds the whole of it
            shape = tuple(
                cut[id(p)].full_size if d == cut[id(p)].dim else n for d, n in enumerate(shape)
            )
        for hf_name in names:
            out[hf_name] = (name, shape)
    return out


def check_tensors(model: StageModel, folder: str | Path) -> dict[Path, list[str]]:
    """Raise unless every tensor ``model`` needs is in ``folder`` with its shape (headers only are read).

    Returns the needed tensors' names grouped by the file that holds them."""
    files = tensor_files(folder)
    needed = hf_shapes(model, files)
    missing = sorted(set(needed) - set(files))
    if missing:
        raise ValueError(
            f"init_from={str(folder)!r} lacks {len(missing)} tensor(s) the model needs, e.g. "
            f"{missing[0]!r} (for our {needed[missing[0]][0]!r}); is it a complete "
            f"{architecture_of(model.config).class_name} folder?"
        )
    by_file: dict[Path, list[str]] = defaultdict(list)
    for hf_name in needed:
        by_file[files[hf_name]].append(hf_name)
    for path, names in by_file.items():
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; {INDEX_FILE} names it for {names[0]!r}")
        with hf_folder.open_safetensors(path) as f:
            present = set(f.keys())
            for hf_name in names:
                if hf_name not in present:
                    raise ValueError(f"{path} lacks {hf_name!r}, which {INDEX_FILE} names it for")
                got = tuple(f.get_slice(hf_name).get_shape())
                if got != needed[hf_name][1]:
                    raise ValueError(
                        f"{path.name}: {hf_name!r} has shape {list(got)} but our "
                        f"{needed[hf_name][0]!r} needs {list(needed[hf_name][1])}; the folder does "
                        "not match its config.json"
                    )
    return by_file


def check_folder(folder: str | Path, config: ModelConfig) -> None:
    """Every tensor of the whole model present with its shape; no tensor data is read."""
    with torch.device("meta"):
        check_tensors(StageModel(config), folder)


@torch.no_grad()
def load_stage(model: StageModel, folder: str | Path) -> int:
    """Copy this stage's tensors (its layers, its experts only) from ``folder`` into ``model``.

    Every shape is checked before anything is copied; each file is memory-mapped, so a rank reads
    only the bytes of the tensors it holds. Returns the number of tensor bytes read."""
    by_file = check_tensors(model, folder)
    targets = {}  # hf name -> the parameter (or expert row) it fills, and whether it is transposed
    arch = architecture_of(model.config)
    read, files = 0, tensor_files(folder)
    for name, p in hf_tensors(model):
        stacked = is_stacked_experts(name)
        if arch.model_type == GPT_OSS and stacked:
            read += _load_gpt_oss_experts(name, p, model, files)
            continue
        for row, hf_name in enumerate(hf_names(name, model.expert_range, arch)):
            targets[hf_name] = (p[row], True) if stacked else (p, False)
    cut = tp_shards(model)
    for path, names in by_file.items():
        with hf_folder.open_safetensors(path) as f:
            for hf_name in names:
                if hf_name not in targets:  # gpt-oss's fused experts, read above
                    continue
                target, transposed = targets[hf_name]
                shard = cut.get(id(target))
                if shard is None:
                    tensor = f.get_tensor(hf_name)
                    target.copy_(tensor.t() if transposed else tensor)
                else:  # only this TP rank's rows (or columns); padded vocabulary rows stay zero
                    per_rank = target.shape[shard.dim]
                    real = real_size(shard.full_size, shard.size, shard.rank)
                    index = [slice(None)] * target.dim()
                    index[shard.dim] = slice(shard.rank * per_rank, shard.rank * per_rank + real)
                    tensor = f.get_slice(hf_name)[tuple(index)]
                    target.zero_().narrow(shard.dim, 0, real).copy_(tensor)
                read += tensor.numel() * tensor.element_size()
    return read


def _load_gpt_oss_experts(
    name: str, p: torch.Tensor, model: StageModel, files: dict[str, Path]
) -> int:
    """Fill our stacked expert tensor ``name`` from rows ``model.expert_range`` of gpt-oss's fused
    tensor (its even, odd or all columns); returns the bytes read. The fused tensor is read once for
    each of its two halves: gate and up share it."""
    arch = architecture_of(model.config)
    fused = hf_names(name, model.expert_range, arch)[0]
    rows, read = gpt_oss.read_fused(
        hf_folder.open_safetensors, files, fused, model.expert_range, p.dtype
    )
    columns = gpt_oss.FUSED[name.rsplit(".", 1)[-1]][1]
    p.copy_(rows[..., columns])
    shared = name.rsplit(".", 1)[-1] in ("w1", "w3", "b1", "b3")
    return read // 2 if shared else read
