"""Dispatch / combine and the MoE layer: process-free at EP=1, then one 4-rank gloo spawn for EP=2 and 4."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from lightning_titan.model.moe.layer import MoELayer
from lightning_titan.model.moe.shared import SharedExpert
from lightning_titan.parallel import overlap
from lightning_titan.parallel.dispatch import (
    combine,
    combine_loop_reference,
    dispatch,
    dispatch_loop_reference,
    sort_by_expert,
)
from lightning_titan.runtime import tracing
from lightning_titan.runtime.launch import run_on_ranks

D, F, E, K = 16, 24, 8, 2


def routed_tokens(n_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens [T, D], distinct top-K expert ids [T, K] and weights summing to 1 per token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, D, generator=g)
    ids = torch.rand(n_tokens, E, generator=g).topk(K, dim=-1).indices
    w = torch.rand(n_tokens, K, generator=g) + 0.1
    return x, ids, w / w.sum(-1, keepdim=True)


def scale_by_expert(rows: torch.Tensor, counts: list[int], first_expert: int) -> torch.Tensor:
    """A stand-in expert that multiplies its rows by (global expert id + 1): misrouting shows."""
    ids = torch.arange(len(counts)).repeat_interleave(torch.tensor(counts)) + first_expert
    return rows * (ids + 1).unsqueeze(-1).to(rows.dtype)


def dense_moe_reference(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token: sum over its top-K experts of weight * SwiGLU(x) (Mixtral's definition)."""
    probs = layer.router(x).float().softmax(-1)
    top = probs.topk(K, dim=-1)
    weights = top.values / top.values.sum(-1, keepdim=True)
    ex = layer.experts
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            e = top.indices[t, k].item()
            h = torch.nn.functional.silu(x[t] @ ex.w1[e]) * (x[t] @ ex.w3[e])
            out[t] += weights[t, k] * (h @ ex.w2[e])
    return out


def force_experts_0_and_1(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Make every token pick experts 0 and 1, so all the others receive zero tokens."""
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0], layer.router.weight[1, 0] = 5.0, 4.0
    x = x.clone()
    x[..., 0] = 1.0 + x[..., 0].abs()
    return x


def test_round_trip_ep1_matches_loop_reference():
    x, ids, w = routed_tokens(50, seed=0)
    expert_in, plan = dispatch(x, ids, E)
    packed, indices = dispatch_loop_reference(x, ids, E)
    assert torch.equal(expert_in, packed)
    assert plan.tokens_per_local_expert == torch.bincount(ids.flatten(), minlength=E).tolist()
    torch.testing.assert_close(combine(expert_in, w, plan), x)
    expert_out = scale_by_expert(expert_in, plan.tokens_per_local_expert, 0)
    torch.testing.assert_close(
        combine(expert_out, w, plan), combine_loop_reference(expert_out, w, indices)
    )
    want = x * (w * (ids + 1)).sum(-1, keepdim=True)
    torch.testing.assert_close(combine(expert_out, w, plan), want)


@pytest.mark.parametrize(
    ("n_ids", "n_experts"),
    [(37, 8), (2048, 8), (16384, 64), (32767, 255), (40000, 64), (16384, 300), (5000, 1)],
)
def test_sort_by_expert_is_the_stable_argsort(n_ids: int, n_experts: int):
    """Covers the comparison sort, the radix path reached by padding, the unpadded radix path and
    wide keys; stability matters because combine and the EP reorder rely on source order."""
    ids = torch.randint(0, n_experts, (n_ids,), generator=torch.Generator().manual_seed(n_ids))
    assert torch.equal(sort_by_expert(ids, n_experts), torch.argsort(ids, stable=True))


def test_large_dispatch_matches_loop_reference_forward_and_backward():
    """Enough tokens for the padded radix sort; gradients of x and of the router weights too."""
    g = torch.Generator().manual_seed(3)
    n_tokens, n_experts = 3000, 64
    x = torch.randn(n_tokens, D, generator=g, dtype=torch.float64)
    ids = torch.rand(n_tokens, n_experts, generator=g).topk(K, dim=-1).indices
    w = torch.rand(n_tokens, K, generator=g, dtype=torch.float64)
    upstream = torch.randn(n_tokens, D, generator=g, dtype=torch.float64)
    results = []
    for vectorised in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        if vectorised:
            rows, plan = dispatch(xi, ids, n_experts)
            counts = plan.tokens_per_local_expert
        else:
            rows, indices = dispatch_loop_reference(xi, ids, n_experts)
            counts = torch.bincount(ids.flatten(), minlength=n_experts).tolist()
        rows = scale_by_expert(rows.sin(), counts, 0)
        out = combine(rows, wi, plan) if vectorised else combine_loop_reference(rows, wi, indices)
        out.backward(upstream)
        results.append((out, xi.grad, wi.grad))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)


def test_dispatch_combine_gradcheck():
    x, ids, w = routed_tokens(12, seed=1)
    x, w = x.double().requires_grad_(), w.double().requires_grad_()

    def moe_like(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        expert_in, plan = dispatch(x, ids, E)
        expert_out = scale_by_expert(expert_in.sin(), plan.tokens_per_local_expert, 0)
        return combine(expert_out, w, plan)

    assert torch.autograd.gradcheck(moe_like, (x, w))


def test_moe_layer_ep1_matches_dense_reference_with_empty_experts():
    torch.manual_seed(0)
    layer = MoELayer(D, F, E, K)
    for forced in (False, True):
        x = torch.randn(2, 9, D)
        if forced:
            x = force_experts_0_and_1(layer, x)
        results = []
        for fn in (lambda x: layer(x)[0], lambda x: dense_moe_reference(layer, x.view(-1, D))):
            xi = x.clone().requires_grad_()
            layer.zero_grad()
            out = fn(xi).view(-1, D)
            out.square().sum().backward()
            grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
            results.append({"out": out, "x.grad": xi.grad, **grads})
        got, want = results
        for key in want:
            torch.testing.assert_close(got[key], want[key], msg=key)
        if forced:
            assert layer.tokens_per_expert.tolist() == [18, 18] + [0] * 6  # from the layer's run
            for name in ("experts.w1", "experts.w2", "experts.w3"):
                assert torch.equal(got[name][2:], torch.zeros_like(got[name][2:]))
                assert got[name][:2].abs().sum() > 0


def _check_layout(group: dist.ProcessGroup, rank: int) -> None:
    """Each local expert receives exactly its tokens, source-rank-major; combine inverts dispatch."""
    ep, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    n_local = E // ep
    x, ids, w = routed_tokens(20 + 7 * rank, seed=rank)  # uneven token counts across ranks
    expert_in, plan = dispatch(x, ids, E, group)

    everyone = [None] * ep
    dist.all_gather_object(everyone, (x, ids), group=group)
    want_rows, want_counts = [], []
    for e in range(ep_rank * n_local, (ep_rank + 1) * n_local):
        rows = [xs[(ids_s == e).any(-1)] for xs, ids_s in everyone]
        want_rows += rows
        want_counts.append(sum(r.shape[0] for r in rows))
    assert plan.tokens_per_local_expert == want_counts
    assert torch.equal(expert_in, torch.cat(want_rows))

    torch.testing.assert_close(combine(expert_in, w, plan), x)
    expert_out = scale_by_expert(expert_in, plan.tokens_per_local_expert, ep_rank * n_local)
    torch.testing.assert_close(
        combine(expert_out, w, plan), x * (w * (ids + 1)).sum(-1, keepdim=True)
    )


def _check_moe_matches_local(group: dist.ProcessGroup, rank: int, forced: bool) -> None:
    """EP-sharded MoE == one layer holding all experts, on each rank's own tokens; expert grads of the
    full layer are the sum over EP ranks of each rank's token contributions."""
    ep, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    start, end = ep_rank * (E // ep), (ep_rank + 1) * (E // ep)
    torch.manual_seed(0)  # the same full layer on every rank
    full = MoELayer(D, F, E, K, aux_loss_coef=0.01, z_loss_coef=0.001)
    shard = MoELayer(
        D, F, E, K, expert_range=(start, end), ep_group=group, aux_loss_coef=0.01, z_loss_coef=0.001
    )
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(1 + rank % 2, 6 + rank, D, generator=g)
    if forced:
        x = force_experts_0_and_1(full, x)
    with torch.no_grad():
        shard.router.weight.copy_(full.router.weight)
        for name in ("w1", "w2", "w3"):
            getattr(shard.experts, name).copy_(getattr(full.experts, name)[start:end])

    results = []
    for layer in (shard, full):
        xi = x.clone().requires_grad_()
        out, aux = layer(xi)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank))
        ((out * grad_out).sum() + aux.sum()).backward()
        results.append((out, aux, xi.grad))
    for got, want in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(shard.router.weight.grad, full.router.weight.grad)
    assert torch.equal(shard.tokens_per_expert, full.tokens_per_expert)
    for name in ("w1", "w2", "w3"):
        want = getattr(full.experts, name).grad.clone()
        dist.all_reduce(want, group=group)
        torch.testing.assert_close(getattr(shard.experts, name).grad, want[start:end])
    if forced:
        counts = full.tokens_per_expert.clone()
        dist.all_reduce(counts, group=group)
        assert counts[2:].sum() == 0 and counts[:2].sum() > 0
        if start >= 2:  # this rank received no token at all, and still took part in every exchange
            assert torch.equal(shard.experts.w1.grad, torch.zeros_like(shard.experts.w1.grad))


def _check_slots_match_dynamic(group: dist.ProcessGroup, rank: int) -> None:
    """Under capacity, the static slots (``slots``: sizes known without reading the counts) give
    what the counted exchange gives: the same outputs and grads, the empty slots' outputs (nonzero
    here: the stand-in expert adds one) left out; ``keep`` leaves at most 6 of 20 per expert."""
    ep, ep_rank = dist.get_world_size(group), dist.get_rank(group)
    x, ids, w = routed_tokens(20, seed=rank)  # the same token count on every rank: static sizes
    keep = torch.rand(ids.shape, generator=torch.Generator().manual_seed(rank)) < 0.6
    for e in range(E):  # at most 6 kept per expert
        kept = (ids == e) & keep
        keep &= ~(kept & (kept.flatten().cumsum(0).view_as(kept) > 6))
    results = []
    for slots in (None, 6):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        expert_in, plan = dispatch(xi, ids, E, group, keep, slots=slots)
        counts = plan.tokens_per_local_expert
        out = combine(scale_by_expert(expert_in, counts, ep_rank * (E // ep)) + 1.0, wi, plan)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
        results.append((out, xi.grad, wi.grad, plan.tokens_per_expert))
        if slots is not None:
            assert counts == [ep * slots] * (E // ep) and plan.send_splits == [E // ep * slots] * ep
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want)


def _check_overlap(group: dist.ProcessGroup, rank: int) -> None:
    """The shared expert's halves run while the tokens travel: each half's forward inside the
    in-flight span of its exchange (up: dispatch, down: combine), each half's weight gradient inside
    that of the exchange's gradient. Waiting at once (``overlap_all_to_all=False``) gives the same
    numbers bit for bit."""
    ep_rank = dist.get_rank(group)
    n_local = E // dist.get_world_size(group)
    layer = MoELayer(D, F, E, K, expert_range=(ep_rank * n_local, (ep_rank + 1) * n_local),
                     ep_group=group, aux_loss_coef=0.01)  # fmt: skip
    torch.manual_seed(1)
    shared = SharedExpert(D, 12)
    stamps: dict[str, int] = {}

    def stamp(name: str):
        def hook(*_) -> None:  # the first call: recompute or a second use would come later
            stamps.setdefault(name, time.perf_counter_ns())

        return hook

    shared.w1.register_forward_hook(stamp("dispatch"))
    shared.w2.register_forward_hook(stamp("combine"))
    shared.w1.weight.register_post_accumulate_grad_hook(stamp("dispatch_grad"))
    shared.w2.weight.register_post_accumulate_grad_hook(stamp("combine_grad"))
    x = torch.randn(2, 5 + rank, D, generator=torch.Generator().manual_seed(rank))
    results = []
    for overlapped in (True, False):
        layer.overlap_all_to_all = overlapped
        layer.zero_grad(), shared.zero_grad()
        xi = x.clone().requires_grad_()
        tracing.start(rank)
        out, aux = layer(xi, shared)
        (out.square().sum() + aux.sum()).backward()
        spans = {s.name: s for s in tracing.stop() if s.kind == "in_flight"}
        if overlapped:
            for name, t in stamps.items():
                assert spans[name].start_ns < t < spans[name].end_ns, (name, spans[name], t)
        stamps.clear()
        results.append(
            [out, xi.grad, shared.w1.weight.grad, shared.w2.weight.grad, layer.experts.w2.grad]
        )
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def _check_pair(group: dist.ProcessGroup, rank: int) -> None:
    """``run_pair``: microbatch 2's forward with microbatch 1's backward, interleaved at their
    exchanges (the backward first; each half starts an exchange while one of the other's travels), with the numbers of running them in turn, bit for bit. An error in the
    backward half reaches the caller after both halves stopped, and the next pair runs."""
    ep_rank = dist.get_rank(group)
    n_local = E // dist.get_world_size(group)
    layer = MoELayer(D, F, E, K, expert_range=(ep_rank * n_local, (ep_rank + 1) * n_local),
                     ep_group=group, aux_loss_coef=0.01)  # fmt: skip
    shared = SharedExpert(D, 12)
    xs = [torch.randn(2, 6 + rank, D, generator=torch.Generator().manual_seed(10 * rank + k))
          for k in range(2)]  # fmt: skip
    results = []
    for paired in (True, False):
        layer.zero_grad(), shared.zero_grad()
        first, second = (x.clone().requires_grad_() for x in xs)
        out1, aux1 = layer(first, shared)
        loss1 = out1.square().sum() + aux1.sum()
        before = overlap.handovers()
        tracing.start(rank)
        if paired:
            (out2, aux2), _ = overlap.run_pair(lambda s=second: layer(s, shared), loss1.backward)
        else:
            out2, aux2 = layer(second, shared)
            loss1.backward()
        spans = [s for s in tracing.stop() if s.kind == "in_flight"]
        if paired:
            assert overlap.handovers() - before >= 4, overlap.handovers() - before
            fwd = [s for s in spans if not s.name.endswith("_grad")]
            bwd = [s for s in spans if s.name.endswith("_grad")]
            assert len(fwd) == 3 and len(bwd) == 2 and len({s.thread for s in fwd + bwd}) == 2
            # the backward goes first; each half starts an exchange while the other's travels
            assert min(bwd, key=lambda s: s.start_ns).start_ns < min(s.start_ns for s in fwd)
            for mine, theirs in ((fwd, bwd), (bwd, fwd)):
                inside = [
                    s for s in mine if any(t.start_ns < s.start_ns < t.end_ns for t in theirs)
                ]
                assert inside, (mine, theirs)
        results.append([out2, aux2, first.grad, layer.experts.w1.grad, shared.w2.weight.grad])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)

    def boom() -> None:
        raise RuntimeError("backward half failed")

    with pytest.raises(RuntimeError, match="backward half failed"):
        overlap.run_pair(lambda: layer(xs[0], shared), boom)
    overlap.run_pair(lambda: layer(xs[0], shared), lambda: None)  # the pair is reusable


def _ep_cases(rank: int, world_size: int) -> str:
    torch.set_num_threads(1)
    # new_group is collective: every rank creates every group, in the same order.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    everyone = dist.new_group(list(range(world_size)))
    _check_overlap(pairs[rank // 2], rank)
    _check_pair(pairs[rank // 2], rank)
    for group in (pairs[rank // 2], everyone):
        _check_layout(group, rank)
        _check_slots_match_dynamic(group, rank)
        _check_moe_matches_local(group, rank, forced=False)
        _check_moe_matches_local(group, rank, forced=True)
    return "ok"


@pytest.mark.timeout(300)
def test_expert_parallel_matches_local_moe():
    assert run_on_ranks(_ep_cases, 4, timeout_s=240, start_method="fork") == ["ok"] * 4
