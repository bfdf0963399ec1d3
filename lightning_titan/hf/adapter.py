"""LoRA adapters (``model/lora.py``) as a PEFT adapter folder (``adapter_config.json`` and
``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads onto the family's
transformers model (transformers 5 module names).

A projection's adapter keeps its factors as they are, under the projection's Hugging Face name
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``). The routed experts are fused
parameters in transformers 5 (``mlp.experts.gate_up_proj`` [E, 2F, D], ``down_proj`` [E, D, F]),
which PEFT adapts with ``target_parameters``: one rank-r adapter per expert of the whole matrix,
stored as ``lora_A`` [r * E, in] (expert e's rows ``e*r .. e*r + r``) and ``lora_B`` [out, r * E]
(expert e's columns ``j * E + e``). Our gate and up adapters are two rank-r adapters; on the fused
``gate_up_proj`` they are one rank-2r adapter with A the two stacked and B block-diagonal, and
alpha doubled so that ``alpha / rank`` stays the same (``rank_pattern``, ``alpha_pattern``): the
same weights' update, exactly.

Not written: dense and shared MLP adapters of Mixtral, Qwen3-MoE, OLMoE and DeepSeek-V3 (peft
renames their modules' v4 expert names, ``gate_proj`` ..., onto the fused experts), router adapters (transformers 5's routers are no ``nn.Linear``, PEFT would need them as
``target_parameters`` of another shape), and gpt-oss's expert adapters (its ``gate_up_proj``
interleaves gate and up columns and is stored transposed): both are refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from lightning_titan.hf.arch import architecture_of, hf_names
from lightning_titan.model.config import ModelConfig
from lightning_titan.model.lora import LoRA, is_adapter

PREFIX = "base_model.model."
# the model types whose v4 expert names PEFT (0.21) turns into the fused expert parameters when it
# loads an adapter: any adapted module named like a v4 expert projection goes there, so a dense or
# shared MLP adapter of these families would land on the experts
PEFT_REMAPS = {"mixtral", "qwen3_moe", "olmoe", "deepseek_v3"}
V4_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


def peft_tensors(adapters: dict[str, Tensor], config: ModelConfig, lora: LoRA) -> dict[str, Tensor]:
    """The PEFT state of ``adapters`` (every adapter of the whole model under our global names:
    ``layers.0.attn.wq.lora_A.weight``, ``layers.1.moe.experts.w1_lora_A`` [E, D, r] ...)."""
    family = architecture_of(config)
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[str, Tensor]] = {}  # layer prefix -> {"w1_lora_A": ...}
    for name, tensor in adapters.items():
        if not is_adapter(name):
            raise ValueError(f"{name!r} is no LoRA adapter's")
        if ".moe.router." in name:
            raise ValueError(
                "router adapters have no PEFT form for transformers' routers (not nn.Linear); "
                "train without the 'router' target to export a PEFT adapter"
            )
        module, _, last = name.rpartition(".")
        if ".moe.experts." in name:
            experts.setdefault(module, {})[last] = tensor
            continue
        base, factor = module.rsplit(".", 1)  # "...attn.wq", "lora_A"
        (hf_base,) = hf_names(base + ".weight", (0, config.n_experts), family)
        projection = hf_base.removesuffix(".weight").rsplit(".", 1)[-1]
        if family.model_type in PEFT_REMAPS and projection in V4_EXPERT_NAMES:
            raise ValueError(
                f"the adapter of {hf_base.removesuffix('.weight')} has no PEFT form: peft maps "
                f"{family.class_name} modules named {projection} onto the fused experts; train "
                "without the 'mlp' and 'shared' targets for a PEFT export, or export it merged"
            )
        out[PREFIX + hf_base.removesuffix(".weight") + f".{factor}.weight"] = tensor
    if experts and family.fused_experts:
        raise ValueError(
            f"expert adapters of {family.class_name} have no PEFT form here (its fused "
            "gate_up_proj interleaves gate and up); export the merged model instead"
        )
    for module, factors in experts.items():  # "layers.3.moe.experts"
        layer = module.split(".")[1]
        where = f"{PREFIX}model.layers.{layer}.mlp.experts"
        gate_up_a, gate_up_b = _fused_gate_up(factors)
        down_a, down_b = _per_expert(factors["w2_lora_A"], factors["w2_lora_B"])
        # PEFT nests one wrapper per target parameter, the first listed innermost (base_layer)
        out[f"{where}.base_layer.lora_A.weight"] = gate_up_a
        out[f"{where}.base_layer.lora_B.weight"] = gate_up_b
        out[f"{where}.lora_A.weight"] = down_a
        out[f"{where}.lora_B.weight"] = down_b
    return {k: v.detach().contiguous() for k, v in out.items()}


def _per_expert(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Our ``a`` [E, in, r], ``b`` [E, r, out] (``y = x @ a @ b``) as PEFT's ``lora_A`` [r * E, in]
    (expert e's rows e*r ..) and ``lora_B`` [out, r * E] (expert e's columns j * E + e)."""
    experts, _, rank = a.shape
    lora_a = a.transpose(1, 2).reshape(experts * rank, -1)
    lora_b = b.permute(2, 1, 0).reshape(b.shape[2], rank * experts)  # [out, r, E] flattened
    return lora_a, lora_b


def _fused_gate_up(factors: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Gate's and up's rank-r adapters as one rank-2r adapter of ``gate_up_proj`` (rows: gate, then
    up): A stacked [gate; up], B block-diagonal."""
    a1, b1, a3, b3 = (factors[k] for k in ("w1_lora_A", "w1_lora_B", "w3_lora_A", "w3_lora_B"))
    experts, rank, ffn = b1.shape
    a = torch.cat([a1, a3], dim=2)  # [E, D, 2r]
    b = a1.new_zeros(experts, 2 * rank, 2 * ffn)
    b[:, :rank, :ffn], b[:, rank:, ffn:] = b1, b3  # gate's rank reaches gate's rows only
    return _per_expert(a, b)


def adapter_config(config: ModelConfig, lora: LoRA, tensors: dict[str, Tensor]) -> dict:
    """``adapter_config.json`` for ``tensors`` (``peft_tensors``'s): the modules and parameters they
    adapt, PEFT's default init, no dropout on expert targets (PEFT has none there)."""
    # each adapted module by its whole name (PEFT matches a name's ending): a short name such as
    # gate_proj would also adapt the modules of that name we did not (a dense layer's, a shared one's)
    modules = sorted(
        {k.removeprefix(PREFIX).rsplit(".", 2)[0] for k in tensors if ".mlp.experts." not in k}
    )
    expert_targets = any(".mlp.experts." in k for k in tensors)
    out: dict = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": 0.0 if expert_targets else lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "base_model_name_or_path": None,
        "inference_mode": True,
    }
    if expert_targets:
        out["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
        out["rank_pattern"] = {"gate_up_proj": 2 * lora.rank}
        out["alpha_pattern"] = {"gate_up_proj": 2 * lora.alpha}
    return out


def write_peft_folder(
    folder: str | Path, adapters: dict[str, Tensor], config: ModelConfig, lora: LoRA
) -> Path:
    """Write ``adapters`` (the whole model's, our names) as a PEFT adapter folder."""
    tensors = peft_tensors(adapters, config, lora)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.float() for k, v in tensors.items()}, folder / WEIGHTS_FILE)
    (folder / CONFIG_FILE).write_text(
        json.dumps(adapter_config(config, lora, tensors), indent=2) + "\n"
    )
    return folder
