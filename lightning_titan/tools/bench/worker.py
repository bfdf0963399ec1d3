"""What each rank runs (spawned by ``lightning_titan.runtime.launch.run_on_ranks``): every case of one world size.

Per case: build each implementation, warm it up, then time ``rounds`` blocks of ``steps`` steps,
rotating the implementations between rounds so that load from elsewhere on the machine falls on all
of them alike; then record a few extra steps of ours as spans, measure the activations one step saves
for backward, and count every implementation's model state. Timed steps run with recording off.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_titan.model.moe.layer import MoELayer
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from lightning_titan.parallel.pipeline.split import AUTO, StageSplit
from lightning_titan.runtime import tracing
from lightning_titan.runtime.saved_tensors import SavedTensorMeter
from lightning_titan.tools.bench.cases import (
    A2A_BLOCKING,
    DDP,
    DDP_ZERO,
    FSDP2,
    FSDP2_ZERO3,
    IMPL_LABELS,
    OURS,
    PER_PARAM,
    SCHEDULE_IMPLS,
    TORCH_PP,
    TORCH_TP,
    ZERO2,
    ZERO3,
    ZERO_LEVELS,
    Case,
    Settings,
)
from lightning_titan.tools.bench.memory import (
    peak_bytes,
    reset_peak,
    state_bytes,
    tp_cut_bytes,
)
from lightning_titan.tools.bench.runners import (
    LR,
    MAX_NORM,
    SEED,
    DDPRunner,
    DDPZeroRunner,
    FSDP2Runner,
    TitanRunner,
    TorchPipeRunner,
)
from lightning_titan.tools.bench.torch_tp import TorchTPRunner
from lightning_titan.train import auto_split

NUM_BATCHES = 4  # distinct global batches, cycled


def _device(settings: Settings, rank: int) -> torch.device:
    if settings.device == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(settings.device)


def _batches(
    settings: Settings, dims: ParallelDims, device: torch.device
) -> list[tuple[Tensor, Tensor]]:
    """This data rank's shard of the same random global batches on every layout."""
    config, b = settings.config, settings.global_batch // dims.data_world
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(NUM_BATCHES):
        tokens = torch.randint(
            0, config.vocab_size, (settings.global_batch, config.seq_len + 1), generator=g
        )
        rows = tokens[dims.data_rank * b : (dims.data_rank + 1) * b].to(device)
        out.append((rows[:, :-1], rows[:, 1:]))
    return out


def _make(
    impl: str,
    case: Case,
    settings: Settings,
    dims: ParallelDims,
    groups: ProcessGroups,
    device: torch.device,
    split: StageSplit,
) -> Any:
    m = settings.num_microbatches(case)
    if impl in (OURS, *ZERO_LEVELS, PER_PARAM, A2A_BLOCKING, *SCHEDULE_IMPLS):
        reducer = "per_param" if impl == PER_PARAM else "bucketed"
        runner = TitanRunner(
            settings.config,
            dims,
            groups,
            device,
            schedule=case.of(impl).schedule,
            num_microbatches=m,
            reducer=reducer,
            zero=ZERO_LEVELS.get(impl, 0),
            bucket_cap_mb=settings.bucket_cap_mb,
            split=split,
        )
        for module in runner.model.modules():  # the baseline of the all-to-alls' overlap
            if isinstance(module, MoELayer):
                module.overlap_all_to_all = impl != A2A_BLOCKING
        return runner
    if impl == DDP:
        return DDPRunner(settings.config, dims, groups, device)
    if impl == DDP_ZERO:
        return DDPZeroRunner(settings.config, dims, groups, device)
    if impl in (FSDP2, FSDP2_ZERO3):
        return FSDP2Runner(
            settings.config, dims, groups, device, reshard_after_forward=impl == FSDP2_ZERO3
        )
    if impl == TORCH_PP:
        return TorchPipeRunner(
            settings.config,
            dims,
            groups,
            device,
            schedule=case.schedule,
            num_microbatches=m,
            split=split,
        )
    if impl == TORCH_TP:
        return TorchTPRunner(
            settings.config, dims, groups, device, seed=SEED, lr=LR, max_norm=MAX_NORM
        )
    raise ValueError(f"impl={impl!r} is unknown; choose one of {list(IMPL_LABELS)}")


def autocast(settings: Settings, device: torch.device) -> AbstractContextManager:
    """One step's autocast under ``bf16-mixed`` (a region per step, as Lightning enters one per
    ``training_step``: autocast's cached weight copies must not outlive the optimizer step)."""
    mixed = settings.precision == "bf16-mixed"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_block(
    runner: Any, batches: list, settings: Settings, device: torch.device
) -> tuple[float, float]:
    """(wall seconds per step, the slowest rank's; CPU seconds per step, all ranks together).

    CPU time (every thread of the process; waiting in gloo does not spin) is what a step costs
    whatever else the machine runs, so it stays comparable on a shared box where wall time is not.
    """
    _sync(device)
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    steps = settings.steps
    for k in range(steps):
        with autocast(settings, device):
            runner.step(*batches[k % len(batches)])
    _sync(device)
    cpu = time.process_time() - cpu
    dist.barrier()
    wall = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    cpu_all = torch.tensor([cpu], dtype=torch.float64)
    dist.all_reduce(cpu_all)
    return wall.item() / steps, cpu_all.item() / steps


def run_case(
    case: Case, settings: Settings, dims: ParallelDims, groups: ProcessGroups, device: torch.device
) -> dict[str, dict]:
    """This rank's measurements of every implementation of ``case``."""
    batches = _batches(settings, dims, device)
    split = _resolve_split(case, settings, dims, device)
    runners: dict[str, Any] = {}
    out: dict[str, dict[str, Any]] = {}
    for impl in case.impls:
        torch.manual_seed(dims.rank)
        reset_peak(device)
        own = split if impl not in SCHEDULE_IMPLS else case.of(impl).split  # zbv's: the V
        runners[impl] = _make(impl, case, settings, dims, groups, device, own)
        for k in range(settings.warmup):
            with autocast(settings, device):
                runners[impl].step(*batches[k % len(batches)])
        _sync(device)
        out[impl] = {
            "rank": dims.rank,
            "coords": dims.coords_of(dims.rank),
            "step_s": [],
            "cpu_s": [],
            "peak_bytes": peak_bytes(device),
        }
    for r in range(settings.rounds):
        order = case.impls[r % len(case.impls) :] + case.impls[: r % len(case.impls)]
        for impl in order:
            wall, cpu = _timed_block(runners[impl], batches, settings, device)
            out[impl]["step_s"].append(wall)
            out[impl]["cpu_s"].append(cpu)
    for result in out.values():
        result["median_step_s"] = statistics.median(result["step_s"])
        result["median_cpu_s"] = statistics.median(result["cpu_s"])

    # zero>0's time split: where its gather and smaller step go; --ep-overlap's exposure
    for impl in (OURS, *ZERO_LEVELS, A2A_BLOCKING, *SCHEDULE_IMPLS):
        if impl in runners:
            out[impl]["spans"] = _traced(runners[impl], batches, settings, dims, device)
    for impl in (ZERO2, ZERO3, FSDP2, FSDP2_ZERO3):  # the weights whole at once during a step
        if impl in runners:
            with autocast(settings, device):
                out[impl]["param_peak_bytes"] = param_peak(runners[impl], batches[0])
    if ZERO3 in runners:  # the blocks' gathers: found in flight (prefetched) or not, or wasted
        out[ZERO3]["block_gathers"] = dict(runners[ZERO3].engine.sharded_params.counts)
    for impl, runner in runners.items():  # after steps: the optimizers hold their state
        out[impl]["state_bytes"] = state_bytes(
            runner.model, runner.optimizer, getattr(runner, "engine", None)
        )
        out[impl]["tp_cut_param_bytes"] = tp_cut_bytes(runner.model)
    # activations saved for backward, every case: the pipeline's per stage, CP's against one rank;
    # under --ep-overlap every schedule's
    if dims.pp > 1:
        out[OURS]["stage_layers"] = split.counts(settings.config.n_layers, dims.pp)
    for impl in [i for i in (OURS, *SCHEDULE_IMPLS) if i in runners]:
        with autocast(settings, device):
            peak, saved = _saved_peak(runners[impl], batches[0])
            out[impl]["saved_peak_bytes"], out[impl]["forward_saved_bytes"] = peak, saved
    if dims.pp > 1 and dims.tp == dims.cp == 1:  # --schedules' theory unit: what one microbatch
        # of each chunk saves (outside the engine, which alone splits a TP/CP sequence)
        with autocast(settings, device):
            out[OURS]["microbatch_saved_bytes"] = _microbatch_saved(runners[OURS], batches[0])
    for runner in runners.values():
        runner.close()
    return out


def _storage_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct storages ``tensors`` (a DTensor: its local shard) live in; zero=3's
    freed parameters hold 0 bytes."""
    storages = {}
    for t in tensors:
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def param_peak(runner: Any, batch: tuple[Tensor, Tensor]) -> int:
    """The most bytes of parameter storage a rank holds during one step: the model's parameters as
    they are then (whole, or freed by zero=3; FSDP2's the gathered ones while a block is unsharded,
    else its shards) and the optimizer's (ZeRO's rows, FSDP2's shards), each storage once, sampled
    at every block's forward (after its gather and the next one's prefetch) and at the start of
    its backward (the grad of its output). The collectives' buffers are not counted."""
    model = runner.model
    leaves = [p for g in runner.optimizer.param_groups for p in g["params"]]
    peak = 0

    def look(*_: Any) -> None:
        nonlocal peak
        peak = max(peak, _storage_bytes([*model.parameters(), *leaves]))

    def on_output(module: Any, args: Any, output: Any) -> None:
        look()
        x = output[0] if isinstance(output, tuple) else output
        if isinstance(x, Tensor) and x.requires_grad:
            x.register_hook(look)  # after the gathers' own hooks, registered before

    handles = []
    for block in model.layers.values():  # after the engine's and FSDP2's hooks
        handles.append(block.register_forward_pre_hook(look))
        handles.append(block.register_forward_hook(on_output))
    try:
        runner.step(*batch)
    finally:
        for h in handles:
            h.remove()
    return peak


def _traced(
    runner: TitanRunner, batches: list, settings: Settings, dims: ParallelDims, device: torch.device
) -> list[tracing.Span]:
    spans = []
    for k in range(settings.traced_steps):
        dist.barrier()
        tracing.start(dims.rank, step=k, synchronize=device.type == "cuda")
        try:
            with autocast(settings, device):
                runner.step(*batches[k % len(batches)])
        finally:
            spans += tracing.stop()
    return spans


def _saved_peak(
    runner: TitanRunner, batch: tuple[Tensor, Tensor]
) -> tuple[int, dict[tuple[int, int], int]]:
    """Peak bytes saved for backward during one step's schedule (activations only), and what each
    (chunk, microbatch)'s forward and loss saved in it: the theory's units, routing and all. Only
    forwards save (a pair's backward frees), so a forward's share is what was added while it ran."""
    meter = SavedTensorMeter(exclude=list(runner.model.parameters()))
    saved: dict[tuple[int, int], int] = {}

    @contextmanager
    def tracer(name: str, i: int, chunk: int) -> Iterator[None]:
        before = meter.added
        yield
        if name == "forward":
            saved[chunk, i] = meter.added - before

    with meter:
        runner.engine.forward_backward(
            runner.model, *batch, runner.num_microbatches, runner.model.token_loss_sum,
            tracer=tracer,
        )  # fmt: skip
    runner.engine.finish_gradients(None)
    runner.optimizer.zero_grad(set_to_none=True)
    return meter.peak, saved


def _resolve_split(
    case: Case, settings: Settings, dims: ParallelDims, device: torch.device
) -> StageSplit:
    """The case's split, ``stage_layers="auto"`` probed on rank 0 and agreed (as the strategy does),
    so ours and the peers build the same stage modules."""
    split = case.split
    if split.stage_layers != AUTO:
        return split
    microbatch = settings.global_batch // dims.data_world // settings.num_microbatches(case)
    counts, _ = auto_split.agree(settings.config, dims.pp, split.virtual_stages, microbatch, device)
    return StageSplit(split.virtual_stages, counts)


def _microbatch_saved(runner: TitanRunner, batch: tuple[Tensor, Tensor]) -> list[int]:
    """Per chunk of this rank, the bytes one microbatch's forward (and, on the head, its loss) saves
    for backward: the unit the schedules' activation-memory theory counts in."""
    model, m = runner.model, runner.num_microbatches
    inputs, targets = (t[: t.shape[0] // m] for t in batch)
    d_model = model.config.d_model
    out = []
    for chunk in range(model.num_chunks):
        meter = SavedTensorMeter(exclude=list(model.parameters()))
        embeds = model.embeds(chunk)
        x = (
            inputs
            if embeds
            else torch.randn(*inputs.shape, d_model, device=inputs.device, requires_grad=True)
        )
        with meter:
            y, aux = model(x, chunk)
            if model.heads(chunk):
                y = runner.model.token_loss_sum(y, targets) + aux.sum()
        del y, aux
        out.append(meter.peak)
    return out


def run_world(rank: int, world_size: int, cases: list[Case], settings: Settings) -> list[dict]:
    """Spawned on every rank: run every case of this world size, in order."""
    device = _device(settings, rank)
    if settings.threads_per_rank is not None:
        torch.set_num_threads(settings.threads_per_rank)
    groups_by_layout: dict[tuple[int, ...], ProcessGroups] = {}
    results = []
    for case in cases:
        dims = ParallelDims(case.dp, case.pp, case.ep, rank, tp=case.tp, cp=case.cp)
        layout = (case.dp, case.pp, case.ep, case.tp, case.cp)
        if layout not in groups_by_layout:  # new_group is collective: every rank, same order
            groups_by_layout[layout] = build_process_groups(dims)
        results.append(run_case(case, settings, dims, groups_by_layout[layout], device))
        gc.collect()
    return results
