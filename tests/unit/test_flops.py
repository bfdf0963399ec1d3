"""Model FLOPs (lightning_titan/model/flops.py): the formula against torch's FlopCounterMode on one
training step of the whole model, and the peak it is a share of."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_titan.model import flops
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.moe.experts import GroupedExperts

CONFIGS = {
    "default": ModelConfig(),
    "gqa, top-1 of 4, longer": ModelConfig(
        d_model=48, n_heads=6, n_kv_heads=2, ffn_dim=80, n_experts=4, top_k=1, seq_len=96
    ),
    "many experts, top-4": ModelConfig(
        d_model=32, n_layers=2, n_heads=2, ffn_dim=24, n_experts=16, top_k=4, seq_len=32
    ),
    "deepseek-v3: latent attention, a dense layer, shared expert": ModelConfig(
        d_model=48,
        n_layers=3,
        n_heads=4,
        ffn_dim=24,
        n_experts=4,
        seq_len=32,
        kv_lora_rank=32,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        router_score="sigmoid",
        router_expert_bias=True,
        shared_expert_dim=48,
        shared_expert_gated=False,
        dense_layers=1,
        dense_ffn_dim=96,
    ),
    "qwen2-moe: gated shared expert": ModelConfig(d_model=32, shared_expert_dim=64, qkv_bias=True),
}


def counted_step_flops(config: ModelConfig, batch: int) -> int:
    """FlopCounterMode's count of one forward + backward of ``batch`` sequences."""
    model = StageModel(config)
    model.init_weights(0)
    for m in model.modules():  # FlopCounterMode counts mm, not torch._grouped_mm
        if isinstance(m, GroupedExperts):
            m.grouped_mm = False
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (batch, config.seq_len + 1), generator=g)
    # the math backend: FlopCounterMode has no formula for the fused CPU attention kernel, and the
    # math one runs the same two matmuls as bmm, which it counts
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits, aux = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + aux.mean()
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_step_flops_within_2_percent_of_flop_counter(name):
    config, batch = CONFIGS[name], 3
    expected = counted_step_flops(config, batch)
    latent = config.attention.latent
    if latent.kv_rank:  # the kernel runs v padded to q's head dim; model FLOPs count v's own width
        pad = latent.nope_dim + latent.rope_dim - latent.v_dim
        per_token = 3 * 2 * config.seq_len * config.n_heads * pad  # forward and backward
        expected -= config.n_layers * batch * config.seq_len * per_token
    # the math backend multiplies the whole S x S and masks; the formula counts the causal keys only
    s = config.seq_len
    full = flops.attention_flops_per_token(config) * s * s / flops.attended_keys(s)  # all S keys
    masked = full * (s * s - flops.attended_keys(s)) / (s * s)
    expected -= 3 * config.n_layers * batch * s * masked
    formula = flops.step_flops(config, batch * config.seq_len)
    assert formula == pytest.approx(expected, rel=0.02), (name, formula, expected)


def test_formula_terms_scale_as_they_should():
    base = ModelConfig()
    # the LM head is counted once per token, not per layer; the attention grows with S
    one_layer = flops.forward_flops_per_token(ModelConfig(n_layers=1))
    two_layers = flops.forward_flops_per_token(ModelConfig(n_layers=2))
    assert two_layers - one_layer == one_layer - 2 * base.d_model * base.vocab_size
    assert flops.training_flops_per_token(base) == 3 * flops.forward_flops_per_token(base)


def test_causal_and_window_keys_are_counted_position_by_position():
    """Position i (1-based) attends to i keys, min(w, i) under a window of w."""
    assert flops.attended_keys(4) == 1 + 2 + 3 + 4
    assert flops.attended_keys(6, window=3) == 1 + 2 + 3 + 3 + 3 + 3
    assert flops.attended_keys(4, window=64) == flops.attended_keys(4)  # wider than the sequence


@pytest.mark.parametrize("window", [0, 5, 31, 32, 64])
@pytest.mark.parametrize(
    "name", ["default", "deepseek-v3: latent attention, a dense layer, shared expert"]
)
def test_attention_flops_are_a_sum_over_positions(name, window):
    """Independently of attended_keys' closed form: a loop over the positions of one sequence,
    query i (1-based) scoring min(window, i) keys (i without a window) and summing as many value
    rows, 2 FLOPs a multiply-add, each head's q.k over its query-key width (latent: the no-RoPE and
    RoPE parts) and its weighted sum over its value width; per token the mean over the positions."""
    config = dataclasses.replace(CONFIGS[name], sliding_window=window)
    if config.attention.kind == "latent":
        latent = config.attention.latent
        qk, v = latent.nope_dim + latent.rope_dim, latent.v_dim
    else:
        qk = v = config.head_dim
    total = 0
    for i in range(1, config.seq_len + 1):
        keys = min(window, i) if window else i
        total += config.n_heads * (2 * keys * qk + 2 * keys * v)
    assert flops.attention_flops_per_token(config, window) == pytest.approx(
        total / config.seq_len, rel=1e-12
    )
    # the causal mean is about half the full S x S product (plus the diagonal's half position)
    full = config.n_heads * 2 * config.seq_len * (qk + v)
    if not window:
        assert total / config.seq_len == pytest.approx(
            full * (config.seq_len + 1) / (2 * config.seq_len)
        )


def test_window_layers_count_the_keys_they_see():
    """gpt-oss: the even layers of 3 attend to min(4, i) of the i keys before them (16 positions)."""
    full = ModelConfig(n_layers=3, seq_len=16)
    window = dataclasses.replace(full, sliding_window=4)
    q_width = full.n_heads * full.head_dim
    causal = sum(range(1, 17))  # 136 keys over the 16 positions
    windowed = 1 + 2 + 3 + 4 * 13  # 58
    saved = 2 * 2 * (causal - windowed) / 16 * q_width  # per token: scores and weighted sum
    assert flops.forward_flops_per_token(full) - flops.forward_flops_per_token(window) == 2 * saved
    wide = dataclasses.replace(full, sliding_window=64)  # wider than the sequence: nothing saved
    assert flops.forward_flops_per_token(wide) == flops.forward_flops_per_token(full)


def test_qwen3_235b_a22b_is_its_published_flops_per_token():
    """About 147 GFLOP a token for training at S = 4096, the count published beside its runs (the
    causal half of the attention). By hand, per token and layer: q/o projections 2 * 4096 * 2 * 8192,
    k/v 2 * 4096 * 2 * 512, attention 2 * (4097 / 2) * 2 * 8192 (causal: (S + 1) / 2 keys on
    average), router 2 * 4096 * 128, 8 experts of 3 * 2 * 4096 * 1536; 94 layers; the head
    2 * 4096 * 151936; times 3 for the backward."""
    qwen = ModelConfig(vocab_size=151936, d_model=4096, n_layers=94, n_heads=64, n_kv_heads=4,
                       attn_head_dim=128, ffn_dim=1536, n_experts=128, top_k=8, seq_len=4096,
                       qk_norm="head")  # fmt: skip
    layer = (2 * 4096 * (2 * 8192 + 2 * 512) + 2 * 4097 / 2 * 2 * 8192 + 2 * 4096 * 128
             + 8 * 3 * 2 * 4096 * 1536)  # fmt: skip
    by_hand = 3 * (94 * layer + 2 * 4096 * 151936)
    assert by_hand == pytest.approx(148.34e9, rel=1e-4)
    assert flops.training_flops_per_token(qwen) == pytest.approx(by_hand, rel=1e-12)
    assert flops.training_flops_per_token(qwen) == pytest.approx(147e9, rel=0.015)
    # not halved: 167 GFLOP, the count of a kernel that multiplies every masked block
    causal = flops.attention_flops_per_token(qwen)
    assert 3 * 94 * (causal * 2 * 4096 / 4097 - causal) == pytest.approx(18.9e9, rel=0.01)


def test_peak_is_a_probe_on_cpu_and_the_catalogue_on_a_known_gpu(monkeypatch):
    cpu = torch.device("cpu")
    peak, source = flops.device_peak(cpu)
    assert peak > 1e8 and "matmul probe" in source
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert flops.catalogue_peak(torch.device("cuda", 0)) == 756e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert flops.catalogue_peak(torch.device("cuda", 0)) == 989e12
    assert flops.catalogue_peak(cpu) is None


def test_titanlm_logs_flops_mfu_and_the_dropped_assignments(tmp_path):
    """Through Trainer + TitanStrategy on one rank (in process); the multi-rank runs of test_cli
    check that every layout logs the same keys."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_titan import TitanLM, TitanStrategy

    config = ModelConfig(d_model=32, n_layers=2, n_heads=2, ffn_dim=32, n_experts=4, seq_len=16,
                         capacity_factor=0.5)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (8, config.seq_len + 1), generator=g)
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=TitanStrategy(), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    module = TitanLM(config, warmup_steps=0)
    # the step's metrics go to Lightning as CPU tensors: a Python float would be copied onto the
    # module's device every step (a host-to-device copy each on CUDA; issue 43)
    logged, log = [], module.log
    module.log = lambda name, value, **kw: (logged.append((name, value)), log(name, value, **kw))
    environ = dict(os.environ)
    try:
        trainer.fit(module, loader)
    finally:  # the fit leaves a process group and its address behind; later spawns need neither
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert logged and all(
        isinstance(v, torch.Tensor) and v.device.type == "cpu" for _, v in logged
    ), logged
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    per_token = metrics["flops_per_sec"] / metrics["tokens_per_sec"]
    assert per_token == pytest.approx(flops.training_flops_per_token(config), rel=1e-6)
    assert 0 < metrics["mfu"] < 1.5  # a share of this box's probed peak (a busy box may wobble)
    assert metrics["mfu"] == pytest.approx(metrics["flops_per_sec"] / module.peak_flops_total)
    assignments = 4 * config.seq_len * config.top_k * config.n_layers
    assert 0 < metrics["dropped_assignments"] < assignments
    assert metrics["dropped_fraction"] == pytest.approx(
        metrics["dropped_assignments"] / assignments
    )
