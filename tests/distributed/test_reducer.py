"""GradReducer and composed clipping: pure bucket logic here, every collective case in one gloo spawn."""

from __future__ import annotations

import math
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from host_reads import HostToDevice
from torch import nn

from lightning_titan.parallel import collectives
from lightning_titan.parallel.dp.clipping import clip_grad_norm_
from lightning_titan.parallel.dp.reducer import GradReducer, assign_buckets
from lightning_titan.parallel.dp.zero import ZeroGroup
from lightning_titan.parallel.dp.zero_grads import ShardedGradReducer, clip_shard_grads_
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.train.nonfinite import nonfinite_message

WORLD = 4
# Small fp32 params plus one fp64 one, so buckets also split by dtype. Bytes: 12 32 20 64 4 24 | 24.
SHAPES = [(3,), (2, 4), (5,), (4, 4), (1,), (6,)]
MIXED_CAP_MB = 48 / 2**20  # packs the small neighbours, leaves the (4, 4) alone


def _params(shapes=SHAPES, extra_fp64: bool = True) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(s)) for s in shapes]
    if extra_fp64:
        params.insert(2, nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    return params


def _grad(i: int, p: nn.Parameter, rank: int, microbatch: int = 0) -> torch.Tensor:
    """The grad rank `rank` produces for param i: small integers, so sums and 1/4 scales are exact."""
    base = torch.arange(1, p.numel() + 1, dtype=torch.float64).reshape(p.shape)
    return (base * (i + 1) + 10 * rank + 100 * microbatch).to(p.dtype)


def _backward(params, rank, indices, microbatch=0, one_graph=False) -> None:
    """Grads for params[indices] as one backward, or one backward each in the given (ready) order."""
    terms = [(params[i] * _grad(i, params[i], rank, microbatch)).sum() for i in indices]
    if one_graph:
        sum(terms).backward()
    else:
        for t in terms:
            t.backward()


def _expected(params, i, ranks, microbatches=(0,), scale=1 / WORLD) -> torch.Tensor:
    total = sum(_grad(i, params[i], r, m).double() for r in ranks for m in microbatches)
    return (total * scale).to(params[i].dtype)


def _check_launch_log(reducer: GradReducer) -> None:
    """Launched in the order the step agreed on: hook buckets, then the rest, each in bucket order."""
    order = [b for b, _ in reducer.last_launch_log]
    assert order == reducer.last_launch_order, (order, reducer.last_launch_order)
    assert sorted(order) == list(range(len(reducer.bucket_params))), order


def _case_hand_checked(rank: int, group) -> dict:
    """Several caps and both modes, with grads ready in forward order (opposite to bucket order)."""
    info = {}
    for name, cap, mode in [
        ("tiny", 1e-9, "bucketed"),
        ("huge", 1e3, "bucketed"),
        ("mixed", MIXED_CAP_MB, "bucketed"),
        ("per_param", 25.0, "per_param"),
    ]:
        for ready in ("forward", "reverse_one_graph"):
            params = _params()
            reducer = GradReducer(params, group, scale=1 / WORLD, bucket_cap_mb=cap, mode=mode)
            n = len(params)
            for step in range(2):  # the first step launches from finish(), then hooks are agreed
                for p in params:
                    p.grad = None
                with HostToDevice() as copies:  # the hooks, the flags, finish(): device ops only
                    if ready == "forward":
                        _backward(params, rank, range(n))
                    else:
                        _backward(params, rank, range(n), one_graph=True)
                    reducer.finish()
                # per_param's flags: one small tensor of the hook counts per step (issue 43)
                assert copies.calls == ([] if mode == "bucketed" else ["lift_fresh"]), copies.calls
                for i, p in enumerate(params):
                    torch.testing.assert_close(
                        p.grad, _expected(params, i, range(WORLD)), rtol=0, atol=0
                    )
                _check_launch_log(reducer)
                if step == 0:
                    assert all(where == "finish" for _, where in reducer.last_launch_log)
            info[(name, ready)] = list(reducer.last_launch_log)
            reducer.remove()
    # forward ready order with one param per bucket: bucket 0 (the last param) is ready last, so
    # nothing may launch before it and then everything launches at once, in order.
    assert [b for b, _ in info[("tiny", "forward")]] == list(range(len(_params())))
    # with reverse ready order, buckets launch from the hooks while backward still runs.
    assert all(where == "hook" for _, where in info[("tiny", "reverse_one_graph")])
    return {k: [w for _, w in v] for k, v in info.items()}


def _case_accumulation_and_unused(rank: int, group) -> None:
    for cap, mode in [(1e-9, "bucketed"), (1e3, "bucketed"), (25.0, "per_param")]:
        # gradient accumulation over 3 microbatches; only the last backward syncs
        params = _params()
        reducer = GradReducer(params, group, scale=1 / WORLD, bucket_cap_mb=cap, mode=mode)
        n = len(params)
        for step in range(2):  # the first step launches from finish(), the second from the hooks
            for p in params:
                p.grad = None
            for mb in range(3):
                with reducer.no_sync() if mb < 2 else nullcontext():
                    _backward(params, rank, range(n), microbatch=mb, one_graph=True)
                if mb < 2:
                    assert reducer._launch_log == [], "a non-sync backward launched a collective"
            reducer.finish()
            for i, p in enumerate(params):
                torch.testing.assert_close(p.grad, _expected(params, i, range(WORLD), (0, 1, 2)))
            want = "finish" if step == 0 else "hook"
            assert all(where == want for _, where in reducer.last_launch_log), step
            _check_launch_log(reducer)

        # second step on the same reducer, with unused parameters:
        # 0 never used, 1 only on even ranks, 2 only in the non-sync microbatch, the rest always.
        for p in params:
            p.grad = None
        always = list(range(3, n))
        with reducer.no_sync():
            _backward(params, rank, [2, *always], microbatch=0)
        with HostToDevice() as copies:  # unused parameters' flags too: device fills
            _backward(params, rank, ([1] if rank % 2 == 0 else []) + always, microbatch=1)
            reducer.finish()
        assert copies.calls == ([] if mode == "bucketed" else ["lift_fresh"]), copies.calls
        if mode == "bucketed":  # no rank used it: grad None, as in one process (and DDP)
            assert params[0].grad is None
        else:  # the per-parameter baseline has no used-flags: zeros
            torch.testing.assert_close(params[0].grad, torch.zeros_like(params[0]))
        torch.testing.assert_close(params[1].grad, _expected(params, 1, [0, 2], (1,)))
        torch.testing.assert_close(params[2].grad, _expected(params, 2, range(WORLD), (0,)))
        for i in always:
            torch.testing.assert_close(params[i].grad, _expected(params, i, range(WORLD), (0, 1)))
        _check_launch_log(reducer)

        # no backward outside no_sync(): finish() alone still reduces the accumulated grads
        for p in params:
            p.grad = None
        with reducer.no_sync():
            _backward(params, rank, range(n), one_graph=True)
        reducer.finish()
        for i, p in enumerate(params):
            torch.testing.assert_close(p.grad, _expected(params, i, range(WORLD)))
        assert all(where == "finish" for _, where in reducer.last_launch_log)
        reducer.remove()


def _case_used_on_some_ranks_launches_in_one_place(rank: int, group) -> dict:
    """A parameter used on even ranks only: its bucket must launch from the same place (hook or
    finish) on every rank, or under NCCL its all-reduce lands elsewhere among other groups'
    collectives on each rank. Returns each step's launch log; the caller compares the ranks."""
    logs = {}
    n = len(SHAPES)
    # params[0] is in the last bucket: with every earlier bucket launched from hooks, nothing but its
    # own hook decides where it launches
    for name, steps in [("from_start", ["some"] * 3), ("later", ["all", "some", "some"])]:
        params = _params(extra_fp64=False)
        reducer = GradReducer(params, group, scale=1 / WORLD, bucket_cap_mb=1e-9)
        for step, used in enumerate(steps):
            for p in params:
                p.grad = None
            indices = list(range(1, n)) + ([0] if used == "all" or rank % 2 == 0 else [])
            _backward(params, rank, indices, one_graph=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                reducer.finish()
            ranks = range(WORLD) if used == "all" else range(0, WORLD, 2)
            torch.testing.assert_close(params[0].grad, _expected(params, 0, ranks))
            _check_launch_log(reducer)
            logs[(name, step)] = list(reducer.last_launch_log)
            # the one step where hooks were agreed and then missed on some ranks says so
            missed = name == "later" and step == 1
            assert any("from finish() from now on" in str(w.message) for w in caught) == missed
        last = n - 1
        assert logs[(name, 2)][-1] == (last, "finish"), logs[(name, 2)]
        assert all(where == "hook" for _, where in logs[(name, 2)][:-1]), logs[(name, 2)]
        reducer.remove()
    return logs


def _case_double_fire_raises(rank: int, group) -> None:
    params = _params()
    # one bucket, so nothing launches before the error and the group stays in step
    reducer = GradReducer(params, group, scale=1 / WORLD, bucket_cap_mb=1e3)
    _backward(params, rank, [0])
    try:
        _backward(params, rank, [0])
    except RuntimeError as err:
        assert "twice" in str(err) and "sync" in str(err), err
    else:
        raise AssertionError("a second sync backward of one param did not raise")
    reducer.remove()


def _case_random_vs_manual_all_reduce(rank: int, group) -> None:
    gen = torch.Generator().manual_seed(1234 + rank)
    shapes = [(17,), (8, 9), (33,), (5, 5, 3), (64,)]
    for mode in ("bucketed", "per_param"):
        params = [nn.Parameter(torch.zeros(s)) for s in shapes]
        grads = [torch.randn(s, generator=gen) for s in shapes]
        reference = [g.clone() for g in grads]
        for r in reference:
            dist.all_reduce(r, group=group)
            r.div_(WORLD)
        reducer = GradReducer(params, group, scale=1 / WORLD, bucket_cap_mb=600 / 2**20, mode=mode)
        sum((p * g).sum() for p, g in zip(params, grads, strict=True)).backward()
        reducer.finish()
        for p, r in zip(params, reference, strict=True):
            torch.testing.assert_close(p.grad, r)
        reducer.remove()


def _case_vs_ddp(rank: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ours = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    ours.load_state_dict(model.state_dict())
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-4)
    reducer = GradReducer(list(ours.parameters()), dist.group.WORLD, scale=1 / WORLD)
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(rank))
    ddp(x).square().sum().backward()
    ours(x).square().sum().backward()
    reducer.finish()
    for a, b in zip(model.parameters(), ours.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)
    reducer.remove()


def _case_subgroups(rank: int) -> None:
    """The strategy's two reducers on real subgroups, incl. a size-1 expert-DP group (scale only)."""
    for dp, pp, ep in [(1, 2, 2), (2, 1, 2)]:
        dims = ParallelDims(dp, pp, ep, rank)
        groups = build_process_groups(dims)
        for kind, scale in [("non_expert_dp", 1 / (dp * ep)), ("expert_dp", 1 / (dp * ep))]:
            params = _params()
            reducer = GradReducer(params, getattr(groups, kind), scale=scale, bucket_cap_mb=1e-9)
            _backward(params, rank, range(1, len(params)), one_graph=True)  # params[0] unused
            reducer.finish()
            members = dims.group_ranks(kind)
            assert params[0].grad is None  # unused on every rank of the group
            for i in range(1, len(params)):
                torch.testing.assert_close(
                    params[i].grad, _expected(params, i, members, scale=scale)
                )
            reducer.remove()


# ZeRO-2 over 4 ranks: rows split evenly (8 rows: the one-copy path) and not (5, 7, 6 rows: padding,
# rank 3 owns none of 5 or 6), two expert-like tensors cut on dim 1, a scalar kept whole, and an fp64
# tensor (a bucket of its own dtype)
ZERO2_SHAPES = [(8, 3), (5,), (6, 2), (2, 8, 3), (3, 6, 2), (), (7, 2)]
ZERO2_EXPERTS = (3, 4)
ZERO2_FP64 = 2


def _case_zero2(rank: int, group) -> None:
    """ShardedGradReducer: each rank ends with exactly its rows of the reduced grads (integer values:
    exact), ``p.grad`` None where rows are cut, the whole grad where nothing is; a parameter no rank
    used has no grad; buckets launch from hooks once agreed, in the agreed order."""
    for cap in (1e-9, 1e3, MIXED_CAP_MB):
        params = [nn.Parameter(torch.zeros(s)) for s in ZERO2_SHAPES]
        params[ZERO2_FP64] = nn.Parameter(
            torch.zeros(ZERO2_SHAPES[ZERO2_FP64], dtype=torch.float64)
        )
        shards = ZeroGroup(params, {id(params[i]) for i in ZERO2_EXPERTS}, group, bucket_cap_mb=cap)
        assert len(shards.shards) == len(params) - 1  # all but the scalar
        reducer = ShardedGradReducer(params, shards, scale=1 / WORLD, bucket_cap_mb=cap)
        for step in range(3):
            for p in params:
                p.grad = None
            used = range(len(params)) if step < 2 else range(1, len(params))  # 2: params[0] unused
            with HostToDevice() as copies:
                _backward(params, rank, used, one_graph=True)
                reducer.finish()
            assert copies.calls == [], (cap, step, copies.calls)
            for i, p in enumerate(params):
                shard = shards.shards.get(id(p))
                want = _expected(params, i, range(WORLD)) if i in used else None
                got = p.grad if shard is None else shard.leaf.grad
                if shard is not None:
                    assert p.grad is None, (cap, step, i)
                    want = None if want is None else shard.rows(want)
                if want is None:
                    assert got is None, (cap, step, i)
                else:
                    torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{cap} {step} {i}")
            _check_launch_log(reducer)
            if step == 1:
                _check_zero2_clipping(params, shards, reducer, group)
            if step < 2:
                want_site = "finish" if step == 0 else "hook"
                assert all(where == want_site for _, where in reducer.last_launch_log), step
        if cap == MIXED_CAP_MB:
            _check_zero2_nonfinite_diagnosis(rank, params, reducer)
        reducer.remove()


def _check_zero2_nonfinite_diagnosis(rank: int, params: list[nn.Parameter], reducer) -> None:
    """An inf in rank 1's grad of params[0] lands in row 0, which rank 0 owns: the non-finite report
    finds it in rank 0's rows (under ZeRO-2 no rank holds the full grad)."""
    for i, p in enumerate(params):
        p.grad = _grad(i, p, rank)
    if rank == 1:
        params[0].grad[0, 0] = math.inf
    reducer.finish()
    scalar = ZERO2_SHAPES.index(())
    assert all(p.grad is None for i, p in enumerate(params) if i != scalar), "cut: rows only"
    module = nn.ParameterList(params)
    dims = ParallelDims(WORLD, 1, 1, rank)
    message = nonfinite_message(module, dims, 3, math.inf, None, reducers=[reducer])
    assert "non-finite gradients on stage(s) pp_rank=[0]" in message, message
    assert "e.g. '0' on rank 0" in message, message


def _check_zero2_clipping(params, shards: ZeroGroup, reducer, group) -> None:
    """The norm from the shards counts every element once (the whole scalar on one rank only) and
    clipping scales the shards and the whole grad alike."""
    full = [_expected(params, i, range(WORLD)).double() for i in range(len(params))]
    ref = torch.stack([g.norm() for g in full]).norm()
    groups = ProcessGroups(
        ep=None, pp=None, expert_dp=group, non_expert_dp=group, sequence_dp=group
    )
    norm = clip_shard_grads_([reducer], [shards], ref.item() / 2, groups)
    torch.testing.assert_close(norm.double(), ref, rtol=1e-6, atol=0)
    coef = ref.item() / 2 / (norm.item() + 1e-6)
    scalar = ZERO2_SHAPES.index(())
    torch.testing.assert_close(params[scalar].grad.double(), full[scalar] * coef)
    for i in ZERO2_EXPERTS:
        shard = shards.shards[id(params[i])]
        torch.testing.assert_close(shard.leaf.grad.double(), shard.rows(full[i]) * coef)


# ---- clipping on (dp=1, pp=2, ep=2): rank = stage * 2 + ep_rank -------------------------------

NON_EXPERT_SHAPES = [(4,), (3, 3), (2,)]  # the (2,) one has no grad anywhere
EXPERT_SHAPES = [(2, 3), (5,)]  # the (5,) one has no grad on rank 3


def _clip_grads(stage: int, rank: int, bad: bool) -> tuple[list, list]:
    """Local (non-expert, expert) grads: non-expert depend on the stage only (they are reduced)."""
    gen = torch.Generator().manual_seed(100 + stage)
    non_expert = [torch.randn(s, generator=gen) for s in NON_EXPERT_SHAPES[:2]] + [None]
    gen = torch.Generator().manual_seed(200 + rank)
    expert = [torch.randn(s, generator=gen) * 0.5 for s in EXPERT_SHAPES]
    if rank == 3:
        expert[1] = None
    if bad and rank == 1:
        expert[0][0, 0] = math.inf
    return non_expert, expert


def _case_collectives(rank: int) -> None:
    """ZeRO's collectives on gloo (``lightning_titan.parallel.collectives``, not the backend's): the
    all-gather fills every rank's chunk, over the world and over a subgroup of two; the
    reduce-scatter leaves each rank its chunk of the sum. Integers: exact."""
    for group in (dist.group.WORLD, dist.new_group([1, 3])):
        if rank not in dist.get_process_group_ranks(group):
            continue
        n, me = dist.get_world_size(group), dist.get_rank(group)
        out = torch.full((n * 5,), -1.0)
        out.view(n, 5)[me] = torch.arange(5.0) + 10 * me
        collectives.all_gather_(out, group)
        want = torch.cat([torch.arange(5.0) + 10 * q for q in range(n)])
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        mine = torch.empty(3)
        collectives.reduce_scatter(mine, torch.arange(3.0 * n) * (rank + 1), group)
        weight = sum(r + 1 for r in dist.get_process_group_ranks(group))
        torch.testing.assert_close(mine, (torch.arange(3.0) + 3 * me) * weight, rtol=0, atol=0)


def _case_clipping(rank: int) -> dict:
    dims = ParallelDims(1, 2, 2, rank)
    groups = build_process_groups(dims)
    norms = {}
    for label, factor, bad in [("clip", 0.3, False), ("loose", 10.0, False), ("none", None, False),
                               ("inf", 0.3, True)]:  # fmt: skip
        # the full model's gradient: each stage's non-expert part once, every owner's experts once
        full, mine = [], None
        for stage in range(2):
            for ep_rank in range(2):
                r = dims.rank_of(0, stage, ep_rank)
                non_expert, expert = _clip_grads(stage, r, bad)
                if ep_rank == 0:
                    full += [g for g in non_expert if g is not None]
                full += [g for g in expert if g is not None]
                if r == rank:
                    mine = (non_expert, expert)
        full_params = [nn.Parameter(torch.zeros_like(g)) for g in full]
        for p, g in zip(full_params, full, strict=True):
            p.grad = g.clone()
        ref_norm = torch.nn.utils.clip_grad_norm_(full_params, max_norm=1.0)  # just the norm
        # a non-finite norm has no meaningful multiple: any max_norm must leave the grads alone
        max_norm = None if factor is None else factor * (1.0 if bad else ref_norm.item())

        local = []
        for shapes, grads in zip((NON_EXPERT_SHAPES, EXPERT_SHAPES), mine, strict=True):
            ps = [nn.Parameter(torch.zeros(s)) for s in shapes]
            for p, g in zip(ps, grads, strict=True):
                p.grad = None if g is None else g.clone()
            local.append(ps)
        # the non-expert copies (equal across EP) are counted on EP rank 0 only
        counted = local[1] + (local[0] if dims.ep_rank == 0 else [])
        norm = clip_grad_norm_(local[1] + local[0], max_norm, counted=counted, group=groups.model)
        assert norm.dtype == torch.float32 and norm.dim() == 0
        norms[label] = norm.item()
        if bad:
            assert not torch.isfinite(norm)
            for ps, grads in zip(local, mine, strict=True):
                for p, g in zip(ps, grads, strict=True):
                    assert (p.grad is None) == (g is None)
                    if g is not None:
                        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
            continue
        torch.testing.assert_close(norm, ref_norm)
        for p, g in zip(full_params, full, strict=True):
            p.grad = g.clone()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(full_params, max_norm=max_norm)
        # match each local grad to its clipped slice of the full vector by its original value
        clipped = {id(g): p.grad for g, p in zip(full, full_params, strict=True)}
        by_value = [(g, clipped[id(g)]) for g in full]
        for ps, grads in zip(local, mine, strict=True):
            for p, g in zip(ps, grads, strict=True):
                if g is None:
                    assert p.grad is None
                    continue
                want = next(
                    c for orig, c in by_value if orig.shape == g.shape and torch.equal(orig, g)
                )
                torch.testing.assert_close(p.grad, want)
        if label == "clip":
            assert not torch.equal(local[0][0].grad, mine[0][0]), "clipping should have scaled"
    return norms


def _all_cases(rank: int, world_size: int) -> dict:
    assert world_size == WORLD
    group = dist.group.WORLD
    launch_sites = _case_hand_checked(rank, group)
    _case_accumulation_and_unused(rank, group)
    used_on_some = _case_used_on_some_ranks_launches_in_one_place(rank, group)
    _case_double_fire_raises(rank, group)
    _case_random_vs_manual_all_reduce(rank, group)
    _case_vs_ddp(rank)
    _case_subgroups(rank)
    _case_zero2(rank, group)
    _case_collectives(rank)
    return {
        "launch_sites": launch_sites,
        "used_on_some": used_on_some,
        "norms": _case_clipping(rank),
    }


@pytest.mark.timeout(180)
def test_reducers_and_clipping_on_four_gloo_ranks():
    results = run_on_ranks(_all_cases, WORLD, timeout_s=150, start_method="fork")
    for r in results[1:]:
        # same launches from the same places, and the bitwise-same norm, on every rank
        assert r["launch_sites"] == results[0]["launch_sites"]
        # a parameter used on some ranks only: the same launches from the same places, except in
        # the one step where the hooks agreed on were missed (which warns and stops it)
        for (name, step), log in r["used_on_some"].items():
            if (name, step) != ("later", 1):
                assert log == results[0]["used_on_some"][(name, step)], (name, step)
        for label, value in r["norms"].items():
            ref = results[0]["norms"][label]
            assert value == ref or (math.isnan(value) and math.isnan(ref)), (label, value, ref)
    assert math.isinf(results[0]["norms"]["inf"])


# ---- process-free ----------------------------------------------------------------------------


def _sized(*numels, dtype=torch.float32) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(n, dtype=dtype)) for n in numels]


def test_buckets_fill_in_reverse_order_up_to_the_cap():
    params = _sized(10, 20, 30, 40)  # 40, 80, 120, 160 bytes
    assert assign_buckets(params, 200) == [[3], [2, 1], [0]]
    assert assign_buckets(params, 400) == [[3, 2, 1, 0]]
    assert assign_buckets(params, 1) == [[3], [2], [1], [0]]
    # a parameter over the cap gets its own bucket and closes the one before
    assert assign_buckets(_sized(1, 100, 1, 1), 16) == [[3, 2], [1], [0]]


def test_buckets_never_mix_dtypes():
    params = _sized(4) + _sized(4, dtype=torch.float64) + _sized(4) + _sized(4, dtype=torch.float64)
    buckets = assign_buckets(params, 1e9)
    assert buckets == [[3, 1], [2, 0]]
    for bucket in buckets:
        assert len({params[i].dtype for i in bucket}) == 1


def test_bucket_assignment_covers_every_param_once():
    params = _params()
    for cap in (1, 48, 100, 1e9):
        flat = sorted(i for b in assign_buckets(params, cap) for i in b)
        assert flat == list(range(len(params)))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mode": "ddp"}, "mode='ddp'"),
        ({"bucket_cap_mb": 0}, "bucket_cap_mb=0"),
        ({"bucket_cap_mb": -1.0}, "bucket_cap_mb=-1.0"),
        ({"bucket_cap_mb": float("inf")}, "bucket_cap_mb=inf"),
        ({"scale": 0.0}, "scale=0.0"),
    ],
)
def test_bad_reducer_arguments_name_the_value(kwargs, match):
    kwargs = {"scale": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        GradReducer(_params(), None, **kwargs)


def test_without_a_group_finish_only_scales():
    params = _params()
    frozen = nn.Parameter(torch.ones(2), requires_grad=False)
    reducer = GradReducer([*params, frozen], None, scale=0.5)
    assert reducer.params == params and reducer.bucket_params == []
    _backward(params, 1, range(1, len(params)))
    _backward(params, 1, range(1, len(params)))  # no hooks: accumulating twice is the caller's call
    reducer.finish()
    assert frozen.grad is None
    assert params[0].grad is None  # unused stays None, as in plain PyTorch
    for i in range(1, len(params)):
        torch.testing.assert_close(params[i].grad, _expected(params, i, [1, 1], scale=0.5))


def test_clipping_without_groups_matches_torch():
    torch.manual_seed(0)
    ours = [nn.Parameter(torch.zeros(s)) for s in [(3, 4), (7,), (2, 2), (5,)]]
    grads = [torch.randn_like(p) for p in ours]
    grads[2] = None
    for max_norm in (0.5, 100.0):
        ref = [nn.Parameter(torch.zeros_like(p)) for p in ours]
        for p, q, g in zip(ours, ref, grads, strict=True):
            p.grad = None if g is None else g.clone()
            q.grad = None if g is None else g.clone()
        want = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        got = clip_grad_norm_(ours, max_norm)
        torch.testing.assert_close(got, want)
        for p, q in zip(ours, ref, strict=True):
            if q.grad is None:
                assert p.grad is None
            else:
                torch.testing.assert_close(p.grad, q.grad)


def test_clipping_leaves_grads_alone_on_a_non_finite_norm():
    p = nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, float("nan"), 2.0])
    before = p.grad.clone()
    norm = clip_grad_norm_([p], 1e-3)
    assert torch.isnan(norm)
    torch.testing.assert_close(p.grad, before, equal_nan=True)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, float("nan")])
def test_clipping_rejects_a_bad_max_norm(max_norm):
    with pytest.raises(ValueError, match="max_norm="):
        clip_grad_norm_([], max_norm)
