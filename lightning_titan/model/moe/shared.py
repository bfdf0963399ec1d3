"""Qwen2-MoE's shared expert: a dense SwiGLU that every token goes through beside the routed experts,
scaled per token by a sigmoid gate, ``y = sigmoid(x @ g) * (silu(x @ w1) * (x @ w3)) @ w2``.
``gated=False``: DeepSeek-V3's shared experts (one SwiGLU of ``n_shared_experts`` x their hidden
size), added as they are; the same module is DeepSeek-V3's dense MLP of its first layers.

It runs where the MoE layer runs, on this rank's tokens (under TP its sequence slice), and is held
whole on every rank of a stage: its grads sum over dp x ep x tp like the router's (``grad_kinds.SEQUENCE``).
The weights are ``nn.Linear`` in Hugging Face orientation (``w1.weight`` is ``gate_proj.weight``);
with ``lora`` the three projections get adapters (the gate does not).

``up`` and ``down`` are its two halves, for the MoE layer to run one under each all-to-all
(``model/moe/layer.py``); ``forward`` is ``down(x, up(x))``, the same operations. ``recompute``
(selective recompute, ``model/recompute.py``): the SwiGLU's product is discarded once the down
projection has read it, and recomputed from the gate and up projections in the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_titan.model import lora as adapters
from lightning_titan.model import recompute as recompute_
from lightning_titan.model.lora import LoRA


class SharedExpert(nn.Module):
    gate: nn.Linear | None

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        gated: bool = True,
        lora: LoRA | None = None,
        recompute: bool = False,
    ) -> None:
        super().__init__()
        self.recompute = recompute
        self.w1 = adapters.linear(d_model, ffn_dim, False, lora)  # gate_proj
        self.w3 = adapters.linear(d_model, ffn_dim, False, lora)  # up_proj
        self.w2 = adapters.linear(ffn_dim, d_model, False, lora)  # down_proj
        self.gate = nn.Linear(d_model, 1, bias=False) if gated else None  # shared_expert_gate

    def forward(self, x_BSD: Tensor) -> Tensor:
        return self.down(x_BSD, self.up(x_BSD))

    def up(self, x_BSD: Tensor) -> recompute_.Recomputed | recompute_.Kept:
        """The SwiGLU's hidden [B, S, ffn] (its ``output``)."""
        return recompute_.run(_swiglu, self.w1(x_BSD), self.w3(x_BSD), recompute=self.recompute)

    def down(self, x_BSD: Tensor, hidden: recompute_.Recomputed | recompute_.Kept) -> Tensor:
        out_BSD = hidden.discard_after(self.w2(hidden.output))
        return out_BSD if self.gate is None else torch.sigmoid(self.gate(x_BSD)) * out_BSD


def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up
