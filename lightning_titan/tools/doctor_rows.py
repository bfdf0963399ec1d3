"""What each rank of a ``titan doctor`` row runs: a few training steps of one small model under a
layout, and the numbers the row is judged by (``doctor.py`` judges them, in the launcher).

Every row trains the same layout-free model on the same global batches, so a layout's per-step losses
and gradient norms (the norm sees a grad scaled wrongly, which Adam's update would hide) must equal
one device's, and one schedule's another's, within the row's tolerance. The steps are
``TrainStep`` itself (the step TitanLM runs), on the engine the strategy builds.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_titan.checkpoint.selfcheck import background_round_trip
from lightning_titan.model import compiled
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.moe.experts import expert_gemm_paths
from lightning_titan.parallel.dp.zero import ZeroShards
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from lightning_titan.parallel.pipeline.schedules import SPLIT_BACKWARD, V_SHAPED
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.runtime import faults  # arms TITAN_FAULT in the ranks: a planted failure
from lightning_titan.train.engine import Engine
from lightning_titan.train.step import TrainStep

SEED = 1234
ONE_DEVICE = ProcessGroups(None, None, None, None)


@dataclass(frozen=True)
class Spec:
    """What every row's ranks need: the model, the batch, the steps, where the ranks compute."""

    config: ModelConfig
    global_batch: int
    steps: int
    cuda: bool
    compile_backend: str
    scratch: str = field(default_factory=lambda: tempfile.gettempdir())


@dataclass
class Trained:
    losses: list[float]
    norms: list[float]  # before clipping, composed over every axis
    model: StageModel
    engine: Engine
    optimizer: torch.optim.Optimizer
    sync_warnings: int | None  # CUDA's synchronising calls in the steps (None: not on CUDA)
    gemm_paths: dict[str, str]
    first_step_s: float


def _device(spec: Spec) -> torch.device:
    # run_on_ranks set this rank's device (rank % device_count) under NCCL
    return torch.device("cuda", torch.cuda.current_device()) if spec.cuda else torch.device("cpu")


def _batch(
    spec: Spec, step: int, dims: ParallelDims, device: torch.device
) -> tuple[Tensor, Tensor]:
    """This data rank's rows of global batch ``step`` (the same global batches under every layout)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(
        0, spec.config.vocab_size, (spec.global_batch, spec.config.seq_len + 1), generator=g
    )
    b = spec.global_batch // dims.data_world
    rows = tokens[dims.data_rank * b : (dims.data_rank + 1) * b].to(device)
    return rows[:, :-1], rows[:, 1:]


@contextmanager
def _counted_syncs(device: torch.device) -> Iterator[list[warnings.WarningMessage] | None]:
    """On CUDA, every synchronising call in the block warns (``set_sync_debug_mode("warn")``) and is
    recorded; elsewhere nothing is counted (None)."""
    if device.type != "cuda":
        yield None
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(0)


def train(
    spec: Spec,
    dims: ParallelDims,
    groups: ProcessGroups,
    *,
    schedule: str = "1f1b",
    microbatches: int = 1,
    zero: int = 0,
    bf16: bool = False,
    compile_backend: str | None = None,
) -> Trained:
    """``spec.steps`` steps of the layout-free model on this rank; the global loss of each."""
    device = _device(spec)
    split = StageSplit(2, None, True) if schedule in V_SHAPED else StageSplit()
    model = StageModel(
        spec.config, pp_rank=dims.pp_rank, pp=dims.pp, ep_rank=dims.ep_rank, ep=dims.ep,
        ep_group=groups.ep, tp_group=groups.tp, cp_group=groups.cp,
        sequence_group=groups.sequence, split=split,
    )  # fmt: skip
    model.init_weights(SEED)
    model.to(device)
    if compile_backend is not None:
        split_backward = schedule in SPLIT_BACKWARD
        compiled.compile_stage(model, split_backward=split_backward, backend=compile_backend)
    engine = Engine(model, dims, groups, schedule=schedule, zero=zero)
    engine.broadcast_replicated()
    # eps=1e-3: Adam divides by sqrt(v) + eps, so with a tiny eps a grad's last-bit differences
    # between layouts (their sums run in other orders) grow into visible weight differences
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-3)
    engine.shard_optimizers([optimizer])
    step = TrainStep(engine, optimizer, max_norm=1.0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    losses, norms, first_step_s, syncs = [], [], 0.0, None
    for i in range(spec.steps):
        faults.set_step(i)
        inputs, targets = _batch(spec, i, dims, device)
        start = time.perf_counter()
        with _counted_syncs(device) as caught, autocast:
            result = step.run(model, inputs, targets, microbatches, model.token_loss_sum, index=i)
        if i == 0:
            first_step_s = time.perf_counter() - start
        if caught is not None:
            found = sum("synchroniz" in str(w.message) for w in caught)
            syncs = found if syncs is None else syncs + found
        losses.append(result.loss)
        norms.append(result.grad_norm)
    return Trained(
        losses, norms, model, engine, optimizer, syncs, expert_gemm_paths(model), first_step_s
    )


def smoke(rank: int, world: int, spec: Spec, bf16: bool) -> dict[str, Any]:
    """ep2 on two ranks, or (``world == 1``) the same steps on one device, no process group: a
    launch of its own, since the step agrees on its numbers over the world group when there is one."""
    device = _device(spec)
    if world == 1:
        dims, groups = ParallelDims(1, 1, 1, 0), ONE_DEVICE
    else:
        dims = ParallelDims(1, 1, 2, rank=rank)
        groups = build_process_groups(dims, device_type=device.type)
    run = train(spec, dims, groups, bf16=bf16)
    run.engine.remove()
    return {
        "losses": run.losses, "norms": run.norms, "syncs": run.sync_warnings,
        "gemm": sorted(set(run.gemm_paths.values())),
    }  # fmt: skip


def pipeline(rank: int, world: int, spec: Spec) -> dict[str, Any]:
    """pp2 x ep2: dualpipev (the overlapped V, M = 2P) against 1f1b, the same model and batches."""
    dims = ParallelDims(1, 2, 2, rank=rank)
    groups = build_process_groups(dims, device_type=_device(spec).type)
    out: dict[str, Any] = {}
    for schedule in ("1f1b", "dualpipev"):
        run = train(spec, dims, groups, schedule=schedule, microbatches=2 * dims.pp)
        run.engine.remove()
        out[schedule] = {"losses": run.losses, "norms": run.norms}
    return out


def background_save(rank: int, world: int, spec: Spec) -> dict[str, Any]:
    """dp2 x tp2 with zero=1: two steps, then a background save against a synchronous one
    (``background_round_trip``: the files byte for byte, where the staged tensors lived, the
    writer's device, the CUDA contexts each rank holds)."""
    dims = ParallelDims(2, 1, 1, rank=rank, tp=2)
    device = _device(spec)
    run = train(spec, dims, build_process_groups(dims, device_type=device.type), zero=1)
    shards = ZeroShards(run.engine.zero_groups)  # the keys the optimizers' shards save under
    report = background_round_trip(
        run.model, [run.optimizer], spec.scratch, zero_shards=shards, layout=dims.degrees
    )
    run.engine.remove()
    return report


def compile_run(rank: int, world: int, spec: Spec) -> dict[str, Any]:
    """One device: eager, then the same steps with the stage compiled (``spec.compile_backend``)."""
    eager = train(spec, ParallelDims(1, 1, 1, 0), ONE_DEVICE)
    eager.engine.remove()
    before = compiled.graphs_compiled()
    built = train(spec, ParallelDims(1, 1, 1, 0), ONE_DEVICE, compile_backend=spec.compile_backend)
    built.engine.remove()
    return {
        "eager": {"losses": eager.losses, "norms": eager.norms},
        "compiled": {"losses": built.losses, "norms": built.norms},
        "compile_s": built.first_step_s,
        "graphs": compiled.graphs_compiled() - before,
    }
