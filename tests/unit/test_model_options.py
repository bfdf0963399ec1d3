"""The model options of the pretrained families, without processes: routing variants against their
definition, the QK-norms, the shared expert, and the ModelConfig errors that name the field."""

import dataclasses
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_titan.model.attention import FullQKNorm, RMSNorm
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.moe.router import route
from lightning_titan.model.options import (
    FLAT_FIELDS,
    AttentionOptions,
    ExpertOptions,
    LatentAttention,
    PositionOptions,
    RouterOptions,
)


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


YARN = {"factor": 4.0, "original_max_position_embeddings": 16}
# rope_yarn values that would train a NaN or a silently wrong RoPE, each named with its range
BAD_YARN = [
    ({"factor": float("nan")}, r"rope_yarn\['factor'\]=nan must be a finite number > 0"),
    ({"factor": float("inf")}, r"rope_yarn\['factor'\]=inf must be a finite number > 0"),
    ({"factor": True}, r"rope_yarn\['factor'\]=True must be a finite number > 0"),
    ({"original_max_position_embeddings": 0}, r"\['original_max_position_embeddings'\]=0 must"),
    ({"attention_factor": 0.0}, r"rope_yarn\['attention_factor'\]=0.0 must be a finite number > 0"),
    ({"beta_slow": float("nan")}, r"rope_yarn\['beta_slow'\]=nan must be a finite number > 0"),
    ({"mscale_all_dim": -0.7}, r"rope_yarn\['mscale_all_dim'\]=-0.7 must be a finite number >= 0"),
    ({"mscale": "1"}, r"rope_yarn\['mscale'\]='1' must be a finite number >= 0"),
    (
        {"beta_fast": 1.0, "beta_slow": 32.0},
        r"beta_fast=1.0 <= beta_slow=32.0: .* give beta_fast >",
    ),
    ({"beta_fast": 0.5}, r"beta_fast=0.5 <= beta_slow=1: "),  # beta_slow's default
    ({"truncate": 0}, r"rope_yarn\['truncate'\]=0 must be True or False"),
]


# -- the option groups (model/options.py): each checks its own fields, naming the flat one --------
@pytest.mark.parametrize(
    "group,fields,match",
    [
        (AttentionOptions, {"qk_norm": "layer"}, r"qk_norm='layer' must be one of"),
        (AttentionOptions, {"attn_sinks": 1}, r"attn_sinks=1 must be True or False"),
        (AttentionOptions, {"sliding_window": -2}, r"sliding_window=-2 must be an int >= 0"),
        (
            AttentionOptions,
            {"kv_lora_rank": 8, "qk_rope_head_dim": 4, "v_head_dim": 4, "qk_norm": "head"},
            r"qk_norm='head' with kv_lora_rank=8: multi-head latent attention has no such option",
        ),
        (AttentionOptions, {"kv_lora_rank": 8, "v_head_dim": 4}, r"qk_rope_head_dim=0 with kv_"),
        (LatentAttention, {"q_lora_rank": -1}, r"q_lora_rank=-1 must be an int >= 0"),
        (LatentAttention, {"rope_interleave": "yes"}, r"rope_interleave='yes' must be True or"),
        (RouterOptions, {"router_score": "relu"}, r"router_score='relu' must be one of"),
        (RouterOptions, {"router_groups": 0}, r"router_groups=0 must be a positive int"),
        (RouterOptions, {"router_topk_groups": 2}, r"router_topk_groups=2 must be an int in 1\.\."),
        (RouterOptions, {"routed_scaling": 0.0}, r"routed_scaling=0.0 must be > 0"),
        (RouterOptions, {"router_expert_bias": None}, r"router_expert_bias=None must be True"),
        (ExpertOptions, {"swiglu_limit": -1.0}, r"swiglu_limit=-1.0 must be a number > 0"),
        (ExpertOptions, {"shared_expert_dim": -1}, r"shared_expert_dim=-1 must be an int >= 0"),
        (ExpertOptions, {"dense_layers": 1}, r"dense_layers=1 with dense_ffn_dim=0"),
        (ExpertOptions, {"expert_proj_bias": "no"}, r"expert_proj_bias='no' must be True or"),
        (PositionOptions, {"rope_theta": 0.0}, r"rope_theta=0.0 must be > 0"),
        (PositionOptions, {"rope_yarn": {"factor": 2.0}}, r"rope_yarn\['original_max_position"),
        (PositionOptions, {"rope_yarn": {"scale": 2.0}}, r"rope_yarn=\{'scale': 2.0\} must be"),
        *[(PositionOptions, {"rope_yarn": {**YARN, **bad}}, match) for bad, match in BAD_YARN],
    ],
)
def test_each_group_checks_its_options_and_names_the_flat_field(group, fields, match):
    """The group raises as it is built from the flat fields (here with ModelConfig's own checks
    bypassed), and ModelConfig raises the same through it."""
    flat = SimpleNamespace(**{**vars(ModelConfig()), **fields})
    with pytest.raises(ValueError, match=match):
        group.of(flat)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**fields)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"router_groups": 3}, r"router_groups=3 must be a positive int dividing n_experts=8"),
        ({"router_groups": 8}, r"router_groups=8 leaves 1 expert per group"),
        ({"router_groups": 4, "top_k": 4}, r"router_topk_groups=1 groups of 2 experts hold fewer"),
        ({"dense_layers": 5, "dense_ffn_dim": 8}, r"dense_layers=5 > n_layers=4"),
        # not "raise router_topk_groups": no groups hold more experts than there are
        ({"router_groups": 4, "top_k": 9}, r"top_k=9 > n_experts=8; use top_k <= n_experts"),
    ],
)
def test_a_group_that_does_not_fit_the_model_is_named(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**fields)


def test_the_groups_read_the_flat_fields_and_vars_stays_flat():
    """Every family option is one ModelConfig field, read by exactly one group field; the groups are
    built on access, never stored: ``vars`` / ``asdict`` (checkpoints, the CLI) stay the flat dict."""
    assert len(FLAT_FIELDS) == len(set(FLAT_FIELDS))
    assert set(FLAT_FIELDS) <= {f.name for f in dataclasses.fields(ModelConfig)}
    config = ModelConfig(**DEEPSEEK_SAVED)
    groups = [config.attention, config.attention.latent, config.router, config.experts]
    groups.append(config.position)
    read = {}
    for group in groups:
        for f in dataclasses.fields(group):
            if "flat" in f.metadata:
                read[f.metadata["flat"]] = getattr(group, f.name)
    assert read == {name: getattr(config, name) for name in FLAT_FIELDS}
    assert vars(config) == dataclasses.asdict(config) == DEEPSEEK_SAVED


# vars(ModelConfig(...)) as the code before the option groups saved it (TitanLM's hparams["model"],
# the checkpoint's model config): DeepSeek-V3's and gpt-oss's options
DEEPSEEK_SAVED = {
    "vocab_size": 257, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": None,
    "ffn_dim": 128, "n_experts": 8, "top_k": 2, "seq_len": 64, "rope_theta": 10000.0,
    "norm_eps": 1e-05, "aux_loss_coef": 0.01, "z_loss_coef": 0.0, "router_bias_update_rate": 0.0,
    "init_std": 0.02, "activation_checkpointing": False, "capacity_factor": None,
    "attn_head_dim": None, "qkv_bias": False, "qk_norm": "none", "router_score": "sigmoid",
    "router_norm_topk": True, "shared_expert_dim": 256, "attn_sinks": False,
    "attn_out_bias": False, "sliding_window": 0, "expert_proj_bias": False, "router_bias": False,
    "swiglu_limit": None, "swiglu_alpha": 1.702, "kv_lora_rank": 8, "q_lora_rank": 12,
    "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 6, "rope_interleave": False,
    "router_groups": 2, "router_topk_groups": 1, "routed_scaling": 2.0, "dense_layers": 1,
    "dense_ffn_dim": 40, "shared_expert_gated": False, "router_expert_bias": True,
    "rope_yarn": {"factor": 4.0, "original_max_position_embeddings": 16},
}  # fmt: skip
GPT_OSS_SAVED = {
    **DEEPSEEK_SAVED, "n_layers": 4, "n_kv_heads": 2, "attn_head_dim": 12, "qkv_bias": True,
    "router_score": "softmax", "shared_expert_dim": 0, "attn_sinks": True, "attn_out_bias": True,
    "sliding_window": 4, "expert_proj_bias": True, "router_bias": True, "swiglu_limit": 7.0,
    "kv_lora_rank": 0, "q_lora_rank": 0, "qk_nope_head_dim": 0, "qk_rope_head_dim": 0,
    "v_head_dim": 0, "router_groups": 1, "routed_scaling": 1.0, "dense_layers": 0,
    "dense_ffn_dim": 0, "shared_expert_gated": True, "router_expert_bias": False, "rope_yarn": None,
}  # fmt: skip


QWEN3 = ModelConfig(qk_norm="head", attn_head_dim=8)


@pytest.mark.parametrize(
    "saved,given",
    [
        (
            DEEPSEEK_SAVED,
            dict(
                n_layers=2, kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=4,
                qk_rope_head_dim=4, v_head_dim=6, router_score="sigmoid", router_expert_bias=True,
                shared_expert_dim=256, shared_expert_gated=False, router_groups=2, dense_layers=1,
                dense_ffn_dim=40, routed_scaling=2.0,
                rope_yarn={"factor": 4.0, "original_max_position_embeddings": 16},
            ),
        ),
        (
            GPT_OSS_SAVED,
            dict(
                attn_sinks=True, qkv_bias=True, attn_out_bias=True, sliding_window=4,
                expert_proj_bias=True, router_bias=True, swiglu_limit=7.0, attn_head_dim=12,
                n_kv_heads=2,
            ),
        ),
        # a config saved before gpt-oss's and DeepSeek-V3's options existed: their defaults
        (
            dict(itertools.takewhile(lambda kv: kv[0] != "attn_sinks", vars(QWEN3).items())),
            {"qk_norm": "head", "attn_head_dim": 8},
        ),
    ],
)  # fmt: skip
def test_a_saved_flat_config_loads_to_the_same_config(saved, given):
    from lightning_titan.checkpoint.reader import check_config

    config = ModelConfig(**saved)
    assert config == ModelConfig(**given)
    assert config.attention == ModelConfig(**given).attention  # and the groups the code reads
    model = StageModel(config)  # the resume check compares the saved dict with the model's
    check_config(Path("ckpt"), saved, model)


def test_a_flat_cli_flag_sets_its_group():
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_argument("--model", type=ModelConfig)
    flags = ["--model.qk_norm=head", "--model.attn_head_dim=8", "--model.router_norm_topk=false"]
    config = parser.instantiate(parser.parse_args(flags)).model
    assert (config.attention.qk_norm, config.attention.head_dim) == ("head", 8)
    assert config.router.norm_topk is False and config == ModelConfig(
        qk_norm="head", attn_head_dim=8, router_norm_topk=False
    )
