"""Packed documents on one process: a packed sequence's logits and per-token losses equal each
document run alone (every attention kind: GQA, sliding window and sinks, MLA), and equal
transformers' model run on each document; positions restart and the mask never crosses a document.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_titan.model.config import ModelConfig
from lightning_titan.model.decoder import StageModel
from lightning_titan.model.documents import document_masks, document_positions

S = 16
# two sequences: lengths of their documents (the second ends in a padding "document")
SPLITS = [(5, 7, 4), (9, 3, 4)]
# past QUERY_CHUNK (128) tokens the masked attention runs by chunks, each from its documents' start
LONG_SPLITS = [(100, 90, 60, 50), (170, 30, 80, 20)]
BASE = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, ffn_dim=24, n_experts=4, top_k=2)
KINDS = {
    "gqa": dict(n_kv_heads=2),
    # window 3 < every document but one: the window and the document cut both matter
    "window_sinks": dict(
        attn_sinks=True, qkv_bias=True, attn_out_bias=True, sliding_window=3, n_kv_heads=2
    ),
    "mla": dict(kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=6),
}  # fmt: skip


def documents_of(splits: list[tuple[int, ...]]) -> torch.Tensor:
    return torch.stack(
        [torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]) for lengths in splits]
    )


def test_positions_restart_at_each_document_and_the_mask_is_block_diagonal_causal():
    docs = documents_of(SPLITS)
    assert document_positions(docs)[0].tolist() == [*range(5), *range(7), *range(4)]
    positions, mask, window = document_masks(docs, None, 2)
    assert torch.equal(positions, document_positions(docs))
    q, k = torch.meshgrid(torch.arange(S), torch.arange(S), indexing="ij")
    want = (docs[:, :, None] == docs[:, None, :]) & (k <= q)
    assert torch.equal(mask[:, 0], want)
    assert window is not None and torch.equal(window[:, 0], want & (q - k < 2))


@pytest.mark.parametrize("splits", [SPLITS, LONG_SPLITS], ids=["short", "long"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_packed_sequence_equals_each_document_alone(kind, splits):
    torch.manual_seed(0)
    s = sum(splits[0])
    model = StageModel(ModelConfig(**BASE, **KINDS[kind], seq_len=s)).eval()
    model.init_weights(0)
    tokens = torch.randint(0, 61, (len(splits), s))
    docs = documents_of(splits)
    with torch.no_grad():
        packed, _ = model(tokens, documents=docs)
        plain, _ = model(tokens)
        for row, lengths in enumerate(splits):
            start = 0
            for n in lengths:
                ids = tokens[row : row + 1, start : start + n]
                alone, _ = model(ids)
                got = packed[row : row + 1, start : start + n]
                torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)
                loss = F.cross_entropy(got[0, :-1], ids[0, 1:], reduction="none")
                want = F.cross_entropy(alone[0, :-1], ids[0, 1:], reduction="none")
                torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-5)
                start += n
    # the first document is the plain sequence's start; a later one is not (the check can fail)
    first = min(lengths[0] for lengths in splits)
    torch.testing.assert_close(packed[:, :first], plain[:, :first], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(packed[:, first:], plain[:, first:], atol=1e-3)


def test_documents_that_do_not_fit_the_batch_are_refused():
    model = StageModel(ModelConfig(**BASE, seq_len=S))
    with pytest.raises(ValueError, match=r"documents \(2, 8\) do not fit the batch \[2, 16\]"):
        model(torch.zeros(2, S, dtype=torch.long), documents=torch.zeros(2, 8, dtype=torch.long))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_a_packed_sequence_equals_transformers_on_each_document(family, tmp_path: Path):
    """Our decoder loaded from a tiny Hugging Face folder, packed, against transformers' model on
    each document alone (gpt-oss: sinks, a 5-position window and YaRN; DeepSeek-V3: MLA)."""
    from hf_tiny import VOCAB, build

    from lightning_titan.hf import load as hf_load

    reference = build(family, tmp_path / family, shard=False)
    model = StageModel(hf_load.config_from_folder(tmp_path / family, ModelConfig(seq_len=S)))
    hf_load.load_stage(model, tmp_path / family)
    model.eval()
    splits = [(7, 9), (3, 8, 5)]
    tokens = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed, _ = model(tokens, documents=documents_of(splits))
        for row, lengths in enumerate(splits):
            start = 0
            for n in lengths:
                ids = tokens[row : row + 1, start : start + n]
                want = reference(ids).logits
                got = packed[row : row + 1, start : start + n]
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
                start += n


def test_masked_attention_by_query_chunks_equals_one_call():
    """Past QUERY_CHUNK queries the masked attention runs chunk by chunk over the keys up to each
    chunk's end, and from its documents' first key when given the key starts: the same outputs and
    grads as one call over every key (the hidden keys add 0); with keys in another order than the
    queries (CP), one call. The key starts are each chunk's first visible key over the batch."""
    from lightning_titan.model.documents import (
        QUERY_CHUNK,
        chunk_key_starts,
        document_masks,
        masked_attention,
    )
    from lightning_titan.model.sinks import sdpa_mask

    s = 2 * QUERY_CHUNK + 37  # three chunks, the last one short
    g = torch.Generator().manual_seed(0)
    documents = (torch.rand(2, s, generator=g) < 8 / s).long().cumsum(1)
    _, mask, _ = document_masks(documents, None, 0)
    starts = chunk_key_starts(documents)
    visible = mask[:, 0, ::QUERY_CHUNK].int().argmax(dim=-1)  # each chunk's first query's first key
    assert starts == tuple(visible.amin(dim=0).tolist()) and starts[0] == 0 and starts[-1] > 0
    additive = sdpa_mask(mask, torch.float64, sink=False)
    q, k, v = (torch.randn(2, 4, s, 8, generator=g, dtype=torch.float64) for _ in range(3))
    # CP-like: this rank's queries are every other position, the keys all of them reversed
    mine, keys = torch.arange(0, s, 2), torch.arange(s - 1, -1, -1)
    cases = [
        (q, k, v, additive, None),
        (q, k, v, additive, starts),
        (q[:, :, mine], k[:, :, keys], v[:, :, keys], additive[..., mine, :][..., keys], None),
    ]
    for (q, k, v, additive, key_starts), scale in [(c, sc) for c in cases for sc in (None, 0.3)]:
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        chunked = masked_attention(*inputs, additive, scale=scale, key_starts=key_starts)
        chunked.square().sum().backward()
        whole_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        whole = F.scaled_dot_product_attention(*whole_inputs, attn_mask=additive, scale=scale)
        whole.square().sum().backward()
        torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)
        for a, b in zip(inputs, whole_inputs, strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
