"""gpt-oss's sink attention through the fused kernel equals the softmax with the sink written out
(transformers' eager gpt-oss attention, restated here), forward and backward, and keeps nothing
S x S per head for the backward."""

import pytest
import torch

from lightning_titan.model.sinks import attend_mask, sdpa_mask, sink_attention


def eager(q, k, v, sinks_H, mask):
    """transformers' ``eager_attention_forward`` of GptOssAttention: the sink logit one more column
    of the scores, its share of the softmax dropped."""
    scores = q @ k.transpose(2, 3) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks_H.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    return torch.softmax(logits, dim=-1)[..., :-1] @ v


def masks(s: int) -> dict[str, tuple[torch.Tensor | None, torch.Tensor]]:
    """name -> (the mask sink_attention gets, the mask the eager reference applies)."""
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    # context parallelism: this rank's queries (the 2nd and 3rd quarters of 4 chunks over cp2's
    # load-balanced order) against every rank's keys in the order they arrive
    chunk = s // 4
    mine = torch.cat([torch.arange(chunk, 2 * chunk), torch.arange(2 * chunk, 3 * chunk)])
    keys = torch.cat([torch.arange(0, chunk), torch.arange(3 * chunk, s), mine])
    cp = attend_mask(mine, keys, 0)
    window = attend_mask(torch.arange(s), torch.arange(s), 5)
    return {"causal": (None, causal), "window": (window, window), "cp": (cp, cp)}


@pytest.mark.parametrize("name", ["causal", "window", "cp"])
def test_sink_attention_equals_the_sink_written_out(name):
    gen = torch.Generator().manual_seed(0)
    b, heads, s, hd = 2, 3, 16, 8
    given, applied = masks(s)[name]
    s_q, s_k = applied.shape
    q = torch.randn(b, heads, s_q, hd, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, heads, s_k, hd, generator=gen, dtype=torch.float64) for _ in range(2))
    # large sinks too: a query may put most of its weight on nothing
    sinks = torch.tensor([-1.0, 0.5, 4.0], dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (q, k, v, sinks)]
    prepared = None if given is None else sdpa_mask(given, q.dtype, sink=True)
    ours, theirs = sink_attention(*inputs, prepared), eager(*inputs, applied)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    grad = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    for a, b_ in zip(
        torch.autograd.grad(ours, inputs, grad),
        torch.autograd.grad(theirs, inputs, grad),
        strict=True,
    ):
        torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["causal", "window"])
def test_nothing_s_by_s_is_kept_per_head(name):
    """Saved for backward: q, k, v, output and a log-sum-exp a query (each linear in S); with a mask,
    that mask once (no batch or head dim), not the scores of every head."""
    b, heads, s, hd = 1, 4, 256, 16
    given, _ = masks(s)[name]
    q, k, v = (torch.randn(b, heads, s, hd, requires_grad=True) for _ in range(3))
    sinks = torch.zeros(heads, requires_grad=True)
    prepared = None if given is None else sdpa_mask(given, q.dtype, sink=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda t: saved.append(t.shape) or t, lambda t: t
    ):
        sink_attention(q, k, v, sinks, prepared)
    square = [shape for shape in saved if sum(n >= s for n in shape) >= 2]
    assert square == ([] if given is None else [torch.Size([s, s + 1])]), saved


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek"])
def test_a_block_keeps_nothing_s_by_s_per_head(family):
    """A whole model's forward (gpt-oss's sinks and window layers; DeepSeek-V3's latent attention,
    whose v is narrower than q and k): no tensor saved for the backward has a head dim and two dims
    of at least S. Only the window layers' mask is S x S: one for all of them (no batch or head dim)."""
    from lightning_titan import ModelConfig, StageModel

    s = 128
    base = dict(vocab_size=61, d_model=32, n_layers=4, n_heads=4, ffn_dim=24, n_experts=4, top_k=2)
    options = {
        "gpt_oss": dict(
            attn_sinks=True, qkv_bias=True, attn_out_bias=True, sliding_window=8,
            expert_proj_bias=True, router_bias=True, swiglu_limit=7.0, n_kv_heads=2,
        ),
        "deepseek": dict(
            kv_lora_rank=12, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        ),
    }[family]  # fmt: skip
    model = StageModel(ModelConfig(**base, **options, seq_len=s))
    model.init_weights(0)
    saved = []

    def pack(t):
        saved.append((t.shape, t.untyped_storage().data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 61, (2, s)))
    square = [(shape, ptr) for shape, ptr in saved if sum(n >= s for n in shape) >= 2]
    assert all(len(shape) == 2 for shape, _ in square), square
    assert len({ptr for _, ptr in square}) == (1 if family == "gpt_oss" else 0), square
