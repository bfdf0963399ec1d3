"""TitanStrategy: DP x PP x EP x CP x TP as a Lightning strategy. Lightning glue only; the machinery
lives in train/engine.py, parallel/, checkpoint/ and the objects it owns (ShardedCheckpoints,
Preemption): ``L.Trainer(accelerator="cpu", devices=8, strategy=TitanStrategy(dp=2, pp=2, ep=2))``"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_titan.checkpoint.sharded import remove_checkpoint
from lightning_titan.lightning import preemption, supervisor
from lightning_titan.lightning.checkpoint_hooks import ShardedCheckpoints
from lightning_titan.lightning.connect import connect
from lightning_titan.lightning.failures import check_finite, report_failure, unreduced_step_error
from lightning_titan.lightning.launchers import launcher_for
from lightning_titan.lightning.layout import Layout
from lightning_titan.parallel.mesh import (
    ParallelDims,
    ProcessGroups,
    build_process_groups,
    check_launched_world,
)
from lightning_titan.parallel.pipeline.schedules import V_SHAPED, check_microbatches
from lightning_titan.plan import auto
from lightning_titan.runtime import faults
from lightning_titan.runtime.agreement import SetupPhase, distributed
from lightning_titan.train.engine import Engine, GradStats
from lightning_titan.train.objective import StepLoss
from lightning_titan.train.options import TrainOptions, check_precision, preflight


class TitanStrategy(ParallelStrategy):
    """DP, PP, EP, CP and TP composed, for a stage-local model built in ``configure_model``.

    Args:
        dp: data-parallel replicas (-1: fill what the other degrees leave of the world).
        pp: pipeline stages; the model's layers split evenly across them (or as ``stage_layers`` says).
        ep: expert-parallel ranks per stage; the experts split evenly across them.
        tp: tensor-parallel ranks (with sequence parallelism): heads, vocabulary and sequence split.
        cp: context-parallel ranks: each sequence's positions split (load-balanced causal chunks).
        schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``, ``"zb_h1"`` (zero-bubble 1F1B) or
            ``"zbv"`` (zero-bubble V: rank r holds virtual stages r and 2*pp-1-r; loss on rank 0).
        virtual_stages: model chunks per rank (>= 2 for interleaved 1F1B, layers round-robin; 2 for
            zbv).
        stage_layers: layers per (virtual) stage, e.g. ``[3, 1]``, or ``"auto"`` (probed); None: even.
        num_microbatches: microbatches per step on every rank (default: ``pp``).
        microbatch_size: sequences per microbatch, instead of ``num_microbatches``.
        bucket_cap_mb: size of a gradient all-reduce bucket.
        reducer: ``"bucketed"`` (overlapped with backward) or ``"per_param"`` (a benchmark baseline).
        zero: 1 splits each parameter's optimizer state over its data-parallel group (ZeRO-1), 2 also its grads.
        gradient_clip_norm: clip the whole model's gradient norm to this (None: only measure and log it).
        timeout_minutes: how long a hung rank can hold the others (a dead one stops them in seconds).
        on_nonfinite: a NaN/inf loss or gradient norm ``"raise"`` s FloatingPointError on every rank
            (naming the step and the stages), or ``"skip"`` s that step's update (a warning says so).
        start_method: ``"popen"`` re-runs the script per rank; ``"fork"`` for notebooks.
        process_group_backend: ``nccl`` on CUDA, ``gloo`` on CPU by default.
        allow_config_change: model-config fields a resume may change (others must match the saved).
        layout: ``"auto"``: the layout and step options ``titan plan`` ranks first for this model,
            world, global batch and device (``plan/auto.py``), said on rank 0; leave the degrees,
            ``zero``, ``schedule``, ``virtual_stages`` and ``num_microbatches`` out.
    """

    strategy_name = "titan"

    strategy_name = "titan"

    def __init__(
        self,
        dp: int = -1,
        pp: int = 1,
        ep: int = 1,
        tp: int = 1,
        cp: int = 1,
        schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zbv"] = "1f1b",
        virtual_stages: int = 1,
        stage_layers: list[int] | Literal["auto"] | None = None,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        bucket_cap_mb: float = 25.0,
        reducer: Literal["bucketed", "per_param"] = "bucketed",
        zero: Literal[0, 1, 2] = 0,
        gradient_clip_norm: float | None = None,
        timeout_minutes: float = 30.0,
        on_nonfinite: Literal["raise", "skip"] = "raise",
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        allow_config_change: list[str] | None = None,
        layout: Literal["auto"] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        degrees = dict(dp=dp, pp=pp, ep=ep, cp=cp, tp=tp)
        if layout not in (None, "auto"):
            raise ValueError(f"layout={layout!r} is unknown; use 'auto' or give the degrees")
        if layout == "auto":
            chosen = dict(zero=zero, schedule=schedule, virtual_stages=virtual_stages)
            auto.check_auto_arguments({**degrees, **chosen, "num_microbatches": num_microbatches})
        self.options = TrainOptions(
            schedule=schedule,
            num_microbatches=num_microbatches,
            microbatch_size=microbatch_size,
            bucket_cap_mb=bucket_cap_mb,
            reducer=reducer,
            gradient_clip_norm=gradient_clip_norm,
            timeout_minutes=timeout_minutes,
            on_nonfinite=on_nonfinite,
            start_method=start_method,
            zero=zero,
            virtual_stages=virtual_stages,
            stage_layers=stage_layers,
        )
        self.layout = Layout(degrees, auto=layout == "auto")
        if schedule in V_SHAPED:  # pp is known here: say now, not on the ranks, what zbv needs
            check_microbatches(schedule, num_microbatches or pp, pp, virtual_stages)
        self._process_group_backend = process_group_backend
        self.checkpoints = ShardedCheckpoints(tuple(allow_config_change or ()))
        self.preemption = preemption.Preemption()
        self._num_nodes = 1
        self._groups: ProcessGroups | None = None
        self._engine: Engine | None = None
        self._setup_phase = SetupPhase()
        self._peers: list[tuple[str, int]] | None = None  # hosts and pids, for failure reports
        # pending: a backward ran, its grads not finished yet; skipped: updates dropped by "skip"
        self._grads_pending, self.skipped_steps = False, 0

    # -- layout, Lightning plumbing, setup ------------------------------------------------------
    @property
    def parallel_dims(self) -> ParallelDims:
        return self.layout.dims

    @property
    def groups(self) -> ProcessGroups:
        if self._groups is None:
            raise RuntimeError("process groups exist only after setup_environment()")
        return self._groups

    @property
    def module(self) -> pl.LightningModule:
        """The LightningModule being run (Lightning connects it before any hook here runs)."""
        if self.lightning_module is None:
            raise RuntimeError("TitanStrategy has no LightningModule: pass one to trainer.fit()")
        return self.lightning_module

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the engine exists only after the strategy's setup()")
        return self._engine

    def preflight(self, module: Any, datamodule: Any, trainer: Any = None) -> None:
        """The checks that need no process group, in the launcher and on every rank before it (with
        ``layout="auto"`` on a rank: once the layout is agreed)."""
        if self.layout.waiting:  # the launcher: choose here, fail early
            self._use_layout(auto.choose_for(self, module, datamodule))
        preflight(self.parallel_dims, self.options, module, datamodule, trainer)

    def _use_layout(self, choice: auto.Choice) -> None:
        """``layout="auto"``: take the chosen degrees and step options, as if they had been given."""
        self.layout.take(choice)
        self.options = choice.applied_to(self.options)
        self.set_world_ranks()

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None  # set by the accelerator connector
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # the accelerator connector reads this: without it sync_dist and the sampler are silently off
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of one pipeline reads the same shard
        return {"num_replicas": self.parallel_dims.data_world, "rank": self.parallel_dims.data_rank}

    def set_world_ranks(self) -> None:
        """Runs when the Trainer is built: check the layout against the world before anything launches."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
            check_launched_world(self.cluster_environment, self.num_processes, self.num_nodes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        check_precision(self.precision_plugin)
        # with layout="auto", once chosen (preflight, or setup_environment's agreement)
        self.layout.resolve(self.num_nodes * self.num_processes, self.global_rank)

    @override
    def _configure_launcher(self) -> None:
        self._launcher = launcher_for(self, self.options.start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        trainer = getattr(self.lightning_module, "_trainer", None)
        datamodule = getattr(trainer, "datamodule", None)
        if not self.layout.auto:
            self.preflight(self.lightning_module, datamodule, trainer)
        assert self.cluster_environment is not None  # set by the accelerator connector
        env, o = self.cluster_environment, self.options
        connect(env, self.root_device, self._process_group_backend, o, self.num_processes)
        if (
            self.layout.auto
        ):  # rank 0's choice (its CPU probe may differ from the others'), or its error
            self._use_layout(
                auto.agree(self.layout.choice, self, self.lightning_module, datamodule)
            )
            self.preflight(self.lightning_module, datamodule, trainer)
        self._setup_phase.start()
        timeout = timedelta(minutes=self.options.timeout_minutes)
        self._groups = build_process_groups(self.parallel_dims, timeout, self.root_device.type)
        self._peers = supervisor.gather_peers()
        self.options = self.options.resolved(
            self.module, trainer, self.parallel_dims, self.root_device
        )

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self._setup_phase.end()  # a rank that failed in configure_model is heard before any broadcast
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._engine is not None:
            self._engine.remove()
        self._engine = Engine(
            self.module, self.parallel_dims, self.groups, **self.options.engine_args
        )
        self._engine.broadcast_replicated()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            self._engine.shard_optimizers(self.optimizers)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.checkpoints.claim(self.module.trainer, self.global_rank)
        # after Lightning registered its signal handlers (Trainer._run)
        preemption.install(self.world_size)

    # -- the end of a step: reduce, check, clip ----------------------------------------------------------
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # automatic optimization with accumulate_grad_batches > 1 calls this on the non-final batches
        self.engine.set_grad_sync(False)
        try:
            yield
        finally:
            self.engine.set_grad_sync(True)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        self._grads_pending = True
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def finish_gradients(self, step: StepLoss | None = None) -> GradStats:
        """Wait for the reducers, check for non-finite values, clip by the composed global norm.

        ``step``: the step's global loss (``engine.forward_backward``), read with the norm and the
        ranks' agreement on a SIGTERM (``preemption``) in one host sync. A non-finite norm or loss
        raises FloatingPointError on every rank, or with ``on_nonfinite="skip"`` drops every gradient
        so that the optimizer step changes nothing (``GradStats.finite`` is then False)."""
        stop = preemption.start_agreement(self.root_device)  # on SIGTERM, over the world
        norm = self.engine.finish_gradients(self.options.gradient_clip_norm)
        self._grads_pending = False
        module, action = self.module, self.options.on_nonfinite
        given = [] if step is None else [step.loss, step.aux, step.dropped]
        *values, stopping = torch.stack([t.double() for t in [norm, *given, stop()]]).tolist()
        self.preemption.decide(stopping, module.trainer)
        finite = check_finite(
            module, self.parallel_dims, module.trainer.global_step, values[:2], action
        )
        self.skipped_steps += not finite
        self.engine.bind_shard_grads(drop=not finite)  # zero>0: after the clip and the skip
        return GradStats(values[0], finite, *values[1:])

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        if not self.module.automatic_optimization:
            # the module's training_step finishes the grads before and does the post-step work
            # after (TitanLM.training_step shows the order)
            if self._grads_pending:
                raise unreduced_step_error()
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # drop-in for DDP: Lightning's loop owns the step, so the strategy does what TitanLM names
        stats: list[GradStats] = []

        def closure_then_finish(user_closure: Callable[[], Any] = closure) -> Any:
            output = user_closure()  # the backward
            stats.append(self.finish_gradients())
            return output

        output = super().optimizer_step(optimizer, closure_then_finish, model, **kwargs)
        self.engine.gather_params()  # zero>0; the expert bias needs TitanLM's counted step
        self.engine.update_router_bias(None, skip=not stats[-1].finite)
        return output

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        faults.set_step(self.module.trainer.global_step)
        return super().training_step(*args, **kwargs)

    # -- collectives for Lightning's loops, callbacks and loggers; failing together -------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        if name == "run-stage":  # the Trainer's first call after it set its signal handlers
            preemption.stop_at_once_outside_fit(self.module.trainer, self.options.grace_s)
        self._setup_phase.barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._setup_phase.broadcast(obj, src, self.global_rank)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op)

    @override
    def on_exception(self, exception: BaseException) -> None:
        trainer, o = getattr(self.lightning_module, "_trainer", None), self.options
        if self.preemption.handles(
            exception, trainer, self.launcher, self.global_rank, self.world_size, o.grace_s
        ):
            return
        self._setup_phase.fail(exception)
        env = self.cluster_environment
        started = distributed() or (env is not None and env.creates_processes_externally)
        report_failure(
            exception,
            dims=self.parallel_dims if started else None,
            peers=self._peers,
            global_step=None if trainer is None else trainer.global_step,
            grace_s=o.grace_s,
        )

    # -- checkpoints: every rank writes and reads its own shards (checkpoint_hooks.py) -----------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage-local model and the optimizer must exist to load into

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already loaded it, resharded for this layout

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the shards are written by save_checkpoint; no full copy is gathered

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "TitanStrategy.save_checkpoint takes no storage_options (it writes DCP shards)"
            )
        path, dims = self.broadcast(str(filepath)), self.parallel_dims
        layout = {**dims.degrees, "schedule": self.options.schedule, "zero": self.options.zero}
        self.checkpoints.save(
            path, checkpoint, self.module, self.optimizers, layout, self._global_batch_size()
        )

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        return self.checkpoints.load(
            path, self.module, self.optimizers, self._global_batch_size(), weights_only
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        remove_checkpoint(filepath)

    def _global_batch_size(self) -> int | None:
        datamodule = getattr(self.module.trainer, "datamodule", None)
        return getattr(datamodule, "global_batch_size", None)

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.remove()
            self._engine = None
        super().teardown()


if TitanStrategy.strategy_name not in StrategyRegistry:  # a re-import must not raise
    StrategyRegistry.register(
        "titan", TitanStrategy, description="DP x PP x EP x CP x TP (lightning_titan)"
    )
