"""No fact rides on a tensor or a module: after real steps under ZeRO-1, ZeRO-2 and TP (2 gloo ranks,
the cases that cut parameters, grads and weights), no module, parameter, grad, buffer, ZeRO leaf or
optimizer state has an attribute named ``_titan_...``. The shard facts live in tables their owners
hand over (``ZeroShards``, the reducers, the modules' ``tp_cuts``); the process-free part of this
check is ``tests/unit/test_side_channels.py``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_harness import FAMILY_CONFIGS, global_batch, loss_fn_for, stage_model
from side_channels import titan_attributes

from lightning_titan.parallel.dp.zero import ZeroShards
from lightning_titan.parallel.dp.zero_grads import ShardedGradReducer
from lightning_titan.parallel.mesh import ParallelDims, build_process_groups
from lightning_titan.parallel.tensor_parallel import tp_shards
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.train.engine import Engine
from lightning_titan.train.step import TrainStep

# every kind of cut: q/k/v rows with their biases, o's columns, the whole-projection QK-norm and the
# sinks (modules that cut their own weight), the vocabulary; and a moving expert bias (a buffer)
CONFIG = replace(
    FAMILY_CONFIGS["qk_full"], attn_sinks=True, n_layers=2, router_bias_update_rate=1e-3
)
CASES = {"dp2 zero=1": ((2, 1), 1), "dp2 zero=2": ((2, 1), 2), "tp2": ((1, 2), 0)}
BATCH, STEPS = 4, 2


def _steps(rank: int, degrees: tuple[int, int], zero: int) -> dict:
    dp, tp = degrees
    dims = ParallelDims(dp, 1, 1, rank=rank, tp=tp)
    groups = build_process_groups(dims)
    model = stage_model(dims, groups, CONFIG)
    engine = Engine(model, dims, groups, bucket_cap_mb=0.01, zero=zero)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine.shard_optimizers([optimizer])
    found: set[str] = set()
    # the grads as the optimizer reads them, and the state before zero_grad
    scan = lambda *_: found.update(titan_attributes(model, [optimizer]))  # noqa: E731
    optimizer.register_step_pre_hook(scan)
    optimizer.register_step_post_hook(scan)
    step = TrainStep(engine, optimizer, max_norm=1.0)
    b = BATCH // dims.data_world
    for i in range(STEPS):
        inputs, targets = global_batch(i, CONFIG, BATCH)
        rows = slice(dims.data_rank * b, (dims.data_rank + 1) * b)
        step.run(model, inputs[rows], targets[rows], 2, loss_fn_for(model, dims), index=i)
    # the case cut what it claims to (else it would prove nothing)
    cut = {
        "zero": len(ZeroShards(engine.zero_groups)),
        "grads": sum(isinstance(r, ShardedGradReducer) for r in engine.reducers),
        "tp": sum(s.size > 1 for s in tp_shards(model).values()),
    }
    engine.remove()
    return {"found": sorted(found), "cut": cut}


def _worker(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    return {label: _steps(rank, degrees, zero) for label, (degrees, zero) in CASES.items()}


@pytest.mark.timeout(300)
def test_no_tensor_or_module_carries_a_titan_attribute_under_zero_and_tp():
    per_rank = run_on_ranks(_worker, 2)
    found = {
        (rank, label, attribute)
        for rank, results in enumerate(per_rank)
        for label, result in results.items()
        for attribute in {where.rpartition(": ")[2] for where in result["found"]}
    }
    assert found == set()
    for results in per_rank:
        assert results["dp2 zero=1"]["cut"]["zero"] > 0
        assert results["dp2 zero=2"]["cut"]["grads"] > 0
        assert results["tp2"]["cut"]["tp"] > 0
