"""An independent Mixtral-style reference: plain PyTorch written from the definition, sharing no code
with ``lightning_titan``, so a bug in code every layout runs (the stage objective, the router losses)
cannot hide behind a single-process run of the same code.

Weights are a dict of global parameter names (ours) -> full tensors; experts stacked on a leading
expert dim, ``y = x @ w`` (so ``w1`` is [E, D, F]). The objective is the project's:

    sum_tokens(CE) / tokens + sum_sequences(sum_layers(aux_coef * LB + z_coef * Z)) / sequences

with, per sequence, ``LB = E * sum_e f_e * P_e`` (f_e: share of the sequence's S*K assignments that went
to e, no gradient; P_e: mean router probability of e) and ``Z = mean_tokens(logsumexp(logits)^2)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def rope(x_BHSd: Tensor, theta: float) -> Tensor:
    """Rotate channel i with channel i + d/2 by angle pos * theta^(-2i/d) (HF ``rotate_half``)."""
    s, d = x_BHSd.shape[-2], x_BHSd.shape[-1]
    freq = theta ** (-torch.arange(0, d // 2, dtype=torch.float64) * 2 / d)
    angle = (torch.arange(s, dtype=torch.float64)[:, None] * freq[None, :]).float()  # [S, d/2]
    x1, x2 = x_BHSd[..., : d // 2], x_BHSd[..., d // 2 :]
    cos, sin = angle.cos(), angle.sin()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention(x_BSD: Tensor, w: dict[str, Tensor], layer: int, cfg) -> Tensor:
    b, s, _ = x_BSD.shape
    h, kv, hd = cfg.n_heads, cfg.kv_heads, cfg.d_model // cfg.n_heads
    p = f"layers.{layer}.attn."
    q = (x_BSD @ w[p + "wq.weight"].T).view(b, s, h, hd).transpose(1, 2)
    k = (x_BSD @ w[p + "wk.weight"].T).view(b, s, kv, hd).transpose(1, 2)
    v = (x_BSD @ w[p + "wv.weight"].T).view(b, s, kv, hd).transpose(1, 2)
    q, k = rope(q, cfg.rope_theta), rope(k, cfg.rope_theta)
    # query head i reads KV head i // (h / kv)
    group = torch.arange(h) // (h // kv)
    k, v = k[:, group], v[:, group]
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [b, h, S, hd]
    return out.transpose(1, 2).reshape(b, s, h * hd) @ w[p + "wo.weight"].T


def moe(x_BSD: Tensor, w: dict[str, Tensor], layer: int, cfg) -> tuple[Tensor, Tensor]:
    """(output [b, S, D], weighted aux loss per sequence [b]); every expert runs on every token."""
    b, s, d = x_BSD.shape
    n, k = cfg.n_experts, cfg.top_k
    p = f"layers.{layer}.moe."
    logits_BSE = x_BSD @ w[p + "router.weight"].T
    probs = torch.softmax(logits_BSE, dim=-1)
    top_p, top_i = probs.topk(k, dim=-1)
    gate_BSE = torch.zeros_like(probs).scatter(-1, top_i, top_p / top_p.sum(-1, keepdim=True))
    out = torch.zeros_like(x_BSD)
    for e in range(n):
        w1, w3, w2 = (w[f"{p}experts.{name}"][e] for name in ("w1", "w3", "w2"))
        out = out + gate_BSE[..., e : e + 1] * ((F.silu(x_BSD @ w1) * (x_BSD @ w3)) @ w2)
    chosen_BSE = F.one_hot(top_i, n).sum(dim=2).float()  # 1 where the token picked e
    f_BE = chosen_BSE.sum(dim=1) / (s * k)
    load_balance = n * (f_BE * probs.mean(dim=1)).sum(-1)
    z = (torch.logsumexp(logits_BSE, dim=-1) ** 2).mean(dim=-1)
    return out, cfg.aux_loss_coef * load_balance + cfg.z_loss_coef * z


def loss(
    w: dict[str, Tensor], inputs: Tensor, targets: Tensor, cfg
) -> tuple[Tensor, Tensor, Tensor]:
    """(objective, mean token CE, mean per-sequence aux) of the whole model on ``inputs`` [B, S]."""
    x = w["embed.weight"][inputs]
    aux = torch.zeros(inputs.shape[0])
    for i in range(cfg.n_layers):
        x = x + attention(rms_norm(x, w[f"layers.{i}.attn_norm.weight"], cfg.norm_eps), w, i, cfg)
        y, layer_aux = moe(rms_norm(x, w[f"layers.{i}.moe_norm.weight"], cfg.norm_eps), w, i, cfg)
        x, aux = x + y, aux + layer_aux
    logits = rms_norm(x, w["norm.weight"], cfg.norm_eps) @ w["lm_head.weight"].T
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")  # -100: none
    tokens, sequences = (targets != -100).sum(), inputs.shape[0]  # the targets counted
    return ce / tokens + aux.sum() / sequences, ce / tokens, aux.mean()


def loss_and_grads(
    weights: dict[str, Tensor], inputs: Tensor, targets: Tensor, cfg
) -> tuple[dict[str, float], dict[str, Tensor]]:
    """Losses and the gradient of the objective for every weight (by name), in fp32."""
    w = {n: t.detach().clone().float().requires_grad_() for n, t in weights.items()}
    objective, ce, aux = loss(w, inputs, targets, cfg)
    objective.backward()
    values = {"objective": objective.item(), "loss": ce.item(), "aux": aux.item()}
    return values, {n: t.grad for n, t in w.items()}
