"""Stage-local model without processes: config checks, layout-free init, stage chaining, checkpointing."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lightning_titan.hf.export import hf_mixtral_state_dict
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.grad_kinds import split_expert_parameters
from lightning_titan.model.moe.experts import GroupedExperts
from lightning_titan.model.moe.router import route

SEED = 1234
LAYOUTS = [(2, 1), (1, 2), (2, 2), (4, 4)]


def small_config(**overrides) -> ModelConfig:
    base = dict(
        d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, n_experts=8, seq_len=16
    )
    return ModelConfig(**{**base, **overrides, "z_loss_coef": overrides.get("z_loss_coef", 1e-3)})


def full_model(**overrides) -> StageModel:
    model = StageModel(small_config(**overrides))
    model.init_weights(SEED)
    return model


def tokens(b: int = 3, s: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 257, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(d_model=0), "d_model=0"),
        (dict(n_layers=-1), "n_layers=-1"),
        (dict(vocab_size=0), "vocab_size=0"),
        (dict(n_kv_heads=0), "n_kv_heads=0"),
        (dict(d_model=30, n_heads=4), "d_model=30 is not divisible by n_heads=4"),
        (dict(n_heads=4, n_kv_heads=3), "n_heads=4 is not divisible by n_kv_heads=3"),
        (dict(top_k=9, n_experts=8), "top_k=9 > n_experts=8"),
        (dict(d_model=36, n_heads=4), "head_dim .* = 9 is odd"),
        (dict(aux_loss_coef=-0.1), "aux_loss_coef=-0.1"),
        (dict(norm_eps=0.0), "norm_eps=0.0"),
    ],
)
def test_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**kwargs)


def test_validate_layout():
    config = ModelConfig(n_layers=4, n_experts=8)
    config.validate_layout(4, 8)
    with pytest.raises(ValueError, match="n_layers=4 is not divisible by pp=3"):
        config.validate_layout(3, 1)
    with pytest.raises(ValueError, match="n_experts=8 is not divisible by ep=3"):
        config.validate_layout(1, 3)
    with pytest.raises(ValueError, match="n_experts=8 is not divisible by ep=3"):
        StageModel(config, ep=3)
    config.validate_layout(1, 2, 4, fold_ep=True)  # 8 experts over ep2 x tp4
    with pytest.raises(ValueError, match=r"n_experts=8 is not divisible by ep\*cp\*tp = 2\*1\*3"):
        config.validate_layout(1, 2, 3, fold_ep=True)


@pytest.mark.parametrize("pp, ep", LAYOUTS)
def test_init_is_layout_free(pp, ep):
    full = dict(full_model().named_parameters())
    seen = set()
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            stage = StageModel(small_config(), pp_rank=pp_rank, pp=pp, ep_rank=ep_rank, ep=ep)
            stage.init_weights(SEED)
            start, end = stage.expert_range
            assert (end - start) * ep == 8
            experts, _ = split_expert_parameters(stage)
            expert_names = {name for name, _ in experts}
            for name, p in stage.named_parameters():
                want = full[name][start:end] if name in expert_names else full[name]
                torch.testing.assert_close(
                    p, want, rtol=0, atol=0, msg=f"{name} at {pp_rank, ep_rank}"
                )
                seen.add(name)
    assert seen == set(full)


def test_init_depends_on_seed_and_name():
    model = full_model()
    other = StageModel(small_config())
    other.init_weights(SEED + 1)
    params = dict(model.named_parameters())
    assert not torch.equal(
        params["layers.0.attn.wq.weight"], dict(other.named_parameters())["layers.0.attn.wq.weight"]
    )
    assert not torch.equal(
        params["layers.0.attn.wq.weight"][:16], params["layers.1.attn.wq.weight"][:16]
    )
    w1 = params["layers.0.moe.experts.w1"]
    assert not torch.equal(w1[0], w1[1])
    assert torch.equal(params["layers.2.attn_norm.weight"], torch.ones(32))
    # Output projections are scaled down by sqrt(2 * n_layers) = sqrt(8).
    assert params["layers.0.attn.wo.weight"].std() < 0.5 * params["layers.0.attn.wq.weight"].std()


@pytest.mark.parametrize("pp", [2, 4])
def test_stages_in_sequence_reproduce_full_model(pp):
    full = full_model()
    x = tokens()
    want_logits, want_aux = full(x)
    h, aux = x, torch.zeros(x.shape[0])
    for pp_rank in range(pp):
        stage = StageModel(small_config(), pp_rank=pp_rank, pp=pp)
        stage.init_weights(SEED)
        assert stage.is_first_stage == (pp_rank == 0) and stage.is_last_stage == (pp_rank == pp - 1)
        assert hasattr(stage, "embed") == stage.is_first_stage
        assert hasattr(stage, "lm_head") == stage.is_last_stage
        h, stage_aux = stage(h)
        aux = aux + stage_aux
    torch.testing.assert_close(h, want_logits, rtol=0, atol=0)
    torch.testing.assert_close(aux, want_aux, rtol=0, atol=0)


def test_stage_input_checks():
    middle = StageModel(small_config(), pp_rank=1, pp=2)
    with pytest.raises(ValueError, match=r"hidden states \[b, S/\(cp\*tp\), 32\]"):
        middle(tokens())
    with pytest.raises(ValueError, match="token ids"):
        full_model()(torch.randn(2, 16, 32))
    with pytest.raises(ValueError, match="no ep_group"):
        StageModel(small_config(), ep=2)(tokens())


def test_activation_checkpointing_matches():
    plain, ckpt = full_model(), full_model(activation_checkpointing=True)
    x = tokens()
    results = []
    for model in (plain, ckpt):
        logits, aux = model(x)
        (logits.square().mean() + aux.sum()).backward()
        results.append((logits, aux, {n: p.grad for n, p in model.named_parameters()}))
    (l0, a0, g0), (l1, a1, g1) = results
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    torch.testing.assert_close(a1, a0, rtol=0, atol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0, msg=name)


def test_causal():
    model = full_model()
    x = tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % 257
    with torch.no_grad():
        lx, ly = model(x)[0], model(y)[0]
    # Not bit-exact: the experts' matmuls see different row counts, so their blocking differs.
    torch.testing.assert_close(ly[:, :10], lx[:, :10])
    assert not torch.allclose(ly[:, 10:], lx[:, 10:])


def test_sequences_are_independent():
    """Each sequence's logits and aux loss are the same alone or in a batch (per-sequence aux)."""
    model = full_model()
    x = tokens(b=4)
    with torch.no_grad():
        logits, aux = model(x)
        for i in range(4):
            li, ai = model(x[i : i + 1])
            torch.testing.assert_close(li[0], logits[i])
            torch.testing.assert_close(ai[0], aux[i])


def test_gradient_reaches_every_parameter():
    model = full_model()
    logits, aux = model(tokens(b=4))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens(b=4, seed=1).flatten())
    (loss + aux.mean()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all(), name
        assert p.grad.abs().sum() > 0, name
    for name, p in split_expert_parameters(model)[0]:
        assert (p.grad.flatten(1).abs().sum(1) > 0).all(), f"an expert of {name} got no gradient"


def test_aux_is_zero_without_coefficients():
    model = full_model(aux_loss_coef=0.0, z_loss_coef=0.0)
    _, aux = model(tokens())
    assert aux.dtype == torch.float32 and torch.equal(aux, torch.zeros(3))


def test_route_losses_match_definition():
    b, s, e, k = 3, 10, 6, 2
    logits = torch.randn(b, s, e, generator=torch.Generator().manual_seed(3))
    routing = route(logits, k)
    probs = logits.softmax(-1)
    for seq in range(b):
        top = probs[seq].topk(k, dim=-1)
        ids = routing.expert_ids.view(b, s, k)[seq]
        assert torch.equal(ids, top.indices)
        torch.testing.assert_close(
            routing.weights.view(b, s, k)[seq], top.values / top.values.sum(-1, keepdim=True)
        )
        f = torch.tensor([(ids == j).sum().item() / (s * k) for j in range(e)])
        torch.testing.assert_close(routing.load_balance[seq], e * (f * probs[seq].mean(0)).sum())
        z = torch.stack([torch.log(torch.exp(logits[seq, t]).sum()) ** 2 for t in range(s)]).mean()
        torch.testing.assert_close(routing.z_loss[seq], z)


def test_tokens_per_expert_recorded():
    model = full_model()
    model(tokens(b=2, s=8))
    counts = model.layers["1"].moe.tokens_per_expert
    assert counts.shape == (8,) and counts.sum().item() == 2 * 8 * 2
    assert not counts.requires_grad


def test_split_expert_parameters():
    model = StageModel(small_config(), pp_rank=1, pp=2, ep_rank=1, ep=2)
    experts, non_experts = split_expert_parameters(model)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(n for n, _ in experts + non_experts) == sorted(names)
    assert [n for n, _ in experts] == [n for n in names if n in dict(experts)]
    assert [n for n, _ in non_experts] == [n for n in names if n in dict(non_experts)]
    grouped = {
        id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    }
    assert {id(p) for _, p in experts} == grouped
    assert "layers.2.moe.router.weight" in dict(non_experts)
    assert dict(experts)["layers.3.moe.experts.w2"].shape == (4, 48, 32)


def test_logits_match_hugging_face_mixtral(tmp_path):
    import safetensors.torch as safetensors_torch
    import transformers  # a test dependency: missing, this must fail, not skip

    config = small_config(aux_loss_coef=0.0, z_loss_coef=0.0)
    model = StageModel(config)
    model.init_weights(SEED)
    hf_config = transformers.MixtralConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.kv_heads,
        num_local_experts=config.n_experts,
        num_experts_per_tok=config.top_k,
        max_position_embeddings=config.seq_len,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=False,
        sliding_window=None,
    )
    hf_config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf_mixtral_state_dict(model).items()}
    safetensors_torch.save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((tmp_path / "config.json").read_text())["num_local_experts"] == 8
    hf = transformers.MixtralForCausalLM.from_pretrained(tmp_path).float().eval()
    x = tokens()
    with torch.no_grad():
        want = hf(input_ids=x).logits
        got, _ = model(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_config_is_a_plain_dataclass():
    config = small_config()
    assert dataclasses.replace(config, n_layers=8).n_layers == 8
    assert config.head_dim == 8 and config.kv_heads == 2
