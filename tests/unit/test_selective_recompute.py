"""Selective recompute (``activation_checkpointing="selective"``, ``model/recompute.py``) in one
process: the same loss and grads as keeping everything, for the default model and the families'
options (gpt-oss's sinks, window and clamped biased experts; DeepSeek-V3's latent attention, shared
expert and dense first layer), on both expert GEMM paths; and what it saves, measured with the
saved-tensor meter against the bytes the shapes say it must save."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from engine_harness import CONFIG, FAMILY_CONFIGS, LORA, SEED

from lightning_titan.model.decoder import StageModel
from lightning_titan.model.moe.experts import expert_gemm_paths, probe_grouped_mm
from lightning_titan.runtime.saved_tensors import SavedTensorMeter

CONFIGS = {"default": CONFIG, "gpt_oss": FAMILY_CONFIGS["gpt_oss"], "deepseek": FAMILY_CONFIGS["deepseek"]}  # fmt: skip


def _grads(
    config, mode: str, grouped: bool, lora=None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = StageModel(replace(config, activation_checkpointing=mode), lora=lora)
    model.init_weights(SEED)
    if grouped:
        probe_grouped_mm(model)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_len + 1), generator=g)
    logits, aux = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + aux.sum()
    loss.backward()
    paths = set(expert_gemm_paths(model).values())
    assert paths == ({"grouped fp32"} if grouped else {"loop"}), paths
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_selective_equals_keeping_everything(name, grouped):
    loss, grads = _grads(CONFIGS[name], "none", grouped)
    loss_s, grads_s = _grads(CONFIGS[name], "selective", grouped)
    assert loss_s == loss  # the forward runs the same operations
    assert grads_s.keys() == grads.keys()
    for n, g in grads.items():  # the input grads of a norm sum in another order: rounding only
        torch.testing.assert_close(grads_s[n], g, rtol=0, atol=1e-6, msg=n)


def test_selective_with_adapters_on_a_frozen_base():
    """LoRA: the embedding and the norms frozen, so the first norm's input wants no grad (autograd
    keeps nothing of it) while the q/k/v adapters still read its output in the backward."""
    loss, grads = _grads(FAMILY_CONFIGS["deepseek"], "none", False, LORA)
    loss_s, grads_s = _grads(FAMILY_CONFIGS["deepseek"], "selective", False, LORA)
    assert loss_s == loss and grads_s.keys() == grads.keys() and grads
    for n, g in grads.items():
        torch.testing.assert_close(grads_s[n], g, rtol=0, atol=1e-6, msg=n)


def _held_per_block(config, mode: str, precision: torch.dtype | None = None) -> int:
    """Bytes one block holds for backward at the end of its forward, on one sequence: a middle stage
    of two blocks less one of one block (the input and the rest of the stage cancel). The meter's
    peaks differ by as much (each is a last block's own peak on top of the blocks before it)."""
    held, peaks = [], []
    for layers in (2, 4):  # pp=2: one block, then two, on the second stage
        model = StageModel(replace(config, n_layers=layers, activation_checkpointing=mode), pp=2, pp_rank=1)  # fmt: skip
        model.init_weights(SEED)
        x = torch.randn(1, config.seq_len, config.d_model, requires_grad=True)
        meter = SavedTensorMeter(exclude=list(model.parameters()))
        with meter, torch.autocast("cpu", precision or torch.float32, enabled=bool(precision)):
            out, aux = model(x)
            held.append(meter.held())
            peaks.append(meter.peak)
        del out, aux
    assert peaks[1] - peaks[0] == held[1] - held[0], (peaks, held)
    return held[1] - held[0]


def test_selective_saves_the_norms_and_the_activation_and_no_more():
    """fp32: each of a block's two norms kept its fp32 normalized copy and its output ([S, D] each)
    and the rms ([S, 1]); the experts kept silu(gate) and the product ([S*K, F] each): what
    selective recompute leaves out. Full recompute keeps only the block's input ([S, D])."""
    c = CONFIG
    s, d, k, f = c.seq_len, c.d_model, c.top_k, c.ffn_dim
    none, selective, full = (_held_per_block(c, m) for m in ("none", "selective", "full"))
    assert none - selective == 2 * (2 * s * d + s) * 4 + 2 * s * k * f * 4
    assert full == s * d * 4


def test_selective_under_bf16_autocast_discards_what_the_projections_saved():
    """bf16: the norm's output is made in bf16, so the q, k and v projections (and the router) save
    it rather than three (one) bf16 copies of an fp32 output: those copies are what goes, with the
    fp32 normalized copies, the rms and the bf16 activations. The routed rows then arrive in bf16
    too, so the experts' gate and up projections (the loop's) share them rather than saving a bf16
    copy each: one copy of the [S*K, D] rows less."""
    c = CONFIG
    s, d, k, f = c.seq_len, c.d_model, c.top_k, c.ffn_dim
    none, selective = (_held_per_block(c, m, torch.bfloat16) for m in ("none", "selective"))
    norms = 2 * (s * d * 4 + s * 4) + (3 + 1) * s * d * 2  # fp32 copies and rms; q, k, v, router
    assert none - selective == norms + 2 * s * k * f * 2 + s * k * d * 2


@pytest.mark.parametrize("name", ["gpt_oss", "deepseek"])
def test_selective_saves_less_for_the_families(name):
    none, selective = (_held_per_block(CONFIGS[name], m) for m in ("none", "selective"))
    assert 0 < selective < none
