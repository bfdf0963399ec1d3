"""DeepSeek-V3's multi-head latent attention (MLA), as transformers' ``DeepseekV3Attention``.

The keys and values of all heads come from one compressed latent per token: ``kv_a_proj`` maps x to
``kv_lora_rank`` latent channels (normalised by ``kv_a_norm``) plus ``qk_rope_head_dim`` channels of
a RoPE key shared by every head; ``kv_b_proj`` expands the latent to each head's un-rotated key
(``qk_nope_head_dim``) and value (``v_head_dim``). The query is ``q_proj(x)``, or low-rank
``q_b_proj(q_a_norm(q_a_proj(x)))`` when ``q_lora_rank`` > 0; its last ``qk_rope_head_dim`` channels
per head are rotated. Softmax scale: ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times YaRN's
``mscale**2`` under ``rope_yarn`` (``config.position.yarn``, model/yarn.py). The sizes are
``config.attention.latent`` (``model/options.py``).

With ``rope_interleave`` (transformers' default for DeepSeek-V3) RoPE pairs channels (2i, 2i+1):
the same as taking the even channels then the odd ones and rotating halves, which is what we do
(q and k are permuted alike, so their dot products are transformers').

Tensor parallelism splits the heads: ``q_proj``/``q_b_proj`` and ``kv_b_proj`` rows, ``wo`` columns.
The down-projections ``q_a_proj``, ``kv_a_proj`` and their norms stay whole on every TP rank (as in
Megatron): they are small, and every head needs their whole output. They run on the gathered
sequence, so each rank's grad holds its heads' part of it, and the sum over the TP group that the
sequence-parallel weights get (``grad_kinds.SEQUENCE``) completes it.

Context parallelism gathers the latent (and the rotated shared key), ``kv_lora_rank +
qk_rope_head_dim`` channels a token, not the expanded heads; each rank expands all keys itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_titan.model import lora as adapters
from lightning_titan.model.attention import RMSNorm, apply_rope
from lightning_titan.model.config import ModelConfig
from lightning_titan.model.documents import masked_attention
from lightning_titan.model.kv_cache import LayerCache
from lightning_titan.model.lora import LoRA
from lightning_titan.model.yarn import softmax_scale_factor
from lightning_titan.parallel.context_parallel import gather_keys
from lightning_titan.parallel.tensor_parallel import (
    TpCuts,
    TpShard,
    gather_sequence,
    scatter_sequence,
    tp_size,
)

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps, not
# rms_norm_eps
LATENT_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """Causal multi-head latent attention over ``x`` [b, S/tp, D] (this rank's sequence slice)."""

    def __init__(
        self,
        config: ModelConfig,
        tp_group: ProcessGroup | None = None,
        cp_group: ProcessGroup | None = None,
        lora: LoRA | None = None,
    ) -> None:
        super().__init__()
        latent, yarn = config.attention.latent, config.position.yarn
        tp = tp_size(tp_group)
        on = lora.on if lora is not None else lambda _: None
        self.tp_group, self.cp_group = tp_group, cp_group
        self.n_heads = config.n_heads // tp
        self.nope, self.rope = latent.nope_dim, latent.rope_dim
        self.v_dim, self.rank = latent.v_dim, latent.kv_rank
        self.interleave = latent.interleave
        self.scale = (self.nope + self.rope) ** -0.5 * softmax_scale_factor(yarn)
        d, q_dim = config.d_model, self.n_heads * (self.nope + self.rope)
        if latent.q_rank:
            self.q_a_proj = adapters.linear(d, latent.q_rank, False, on("q_a"))
            self.q_a_norm = RMSNorm(latent.q_rank, LATENT_NORM_EPS)
            self.q_b_proj = adapters.linear(latent.q_rank, q_dim, False, on("q_b"))
            q_heads = self.q_b_proj
        else:
            self.q_proj = adapters.linear(d, q_dim, False, on("q"))
            q_heads = self.q_proj
        self.kv_a_proj = adapters.linear(d, self.rank + self.rope, False, on("kv_a"))
        self.kv_a_norm = RMSNorm(self.rank, LATENT_NORM_EPS)
        kv_dim = self.n_heads * (self.nope + self.v_dim)
        self.kv_b_proj = adapters.linear(self.rank, kv_dim, False, on("kv_b"))
        self.wo = adapters.linear(self.n_heads * self.v_dim, d, False, on("o"))
        self.tp_cuts: TpCuts = {}  # what TP cuts (tensor_parallel.CutsWeights)
        for per_head_rows in (q_heads, self.kv_b_proj):
            self.tp_cuts[per_head_rows] = TpShard(0, per_head_rows.out_features * tp, tp_group)
        self.tp_cuts[self.wo] = TpShard(1, self.wo.in_features * tp, tp_group)
        self.tp_cuts.update(adapters.factor_cuts(self.tp_cuts))  # the adapters' factors alike

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rope(x, cos, sin)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        key_starts: tuple[int, ...] | None = None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """``cos``/``sin`` [S, qk_rope_head_dim] of this rank's positions ([b, 1, S, ...] for packed
        documents); ``mask`` [S_q, S_k] additive (``sinks.sdpa_mask``) under context parallelism
        and with a ``cache`` (generation: the earlier tokens' latents, ``model/kv_cache.py``),
        [b, 1, S_q, S_k] for packed documents (``model/documents.py``), else None: causal by order."""
        x = gather_sequence(x, self.tp_group)
        b, s, _ = x.shape
        if hasattr(self, "q_proj"):
            q_BSC = self.q_proj(x)
        else:
            q_BSC = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q_BSC.view(b, s, self.n_heads, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        q = torch.cat((q_nope, self._rotate(q_rot, cos, sin)), dim=-1)

        latent_BSR, k_rot_BSC = self.kv_a_proj(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_norm(latent_BSR).unsqueeze(1)  # [b, 1, S, rank]
        k_rot = self._rotate(k_rot_BSC.unsqueeze(1), cos, sin)  # [b, 1, S, rope]
        # every CP rank's latent and shared RoPE key: rank + rope channels a token
        latent, k_rot = gather_keys(latent, self.cp_group), gather_keys(k_rot, self.cp_group)
        if cache is not None:  # the earlier tokens' latents and shared keys, then these
            latent, k_rot = cache.extend(latent, k_rot)
        s_k = latent.shape[2]
        kv = self.kv_b_proj(latent.squeeze(1)).view(b, s_k, self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, self.n_heads, -1, -1)), dim=-1)
        # one head dim for q, k and v, the narrower padded with zeros (nothing added to a score or
        # an output): the fused kernels take one, and with two the math kernel ran and saved every
        # head's S x S weights for the backward (DeepSeek-V3 at 4,096 tokens: 2,947 KiB a token a
        # block, 836 KiB with one)
        width = max(q.shape[-1], self.v_dim)
        q, k, v = (
            t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v)
        )
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            out = masked_attention(q, k, v, mask, scale=self.scale, key_starts=key_starts)
        out = out[..., : self.v_dim]
        return scatter_sequence(self.wo(out.transpose(1, 2).reshape(b, s, -1)), self.tp_group)
