"""The backward split zero-bubble schedules use (``pipeline.backward_split``), in one process: B gives
the input grad of a full backward and leaves every weight grad untouched; W then gives every weight
grad of a full backward, each weight's post-accumulate hook (the reducers') firing exactly once."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from engine_harness import CONFIG, SEED

from lightning_titan.model.decoder import StageModel
from lightning_titan.parallel.pipeline import backward_split


@pytest.mark.parametrize("recompute", [False, True, "selective"])
@pytest.mark.parametrize("pp_rank,pp", [(1, 2), (1, 3)])  # the head stage, a middle stage
def test_b_then_w_equals_one_backward(pp_rank, pp, recompute):
    config = replace(CONFIG, n_layers=6, activation_checkpointing=recompute)
    model = StageModel(config, pp_rank=pp_rank, pp=pp)
    model.init_weights(SEED)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, config.seq_len, config.d_model, generator=g)
    targets = torch.randint(0, config.vocab_size, (2, config.seq_len), generator=g)
    grad_out = torch.randn(2, config.seq_len, config.d_model, generator=g)

    def objective(x):
        out, aux = model(x)
        if model.is_last_stage:
            return (
                F.cross_entropy(out.flatten(0, 1), targets.flatten(), reduction="sum") + aux.sum()
            )
        return (out * grad_out).sum() + aux.sum()

    x = x0.clone().requires_grad_()
    objective(x).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    want_dx = x.grad.clone()
    model.zero_grad(set_to_none=True)

    fired: dict[str, int] = {}
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda _, n=name: fired.update({n: fired.get(n, 0) + 1})
        )
    x = x0.clone().requires_grad_()
    dx, weights = backward_split.split(objective(x), x, list(model.parameters()))
    assert all(p.grad is None for p in model.parameters()), "B accumulated a weight grad"
    torch.testing.assert_close(dx, want_dx, rtol=1e-6, atol=1e-7)
    weights.run()
    assert fired == dict.fromkeys(want, 1), "each weight's hook must fire once"
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_weight_used_twice_on_the_input_path_is_counted_once():
    """One weight in two matmuls of the x path: two intermediates, each called on the grad B kept for
    it; the two grads meet at the weight's accumulate node and are summed there, once. The second
    matmul also adds a bias (two weight-side grads from one node) and the scale is broadcast over
    the rows (its grad summed down to its shape)."""
    g = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(4, 4, generator=g))
    bias = torch.nn.Parameter(torch.randn(4, generator=g))
    scale = torch.nn.Parameter(torch.randn(4, generator=g))
    x0 = torch.randn(3, 4, generator=g)

    def objective(x):
        return (F.linear(torch.tanh(x @ weight), weight.T, bias) * scale).pow(2).sum()

    x = x0.clone().requires_grad_()
    objective(x).backward()
    want = tuple(p.grad.clone() for p in (weight, bias, scale))
    want_dx = x.grad.clone()
    weight.grad = bias.grad = scale.grad = None
    x = x0.clone().requires_grad_()
    dx, weights = backward_split.split(objective(x), x, [weight, bias, scale])
    assert len(weights.intermediates) == 3  # both matmuls and the scale's multiply
    torch.testing.assert_close(dx, want_dx)
    weights.run()
    torch.testing.assert_close((weight.grad, bias.grad, scale.grad), want)


def test_the_weight_may_come_first_and_a_weight_left_out_gets_no_grad():
    """A matmul whose first input is the weight (its node's first edge leads to the weight side, the
    second to x's path) is still an intermediate; a tensor that needs a grad but is not in ``params``
    is not a weight: neither B nor W gives it a grad."""
    g = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(5, 4, generator=g))
    other = torch.nn.Parameter(torch.randn(3, 5, generator=g))
    x0 = torch.randn(4, 3, generator=g)

    def objective(x):
        return torch.tanh(weight @ x @ other).pow(2).sum()

    x = x0.clone().requires_grad_()
    objective(x).backward()
    want, want_dx = weight.grad.clone(), x.grad.clone()
    weight.grad = other.grad = None
    x = x0.clone().requires_grad_()
    dx, weights = backward_split.split(objective(x), x, [weight])
    assert len(weights.intermediates) == 1
    weights.run()
    torch.testing.assert_close((dx, weight.grad), (want_dx, want))
    assert other.grad is None


def test_an_objective_that_ignores_x_gives_a_zero_input_grad_and_still_its_weight_grads():
    """The stage before waits for a grad whatever this stage computes: B owes it zeros, not None
    (which the transport would drop, leaving that stage waiting); with no node on x's path every
    weight grad is W's, and W still gives them."""
    weight = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(3, 4, requires_grad=True)
    ignored = x * 2  # on the graph of x, not of the objective
    dx, weights = backward_split.split((weight @ weight).pow(2).sum(), x, [weight])
    assert ignored.requires_grad and torch.equal(dx, torch.zeros_like(x))
    weights.run()
    want = torch.autograd.grad((weight @ weight).pow(2).sum(), weight)[0]
    torch.testing.assert_close(weight.grad, want)


def test_a_custom_function_that_takes_a_weight_is_refused_with_the_way_out():
    """W calls each intermediate by itself; a custom Function's backward would compute every grad
    (and run any collective in it) again, so split says so instead of running it."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            x, w = ctx.saved_tensors
            return grad * w, (grad * x).sum(0)

    w = torch.nn.Parameter(torch.ones(4))
    x = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"ScaleBackward.*custom autograd Function.*1f1b"):
        backward_split.split(Scale.apply(x, w).sum(), x, [w])
