"""The model options of the pretrained families, without processes: routing variants against their
definition, the QK-norms, the shared expert, and the ModelConfig errors that name the field."""

import pytest
import torch

from lightning_titan.model.attention import FullQKNorm, RMSNorm
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.moe.router import route


def _logits() -> torch.Tensor:
    return torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(0)) * 2


def test_sigmoid_routing_without_renormalisation_weighs_by_the_raw_scores():
    logits = _logits()
    routing = route(logits, 2, score="sigmoid", norm_topk=False)
    scores = torch.sigmoid(logits).reshape(10, 6)
    top = scores.topk(2, dim=-1)
    assert torch.equal(routing.expert_ids, top.indices)
    torch.testing.assert_close(routing.weights, top.values)
    # the load-balancing loss's P_e is a distribution: the sigmoid scores normalised per token
    shares = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
    chosen = torch.zeros(2, 6).scatter_add_(1, top.indices.reshape(2, 10), torch.ones(2, 10))
    want = 6 * (chosen / 10 * shares.mean(dim=1)).sum(-1)
    torch.testing.assert_close(routing.load_balance, want)


def test_softmax_routing_renormalises_only_when_asked():
    logits = _logits()
    probs = torch.softmax(logits, dim=-1).reshape(10, 6)
    top = probs.topk(2, dim=-1)
    raw = route(logits, 2, norm_topk=False)
    torch.testing.assert_close(raw.weights, top.values)
    normed = route(logits, 2)
    torch.testing.assert_close(normed.weights, top.values / top.values.sum(-1, keepdim=True))


def test_full_qk_norm_on_one_rank_is_an_rms_norm_over_the_whole_projection():
    x = torch.randn(2, 3, 12)
    full, plain = FullQKNorm(12, 12, 1e-6, None), RMSNorm(12, 1e-6)
    with torch.no_grad():
        full.weight.copy_(torch.randn(12))
        plain.weight.copy_(full.weight)
    torch.testing.assert_close(full(x), plain(x))


def test_the_options_build_the_tensors_their_families_have():
    head = StageModel(ModelConfig(n_layers=1, qk_norm="head", attn_head_dim=6))
    shapes = {n: tuple(p.shape) for n, p in head.named_parameters()}
    assert shapes["layers.0.attn.q_norm.weight"] == (6,)  # one weight shared by the heads
    assert shapes["layers.0.attn.wq.weight"] == (4 * 6, 64)  # n_heads * attn_head_dim
    full = StageModel(ModelConfig(n_layers=1, n_kv_heads=2, qk_norm="full"))
    shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
    assert shapes["layers.0.attn.q_norm.weight"] == (64,)  # the whole projection
    assert shapes["layers.0.attn.k_norm.weight"] == (32,)
    qwen2 = StageModel(ModelConfig(n_layers=1, qkv_bias=True, shared_expert_dim=16))
    qwen2.init_weights(0)
    params = dict(qwen2.named_parameters())
    assert (
        params["layers.0.attn.wk.bias"].shape == (64,) and not params["layers.0.attn.wk.bias"].any()
    )
    assert params["layers.0.shared_expert.w1.weight"].shape == (16, 64)
    assert params["layers.0.shared_expert.gate.weight"].shape == (1, 64)
    assert "layers.0.attn.wo.bias" not in params


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"qk_norm": "layer"}, r"qk_norm='layer' must be one of \('none', 'head', 'full'\)"),
        ({"router_score": "relu"}, r"router_score='relu' must be one of"),
        ({"shared_expert_dim": -1}, r"shared_expert_dim=-1 must be an int >= 0"),
        ({"attn_head_dim": 0}, r"attn_head_dim=0 must be a positive int"),
        ({"attn_head_dim": 7}, r"attn_head_dim = 7 is odd"),
        ({"qkv_bias": 1}, r"qkv_bias=1 must be True or False"),
    ],
)
def test_a_bad_option_is_named(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**fields)


def test_an_explicit_head_dim_need_not_divide_d_model():
    config = ModelConfig(d_model=36, n_heads=4, attn_head_dim=8)
    assert config.head_dim == 8
    with pytest.raises(ValueError, match="d_model=36 is not divisible by n_heads=8"):
        ModelConfig(d_model=36, n_heads=8)


def test_a_resume_compares_the_model_a_config_means_not_how_it_is_spelled():
    """n_kv_heads=None is n_heads, attn_head_dim=None is d_model / n_heads: a checkpoint saved with
    the None loads into a model that writes the value out, and a real change is still refused."""
    import dataclasses
    from pathlib import Path

    from lightning_titan.checkpoint.reader import check_config

    class Holder(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config

    saved = dataclasses.asdict(ModelConfig(d_model=64, n_heads=4))
    check_config(Path("ckpt"), saved, Holder(ModelConfig(d_model=64, n_heads=4, n_kv_heads=4)))
    check_config(Path("ckpt"), saved, Holder(ModelConfig(d_model=64, n_heads=4, attn_head_dim=16)))
    with pytest.raises(ValueError, match=r"checkpoint has n_kv_heads=None \(= 4\), model has 2"):
        check_config(Path("ckpt"), saved, Holder(ModelConfig(d_model=64, n_heads=4, n_kv_heads=2)))
