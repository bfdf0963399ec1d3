"""The parallel machinery of one rank, without Lightning: the reducers, ZeRO's shards, the composed
clipping and the schedules, as the parts a training step is made of.

engine = Engine(module, dims, groups, schedule="1f1b")
engine.broadcast_replicated()
engine.shard_optimizers([optimizer])  # zero > 0: each rank's optimizer updates its own rows
step = TrainStep(engine, optimizer, max_norm=1.0)  # the parts in their order (train/step.py)
result = step.run(stage_model, inputs, targets, 4, loss_fn)

``TrainStep`` is the one place that calls the parts below in the order a step needs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_titan.model.decoder import Block, StageModel
from lightning_titan.model.grad_kinds import (
    EXPERT,
    SEQUENCE,
    TP_SHARDED,
    grad_group_kinds,
)
from lightning_titan.model.moe import balance
from lightning_titan.model.moe.experts import probe_grouped_mm
from lightning_titan.model.moe.layer import StepCounts, take_step_counts
from lightning_titan.parallel.dp import zero as zero_levels
from lightning_titan.parallel.dp import zero_grads
from lightning_titan.parallel.dp.clipping import clip_grad_norm_
from lightning_titan.parallel.dp.master import MasterWeights, masters_of, parameter_dtype
from lightning_titan.parallel.dp.offload import HostOptimizer
from lightning_titan.parallel.dp.reducer import GradReducer
from lightning_titan.parallel.dp.zero3 import ShardedParams
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups
from lightning_titan.parallel.pipeline.p2p import StageLinks
from lightning_titan.parallel.pipeline.schedules import get_schedule
from lightning_titan.parallel.pipeline.stage import PipelineStage
from lightning_titan.parallel.tensor_parallel import tp_shards
from lightning_titan.runtime import probes
from lightning_titan.train.objective import (
    LossFn,
    Objective,
    StepLoss,
    count_targets,
    global_means,
)
from lightning_titan.train.options import check_offload, zero3_reshards_after_forward


class Engine:
    """Owns the two reducers and the composed clipping for ``module``'s parameters, and runs schedules.

    ``module`` is whatever holds the parameters (a LightningModule or the stage model itself): expert
    parameters are told apart by module type, so any module works (one without experts has none).
    """

    def __init__(
        self,
        module: nn.Module,
        dims: ParallelDims,
        groups: ProcessGroups,
        *,
        schedule: str = "1f1b",
        bucket_cap_mb: float = 25.0,
        reducer: str = "bucketed",
        zero: int = 0,
        param_dtype: str = "fp32",
        offload_optimizer: bool = False,
    ) -> None:
        """``param_dtype="bf16"``: the trainable parameters are stored in bf16 and the optimizer
        steps fp32 masters of them (``parallel/dp/master.py``; under zero=3 each rank's rows of them,
        gathered in bf16: ``parallel/dp/zero3.py``).
        ``offload_optimizer``: the optimizer steps host copies of its tensors, on the CPU, and its
        state and the fp32 masters live in host memory (``parallel/dp/offload.py``; zero 0, 1, 2)."""
        get_schedule(schedule)
        dtype = parameter_dtype(param_dtype)
        if zero not in zero_levels.LEVELS:
            raise ValueError(
                f"zero={zero!r} is not a ZeRO level; choose one of {zero_levels.LEVELS}"
            )
        self.module, self.dims, self.groups, self.schedule = module, dims, groups, schedule
        self.zero = zero
        check_offload(offload_optimizer, zero)
        self.offload_optimizer = offload_optimizer
        self.offload: HostOptimizer | None = None  # the host copies, from ``shard_optimizers``
        if dims.fold_ep and zero == 3:
            raise ValueError(
                "fold_ep with zero=3 is not built yet; use zero 0, 1 or 2 with fold_ep, or unfold"
            )
        # zero=3: the units gathered around their use (None below zero=3)
        self.sharded_params: ShardedParams | None = None
        if zero == 3:
            self.sharded_params = self._sharded_params(
                module, reshard_after_forward=zero3_reshards_after_forward(dims.pp, schedule)
            )
        kinds = grad_group_kinds(module)
        # bf16 weights: the fp32 masters, taken before the cast (they start at the fp32 init)
        self.masters: MasterWeights | None = None
        if dtype != torch.float32:
            self.masters = MasterWeights([p for _, p, _ in kinds], dtype)
        self.expert_params = [p for _, p, kind in kinds if kind == EXPERT]
        scale = 1.0 / dims.data_world  # the global mean over every data rank's loss
        # 1/data_world = 1/dp (the expert-DP average) / ep: an expert owner sums every EP rank's
        # tokens; the CP and TP ranks' grads are parts of one sum (their own tokens, heads or vocabulary)
        # whether they reach the owner through the all-to-all (fold_ep) or the expert-DP all-reduce

        # ZeRO: the optimizer state (zero=2: and the grads) of each reducer's parameters is split
        # over that reducer's group (a TP-cut weight's along a dim TP does not cut)
        expert_ids = {id(p) for p in self.expert_params}
        cut_by_tp = tp_shards(module)
        self.zero_groups: list[zero_levels.ZeroGroup] = []

        def reducer_over(params: list[nn.Parameter], group: dist.ProcessGroup) -> GradReducer:
            if zero and group is not None and dist.get_world_size(group) > 1:
                params = [p for p in params if p.requires_grad]
                units = None if self.sharded_params is None else self.sharded_params.units
                shards = zero_levels.ZeroGroup(
                    params, expert_ids, group, bucket_cap_mb=bucket_cap_mb, tp_shards=cut_by_tp,
                    units=units,
                )  # fmt: skip
                self.zero_groups.append(shards)
                if zero >= 2:
                    return zero_grads.ShardedGradReducer(
                        params, shards, scale=scale, bucket_cap_mb=bucket_cap_mb, mode=reducer,
                        masters=self.masters,
                    )  # fmt: skip
            return GradReducer(
                params, group, scale=scale, bucket_cap_mb=bucket_cap_mb, mode=reducer,
                masters=self.masters,
            )  # fmt: skip

        # parameters whose grads sum over the same ranks share a reducer: fewer, fuller buckets
        # (with cp = tp = ep = 1 every kind is the DP group: one reducer)
        by_ranks: dict[tuple[int, ...], tuple[str, list[nn.Parameter]]] = {}
        for _, p, kind in kinds:
            if p.requires_grad:
                ranks = tuple(dims.group_ranks(kind))
                by_ranks.setdefault(ranks, (kind, []))[1].append(p)
        self.reducers = [
            reducer_over(params, getattr(groups, kind)) for kind, params in by_ranks.values()
        ]
        if self.masters is not None:  # zero>0: a rank keeps the masters of its rows only
            for g in self.zero_groups:
                g.take_masters(self.masters)
        # the norm counts a copy on the first rank of the axes it is copied over (parallel/dp/clipping.py)
        coords = dims.coords(dims.rank)
        self.norm_params = [
            p for _, p, kind in kinds if all(coords[a] == 0 for a in dims.copied_over(kind))
        ]
        self.params = [p for _, p, _ in kinds]
        self.balanced_layers = balance.balanced_layers(module)  # MoE layers with an expert bias
        # here, on the weights' device, not in a forward (in an overlapped pair a probe's backward
        # would wait on autograd's device thread, parked in the hand-over)
        probe_grouped_mm(module)
        if zero and not self.zero_groups:
            warnings.warn(
                f"zero={zero} changes nothing here: this layout (dp={dims.dp}, ep={dims.ep}) has no "
                "data-parallel group to split the optimizer state over; use dp > 1 (or ep > 1)",
                stacklevel=2,
            )

    @staticmethod
    def _sharded_params(module: nn.Module, *, reshard_after_forward: bool) -> ShardedParams:
        """zero=3's units: each decoder block, and the rest of the stage (``parallel/dp/zero3.py``)."""
        stages = [m for m in module.modules() if isinstance(m, StageModel)]
        if len(stages) != 1:
            raise ValueError(
                f"zero=3 gathers the blocks of one StageModel; this module holds {len(stages)}"
            )
        blocks = [m for m in stages[0].modules() if isinstance(m, Block)]
        return ShardedParams(stages[0], blocks, reshard_after_forward=reshard_after_forward)

    @torch.no_grad()
    def broadcast_replicated(self) -> None:
        """Replicas start equal: each parameter from the first rank of the group its grads are reduced
        over, floating buffers over the non-expert-DP group (layout-free init makes them equal already;
        this guards against drift, e.g. a user's own init that used the global RNG)."""
        buffers = [b for b in self.module.buffers() if b.is_floating_point()]
        # every parameter over the group its grads would be reduced over, frozen ones too (LoRA's
        # base: it has no reducer)
        pairs: list[tuple[list[Tensor], str]] = [
            ([p for _, p, k in grad_group_kinds(self.module) if k == kind], kind)
            for kind in (EXPERT, TP_SHARDED, SEQUENCE)
        ]
        for tensors, kind in [*pairs, (buffers, "non_expert_dp")]:
            group = getattr(self.groups, kind)
            ranks = self.dims.group_ranks(kind)
            if len(ranks) > 1:
                if self.masters is not None:  # a bf16 parameter's fp32 master (it then takes it)
                    tensors = [m if (m := self.masters.of(t)) is not None else t for t in tensors]
                for t in tensors:
                    dist.broadcast(t.data, src=ranks[0], group=group)
        if self.masters is not None:
            self.masters.write_back()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards that accumulate without reducing (every reducer's ``no_sync``): all but the last
        of a schedule's, and Lightning's ``accumulate_grad_batches`` but the last batch."""
        with ExitStack() as stack:
            for r in self.reducers:
                stack.enter_context(r.no_sync())
            yield

    def forward_backward(
        self,
        stage_model: StageModel,
        inputs: Tensor,
        targets: Tensor,
        num_microbatches: int,
        loss_fn: LossFn,
        *,
        backward: Callable[[Tensor], None] | None = None,
        tracer: Callable[[str, int, int], object] | None = None,
        documents: Tensor | None = None,
    ) -> StepLoss:
        """One step's forward and backward over ``num_microbatches`` with the schedule; grads are reduced
        during the last backward (overlapped; the stage runs the others under ``no_sync``), finished
        by ``finish_gradients``. The result carries the MoE layers' routing counts of these
        forwards (a count left by a forward outside a step is dropped first). ``documents`` [b, S]:
        a packed batch's document ids (``model/documents.py``), None: one document a sequence."""
        take_step_counts(stage_model)
        if self.sharded_params is not None:  # zero=3 under a pipeline: the stage whole for the step
            self.sharded_params.gather_for_step()
        stage = PipelineStage(
            stage_model,
            self.dims,
            self._links(stage_model, inputs.device),
            inputs,
            targets,
            num_microbatches,
            self._objective(loss_fn, inputs, targets),
            backward=backward,
            accumulate=self.no_sync,
            tracer=tracer,
            documents=documents,
        )
        sums = stage.run(self.schedule)
        counts = take_step_counts(stage_model)
        # this rank's tokens in its stage's layers (the all-reduce sums the ranks)
        dropped = counts.total_dropped()
        step = global_means(sums, inputs.shape[0], self.dims.data_world, dropped)
        return replace(step, counts=counts)

    @torch.no_grad()
    def forward_only(
        self,
        stage_model: StageModel,
        inputs: Tensor,
        targets: Tensor,
        num_microbatches: int,
        loss_fn: LossFn,
        documents: Tensor | None = None,
    ) -> StepLoss:
        links = self._links(stage_model, inputs.device)
        objective = self._objective(loss_fn, inputs, targets)
        if self.sharded_params is not None:  # zero=3 under a pipeline: the stage whole meanwhile
            self.sharded_params.gather_for_step()
        stage = PipelineStage(
            stage_model,
            self.dims,
            links,
            inputs,
            targets,
            num_microbatches,
            objective,
            documents=documents,
        )
        sums = stage.run(None)
        if self.sharded_params is not None:  # zero=3: its rows only again, as between steps
            self.sharded_params.release_all()
        return global_means(sums, inputs.shape[0], self.dims.data_world)

    @staticmethod
    def _objective(loss_fn: LossFn, inputs: Tensor, targets: Tensor) -> Objective:
        return Objective(loss_fn, count_targets(targets), local_sequences=inputs.shape[0])

    def _links(self, stage_model: StageModel, device: torch.device) -> StageLinks:
        dtype = next(stage_model.parameters()).dtype
        # virtual stages: the last rank's chunk c feeds the first rank's chunk c + 1 (the V of zbv
        # turns on the last rank instead: no ring)
        ring = getattr(stage_model, "num_chunks", 1) > 1 and not getattr(
            stage_model, "v_shape", False
        )
        return StageLinks(self.dims, self.groups.pp, dtype, device, ring=ring)

    def finish_gradients(self, max_norm: float | None = None) -> Tensor:
        """Wait for every bucket (launching, in order, any that never filled), then clip by the global norm
        composed over stages, expert shards and TP shards. Returns the pre-clip norm, the same on every rank."""
        probes.fault("all_reduce")
        for r in self.reducers:
            r.finish()
        with probes.span("all_reduce", "grad norm"):
            if self.zero >= 2 and self.zero_groups:  # the grads are shards now
                return zero_grads.clip_shard_grads_(
                    self.reducers, self.zero_groups, max_norm, self.groups
                )
            # bf16 weights: the reduced fp32 grads are the masters'
            return clip_grad_norm_(
                masters_of(self.masters, self.params),
                max_norm,
                counted=masters_of(self.masters, self.norm_params),
                group=self.groups.model,
            )

    @property
    def unfinished(self) -> bool:
        """A backward filled a reducer's bucket that ``finish_gradients`` has not reduced yet: an
        optimizer step now would update by unreduced grads (each rank its own)."""
        return any(r.unfinished for r in self.reducers)

    def shard_optimizers(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Under zero>0, make each optimizer update only this rank's shards (see ``zero``)."""
        for optimizer in optimizers:
            if self.masters is not None:  # bf16 weights: the optimizer steps their fp32 masters
                self.masters.step_masters(optimizer)
            zero_levels.shard_optimizer(optimizer, self.zero_groups)
        if self.offload_optimizer:  # the optimizers step host copies of what they were given
            freed = [m for _, m in self.masters or ()] + [
                s.leaf for g in self.zero_groups for s in g.shards.values() if s.master
            ]  # the fp32 masters: only the host holds them between steps
            self.offload = HostOptimizer(optimizers, freed)
        if self.sharded_params is not None:  # zero=3: only the rows from here on
            self.sharded_params.shard(self.zero_groups)

    def bind_shard_grads(self, drop: bool = False) -> None:
        """Under zero>0, just before the optimizer step: the shards' reduced grads (None: ``drop``, a
        skipped step). zero=2's reducers set them in ``finish_gradients`` already (clipping scaled
        them there): only a drop is left to do."""
        if self.sharded_params is not None:  # zero=3: the grads are reduced, the blocks not needed
            self.sharded_params.release_all()
        for g in self.zero_groups:
            if self.sharded_params is None:  # zero=3: the leaves are the only copy of the rows
                g.take_rows()
            if drop:
                g.drop_grads()
            elif self.zero == 1:
                g.bind_grads(None if self.masters is None else self._reduced_grad)
        if self.offload is not None:  # the optimizer's grads are the host copies'
            self.offload.grads_to_host(drop)

    def _reduced_grad(self, param: nn.Parameter) -> Tensor | None:
        """bf16 weights: ``param``'s reduced fp32 grad (``MasterWeights.grad_holder``)."""
        assert self.masters is not None
        return self.masters.grad_holder(param).grad

    def gather_params(self) -> None:
        """Under zero 1 and 2, just after the optimizer step: every rank's parameters whole again
        (zero=3 gathers each block when it runs). bf16 weights: each takes its updated master.
        Offload: the host copies the optimizer updated into the device tensors first."""
        if self.offload is not None:
            self.offload.copy_back()
        if self.masters is not None:
            self.masters.write_back()
            self.masters.drop_held_grads()
        if self.sharded_params is None:
            for g in self.zero_groups:
                g.gather()
        if self.offload is not None:  # the device masters go again (read by the gather above)
            self.offload.release()

    @contextmanager
    def whole_params(self) -> Iterator[None]:
        """Every parameter whole inside (zero=3 gathers them all; after, each rank's rows are taken
        from them, where a checkpoint load may have written, and they are freed): to save, load or
        read the model between steps. Every rank of the model's groups enters it together."""
        if self.sharded_params is None:
            if self.offload is not None:  # the device masters whole, for a save to read
                self.offload.fill_from_host()
            try:
                yield
            finally:  # bf16 weights: a load wrote the masters (the checkpoint's fp32 weights)
                if self.masters is not None:
                    self.masters.write_back()
                    for g in self.zero_groups:  # zero=1: the rows of every rank's masters
                        g.gather()
                if self.offload is not None:  # the host copies take what a load wrote
                    for g in self.zero_groups:
                        g.take_rows()
                    self.offload.refresh()
                    self.offload.release()
            return
        self.sharded_params.gather_all()
        try:
            yield
        finally:
            self.sharded_params.take_rows()  # bf16 weights: not the masters' rows (a load's)
            self.sharded_params.release_all()
            if self.masters is not None:  # a load wrote the whole (uncut) masters too
                self.masters.write_back()

    def update_router_bias(self, counts: StepCounts, skip: bool = False) -> None:
        """Just after the optimizer step: move the MoE layers' expert biases by the step's global
        expert loads (``counts``: the step's, of this rank's forwards; one all-reduce over the stage's
        ``sequence_dp`` ranks; ``model/moe/balance.py``). ``skip``: the step's update was dropped
        (non-finite), so the bias stays too; every rank of the group passes the same (it decides
        whether there is an all-reduce)."""
        balance.update_expert_bias(self.balanced_layers, counts, self.groups.sequence_dp, skip=skip)

    def remove(self, whole: bool = True) -> None:
        """Take the engine's hooks off the model. ``whole`` (zero=3): gather the parameters first,
        so the model is whole and trained after it (a collective: every rank removes together;
        False after a failure, where a peer may be gone)."""
        for r in self.reducers:
            r.remove()
        if self.offload is not None:  # the device tensors hold the host copies' values
            self.offload.fill_from_host()
            self.offload = None
        if self.sharded_params is not None and whole:
            if self.masters is None:
                self.sharded_params.gather_all()
            else:  # bf16 weights: ``restore_masters`` gathers the fp32 rows, not the bf16 ones
                self.sharded_params.release_all()  # (a prefetch in flight waited)
        if self.masters is not None:  # bf16 weights: the model is its fp32 masters again
            self.masters.restore()
            for g in self.zero_groups if whole else ():  # zero>0: the rows gathered
                g.restore_masters()
        if self.sharded_params is not None:
            self.sharded_params.remove()
