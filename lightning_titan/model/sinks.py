"""gpt-oss attention: a learned per-head sink logit in the softmax, and sliding-window layers.

A sink is one more logit per head and query with no value behind it: ``softmax([scores, sink])``
with the sink's column dropped, so a query may put weight on "nothing" and its output shrinks
(transformers' ``eager_attention_forward`` of ``GptOssAttention``). The keys arrive whole (under
context parallelism all-gathered, ``parallel/context_parallel.py``), so the sink enters each query's
denominator exactly once, however the sequence is split.

A sliding-window layer lets query position ``q`` see keys ``k`` with ``q - window < k <= q``
(transformers' ``sliding_window_overlay``), by global positions, so context parallelism cuts it the
same as one process.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_titan.parallel.tensor_parallel import TpCuts, TpShard


class AttentionSinks(nn.Module):
    """The sink logits ``weight`` [H/tp] of this TP rank's heads (cut with the heads, like q's rows)."""

    def __init__(self, n_local_heads: int, n_heads: int, group: ProcessGroup | None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_local_heads))
        self.tp_cut = TpShard(0, n_heads, group)

    @property
    def tp_cuts(self) -> TpCuts:  # tensor_parallel.CutsWeights (a property: no cycle through self)
        return {self: self.tp_cut}


def attend_mask(q_pos: Tensor, k_pos: Tensor, window: int) -> Tensor:
    """[S_q, S_k] bool (True: attend): causal by the global positions ``q_pos`` [S_q], ``k_pos``
    [S_k], and within ``window`` positions back when ``window`` > 0."""
    mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
    if window > 0:
        mask = mask & (k_pos.unsqueeze(0) > q_pos.unsqueeze(1) - window)
    return mask


def sdpa_mask(mask: Tensor, dtype: torch.dtype, sink: bool) -> Tensor:
    """``mask`` [S_q, S_k] bool (True: attend) as the additive mask the attention kernel takes as it
    is (0 or -inf, in the dtype it computes in; with ``sink``, a first column of 0 for the sink key,
    ``sink_attention``). Built once a forward and handed to every layer: a bool mask is converted
    inside the kernel on every call, one S x S tensor a layer kept for the backward."""
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, -math.inf
    )
    return F.pad(additive, (1, 0)) if sink else additive


# channels added to each head for the sink (one carries it; the rest keep the head dim a multiple of
# 8, which the fused kernels on GPU require)
SINK_CHANNELS = 8


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks_H: Tensor, mask: Tensor | None) -> Tensor:
    """Softmax attention of ``q`` [b, H, S_q, hd] over ``k``, ``v`` [b, H, S_k, hd] (heads repeated
    for GQA) with the sink logit ``sinks_H`` [H] of each head in every query's denominator; ``mask``
    [S_q, 1 + S_k] (packed documents: [b, 1, S_q, 1 + S_k]) additive with the sink's column first
    (``sdpa_mask(..., sink=True)``), None:
    causal by order. Scaled by 1/sqrt(hd), as transformers'
    gpt-oss attention.

    The sink is one more key, seen by every query, whose score is the sink logit and whose value is
    zero: each query gets a channel of ones, each key a channel of zeros, and the sink key
    ``sink * sqrt(hd)`` in that channel. So the fused attention (``scaled_dot_product_attention``)
    computes it and saves q, k, v, the output and one log-sum-exp a query for the backward: nothing
    S x S per head, where the scores written out cost 4 bytes x H x S^2 a sequence (3.6 GB a block
    of gpt-oss at 4,096 tokens). Without a mask the sink goes first and a dummy query before the
    sequence: the causal mask then lets query ``i`` see the sink and keys ``0..i``, with no mask
    tensor."""
    b, n_heads, s_q, hd = q.shape
    scale = hd**-0.5
    ones = q.new_ones(b, n_heads, s_q, 1)
    q = torch.cat([q, ones, q.new_zeros(b, n_heads, s_q, SINK_CHANNELS - 1)], dim=-1)
    sink = (sinks_H.to(k.dtype) / scale).view(n_heads, 1)
    sink_key = F.pad(sink, (hd, SINK_CHANNELS - 1)).view(1, n_heads, 1, -1).expand(b, -1, -1, -1)
    k = torch.cat([sink_key, F.pad(k, (0, SINK_CHANNELS))], dim=2)
    v = F.pad(v, (0, SINK_CHANNELS, 1, 0))  # the sink's value: zeros
    if mask is None:
        q = F.pad(q, (0, 0, 1, 0))  # the dummy query, dropped from the output
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)[:, :, 1:]
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out[..., :hd]
