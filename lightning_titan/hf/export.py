"""From a sharded checkpoint to the Hugging Face format of the model's family (``hf/families/``: the
one it was loaded from, ``hf.arch.architecture_of``), a tensor at a time (``hf/shards.py``); and the
full model in one process (``load_full_model``).

titan export --ckpt runs/dp_pp_ep --out mixtral-tiny [--dtype bf16]   # the runs' newest checkpoint
    [--max-shard-size 5GB] [--peft] [--base FOLDER]
# then: transformers.AutoModelForCausalLM.from_pretrained("mixtral-tiny")
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import Tensor

from lightning_titan.checkpoint import ModelEntries, consolidate, files, read_checkpoint_info, runs
from lightning_titan.data.tokenizer import tokenizer_files_of
from lightning_titan.hf import folder as hf_folder
from lightning_titan.hf import load as hf_load
from lightning_titan.hf import shards
from lightning_titan.hf.adapter import write_peft_folder
from lightning_titan.hf.arch import architecture_of, hf_config, hf_tensors
from lightning_titan.hf.shards import is_stacked_experts
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.lora import LoRA, is_adapter, merge_

__all__ = [
    "export_hf",
    "hf_config",
    "hf_state_dict",
    "is_stacked_experts",
    "load_full_model",
    "write_hf_folder",
]


def hf_state_dict(model: StageModel) -> dict[str, Tensor]:
    """This stage's parameters under the Hugging Face names of its family (``hf.arch.architecture_of``;
    experts split per global id, or fused as the family keeps them): the mapping the export writes."""
    read = _read_from(model)
    out: dict[str, Tensor] = {}
    for group in _groups(model):
        out.update({k: v.detach() for k, v in group.make(read(list(group.sources))).items()})
    return out


hf_mixtral_state_dict = hf_state_dict  # the name from when Mixtral was the only family


def _groups(model: StageModel) -> list[shards.Group]:
    return shards.groups_of(hf_tensors(model), model.expert_range, architecture_of(model.config))


def _read_from(model: StageModel) -> shards.Read:
    """The ``shards.Read`` of a model in memory: our tensors, an expert's row of its stacked tensor."""
    start = model.expert_range[0]
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())

    def read(keys: list[shards.Key]) -> list[Tensor]:
        return [
            tensors[n].detach() if e is None else tensors[n].detach()[e - start] for n, e in keys
        ]

    return read


def load_full_model(ckpt: str | Path, base: str | Path | None = None) -> StageModel:
    """The whole model (every layer and expert) in this process, in eval mode; no process group needed.

    A LoRA checkpoint holds the adapters only: the base is rebuilt from where the run took it,
    the ``init_from`` folder (``base``: another path to it) or the seed, and the adapters loaded
    onto it (``lora.merge_`` folds them in)."""
    info = read_checkpoint_info(ckpt)
    if not info.get("model_config"):
        raise ValueError(
            f"{ckpt} holds no model config: it was not written by TitanLM under TitanStrategy"
        )
    hparams = (info.get("meta") or {}).get("hyper_parameters") or {}
    lora = LoRA(**hparams["lora"]) if hparams.get("lora") else None
    model = StageModel(ModelConfig(**info["model_config"]), lora=lora)
    state = consolidate(ckpt)
    # TitanLM holds the stage as `self.model`: its keys start with "model."
    state = {k.removeprefix("model."): v for k, v in state.items()}
    if lora is None:
        model.load_state_dict(state, strict=True)
        return model.eval()
    folder = base or hparams.get("init_from")
    if folder is not None:
        if not Path(folder).is_dir():
            raise FileNotFoundError(
                f"{ckpt} holds LoRA adapters trained on the base model in {folder}, which is not "
                "a folder here; pass the base's folder (--base)"
            )
        hf_load.load_stage(model, folder)
    else:  # the base the run drew from its seed
        model.init_weights(hparams["seed"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    if unexpected or trained & set(missing):
        raise ValueError(
            f"{ckpt} does not hold this LoRA model's adapters: missing "
            f"{sorted(trained & set(missing))[:3]}, unexpected {sorted(unexpected)[:3]}"
        )
    return model.eval()


def byte_tokenizer_files() -> dict[str, dict]:
    """Our byte tokenizer (ids 0-255 = bytes, 256 = end of document) as a Hugging Face fast tokenizer:
    byte-level BPE with no merges, so every byte is one token with id = its value."""
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    eod = "<|endoftext|>"
    tokenizer: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": 256,
                "content": eod,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": {**vocab, eod: 256},
            "merges": [],
        },
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eod,
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
        "chat_template": BYTE_CHAT_TEMPLATE,
    }
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


# the built-in chat template (data/chat.py) in the jinja transformers' apply_chat_template reads:
# each turn its header <|role|> and a newline, its content, then the end-of-document token
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "<|endoftext|>{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what ByteLevel pre-tokenisation emits)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _looks_like_checkpoint(path: Path) -> bool:
    names = (files.MARKER, files.META_FILE, files.DCP_METADATA)
    return path.is_dir() and any((path / name).exists() for name in names)


def check_out(out: Path) -> None:
    """Refuse an ``--out`` that would overwrite something or vanish, before any model is loaded."""
    if out.is_symlink() and not out.exists():
        raise FileExistsError(
            f"--out {out} is a dangling symlink (to {os.readlink(out)}); remove it or choose a new "
            "--out directory"
        )
    if out.exists() and not out.is_dir():
        raise FileExistsError(
            f"--out {out} is an existing file; choose a new --out directory (or delete the file)"
        )
    inside = next((p for p in [out, *out.parents] if _looks_like_checkpoint(p)), None)
    if inside is not None:
        raise ValueError(
            f"--out {out} is inside the checkpoint directory {inside}: the next save of that "
            "checkpoint replaces the directory and deletes the export; choose an --out outside it"
        )
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"--out {out} exists and is not empty; choose a new --out directory")


def check_copyable(path: Path) -> None:
    """Refuse a file of the ``init_from`` folder that is a link out of it (to a key, a secret): the
    export would publish its content."""
    escaped = hf_folder.outside(path.parent, path.name)
    if escaped is not None:
        raise ValueError(
            f"{path} is a symlink to {escaped}, outside its folder {path.parent}: titan export "
            "copies only files inside the init_from folder; replace the link with a copy of the "
            "file it should be, or remove it"
        )


def export_hf(
    ckpt: str | Path,
    out: str | Path,
    dtype: str | torch.dtype = "bf16",
    max_shard_size: str | int = "5GB",
    progress: bool = True,
    peft: bool = False,
    base: str | Path | None = None,
) -> Path:
    """Write ``config.json`` and the weights in the model's family and in ``dtype``, cut into
    safetensors files of at most ``max_shard_size`` (with ``model.safetensors.index.json`` when there
    are several), and the tokenizer: the files of the Hugging Face folder the model was loaded from
    (init_from) when it has them, else ours when the data module used the byte tokenizer. The
    checkpoint is read a tensor at a time: memory holds one output file and one tensor. Nothing is
    written when the model fits no family. ``progress``: a line on stderr per file written.

    A LoRA checkpoint: the adapters merged into the base (rebuilt from ``init_from``, or ``base``,
    or the seed; the whole model in memory), or with ``peft`` the adapters alone as a PEFT adapter
    folder (``hf/adapter.py``)."""
    out, dtype, max_bytes = Path(out), shards.dtype_of(dtype), shards.size_of(max_shard_size)
    check_out(out)
    info = read_checkpoint_info(ckpt)
    meta = info.get("meta", {})
    if not info.get("model_config"):
        raise ValueError(
            f"{ckpt} holds no model config: it was not written by TitanLM under TitanStrategy"
        )
    config = ModelConfig(**info["model_config"])
    architecture_of(config)  # refused before the checkpoint is read or anything is written
    lora = (meta.get("hyper_parameters") or {}).get("lora")
    if peft and not lora:
        raise ValueError(f"--peft: {ckpt} was not trained with LoRA (model.lora); export it whole")
    if lora and peft:
        model = load_full_model(ckpt, base)
        adapters = {n: p.detach() for n, p in model.named_parameters() if is_adapter(n)}
        return write_peft_folder(out, adapters, config, LoRA(**lora))
    init_from = (meta.get("hyper_parameters") or {}).get("init_from")
    # no data module recorded (a plain DataLoader): the ids were the folder's if it has a tokenizer
    tokenizer = (meta.get("datamodule_hyper_parameters") or {}).get("tokenizer", "auto")
    copied = tokenizer_files_of(init_from) if init_from and tokenizer in ("auto", init_from) else []
    for path in copied:
        check_copyable(path)
    special = {}  # the folder's special tokens, as its own config.json gives them
    if copied:  # read before anything is written: a damaged one is named first
        assert init_from  # the files are copied from it
        hf = hf_folder.read_json(Path(init_from) / "config.json")
        special = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
    if lora:  # the base is not in the checkpoint: the whole model, its adapters folded in
        shapes = load_full_model(ckpt, base)
        merge_(shapes)
        read = _read_from(shapes)
    else:
        with torch.device("meta"):  # names and shapes: the values are read from the checkpoint
            shapes = StageModel(config)
        read = ModelEntries(ckpt).read
    byte_tokenizer = not copied and tokenizer in ("byte", "auto")
    stream = sys.stderr if progress else None
    _write(shapes, read, out, byte_tokenizer, dtype, max_bytes, stream)
    for path in copied:
        # the content only: the new file gets the mode every other file of the export gets
        shutil.copyfile(path, out / path.name)
    if special:
        written = json.loads((out / "config.json").read_text())
        written.update(special)
        (out / "config.json").write_text(json.dumps(written, indent=2))
    return out


def write_hf_folder(
    model: StageModel,
    out: str | Path,
    byte_tokenizer: bool = False,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
) -> Path:
    """``model`` (the whole of it, one process) as a Hugging Face folder of its family, in ``dtype``
    (None: the model's own); with ``byte_tokenizer`` (and a vocabulary that holds it) our byte
    tokenizer's files too."""
    cast = None if dtype is None else shards.dtype_of(dtype)
    max_bytes = shards.size_of(max_shard_size)
    return _write(model, _read_from(model), Path(out), byte_tokenizer, cast, max_bytes, None)


def _write(
    model: StageModel,
    read: shards.Read,
    out: Path,
    byte_tokenizer: bool,
    dtype: torch.dtype | None,
    max_bytes: int,
    progress: TextIO | None,
) -> Path:
    """The folder of ``model``'s family, its tensors read through ``read`` (``model``: their names
    and shapes, its values unused)."""
    try:
        import safetensors  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "titan export needs safetensors: pip install 'lightning-titan[export]'"
        ) from e
    family = architecture_of(model.config)
    bias_names = [n for n, b in model.named_buffers() if n.endswith("expert_bias")]
    biases = read([(n, None) for n in bias_names])
    biased = [n for n, b in zip(bias_names, biases, strict=True) if b.any()]
    if biased and not family.keeps_expert_bias:  # DeepSeek-V3 keeps it
        warnings.warn(
            f"{len(biased)} MoE layers carry an expert bias (router_bias_update_rate, e.g. "
            f"{biased[0]}): {family.class_name} has no place for it, so the export leaves it out and "
            "its router picks experts by the unbiased scores (the combine weights are unchanged)",
            stacklevel=3,
        )
    if model.config.capacity_factor is not None:
        warnings.warn(
            f"the model was trained with capacity_factor={model.config.capacity_factor}: "
            f"{family.class_name} has no expert capacity, so the exported model keeps every assignment (dropless)",
            stacklevel=3,
        )
    out.mkdir(parents=True, exist_ok=True)
    shards.write_shards(_groups(model), read, out, dtype, max_bytes, progress)
    byte_tokenizer = byte_tokenizer and model.config.vocab_size >= 257
    eos = 256 if byte_tokenizer else None
    config = hf_config(model.config, eos)
    written = dtype or next(p.dtype for p in model.parameters())
    config["torch_dtype"] = str(written).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if byte_tokenizer:
        for name, content in byte_tokenizer_files().items():
            (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="titan export", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ckpt",
        required=True,
        help="a checkpoint directory written by TitanStrategy, or a run folder (runs/<name>/"
        "version_N) or a config's runs (runs/<name>): their newest complete checkpoint",
    )
    parser.add_argument("--out", required=True, help="a new directory for the Hugging Face files")
    parser.add_argument(
        "--dtype",
        default="bf16",
        choices=sorted(shards.DTYPES),
        help="the weights' dtype in the folder (default bf16, as the families publish them)",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="the largest safetensors file, e.g. 5GB, 500MB, 2GiB (default 5GB); a model that "
        "fits in one is one model.safetensors",
    )
    parser.add_argument(
        "--peft",
        action="store_true",
        help="a LoRA checkpoint's adapters alone, as a PEFT adapter folder (default: merged into "
        "the base)",
    )
    parser.add_argument(
        "--base",
        default=None,
        help="a LoRA checkpoint's base model folder, where it is no longer at the init_from path "
        "the run used",
    )
    args = parser.parse_args(argv)
    try:
        max_bytes = shards.size_of(args.max_shard_size)
    except ValueError as e:
        parser.error(str(e))
    try:
        ckpt = runs.resolve(args.ckpt, say=print)
    except ValueError as e:
        parser.error(str(e))
    out = export_hf(ckpt, args.out, args.dtype, max_bytes, peft=args.peft, base=args.base)
    if args.peft:
        print(f"wrote {out.resolve()} (load with peft.PeftModel.from_pretrained(base, folder))")
    else:
        print(
            f"wrote {out.resolve()} (load with transformers.AutoModelForCausalLM.from_pretrained)"
        )
