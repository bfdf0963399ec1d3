"""Stage-local Mixtral-style MoE decoder: the layers ``[start, end)`` and experts ``[start, end)`` one
rank owns, named globally so that any (pp, ep, tp) layout holds slices of the same full model.

Under tensor parallelism (``tensor_parallel``) a rank also holds only its heads of each attention
(q, k, v rows, o columns) and its rows of the embedding and the LM head (the vocabulary padded to a
multiple of tp); the module that cuts a weight says which dim in its ``tp_cuts``
(``tensor_parallel.CutsWeights``).

Block: ``x = x + attn(rmsnorm(x)); x = x + moe(rmsnorm(x))`` (+ a shared expert, Qwen2-MoE). The
options of the pretrained families, read as the config's groups (``model/options.py``: attention,
router, experts, position), make it Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss (sinks and window
layers: model/sinks.py) or DeepSeek-V3 (model/mla.py); names map to theirs (``hf/families/``) and
logits match transformers' models.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import checkpoint

from lightning_titan.model import lora as adapters
from lightning_titan.model import recompute
from lightning_titan.model.attention import Attention, RMSNorm, apply_rope, rope_cos_sin
from lightning_titan.model.config import FULL, SELECTIVE, ModelConfig
from lightning_titan.model.documents import QUERY_CHUNK, chunk_key_starts, document_masks
from lightning_titan.model.init import init_adapters, init_weights
from lightning_titan.model.kv_cache import KVCache, LayerCache
from lightning_titan.model.lora import LoRA
from lightning_titan.model.mla import MLAttention
from lightning_titan.model.moe.layer import MoELayer
from lightning_titan.model.moe.shared import SharedExpert
from lightning_titan.model.options import LATENT
from lightning_titan.model.sinks import attend_mask, sdpa_mask
from lightning_titan.model.yarn import rope_cos_sin_yarn
from lightning_titan.parallel import context_parallel
from lightning_titan.parallel.dispatch import ep_size
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.parallel.tensor_parallel import (
    TpCuts,
    TpShard,
    gather_sequence,
    padded_vocab,
    scatter_sequence,
    tp_size,
    vocab_parallel_cross_entropy,
)

__all__ = ["Attention", "ModelConfig", "RMSNorm", "StageModel", "apply_rope", "rope_cos_sin"]


class Block(nn.Module):
    """One layer. ``dense``: a plain SwiGLU ``mlp`` instead of the MoE layer (DeepSeek-V3's first
    layers): no router, no experts, no dispatch; it runs on this rank's tokens like a shared expert."""

    moe: MoELayer | None

    def __init__(
        self,
        config: ModelConfig,
        expert_range: tuple[int, int],
        ep_group: ProcessGroup | None,
        tp_group: ProcessGroup | None = None,
        cp_group: ProcessGroup | None = None,
        sequence_group: ProcessGroup | None = None,
        layer: int = 0,
        dense: bool = False,
        lora: LoRA | None = None,
    ) -> None:
        super().__init__()
        attention, router, experts = config.attention, config.router, config.experts
        self.sliding = attention.sliding(layer)  # gpt-oss: the even layers
        self.selective = selective = config.recompute == SELECTIVE  # model/recompute.py
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn: nn.Module = (
            MLAttention(config, tp_group, cp_group, lora)
            if attention.kind == LATENT
            else Attention(config, tp_group, cp_group, lora)
        )
        self.moe_norm = RMSNorm(config.d_model, config.norm_eps)
        self.shared_expert = None
        if dense:
            self.moe = None
            self.mlp = SharedExpert(
                config.d_model, experts.dense_ffn_dim, False, lora and lora.on("mlp"), selective
            )
            return
        self.moe = MoELayer(
            config.d_model,
            config.ffn_dim,
            config.n_experts,
            config.top_k,
            expert_range=expert_range,
            ep_group=ep_group,
            aux_loss_coef=config.aux_loss_coef,
            z_loss_coef=config.z_loss_coef,
            sequence_group=sequence_group,
            bias_update_rate=config.router_bias_update_rate,
            capacity_factor=config.capacity_factor,
            sequence_split=(tp_size(cp_group), tp_size(tp_group)),
            router_score=router.score,
            norm_topk=router.norm_topk,
            router_bias=router.bias,
            expert_proj_bias=experts.proj_bias,
            swiglu=(experts.swiglu_limit, experts.swiglu_alpha),
            groups=(router.groups, router.topk_groups),
            scaling=router.scaling,
            expert_bias=router.expert_bias,
            lora=lora,
            recompute=selective,
        )
        if experts.shared_dim:
            self.shared_expert = SharedExpert(
                config.d_model,
                experts.shared_dim,
                experts.shared_gated,
                lora=lora and lora.on("shared"),
                recompute=selective,
            )

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        key_starts: tuple[int, ...] | None = None,
        cache: LayerCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        if self.selective and torch.is_grad_enabled():
            return recompute.selective_block(self, x, cos, sin, mask, key_starts, cache)
        x, h = self.attend(x, cos, sin, mask, key_starts, cache)
        if self.moe is None:  # a dense layer: no aux loss
            return x + self.mlp(h), torch.zeros(x.shape[0], device=x.device, dtype=torch.float32)
        moe_out, aux = self.moe(h, self.shared_expert)  # the shared expert runs under its exchanges
        return x + moe_out, aux

    def attend(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None = None,
        key_starts: tuple[int, ...] | None = None,
        cache: LayerCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The residual stream after attention, and its MoE-normed copy: the block's part without
        data-dependent shapes (``model/compiled.py`` compiles it; the packed documents' key starts
        are ints that vary by batch, which dynamo takes as dynamic after their first change)."""
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, key_starts=key_starts, cache=cache)
        return x, self.moe_norm(x)


class StageModel(nn.Module):
    """The part of the model one (pp_rank, ep_rank, cp_rank, tp_rank) owns; a pure ``nn.Module`` with
    no Lightning glue.

    ``forward`` takes token ids [b, S/cp] (this CP rank's positions, ``context_parallel.take_local``)
    on the first stage, hidden states [b, S/(cp*tp), D] elsewhere, and returns (hidden
    [b, S/(cp*tp), D], or on the last stage logits [b, S/cp, V/tp] of this rank's vocabulary shard,
    and aux [b] fp32): the per-sequence auxiliary loss summed over this stage's layers, already
    weighted by the coefficients (under CP or TP, this rank's tokens' share). ``token_loss_sum`` turns
    the logits into the summed cross-entropy, without gathering them.

    ``split`` (``pipeline.split``): a rank may hold several chunks of layers (virtual stages) and
    the stages may hold different numbers of layers; ``forward(x, chunk=c)`` runs chunk ``c``
    (``chunk_ranges[c]``), the embedding before the chunk of virtual stage 0, the head after the chunk
    of the last one (``embeds``, ``heads``: under the V both are on rank 0).

    ``sequence_group``: the cp x tp ranks that hold one sequence (for the aux losses' counts); it may
    be left None when only one of cp and tp is used.

    ``lora`` (``model/lora.py``): adapters on the projections it targets, the rest frozen.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        pp_rank: int = 0,
        pp: int = 1,
        ep_rank: int = 0,
        ep: int = 1,
        ep_group: ProcessGroup | None = None,
        tp_group: ProcessGroup | None = None,
        cp_group: ProcessGroup | None = None,
        sequence_group: ProcessGroup | None = None,
        split: StageSplit | None = None,
        lora: LoRA | None = None,
    ) -> None:
        super().__init__()
        tp, cp = tp_size(tp_group), tp_size(cp_group)
        split = split or StageSplit()
        config.validate_layout(pp, ep, tp, cp, split)
        if sequence_group is None and tp > 1 and cp > 1:
            raise ValueError(
                "with both tp and cp, pass sequence_group: the cp x tp ranks of one sequence "
                "(ProcessGroups.sequence)"
            )
        if sequence_group is None:
            sequence_group = tp_group if tp > 1 else cp_group
        if not 0 <= pp_rank < pp:
            raise ValueError(f"pp_rank={pp_rank} is outside 0..{pp - 1} (pp={pp})")
        if not 0 <= ep_rank < ep:
            raise ValueError(f"ep_rank={ep_rank} is outside 0..{ep - 1} (ep={ep})")
        if ep_group is not None and ep_size(ep_group) != ep:
            raise ValueError(
                f"ep_group has {ep_size(ep_group)} ranks but ep={ep}; pass this stage's EP group"
            )
        self.config, self.lora = config, lora
        self.sliding_window = config.attention.sliding_window  # gpt-oss's window layers
        per_rank = config.n_experts // ep
        self.chunk_ranges = split.chunk_ranges(config.n_layers, pp, pp_rank)
        self.num_chunks = len(self.chunk_ranges)
        # with one chunk: its layers; with more, the span from the first to the last one held
        self.layer_range = (self.chunk_ranges[0][0], self.chunk_ranges[-1][1])
        self.expert_range = (ep_rank * per_rank, (ep_rank + 1) * per_rank)
        # the embedding goes with virtual stage 0, the head with the last one, wherever the placement
        # puts them (the V puts both on rank 0)
        self.stage_ids = stage_ids = split.stage_ids(pp, pp_rank)  # each chunk's virtual stage
        last = pp * split.virtual_stages - 1
        self.embed_chunk = stage_ids.index(0) if 0 in stage_ids else None
        self.head_chunk = stage_ids.index(last) if last in stage_ids else None
        self.is_first_stage = self.embed_chunk is not None  # holds the embedding
        self.is_last_stage = self.head_chunk is not None  # holds the head
        self.v_shape = split.v_shape  # chunks linked down and back up the ranks, not round a ring
        self.tp_group, self.cp_group = tp_group, cp_group
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        vocab_rows = padded_vocab(config.vocab_size, tp) // tp
        self.vocab_start = self.tp_rank * vocab_rows
        self._rope_cache: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = {}

        self.tp_cuts: TpCuts = {}  # the vocabulary's rows (tensor_parallel.CutsWeights)
        if self.is_first_stage:
            self.embed = nn.Embedding(vocab_rows, config.d_model)
            self.tp_cuts[self.embed] = TpShard(0, config.vocab_size, tp_group)
        self.layers = nn.ModuleDict(
            {
                str(i): Block(
                    config,
                    self.expert_range,
                    ep_group,
                    tp_group,
                    cp_group,
                    sequence_group,
                    layer=i,
                    dense=config.experts.is_dense(i),
                    lora=lora,
                )
                for start, end in self.chunk_ranges
                for i in range(start, end)
            }
        )
        if self.is_last_stage:
            self.norm = RMSNorm(config.d_model, config.norm_eps)
            self.lm_head = nn.Linear(config.d_model, vocab_rows, bias=False)
            self.tp_cuts[self.lm_head] = TpShard(0, config.vocab_size, tp_group)
        if lora is not None:  # only the adapters train (model/lora.py)
            adapters.freeze_base(self)

    def embeds(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` starts with the embedding (takes token ids)."""
        return chunk == self.embed_chunk

    def heads(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` ends with the final norm and the LM head (returns logits)."""
        return chunk == self.head_chunk

    def forward(
        self,
        x: Tensor,
        chunk: int = 0,
        documents: Tensor | None = None,
        cache: KVCache | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``documents`` [b, S]: each token's document id in a packed batch, whole on every CP rank
        and every stage (``model/documents.py``); None: one document a sequence. ``cache``
        (``model/kv_cache.py``, generation only): the earlier tokens' keys, ``x`` the tokens after."""
        if self.embeds(chunk):
            if x.dim() != 2 or x.dtype != torch.long:
                raise ValueError(
                    f"the first stage takes token ids [b, S] long, got {x.dtype} {tuple(x.shape)}"
                )
            seq_len = x.shape[1] * tp_size(self.cp_group)
            x = self._embed(x)
        elif x.dim() != 3 or x.shape[-1] != self.config.d_model:
            raise ValueError(
                f"stage {self.chunk_ranges[chunk]} takes hidden states [b, S/(cp*tp), {self.config.d_model}], got {tuple(x.shape)}"
            )
        else:
            seq_len = x.shape[1] * tp_size(self.tp_group) * tp_size(self.cp_group)
        cos, sin = self._rope(seq_len, x.device)
        mask = window_mask = key_starts = None
        if cache is not None:  # positions and masks continue after the held tokens
            split = self.num_chunks > 1 or tp_size(self.tp_group) * tp_size(self.cp_group) > 1
            table = self._rope(cache.capacity, x.device)
            cos, sin, mask, window_mask = cache.step(
                seq_len, *table, self.sliding_window, cacheable=documents is None and not split
            )
        elif documents is not None:  # block-diagonal by document, RoPE from each document's start
            if documents.shape != (x.shape[0], seq_len):
                raise ValueError(
                    f"documents {tuple(documents.shape)} do not fit the batch [{x.shape[0]}, {seq_len}]; "
                    "pass the whole sequences' ids (not a CP rank's slice)"
                )
            within, mask, window_mask = document_masks(
                documents, self.cp_group, self.sliding_window
            )
            if tp_size(self.cp_group) == 1 and seq_len > QUERY_CHUNK:  # masked_attention's chunks
                key_starts = chunk_key_starts(documents)
            cos, sin = cos[within].unsqueeze(1), sin[within].unsqueeze(1)  # [b, 1, S/cp, dim]
        elif tp_size(self.cp_group) > 1:  # RoPE and the causal mask by the tokens' global positions
            mine = context_parallel.local_positions(seq_len, self.cp_group, x.device)
            keys = context_parallel.all_positions(seq_len, self.cp_group, x.device)
            cos, sin, mask = cos[mine], sin[mine], attend_mask(mine, keys, 0)
        # gpt-oss's window layers, by global positions (by document: document_masks)
        if self.sliding_window and documents is None and cache is None:
            mine = keys = torch.arange(seq_len, device=x.device)
            if tp_size(self.cp_group) > 1:
                mine = context_parallel.local_positions(seq_len, self.cp_group, x.device)
                keys = context_parallel.all_positions(seq_len, self.cp_group, x.device)
            window_mask = attend_mask(mine, keys, self.sliding_window)
        # additive, in the dtype the attention computes in, built once for every layer
        dtype, sink = recompute.compute_dtype(x), self.config.attention.sinks
        mask, window_mask = (
            None if m is None else sdpa_mask(m, dtype, sink) for m in (mask, window_mask)
        )
        aux = torch.zeros(x.shape[0], device=x.device, dtype=torch.float32)
        for i in range(*self.chunk_ranges[chunk]):
            block = self.layers[str(i)]
            layer_mask = window_mask if block.sliding else mask
            if self.config.recompute == FULL and torch.is_grad_enabled():
                x, block_aux = checkpoint(
                    block, x, cos, sin, layer_mask, key_starts, use_reentrant=False
                )
            else:
                layer_cache = None if cache is None else cache.layer(i)
                x, block_aux = block(x, cos, sin, layer_mask, key_starts, layer_cache)
            aux = aux + block_aux
        if self.heads(chunk):
            x = self.head(x)
        return x, aux

    def head(self, x: Tensor) -> Tensor:
        """The last stage's final norm and LM head: hidden states [b, S/(cp*tp), D] -> this rank's
        vocabulary shard of the logits [b, S/cp, V/tp]."""
        return self.lm_head(gather_sequence(self.norm(x), self.tp_group))

    def _embed(self, ids: Tensor) -> Tensor:
        """Token ids [b, S] -> this rank's sequence slice of the embeddings [b, S/tp, D]: each rank
        looks up the ids in its vocabulary rows, and the reduce-scatter sums the rows and slices."""
        if tp_size(self.tp_group) == 1:
            return self.embed(ids)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.embed.num_embeddings)
        rows = self.embed(torch.where(mine, local, 0)) * mine.unsqueeze(-1).to(
            self.embed.weight.dtype
        )
        return scatter_sequence(rows, self.tp_group)

    def token_loss_sum(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The summed cross-entropy of ``targets`` [..., S] under the last stage's ``logits``
        [..., S, V/tp] (the padded vocabulary rows excluded); the same value on every TP rank."""
        losses = vocab_parallel_cross_entropy(
            logits.flatten(0, -2),
            targets.flatten(),
            vocab_start=self.vocab_start,
            vocab_size=self.config.vocab_size,
            group=self.tp_group,
        )
        return losses.sum()

    def _rope(self, seq_len: int, device: torch.device) -> tuple[Tensor, Tensor]:
        # A plain cache, not a buffer: a buffer would be garbage after meta-device init + to_empty.
        key = (seq_len, device)
        if key not in self._rope_cache:
            dim, position = self.config.rope_dim, self.config.position
            if position.yarn:
                self._rope_cache[key] = rope_cos_sin_yarn(
                    seq_len, dim, position.theta, position.yarn, device
                )
            else:
                self._rope_cache[key] = rope_cos_sin(seq_len, dim, position.theta, device)
        return self._rope_cache[key]

    def init_weights(self, seed: int) -> None:
        """Layout-free init (``model/init.py``): each value depends on (seed, global name, global
        expert) only, so every layout starts from the same model."""
        init_weights(self, self.config, seed, (tp_size(self.tp_group), self.tp_rank))
        if self.lora is not None:
            adapters.store_base_(self, self.lora)

    def init_adapters(self, seed: int) -> None:
        """The LoRA adapters' layout-free init alone (after a base loaded from a folder), and the
        frozen base stored in ``lora.base_dtype``."""
        init_adapters(self, seed, (tp_size(self.tp_group), self.tp_rank))
        if self.lora is not None:
            adapters.store_base_(self, self.lora)
