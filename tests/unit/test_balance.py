"""Aux-loss-free balancing (model/moe/balance.py): the expert bias picks the experts but does not weigh
them, moves by the sign of the step's load against the mean, and counts each training token once.

Across layouts (the counts summed over data, expert, context and tensor ranks) the equivalence suite
checks it: tests/distributed/test_equivalence.py, BIAS cases."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from engine_harness import BIAS_CONFIG, reference

from lightning_titan.checkpoint.state import MODEL, model_entries
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.moe.balance import bias_step, update_expert_bias
from lightning_titan.model.moe.layer import MoELayer, take_step_counts
from lightning_titan.model.moe.router import route
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups
from lightning_titan.train.engine import Engine
from lightning_titan.train.step import TrainStep

CONFIG = ModelConfig(
    d_model=32, n_layers=2, n_heads=4, ffn_dim=24, n_experts=4, seq_len=8,
    router_bias_update_rate=0.01,
)  # fmt: skip


def test_selection_follows_the_bias_and_weights_ignore_it():
    b, s, e, k = 2, 6, 5, 2
    logits = torch.randn(b, s, e, generator=torch.Generator().manual_seed(0))
    probs = logits.softmax(-1)
    bias = torch.tensor([0.0, 5.0, 0.0, 0.0, 5.0])  # experts 1 and 4 win every token
    routing = route(logits, k, selection_bias=bias)
    assert routing.expert_ids.sort(-1).values.eq(torch.tensor([1, 4])).all()
    chosen = probs.reshape(b * s, e).gather(-1, routing.expert_ids)
    torch.testing.assert_close(routing.weights, chosen / chosen.sum(-1, keepdim=True))
    # a zero bias selects and weighs exactly as no bias
    plain, zero = route(logits, k), route(logits, k, selection_bias=torch.zeros(e))
    assert torch.equal(plain.expert_ids, zero.expert_ids)
    assert torch.equal(plain.weights, zero.weights)


def test_layer_output_uses_the_unbiased_weights():
    torch.manual_seed(0)
    layer = MoELayer(16, 8, 4, 2, bias_update_rate=1e-3)
    layer.expert_bias.copy_(torch.tensor([0.0, 3.0, 3.0, 0.0]))  # experts 1 and 2 for every token
    x = torch.randn(2, 5, 16)
    out, _ = layer(x)
    tokens = x.reshape(10, 16)
    probs = layer.router(tokens).softmax(-1)
    w = layer.experts

    def expert(i: int) -> torch.Tensor:
        return (F.silu(tokens @ w.w1[i]) * (tokens @ w.w3[i])) @ w.w2[i]

    p1, p2 = probs[:, 1:2], probs[:, 2:3]
    expected = (p1 * expert(1) + p2 * expert(2)) / (p1 + p2)
    torch.testing.assert_close(out.reshape(10, 16), expected, rtol=1e-5, atol=1e-6)


def test_bias_step_is_the_sign_of_mean_minus_load():
    counts = torch.tensor([[3, 1, 0, 4], [2, 2, 2, 2], [5, 1, 1, 1]])  # means 2, 2, 2
    expected = torch.tensor([[-1, 1, 1, -1], [0, 0, 0, 0], [-1, 1, 1, 1]]) * 0.5
    assert torch.equal(bias_step(counts, 0.5), expected.float())


def test_counts_once_per_training_token():
    """Train forwards count (once under activation checkpointing's recompute); eval and no_grad
    forwards do not; the update spends the counts."""
    ids = torch.randint(0, 257, (3, 8), generator=torch.Generator().manual_seed(1))
    counted = []
    for recompute in (False, True):
        model = StageModel(replace(CONFIG, activation_checkpointing=recompute))
        model.init_weights(0)
        # torch stops a recompute once it has the saved tensors it needs, which may be before the
        # layer counts; without that early stop the recompute runs the whole block
        layer = model.layers["1"].moe
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            logits, aux = model(ids)
            (logits.square().mean() + aux.sum()).backward()
        with torch.no_grad():
            model(ids)
        model.eval()
        model(ids)
        counts = take_step_counts(model)
        assert counts.selected[layer].sum() == 3 * 8 * CONFIG.top_k
        counted.append(counts.selected[layer].clone())
        assert take_step_counts(model).selected == {}  # taken: the count starts again
        update_expert_bias([layer], counts, None)
        assert torch.equal(
            layer.expert_bias, bias_step(counted[-1], CONFIG.router_bias_update_rate)
        )
    assert torch.equal(counted[0], counted[1])


def test_skipped_step_keeps_the_bias():
    model = StageModel(CONFIG)
    model.init_weights(0)
    engine = Engine(model, ParallelDims(1, 1, 1), ProcessGroups(None, None, None, None))
    assert len(engine.balanced_layers) == 2
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = TrainStep(engine, optimizer, on_nonfinite="skip")
    ids = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(2))

    def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return model.token_loss_sum(logits, targets) * poison

    poison = float("nan")  # a non-finite loss: the step's update is dropped, and the bias stays
    with warnings.catch_warnings(record=True):
        result = step.run(model, ids[:, :-1], ids[:, 1:], 1, loss_sum)
    assert not result.finite and step.skipped == 1
    assert all(layer.expert_bias.abs().sum() == 0 for layer in engine.balanced_layers)
    poison = 1.0
    assert step.run(model, ids[:, :-1], ids[:, 1:], 1, loss_sum).finite
    assert all(layer.expert_bias.abs().sum() > 0 for layer in engine.balanced_layers)
    engine.remove()


def test_bias_is_a_checkpointed_buffer_only_when_on():
    on, off = (
        StageModel(CONFIG, pp_rank=1, pp=2),
        StageModel(replace(CONFIG, router_bias_update_rate=0)),
    )
    state = on.state_dict()
    assert state["layers.1.moe.expert_bias"].dtype == torch.float32
    assert state["layers.1.moe.expert_bias"].shape == (CONFIG.n_experts,)
    assert MODEL + "layers.1.moe.expert_bias" in model_entries(on)  # its global name
    assert not [k for k in off.state_dict() if "bias" in k]


def test_bias_with_the_aux_loss_off():
    result = reference(replace(BIAS_CONFIG, aux_loss_coef=0.0), steps=3)
    assert all(b.abs().sum() > 0 for b in result["biases"].values())
    assert all(torch.isfinite(torch.tensor(result["loss"])))


@pytest.mark.parametrize("rate", [-1e-3, float("nan")])
def test_negative_rate_is_refused(rate):
    with pytest.raises(ValueError, match=f"router_bias_update_rate={rate}"):
        replace(CONFIG, router_bias_update_rate=rate)


def test_export_warns_that_the_bias_is_left_out(tmp_path):
    from lightning_titan.hf import export

    model = StageModel(CONFIG)
    model.init_weights(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a zero bias changes nothing: no warning
        export.write_hf_folder(model, tmp_path / "zero")
    model.layers["1"].moe.expert_bias[0] = 1e-3
    with pytest.warns(UserWarning, match="1 MoE layers carry an expert bias .*layers.1.moe"):
        export.write_hf_folder(model, tmp_path / "moved")
