"""The dispatch under expert capacity in static slots (parallel/slots.py): the same outputs and grads
as the counted dispatch, the empty slots left out of everything, and no read back to the host.

Across EP ranks: tests/distributed/test_dispatch.py (``_check_slots_match_dynamic``) and the
capacity cases of tests/distributed/test_collective_order.py (no host read per MoE layer)."""

from __future__ import annotations

import pytest
import torch
from host_reads import HostReads, HostToDevice

from lightning_titan.model.moe.capacity import expert_capacity, keep_mask
from lightning_titan.model.moe.experts import GroupedExperts
from lightning_titan.model.moe.layer import MoELayer
from lightning_titan.parallel.dispatch import combine, dispatch
from lightning_titan.parallel.slots import slots_per_expert

D, F, E, K = 16, 24, 4, 2
B, S = 3, 10


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "loop"])
def test_static_slots_equal_the_counted_dispatch_with_biased_experts(grouped):
    """gpt-oss's biased experts give an empty (zero) slot a nonzero output: it must reach neither
    a token nor a gradient (the biases' included)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B * S, D, generator=g)
    ids = torch.rand(B * S, E, generator=g).topk(K, dim=-1).indices
    w = torch.rand(B * S, K, generator=g) + 0.1
    capacity = expert_capacity(1.0, S, K, E)  # 5 of a sequence's 20 assignments per expert
    keep = keep_mask(ids, B, E, capacity)
    kept = torch.bincount(ids[keep], minlength=E)
    assert not keep.all() and kept.min() < B * capacity  # drops, and empty slots
    results = []
    for slots in (None, slots_per_expert(B, S, capacity)):
        torch.manual_seed(1)
        experts = GroupedExperts(D, F, (0, E), grouped_mm=grouped, bias=True)
        with torch.no_grad():
            for b in (experts.b1, experts.b3, experts.b2):
                assert b is not None
                b.normal_(std=0.5)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        rows, plan = dispatch(xi, ids, E, None, keep, slots=slots)
        out = combine(experts(rows, plan.tokens_per_local_expert, plan.local_counts), wi, plan)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
        grads = {n: p.grad for n, p in experts.named_parameters()}
        results.append((out, xi.grad, wi.grad, grads, plan))
    (out_s, x_s, w_s, grads_s, plan_s), (out_c, x_c, w_c, grads_c, plan_c) = results[1], results[0]
    assert plan_s.tokens_per_local_expert == [B * capacity] * E
    assert torch.equal(plan_s.tokens_per_expert, plan_c.tokens_per_expert)  # the kept ones
    for name, got, want in [("out", out_s, out_c), ("x", x_s, x_c), ("w", w_s, w_c)] + [
        (n, grads_s[n], grads_c[n]) for n in grads_c
    ]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_slots_need_the_keep_mask():
    x, ids = torch.randn(4, D), torch.zeros(4, K, dtype=torch.long)
    with pytest.raises(ValueError, match="slots=3 needs keep"):
        dispatch(x, ids, E, None, slots=3)


@pytest.mark.parametrize("grouped", [None, True], ids=["loop", "grouped"])
def test_a_capacity_layer_reads_nothing_back_to_the_host(grouped):
    """Dropless reads the split sizes once per forward (tests/unit/test_gpu_readiness.py); with a
    capacity factor the sizes are static: no read, forward or backward, and no copy onto the
    device."""
    torch.manual_seed(0)
    layer = MoELayer(D, F, 8, K, capacity_factor=1.0)
    layer.experts.grouped_mm, layer.experts.align_rows = grouped, 16 if grouped else None
    x = torch.randn(2, 5, D, requires_grad=True)
    with HostReads() as reads, HostToDevice() as copies:
        out, aux = layer(x)
        (out.square().sum() + aux.sum()).backward()
    assert reads.calls == [], reads.calls
    assert copies.calls == [], copies.calls
