"""From a sharded checkpoint to one process: the full model, and the Hugging Face Mixtral format.

titan export --ckpt runs/dp_pp_ep/checkpoints/last.ckpt --out mixtral-tiny
# then: transformers.MixtralForCausalLM.from_pretrained("mixtral-tiny")
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path

from torch import Tensor

from lightning_titan.checkpoint import consolidate, files, read_checkpoint_info
from lightning_titan.model import ModelConfig, StageModel

# Our name -> Hugging Face Mixtral name ("{i}" is the global layer id). Experts map per row, transposed.
HF_MIXTRAL_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attn.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attn.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attn.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attn.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.moe_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.moe.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
    "layers.{i}.moe.experts.{w}": "model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def hf_mixtral_names(name: str, expert_range: tuple[int, int] = (0, 1)) -> list[str]:
    """The Hugging Face Mixtral tensors that hold our parameter ``name``: one name, or for stacked
    experts one per row (row r is global expert ``expert_range[0] + r``; each the row's transpose)."""
    parts = name.split(".")
    if parts[0] != "layers":
        return [HF_MIXTRAL_NAMES[name]]
    layer, rest = parts[1], ".".join(parts[2:])
    if rest.startswith("moe.experts."):
        template = HF_MIXTRAL_NAMES["layers.{i}.moe.experts.{w}"]
        return [template.format(i=layer, e=e, w=parts[-1]) for e in range(*expert_range)]
    return [HF_MIXTRAL_NAMES["layers.{i}." + rest].format(i=layer)]


def is_stacked_experts(name: str) -> bool:
    """Our expert tensors are [n_local, ...]: Hugging Face holds each row, transposed, apart."""
    return ".moe.experts." in name


def hf_mixtral_state_dict(model: StageModel) -> dict[str, Tensor]:
    """This stage's parameters under Hugging Face Mixtral names (experts split per global id)."""
    out = {}
    for name, p in model.named_parameters():
        hf_names = hf_mixtral_names(name, model.expert_range)
        if not is_stacked_experts(name):
            out[hf_names[0]] = p.detach()
            continue
        for row, hf_name in enumerate(hf_names):
            out[hf_name] = p[row].detach().t().contiguous()
    return out


def load_full_model(ckpt: str | Path) -> StageModel:
    """The whole model (every layer and expert) in this process, in eval mode; no process group needed."""
    info = read_checkpoint_info(ckpt)
    if not info.get("model_config"):
        raise ValueError(
            f"{ckpt} holds no model config: it was not written by TitanLM under TitanStrategy"
        )
    model = StageModel(ModelConfig(**info["model_config"]))
    state = consolidate(ckpt)
    # TitanLM holds the stage as `self.model`: its keys start with "model."
    state = {k.removeprefix("model."): v for k, v in state.items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def hf_config(config: ModelConfig, eos_token_id: int | None = None) -> dict:
    return {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.ffn_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "num_local_experts": config.n_experts,
        "num_experts_per_tok": config.top_k,
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
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


def byte_tokenizer_files() -> dict[str, dict]:
    """Our byte tokenizer (ids 0-255 = bytes, 256 = end of document) as a Hugging Face fast tokenizer:
    byte-level BPE with no merges, so every byte is one token with id = its value."""
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    eod = "<|endoftext|>"
    tokenizer = {
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
        ],  # fmt: skip
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },  # fmt: skip
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
        },  # fmt: skip
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eod, "model_max_length": 1 << 30,
              "clean_up_tokenization_spaces": False}  # fmt: skip
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


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


def export_hf(ckpt: str | Path, out: str | Path) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ the tokenizer when it is our byte tokenizer)."""
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError(
            "titan export needs safetensors: pip install 'lightning-titan[export]'"
        ) from e
    out = Path(out)
    check_out(out)
    model = load_full_model(ckpt)
    biased = [n for n, b in model.named_buffers() if n.endswith("expert_bias") and b.any()]
    if biased:
        warnings.warn(
            f"{len(biased)} MoE layers carry an expert bias (router_bias_update_rate, e.g. "
            f"{biased[0]}): Mixtral has no place for it, so the export leaves it out and its router "
            "picks experts by the unbiased scores (the combine weights are unchanged)",
            stacklevel=2,
        )
    if model.config.capacity_factor is not None:
        warnings.warn(
            f"the model was trained with capacity_factor={model.config.capacity_factor}: Mixtral "
            "has no expert capacity, so the exported model keeps every assignment (dropless)",
            stacklevel=2,
        )
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in hf_mixtral_state_dict(model).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    info = read_checkpoint_info(ckpt)
    tokenizer = (info.get("meta", {}).get("datamodule_hyper_parameters") or {}).get(
        "tokenizer", "byte"
    )
    byte_tokenizer = tokenizer == "byte" and model.config.vocab_size >= 257
    eos = 256 if byte_tokenizer else None
    (out / "config.json").write_text(json.dumps(hf_config(model.config, eos), indent=2))
    if byte_tokenizer:
        for name, content in byte_tokenizer_files().items():
            (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="titan export", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ckpt", required=True, help="a checkpoint directory written by TitanStrategy"
    )
    parser.add_argument("--out", required=True, help="a new directory for the Hugging Face files")
    args = parser.parse_args(argv)
    out = export_hf(args.ckpt, args.out)
    print(f"wrote {out.resolve()} (load with transformers.MixtralForCausalLM.from_pretrained)")
