"""The experts' gated activations: SwiGLU (Mixtral, Qwen, OLMoE) and gpt-oss's clamped form.

gpt-oss (transformers' ``GptOssExperts._apply_gate``): the gate clamped from above and the up
projection on both sides at ``limit``, the gate through ``g * sigmoid(alpha * g)``, times ``up + 1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gated(gate: Tensor, up: Tensor, limit: float | None, alpha: float) -> Tensor:
    """The expert's hidden activation from its gate and up projections (``limit`` None: SwiGLU)."""
    if limit is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
