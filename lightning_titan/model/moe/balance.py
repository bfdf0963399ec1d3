"""Auxiliary-loss-free load balancing (DeepSeek-V3, sec. 2.1.2), without a loss term.

Each MoE layer holds a per-expert bias ``expert_bias`` [E] fp32 that is added to the routing scores
for choosing the top-K experts only (``router.route``). After each optimizer step every bias moves by
``rate * sign(mean_load - load_e)``: an overloaded expert becomes less attractive, an idle one more.

The load is the step's GLOBAL count of assignments per expert: every microbatch, every data rank and
every CP/TP slice of the sequences. A layer lives on the ranks of its stage, and the ranks of a stage
that see different tokens are its ``sequence_dp`` group (dp x ep x cp x tp): one all-reduce of a
[layers of the stage, E] table sums them all. The counts are integers and the sign is taken of
``total - E * load_e`` (exact), so every rank of every layout computes the same bias, bit for bit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_titan.model.moe.layer import MoELayer, StepCounts
from lightning_titan.runtime import probes


def balanced_layers(module: nn.Module) -> list[MoELayer]:
    """The MoE layers of ``module`` whose selection bias moves (a loaded bias with rate 0 stays), in
    ``modules()`` order (the same on every rank of a stage, hence the same rows of the all-reduced
    table)."""
    return [
        m
        for m in module.modules()
        if isinstance(m, MoELayer) and m.expert_bias is not None and m.bias_update_rate > 0
    ]


def bias_step(tokens_per_expert_LE: Tensor, rate: float) -> Tensor:
    """``rate * sign(mean_load - load_e)`` [..., E] fp32 from integer counts [..., E] (exact: the
    sign of ``total - E * load_e``, no division)."""
    n_experts = tokens_per_expert_LE.shape[-1]
    total = tokens_per_expert_LE.sum(dim=-1, keepdim=True)
    return torch.sign(total - n_experts * tokens_per_expert_LE).float() * rate


@torch.no_grad()
def update_expert_bias(
    layers: list[MoELayer], counts: StepCounts, group: ProcessGroup | None, *, skip: bool = False
) -> None:
    """Move each layer's bias by its step's global load (``counts``: the step's, ``take_step_counts``).

    ``group``: the stage's ranks that saw other tokens (``sequence_dp``). ``skip``: the step's update
    was dropped (a non-finite step), so the bias stays too. Every rank of ``group`` must call this
    with the same ``skip`` (it decides whether there is an all-reduce)."""
    if not layers or skip:
        return
    # a layer that saw no training forward this step (none on this rank's microbatches) counts 0
    zero = torch.zeros(layers[0].n_experts, dtype=torch.long, device=layers[0].router.weight.device)
    counts_LE = torch.stack([counts.selected.get(m, zero) for m in layers])
    if group is not None and dist.get_world_size(group) > 1:
        with probes.span("all_reduce", "expert loads"):
            dist.all_reduce(counts_LE, group=group)
    for layer, counts_E in zip(layers, counts_LE, strict=True):
        assert layer.expert_bias is not None  # balanced_layers keeps only those with one
        layer.expert_bias.add_(bias_step(counts_E, layer.bias_update_rate))
