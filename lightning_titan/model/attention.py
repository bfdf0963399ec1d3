"""Causal self-attention with RoPE and grouped-query heads, and the options pretrained MoE checkpoints
use (``config.attention``: ``qkv_bias``, ``qk_norm``, ``head_dim``, ``sinks``, ``out_bias``).

QK-norm comes in two shapes. Qwen3-MoE (``qk_norm="head"``) normalises each head's q and k over
``head_dim`` with one weight ``[head_dim]`` shared by the heads: local to a TP rank's heads, its grad a
partial sum over them like a norm of the sequence-parallel region. OLMoE (``qk_norm="full"``)
normalises the whole q (and k) projection, ``[H * head_dim]`` channels at once: under TP a rank holds
``H/tp`` heads' channels, so the mean of squares is summed over the TP group (``FullQKNorm``) and the
weight is cut like the projection's rows.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_titan.model import lora as adapters
from lightning_titan.model import recompute
from lightning_titan.model.config import ModelConfig
from lightning_titan.model.documents import masked_attention
from lightning_titan.model.kv_cache import LayerCache
from lightning_titan.model.lora import LoRA
from lightning_titan.model.sinks import AttentionSinks, sink_attention
from lightning_titan.parallel.context_parallel import gather_keys
from lightning_titan.parallel.tensor_parallel import (
    TpCuts,
    TpShard,
    gather_sequence,
    scatter_sequence,
    tp_size,
)


class RMSNorm(nn.Module):
    """Mixtral's RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * normalized(x, self.eps)

    def recomputed(self, x: Tensor) -> tuple[recompute.Recomputed | recompute.Kept, Tensor]:
        """``self(x)`` in the compute dtype (the tensor the projections save under autocast too, so
        the one discarded) and its ``Recomputed``: selective recompute (``model/recompute.py``)."""
        dtype = recompute.compute_dtype(x)
        normed = recompute.run(lambda x: normalized(x, self.eps), x, recompute=True)
        return normed, normed.then(lambda n: (self.weight * n).to(dtype))


def normalized(x: Tensor, eps: float) -> Tensor:
    """RMSNorm before its weight: ``x`` over its root mean square, computed in fp32, in ``x``'s dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return h.to(x.dtype)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward is the all-reduce of the grads: every rank's output used every
    rank's input."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class FullQKNorm(RMSNorm):
    """OLMoE's q/k norm over all ``full_dim`` channels of a projection, of which this TP rank holds a
    contiguous ``weight``-sized slice ``x`` [..., full_dim / tp]: the sum of squares is the group's."""

    def __init__(
        self, local_dim: int, full_dim: int, eps: float, group: ProcessGroup | None
    ) -> None:
        super().__init__(local_dim, eps)
        self.full_dim, self.group = full_dim, group
        self.tp_cut = TpShard(0, full_dim, group)

    @property
    def tp_cuts(self) -> TpCuts:  # tensor_parallel.CutsWeights (a property: no cycle through self)
        return {self: self.tp_cut}

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        squares = h.pow(2).sum(-1, keepdim=True)
        if tp_size(self.group) > 1:
            squares = _SumOverGroup.apply(squares, self.group)
        h = h * torch.rsqrt(squares / self.full_dim + self.eps)
        return self.weight * h.to(x.dtype)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """[S, head_dim] fp32 tables for positions 0..S-1, halves duplicated (HF ``rotate_half`` convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    positions = torch.arange(seq_len, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).to(device)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [b, H, S, hd]: channel i pairs with i + hd/2 (not interleaved pairs)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query heads (Mixtral), optionally with q/k/v biases
    (Qwen2-MoE) and QK-norm (Qwen3-MoE per head, OLMoE over the whole projection), or gpt-oss's
    sinks (``model/sinks.py``) and o-projection bias.

    With a ``tp_group`` of n ranks it holds heads ``[r * H/n, (r + 1) * H/n)`` (and the KV heads they
    read), takes and returns the rank's sequence slice, and gathers the sequence inside."""

    def __init__(
        self,
        config: ModelConfig,
        tp_group: ProcessGroup | None = None,
        cp_group: ProcessGroup | None = None,
        lora: LoRA | None = None,
    ) -> None:
        super().__init__()
        options = config.attention
        tp = tp_size(tp_group)
        on = lora.on if lora is not None else lambda _: None
        self.tp_group, self.cp_group = tp_group, cp_group
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads // tp,
            config.kv_heads // tp,
            config.head_dim,
        )
        d, bias = config.d_model, options.qkv_bias
        self.wq = adapters.linear(d, self.n_heads * self.head_dim, bias, on("q"))
        self.wk = adapters.linear(d, self.n_kv_heads * self.head_dim, bias, on("k"))
        self.wv = adapters.linear(d, self.n_kv_heads * self.head_dim, bias, on("v"))
        self.wo = adapters.linear(self.n_heads * self.head_dim, d, False, on("o"))
        self.tp_cuts: TpCuts = {}  # what TP cuts (tensor_parallel.CutsWeights)
        for column_parallel in (self.wq, self.wk, self.wv):  # a bias is cut with the rows
            self.tp_cuts[column_parallel] = TpShard(0, column_parallel.out_features * tp, tp_group)
        self.tp_cuts[self.wo] = TpShard(1, self.wo.in_features * tp, tp_group)  # row-parallel
        self.tp_cuts.update(adapters.factor_cuts(self.tp_cuts))  # the adapters' factors alike
        if options.out_bias:  # added after the TP reduction (once), not by wo on every rank
            self.wo.bias = nn.Parameter(torch.zeros(d))
        self.sinks = (
            AttentionSinks(self.n_heads, config.n_heads, tp_group) if options.sinks else None
        )
        self.qk_norm = options.qk_norm
        if self.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)
        elif self.qk_norm == "full":
            q_dim, k_dim = self.wq.out_features, self.wk.out_features
            self.q_norm = FullQKNorm(q_dim, q_dim * tp, config.norm_eps, tp_group)
            self.k_norm = FullQKNorm(k_dim, k_dim * tp, config.norm_eps, tp_group)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        key_starts: tuple[int, ...] | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """``cos``/``sin`` [S, hd], or [b, 1, S, hd] for packed documents (each document's
        positions); ``mask``: additive (``sinks.sdpa_mask``; with sinks, the sink's column first)
        [S_q, S_k] under context parallelism, on window layers and with a ``cache`` (generation:
        the earlier tokens' k and v, ``model/kv_cache.py``), [b, 1, S_q, S_k] for packed
        documents (``model/documents.py``), else None: causal by order."""
        x = gather_sequence(x, self.tp_group)
        b, s, _ = x.shape
        q_BSC, k_BSC, v_BSC = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "full":
            q_BSC, k_BSC = self.q_norm(q_BSC), self.k_norm(k_BSC)
        q = q_BSC.view(b, s, self.n_heads, self.head_dim)
        k = k_BSC.view(b, s, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v_BSC.view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # every CP rank's keys and values, before the GQA repeat (fewer bytes on the wire)
        k, v = gather_keys(k, self.cp_group), gather_keys(v, self.cp_group)
        if cache is not None:  # the earlier tokens' keys and values, then these
            k, v = cache.extend(k, v)
        # KV head j serves query heads j*rep .. (j+1)*rep-1, as HF's repeat_kv.
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if self.sinks is not None:
            out = sink_attention(q, k, v, self.sinks.weight, mask)
        elif mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = masked_attention(q, k, v, mask, key_starts=key_starts)
        # each rank's o-projection of its heads is a partial sum of the output
        heads_out = out.transpose(1, 2).reshape(b, s, -1)
        if self.wo.bias is None:
            out = self.wo(heads_out)  # called as a module: torch's TP (the bench's peer) hooks it
        else:  # gpt-oss's bias goes on after the TP reduction, once, not by wo on every rank
            out = adapters.without_bias(self.wo, heads_out)
        out = scatter_sequence(out, self.tp_group)
        return out if self.wo.bias is None else out + self.wo.bias
