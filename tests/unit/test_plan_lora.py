"""`titan plan` knows LoRA: the frozen base's backward is one pass (no weight-gradient GEMMs), its
reductions and optimizer carry the adapters only, and the models that fit no 8-GPU node for a full
fine-tune fit it for LoRA. The state model's bytes are held to the measured ones under every
layout by tests/distributed/test_lora_layouts.py."""

from __future__ import annotations

import pytest

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.lora import LoRA
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.plan.cost import StepOptions, predict
from lightning_titan.plan.devices import GPUS, on_nodes
from lightning_titan.plan.memory import rank_state, trained_params

CONFIG = ModelConfig(d_model=256, ffn_dim=512, seq_len=1024, vocab_size=1024)
DEGREES = {"dp": 2, "pp": 1, "ep": 4, "cp": 1, "tp": 1}


def test_a_frozen_base_backward_is_one_pass_and_only_adapters_are_reduced():
    device = on_nodes(GPUS["h100-80gb"], 8, 1)
    params = (10**6, 10**7)
    full = predict(CONFIG, DEGREES, 0, StepOptions(), 64, device, params)
    frozen = predict(CONFIG, DEGREES, 0, StepOptions(), 64, device, params, frozen_base=True)
    fixed = (CONFIG.n_layers + 1) * device.pass_s  # one microbatch's passes: alike in both
    # forward + the input grads: two of the full fine-tune's three passes of FLOPs
    assert frozen.compute - fixed == pytest.approx(2 / 3 * (full.compute - fixed), rel=1e-9)
    lora = LoRA(rank=8, targets=("attention", "experts"))
    dims = ParallelDims(**DEGREES)
    adapters = trained_params(CONFIG, dims, lora)
    whole = trained_params(CONFIG, dims)
    assert 0 < sum(adapters) < 0.2 * sum(whole)
    state = rank_state(CONFIG, dims, 0, lora=lora)
    assert state["expert_grads"] == 4 * adapters[1] and state["non_expert_grads"] == 4 * adapters[0]
    assert state["expert_optimizer"] == 8 * adapters[1]
    # the bf16 base halves the frozen matrices' bytes
    bf16 = rank_state(
        CONFIG, dims, 0, lora=LoRA(rank=8, targets=("attention", "experts"), base_dtype="bf16")
    )
    assert bf16["expert_params"] < 0.6 * state["expert_params"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_oss_120b_fits_one_node_for_lora_not_for_a_full_fine_tune():
    from lightning_titan.tools.plan_lora import ADAPTERS, GPT_OSS_120B, plan

    full = plan("gpt-oss-120b", GPT_OSS_120B, "full", None)
    lora = plan("gpt-oss-120b", GPT_OSS_120B, "lora", ADAPTERS["LoRA r16 attention+experts"])
    assert full.label == "nothing fits" and full.memory_gb > 80
    assert lora.label != "nothing fits" and lora.memory_gb <= 80 and lora.step_s
    assert lora.trained < 0.02 * full.trained
