"""Layout-free initialisation of a stage: each value depends on (seed, global name, global expert)
only, so a rank that holds a slice of the model (its layers, experts, TP rows) draws exactly the
values one process would hold there."""

from __future__ import annotations

import math
import zlib

import torch
from torch import Tensor, nn

from lightning_titan.model.attention import RMSNorm
from lightning_titan.model.config import ModelConfig
from lightning_titan.model.lora import LoRAFactor, is_adapter, kaiming_bound, seeded_uniform
from lightning_titan.model.moe.experts import GroupedExperts
from lightning_titan.model.sinks import AttentionSinks
from lightning_titan.parallel.tensor_parallel import local_slice, tp_cut_modules


@torch.no_grad()
def init_weights(model: nn.Module, config: ModelConfig, seed: int, tp: tuple[int, int]) -> None:
    """Layout-free init of ``model`` (a stage of ``config``; ``tp``: its TP size and rank): each value
    depends on (seed, global name, global expert) only.

    Norm weights are 1, biases 0; every other matrix is Normal(0, init_std), output projections
    (``wo``, experts' and the shared expert's ``w2``) scaled by 1/sqrt(2 * n_layers) so the residual
    stream does not grow with depth.
    """
    std = config.init_std
    out_std = std / math.sqrt(2 * config.n_layers)
    cuts = tp_cut_modules(model)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, AttentionSinks):
            module.weight.zero_()  # exp(0): one key's worth of weight on nothing
        elif isinstance(module, GroupedExperts):
            start = module.expert_range[0]
            for pname, p in module.named_parameters(recurse=False):
                if is_adapter(pname):  # init_adapters
                    continue
                if pname.startswith("b"):  # the biases b1, b3, b2
                    p.zero_()
                    continue
                param_std = out_std if pname == "w2" else std
                for e in range(module.n_local):
                    p[e].copy_(
                        _seeded_normal(p.shape[1:], param_std, seed, prefix + pname, start + e)
                    )
        elif isinstance(module, LoRAFactor):  # init_adapters
            continue
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            param_std = (
                out_std if module_name.endswith(("attn.wo", "shared_expert.w2", "mlp.w2")) else std
            )
            if isinstance(bias := getattr(module, "bias", None), Tensor):
                bias.zero_()
            shard = cuts.get(module)
            shape = list(module.weight.shape)
            if shard is not None:
                shape[shard.dim] = shard.full_size  # draw the whole tensor, keep the slice
            weight = _seeded_normal(torch.Size(shape), param_std, seed, prefix + "weight")
            if shard is not None:
                weight = local_slice(weight, shard.dim, *tp)
            module.weight.copy_(weight)
    init_adapters(model, seed, tp)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int, tp: tuple[int, int]) -> None:
    """PEFT's default init of every LoRA adapter under ``model`` (``model/lora.py``), layout-free: each
    ``A`` uniform in +-1/sqrt(its full fan-in) from (seed, global name, global expert), each ``B``
    zero, so the adapted model starts as the base (also after a base loaded from a folder)."""
    cuts = tp_cut_modules(model)
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, LoRAFactor):
            if module_name.endswith("lora_B"):
                module.weight.zero_()
                continue
            shard = cuts.get(module)
            shape = list(module.weight.shape)  # [rank, in]
            if shard is not None:
                shape[shard.dim] = shard.full_size  # draw the whole tensor, keep the slice
            weight = seeded_uniform(
                torch.Size(shape), kaiming_bound(shape[1]), seed, prefix + "weight"
            )
            if shard is not None:
                weight = local_slice(weight, shard.dim, *tp)
            module.weight.copy_(weight)
        elif isinstance(module, GroupedExperts):
            start = module.expert_range[0]
            for w, (a, b) in module.adapters().items():
                b.zero_()
                for e in range(module.n_local):  # a[e]: [in, rank], fan-in its first dim
                    bound = kaiming_bound(a.shape[1])
                    name = f"{prefix}{w}_lora_A"
                    a[e].copy_(seeded_uniform(a.shape[1:], bound, seed, name, start + e))


def _seeded_normal(shape: torch.Size, std: float, seed: int, name: str, expert: int = -1) -> Tensor:
    # crc32, not hash(): Python's string hash is salted per process, so ranks would disagree.
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}|{name}|{expert}".encode()))
    # Drawn on CPU whatever the ambient device: Lightning builds the model under ``with root_device:``,
    # where a CUDA randn would reject this CPU generator (and a CUDA one would give other values).
    # The caller's copy_ moves the values to the parameter's device.
    return torch.randn(shape, generator=generator, device="cpu") * std
