"""Expert capacity (model/moe/capacity.py): per sequence, first choices before second ones, in position
order; dropped assignments are not dispatched and add nothing; bad factors fail at config time.

Across layouts (the queue counted over a sequence's CP and TP ranks) the equivalence suite checks
it: tests/distributed/test_equivalence.py, CAPACITY cases."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.moe.capacity import expert_capacity, queue_position, sequence_positions
from lightning_titan.model.moe.layer import MoELayer, take_step_counts
from lightning_titan.parallel.context_parallel import positions


def brute_force_keep(ids_BSK: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    b, s, k = ids_BSK.shape
    keep = torch.zeros(b, s, k, dtype=torch.bool)
    for seq in range(b):
        taken = [0] * n_experts
        for choice in range(k):
            for pos in range(s):
                e = int(ids_BSK[seq, pos, choice])
                keep[seq, pos, choice] = taken[e] < capacity
                taken[e] += 1
    return keep


def test_queue_is_first_choices_then_second_in_position_order():
    ids = torch.tensor([[[0, 1], [0, 2], [1, 0], [0, 1]]])  # one sequence, S=4, K=2
    expected = torch.tensor([[[0, 1], [1, 0], [0, 3], [2, 2]]])  # e1: pos 2 first, then pos 0
    assert torch.equal(queue_position(ids, 3), expected)
    g = torch.Generator().manual_seed(0)
    many = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(5 * 12)]).view(5, 12, 2)
    for capacity in (1, 3, 5):
        assert torch.equal(queue_position(many, 6) < capacity, brute_force_keep(many, 6, capacity))


@pytest.mark.parametrize("cp, tp", [(1, 2), (2, 1), (2, 2), (4, 1)])
def test_sequence_positions_are_each_ranks_tokens(cp, tp):
    seq_len = 16
    where = sequence_positions(seq_len, cp, tp, torch.device("cpu"))
    assert sorted(where.reshape(-1).tolist()) == list(range(seq_len))
    per = seq_len // (cp * tp)
    for cp_rank in range(cp):  # what take_local then the TP slice give rank (cp_rank, tp_rank)
        mine = positions(seq_len, cp, cp_rank)
        for tp_rank in range(tp):
            expected = mine[tp_rank * per : (tp_rank + 1) * per]
            assert torch.equal(where[cp_rank * tp + tp_rank], expected)


def reference_output(layer: MoELayer, x: torch.Tensor, capacity: int) -> torch.Tensor:
    """Every expert on every token, masked by the brute-force queue: what the layer must return."""
    b, s, d = x.shape
    tokens = x.reshape(b * s, d)
    probs = layer.router(tokens).float().softmax(-1)
    weights, ids = probs.topk(layer.top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    keep = brute_force_keep(ids.view(b, s, -1), layer.n_experts, capacity).view(b * s, -1)
    w = layer.experts
    out = torch.zeros_like(tokens)
    for k in range(layer.top_k):
        for e in range(layer.n_experts):
            rows = (ids[:, k] == e) & keep[:, k]
            y = (F.silu(tokens @ w.w1[e]) * (tokens @ w.w3[e])) @ w.w2[e]
            out = out + (rows * weights[:, k]).unsqueeze(1) * y
    return out.view(b, s, d)


@pytest.mark.parametrize("grouped", [True, False])
def test_layer_drops_over_capacity_outputs_and_grads(grouped):
    torch.manual_seed(0)
    layer = MoELayer(16, 8, 4, 2, capacity_factor=0.5)  # 10 * 2 / 4 * 0.5 -> 2 per expert
    layer.experts.grouped_mm = grouped
    x = torch.randn(3, 10, 16, requires_grad=True)
    out, _ = layer(x)
    counts = take_step_counts(layer)
    capacity = expert_capacity(0.5, 10, 2, 4)
    assert capacity == 2 and counts.dropped[layer] > 0
    assert max(layer.rows_per_local_expert) <= capacity * 3  # 3 sequences
    twin = copy.deepcopy(layer)
    x_ref = x.detach().clone().requires_grad_(True)
    expected = reference_output(twin, x_ref, capacity)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    (out * grad).sum().backward()
    (expected * grad).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(layer.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_all_tokens_to_one_expert_it_takes_exactly_capacity():
    layer = MoELayer(8, 4, 4, 1, capacity_factor=1.0)  # top-1: 6 * 1 / 4 -> 1 per sequence
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2] = 1.0
    x = torch.rand(5, 6, 8) + 0.1  # positive: expert 2 wins every token
    layer(x)
    counts = take_step_counts(layer)
    assert layer.rows_per_local_expert == [5] * 4  # static slots: 5 sequences x 1, zeros after
    assert int(counts.dropped[layer]) == 5 * 6 - 5
    assert layer.tokens_per_expert.tolist() == [0, 0, 30, 0]  # selections, before the drops


def test_capacity_with_room_for_all_equals_dropless():
    torch.manual_seed(1)
    dropless = MoELayer(16, 8, 8, 2)
    roomy = MoELayer(16, 8, 8, 2, capacity_factor=3.9)  # 10 * 2 / 8 * 3.9 -> 9 of 10 tokens
    roomy.load_state_dict(dropless.state_dict())
    x = torch.randn(2, 10, 16)
    ids = dropless.router(x.reshape(20, 16)).topk(2).indices.view(2, 10, 2)
    assert (queue_position(ids, 8) < 9).all(), "no expert should get 10 assignments of one sequence"
    torch.testing.assert_close(roomy(x)[0], dropless(x)[0], rtol=0, atol=1e-7)
    counts = take_step_counts(roomy)
    assert int(counts.dropped[roomy]) == 0


@pytest.mark.parametrize(
    "factor, words",
    [
        (-1.0, ["capacity_factor=-1.0", "must be a number > 0", "None for dropless"]),
        (0.0, ["capacity_factor=0.0", "> 0"]),
        ("1.5", ["capacity_factor='1.5'"]),
        (0.01, ["capacity_factor=0.01", "every token", "use capacity_factor >= 0.0625"]),
        (4.0, ["capacity_factor=4.0", "n_experts / top_k = 4", "capacity_factor=None"]),
    ],
)
def test_bad_capacity_factor_is_named_with_the_fix(factor, words):
    with pytest.raises(ValueError) as error:
        replace(ModelConfig(), capacity_factor=factor)  # 64 tokens, top-2 of 8: 16 at factor 1
    for word in words:
        assert word in str(error.value)


def test_export_warns_that_the_capacity_is_left_out(tmp_path):
    from lightning_titan.hf import export
    from lightning_titan.model.decoder import StageModel

    model = StageModel(ModelConfig(d_model=32, n_layers=2, n_heads=4, ffn_dim=24, n_experts=4,
                                   seq_len=8, capacity_factor=1.0))  # fmt: skip
    model.init_weights(0)
    with pytest.warns(
        UserWarning, match="capacity_factor=1.0: MixtralForCausalLM has no expert capacity"
    ):
        export.write_hf_folder(model, tmp_path / "out")


def test_a_steps_drops_sum_over_its_microbatches_and_layers():
    """Each training forward adds its drops to its layer's count, and the step's total is the sum
    over the layers (what TitanLM logs as dropped_assignments); taking the counts starts again."""
    layers = nn.ModuleList([MoELayer(8, 4, 4, 1, capacity_factor=1.0) for _ in range(2)])
    with torch.no_grad():
        for layer in layers:
            layer.router.weight.zero_()
            layer.router.weight[2] = 1.0  # expert 2 wins every token: 6 - 1 dropped per sequence
    x = torch.rand(5, 6, 8) + 0.1
    layers[0](x)
    layers[0](x)  # a second microbatch
    layers[1](x)
    counts = take_step_counts(layers)
    assert [int(counts.dropped[m]) for m in layers] == [2 * 25, 25]
    total = counts.total_dropped()
    assert total is not None and int(total) == 75
    assert take_step_counts(layers).total_dropped() is None
