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

import torch
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


def sink_attention(q: Tensor, k: Tensor, v: Tensor, sinks_H: Tensor, mask: Tensor) -> Tensor:
    """Softmax attention of ``q`` [b, H, S_q, hd] over ``k``, ``v`` [b, H, S_k, hd] (heads repeated
    for GQA) with the sink logit ``sinks_H`` [H] of each head in every query's denominator; ``mask``
    [S_q, S_k] bool. Scaled by 1/sqrt(hd), as transformers' gpt-oss attention."""
    scores = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks_H.to(scores.dtype).view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values  # the sink keeps every row finite
    probs = torch.softmax(logits, dim=-1)[..., :-1]  # the sink's share goes nowhere
    return torch.matmul(probs.to(v.dtype), v)
