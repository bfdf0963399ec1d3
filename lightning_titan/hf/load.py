"""Start from a pretrained Hugging Face MoE folder of a family we know (``hf/families/``: Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss, DeepSeek-V3): its config becomes our ModelConfig, and each rank
reads only its own stage's tensors and its own experts, memory-mapped from the safetensors files.

titan fit --config configs/dp_pp_ep.yaml --model.init_from=path/to/Mixtral-8x7B-v0.1
# or: TitanLM(init_from="path/to/Mixtral-8x7B-v0.1")

A ModelConfig field counts as given when its value differs from the dataclass default; a given field
must equal the folder's value (an error names both). Fields at their default take the folder's value.
The training fields (seq_len, aux_loss_coef, z_loss_coef, init_std, activation_checkpointing) are ours.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, NoReturn

import torch

from lightning_titan.hf import folder as hf_folder
from lightning_titan.hf.arch import architecture_of, hf_names, hf_tensors, rope_theta_of
from lightning_titan.hf.families import FAMILIES
from lightning_titan.hf.family import DEFAULTS, Family
from lightning_titan.hf.shards import is_stacked_experts
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.options import FLAT_FIELDS
from lightning_titan.parallel.tensor_parallel import real_size, tp_shards

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# our field -> the Hugging Face config key it is read from, in every family (rope_theta may sit in
# rope_parameters); ffn_dim and n_experts have a key per family (hf.family.Family)
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
    if not Path(folder).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", str(folder)):
        name = str(folder).split("/")[1]
        raise FileNotFoundError(
            f"init_from={str(folder)!r} is no folder here; as a Hugging Face Hub id, download it "
            f"first (huggingface-cli download {folder} --local-dir {name}) and pass the folder "
            f"(--model.init_from={name})"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"init_from={str(folder)!r} has no config.json: pass a Hugging Face model folder "
            "(config.json + *.safetensors), e.g. one written by save_pretrained()"
        )
    return hf_folder.read_json(path)


def check_supported(hf: dict[str, Any], seq_len: int, folder: str | Path) -> Family:
    """The folder's family; refuse what our decoder does not model, naming the config.json field and
    its value."""

    def refuse(field: str, why: str) -> NoReturn:
        raise ValueError(f"{folder}/config.json: {field}={hf.get(field)!r} {why}")

    family = FAMILIES.get(str(hf.get("model_type")))
    if family is None:
        refuse("model_type", f"is not supported: init_from loads model_type {sorted(FAMILIES)}")
    if (hf.get("architectures") or [family.class_name]) != [family.class_name]:
        refuse(
            "architectures",
            f"is not supported: init_from loads [{family.class_name!r}] for "
            f"model_type {family.model_type!r}",
        )
    family.check_supported(hf, seq_len, refuse)
    return family


def folder_fields(hf: dict[str, Any], folder: str | Path, family: Family) -> dict[str, Any]:
    """Our ModelConfig fields read from a config.json: field -> (value, the key it came from). The
    family options its family does not hold are their defaults (a model from a folder is of that
    family)."""
    values = {}
    keys = {**HF_CONFIG_KEYS, "ffn_dim": family.ffn_key, "n_experts": family.experts_keys[0]}
    for ours, key in keys.items():
        value = rope_theta_of(hf) if key == "rope_theta" else hf.get(key)
        if ours == "n_experts":
            key = next((k for k in family.experts_keys if hf.get(k) is not None), key)
            value = hf.get(key)
        if key == "num_key_value_heads" and value is None:
            value = hf.get("num_attention_heads")  # transformers' rule
        if value is None:
            value = HF_DEFAULTS.get(key)
        if value is None:
            raise ValueError(
                f"{folder}/config.json has no {key!r}: it is not a complete {family.class_name} config"
            )
        values[ours] = (float(value) if ours in ("rope_theta", "norm_eps") else value, key)
    unheld = {
        name: (DEFAULTS[name], "model_type")
        for name in FLAT_FIELDS
        if name not in values and family.need(name) is None
    }
    return {**values, **unheld, **family.options_from(hf)}


def config_from_folder(folder: str | Path, given: ModelConfig | None = None) -> ModelConfig:
    """``given`` (default: ModelConfig()) with the model's shape and options read from ``folder``'s
    config.json.

    A field of ``given`` that is not at its default is explicit: it must equal the folder's value."""
    return config_from_hf(read_hf_config(folder), folder, given)


def config_from_hf(
    hf: dict[str, Any], folder: str | Path, given: ModelConfig | None = None
) -> ModelConfig:
    """``config_from_folder`` from an already read config.json (``titan plan`` drops the keys that
    do not change the shapes first)."""
    given = given if given is not None else ModelConfig()
    family = check_supported(hf, given.seq_len, folder)
    values = folder_fields(hf, folder, family)
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
            if not isinstance(file, str):
                raise ValueError(
                    f"{folder / INDEX_FILE}: weight_map[{name!r}] = {file!r} is not a file name; "
                    f"its entries map tensor names to safetensors files; {hf_folder.REDOWNLOAD}"
                )
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
    family = architecture_of(model.config)
    for name, p in hf_tensors(model):
        names = hf_names(name, model.expert_range, family)
        if family.fused_experts and is_stacked_experts(name):  # whole fused tensors
            shapes = family.fused_shapes(names[0], model.config, files or {})
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


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # per-expert tensors (fused families have none)


def check_counts(folder: str | Path, config: ModelConfig) -> None:
    """The config's layers and experts against the tensors the files name (the index or the header):
    a config.json that does not match its weights (``num_hidden_layers: 10000000``) is named before
    a model of its size, or a name for each of its tensors, is built."""
    names = tensor_files(folder)
    for what, key, pattern, wanted in (
        ("layers", "num_hidden_layers", _LAYER, config.n_layers),
        ("experts", "the expert count", _EXPERT, config.n_experts),
    ):
        held = {int(m.group(1)) for n in names if (m := pattern.search(n))}
        if held and wanted != max(held) + 1:
            raise ValueError(
                f"{folder}/config.json gives {wanted} {what} ({key}), but its weight files hold "
                f"{max(held) + 1} (numbered 0..{max(held)}): the config does not belong to these "
                f"weights; {hf_folder.REDOWNLOAD}"
            )


def check_folder(folder: str | Path, config: ModelConfig) -> None:
    """Every tensor of the whole model present with its shape; no tensor data is read."""
    check_counts(folder, config)
    with torch.device("meta"):
        check_tensors(StageModel(config), folder)


@torch.no_grad()
def load_stage(model: StageModel, folder: str | Path) -> int:
    """Copy this stage's tensors (its layers, its experts only) from ``folder`` into ``model``.

    Every shape is checked before anything is copied, and every value read is checked finite; each
    file is memory-mapped, so a rank reads only the bytes of the tensors it holds. Returns the number of tensor bytes read."""
    by_file = check_tensors(model, folder)
    targets = {}  # hf name -> the parameter (or expert row) it fills, and whether it is transposed
    family = architecture_of(model.config)
    read, files = 0, tensor_files(folder)
    for name, p in hf_tensors(model):
        stacked = is_stacked_experts(name)
        names = hf_names(name, model.expert_range, family)
        if family.fused_experts and stacked:  # its own reader (gpt-oss: even/odd columns, MXFP4)
            ours = name.rsplit(".", 1)[-1]
            read += family.read_fused_experts(ours, names[0], p, model.expert_range, files)
            continue
        for row, hf_name in enumerate(names):
            targets[hf_name] = (p[row], True) if stacked else (p, False)
    cut = tp_shards(model)
    for path, names in by_file.items():
        with hf_folder.open_safetensors(path) as f:
            for hf_name in names:
                if hf_name not in targets:  # fused experts, read above
                    continue
                target, transposed = targets[hf_name]
                shard = cut.get(id(target))
                if shard is None:
                    tensor = f.get_tensor(hf_name)
                    hf_folder.check_finite(path, hf_name, tensor)
                    target.copy_(tensor.t() if transposed else tensor)
                else:  # only this TP rank's rows (or columns); padded vocabulary rows stay zero
                    per_rank = target.shape[shard.dim]
                    real = real_size(shard.full_size, shard.size, shard.rank)
                    index = [slice(None)] * target.dim()
                    index[shard.dim] = slice(shard.rank * per_rank, shard.rank * per_rank + real)
                    tensor = f.get_slice(hf_name)[tuple(index)]
                    hf_folder.check_finite(path, hf_name, tensor)
                    target.zero_().narrow(shard.dim, 0, real).copy_(tensor)
                read += tensor.numel() * tensor.element_size()
    return read
