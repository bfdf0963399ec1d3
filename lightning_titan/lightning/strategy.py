"""TitanStrategy: DP x PP x EP x CP x TP, Lightning glue over the engine and the objects it owns."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from typing_extensions import override

from lightning_titan.data.checks import TooLittleData
from lightning_titan.lightning import preemption, supervisor
from lightning_titan.lightning.connect import connect
from lightning_titan.lightning.failures import report_failure, unreduced_step_error
from lightning_titan.lightning.launchers import launcher_for
from lightning_titan.lightning.layout import Layout
from lightning_titan.lightning.run_folders import resume_line
from lightning_titan.lightning.sharded_strategy import ShardedStrategy
from lightning_titan.lightning.workload import hardware, workload
from lightning_titan.parallel.dp.zero import ZeroShards
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups, build_process_groups
from lightning_titan.plan import auto
from lightning_titan.runtime import faults
from lightning_titan.runtime.agreement import SetupPhase
from lightning_titan.train.engine import Engine
from lightning_titan.train.options import (
    Schedule,
    TrainOptions,
    check_precision,
    preflight,
)
from lightning_titan.train.step import TrainStep


def check_param_precision(param_dtype: str, plugin: Any) -> None:
    """bf16 weights need bf16 autocast: an fp32 matmul cannot read a bf16 weight (and a 16-bit
    true precision would make the masters bf16 too)."""
    precision = str(getattr(plugin, "precision", ""))
    if param_dtype == "bf16" and precision != "bf16-mixed":
        raise ValueError(
            f"param_dtype='bf16' keeps the weights in bf16, which precision={precision!r} cannot "
            "multiply with its activations; use --trainer.precision=bf16-mixed, or param_dtype='fp32'"
        )


class TitanStrategy(ShardedStrategy):
    """DP, PP, EP, CP and TP composed, for a stage-local model built in ``configure_model``.

    Args:
        dp: data-parallel replicas (-1: fill what the other degrees leave of the world).
        pp: pipeline stages; the model's layers split evenly across them (or as ``stage_layers`` says).
        ep: expert-parallel ranks per stage; the experts split evenly across them.
        tp: tensor-parallel ranks (with sequence parallelism): heads, vocabulary and sequence split.
        cp: context-parallel ranks: each sequence's positions split (load-balanced causal chunks).
        fold_ep: MoE Parallel Folding: the experts split over the ep x cp x tp ranks of a stage, not
            only its ep ranks (attention keeps tp and cp; each of those ranks sends its own tokens to
            the experts); ep=2, tp=2 is then expert parallelism over 4 ranks, and n_experts must be
            a multiple of ep*cp*tp. Not with zero=3 yet; layout="auto" folds where its plan does.
        schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``, ``"zb_h1"`` (zero-bubble 1F1B),
            ``"zbv"`` (the V: rank r holds virtual stages r and 2*pp-1-r), ``"1f1b_overlap"`` (pp=1)
            or ``"dualpipev"`` (the V), the last two hiding the EP all-to-alls (docs/concepts.md).
        virtual_stages: chunks per rank: >= 2 for interleaved 1F1B (round-robin), 2 for the V (None).
        stage_layers: layers per (virtual) stage, e.g. ``[3, 1]``, or ``"auto"`` (probed); None: even.
        num_microbatches: per step on every rank (default: ``pp``; 1f1b_overlap 2, dualpipev 2*pp).
        microbatch_size: sequences per microbatch, instead of ``num_microbatches``.
        bucket_cap_mb: size of a gradient all-reduce bucket.
        reducer: ``"bucketed"`` (overlapped with backward) or ``"per_param"`` (a benchmark baseline).
        zero: 1 splits each parameter's optimizer state over its data-parallel group (ZeRO-1), 2 also its grads,
            3 also the parameters between steps (at pp=1 under gpipe or 1f1b each block is gathered
            for its forward and again for its backward; under a pipeline or another schedule the
            stage is gathered once a step and kept whole until its grads are reduced).
        param_dtype: ``"bf16"`` stores the trainable weights in bf16 (what forward and backward
            read) and steps fp32 master copies of them, reducing the grads in fp32; checkpoints hold
            the fp32 masters. Needs ``--trainer.precision=bf16-mixed``; any zero level (zero=3
            gathers the weights in bf16 from each rank's fp32 master rows).
        offload_optimizer: keep the optimizer state (AdamW's moments) and the fp32 masters in host
            memory (pinned on CUDA) and run the optimizer step on the CPU; grads go to the host
            and the updated weights come back each step. Checkpoints are the same as without it.
            zero 0, 1 or 2.
        gradient_clip_norm: clip the whole model's gradient norm to this (None: only measure and log it).
        timeout_minutes: how long a hung rank can hold the others (a dead one stops them in seconds);
            also bounds a wait for an ``async_save`` write and that write's collectives.
        on_nonfinite: a NaN/inf loss or gradient norm ``"raise"`` s FloatingPointError on every rank
            (naming the step and the stages), or ``"skip"`` s that step's update (a warning says so).
        start_method: ``"popen"`` re-runs the script per rank; ``"fork"`` for notebooks.
        max_restarts: times to restart every rank from the newest complete checkpoint if one dies.
        process_group_backend: ``nccl`` on CUDA, ``gloo`` on CPU by default.
        allow_config_change: model-config fields a resume may change (others must match).
        async_save: write the checkpoints saved in training in the background (from a host copy).
        layout: ``"auto"``: the layout and step options ``titan plan`` ranks first for this model,
            world, global batch and device (``plan/auto.py``), said on rank 0; leave the degrees,
            ``zero``, ``schedule``, ``virtual_stages`` and ``num_microbatches`` out.
    """

    strategy_name = "titan"

    def __init__(
        self,
        dp: int = -1,
        pp: int = 1,
        ep: int = 1,
        tp: int = 1,
        cp: int = 1,
        fold_ep: bool = False,
        schedule: Schedule = "1f1b",
        virtual_stages: int | None = None,
        stage_layers: list[int] | Literal["auto"] | None = None,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        bucket_cap_mb: float = 25.0,
        reducer: Literal["bucketed", "per_param"] = "bucketed",
        zero: Literal[0, 1, 2, 3] = 0,
        param_dtype: Literal["fp32", "bf16"] = "fp32",
        offload_optimizer: bool = False,
        gradient_clip_norm: float | None = None,
        timeout_minutes: float = 30.0,
        on_nonfinite: Literal["raise", "skip"] = "raise",
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        max_restarts: int = 0,
        process_group_backend: str | None = None,
        allow_config_change: list[str] | None = None,
        async_save: bool = False,
        layout: Literal["auto"] | None = None,
        **kwargs: Any,
    ) -> None:
        options = TrainOptions(
            schedule=schedule,
            num_microbatches=num_microbatches,
            microbatch_size=microbatch_size,
            bucket_cap_mb=bucket_cap_mb,
            reducer=reducer,
            gradient_clip_norm=gradient_clip_norm,
            timeout_minutes=timeout_minutes,
            on_nonfinite=on_nonfinite,
            start_method=start_method,
            max_restarts=max_restarts,
            zero=zero,
            param_dtype=param_dtype,
            offload_optimizer=offload_optimizer,
            virtual_stages=TrainOptions.chunks_for(schedule, virtual_stages),
            stage_layers=stage_layers,
        )  # checked first: a bad timeout_minutes is named before it becomes a timedelta
        # a background save's waits and collectives are bounded as a synchronous save's are
        save_timeout = timedelta(minutes=options.timeout_minutes)
        super().__init__(allow_config_change, async_save, save_timeout, **kwargs)
        self.options = options
        degrees = dict(dp=dp, pp=pp, ep=ep, cp=cp, tp=tp)
        self.layout = Layout(degrees, layout, self.options, fold_ep=fold_ep)
        self._process_group_backend = process_group_backend
        self.preemption = preemption.Preemption()
        self._groups: ProcessGroups | None = None
        self._engine: Engine | None = None
        self._train_step: TrainStep | None = None
        self._setup_phase = SetupPhase()
        self._peers: list[tuple[str, int]] | None = None  # hosts and pids, for failure reports

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
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the engine exists only after the strategy's setup()")
        return self._engine

    @override
    def whole_params(self) -> AbstractContextManager[None]:
        # zero=3: gathered for a save or a load (before setup the parameters are whole)
        return nullcontext() if self._engine is None else self._engine.whole_params()

    @property
    def train_step(self) -> TrainStep:
        """The training step (``train/step.py``) of the module's one optimizer and LR scheduler,
        with this strategy's clipping, non-finite policy and preemption; built on first use in fit.
        Under automatic optimization Lightning steps the scheduler itself, and the step leaves it."""
        if self._train_step is None:
            o = self.options
            optimizer: Any = self.optimizers[0]  # Lightning steps its scheduler (automatic)
            scheduler: LRScheduler | None = None
            if not self.module.automatic_optimization:
                optimizer, scheduler = self._stepped_by_the_module()
            self._train_step = TrainStep(
                self.engine, optimizer, scheduler, max_norm=o.gradient_clip_norm,
                on_nonfinite=o.on_nonfinite, stop=self.preemption,
            )  # fmt: skip
        return self._train_step

    @property
    def skipped_steps(self) -> int:
        """Updates dropped by ``on_nonfinite="skip"`` in this fit."""
        return 0 if self._train_step is None else self._train_step.skipped

    def _stepped_by_the_module(self) -> tuple[LightningOptimizer, LRScheduler | None]:
        """Manual optimization: the module's one optimizer (Lightning's wrapper: its ``step``
        counts ``global_step``) and LR scheduler, if any."""
        optimizer, scheduler = self.module.optimizers(), self.module.lr_schedulers()
        if not isinstance(optimizer, LightningOptimizer) or isinstance(scheduler, list):
            raise TypeError(
                "TitanStrategy's training step takes one optimizer and at most one LR scheduler; "
                f"configure_optimizers gave {len(self.optimizers)} optimizers: return one (with "
                "an optional lr_scheduler)"
            )
        if isinstance(scheduler, ReduceLROnPlateau):  # its step() needs a metric
            raise TypeError(
                "TitanStrategy's training step steps the LR scheduler after every optimizer step; "
                "ReduceLROnPlateau needs a metric: step it yourself in a hook, and return no "
                "lr_scheduler from configure_optimizers"
            )
        return optimizer, scheduler

    def preflight(self, module: Any, datamodule: Any, trainer: Any = None) -> None:
        """The checks that need no process group, in the launcher and on every rank before it (with
        ``layout="auto"`` on a rank: once the layout is agreed)."""
        work = workload(module, datamodule, trainer)
        if self.layout.waiting:  # the launcher: choose here, fail early
            self._use_layout(auto.choose_for(work, hardware(self)))
        preflight(self.parallel_dims, self.options, work)

    def _use_layout(self, choice: auto.Choice) -> None:
        """``layout="auto"``: take the chosen degrees and step options, as if they had been given."""
        self.layout.take(choice)
        self.options = choice.applied_to(self.options)
        self.set_world_ranks()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every stage of one pipeline reads the same shard
        return {"num_replicas": self.parallel_dims.data_world, "rank": self.parallel_dims.data_rank}

    def set_world_ranks(self) -> None:
        """Runs when the Trainer is built: check the layout against the world before anything launches."""
        super().set_world_ranks()
        check_precision(self.precision_plugin.precision)
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
        module, trainer = self.lightning_module, getattr(self.lightning_module, "_trainer", None)
        datamodule = getattr(trainer, "datamodule", None)
        if not self.layout.auto:
            self.preflight(module, datamodule, trainer)
        assert self.cluster_environment is not None  # set by the accelerator connector
        env, o = self.cluster_environment, self.options
        connect(env, self.root_device, self._process_group_backend, o, self.num_processes)
        if self.layout.auto:  # rank 0's choice (its CPU probe may differ), or its error
            work = workload(module, datamodule, trainer)
            self._use_layout(auto.agree(self.layout.choice, work, hardware(self)))
            self.preflight(module, datamodule, trainer)
        self._setup_phase.start()
        timeout = timedelta(minutes=self.options.timeout_minutes)
        self._groups = build_process_groups(self.parallel_dims, timeout, self.root_device.type)
        self._peers = supervisor.watch_peers(self.num_nodes, trainer, o.grace_s)
        dims, device = self.parallel_dims, self.root_device
        self.options = self.options.resolved(
            workload(self.module, datamodule, trainer), dims, device
        )

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self._setup_phase.end()  # a rank that failed in configure_model is heard before any broadcast
        self.accelerator.setup(trainer)
        check_param_precision(self.options.param_dtype, self.precision_plugin)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self._engine is not None:
            self._engine.remove()
        self._train_step = None  # of the engine and the optimizers built here
        self._engine = Engine(
            self.module, self.parallel_dims, self.groups, **self.options.engine_args
        )
        self._engine.broadcast_replicated()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            self._engine.shard_optimizers(self.optimizers)
            # the checkpoints' keys (and bf16 weights' fp32 masters, saved as the weights)
            self.zero_shards = ZeroShards(
                self._engine.zero_groups, self._engine.masters, self._engine.offload
            )
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # claims the checkpoint directories
        line = resume_line(self.module.trainer) if self.global_rank == 0 else None
        if line:
            supervisor.say(line)
        # after Lightning registered its signal handlers (Trainer._run)
        self.preemption.install(self.module.trainer, self.world_size)

    # -- the training step (train/step.py) under manual and automatic optimization --------------------
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # automatic optimization with accumulate_grad_batches > 1 calls this on the non-final batches
        with self.engine.no_sync():
            yield

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        if not self.module.automatic_optimization:
            # the module's step (TitanLM.training_step: self.train_step.run) finished the grads
            # before: refuse an update by grads a backward left unreduced since
            def closure_then_check() -> Any:
                output = closure()
                if self.engine.unfinished:
                    raise unreduced_step_error()
                return output

            return super().optimizer_step(optimizer, closure_then_check, model, **kwargs)

        # drop-in for DDP: Lightning's loop runs the backward (its closure) and steps the scheduler;
        # the training step runs around them
        def lightning_backward() -> None:
            closure()  # zero_grad, the module's training_step, its backward

        def update(finishing: Callable[[], None]) -> Any:
            return super(TitanStrategy, self).optimizer_step(optimizer, finishing, model, **kwargs)

        index = self.module.trainer.global_step
        return self.train_step.update(lightning_backward, update, index=index)

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
    def on_exception(self, exception: BaseException) -> None:
        trainer, grace_s = getattr(self.lightning_module, "_trainer", None), self.options.grace_s
        if self.preemption.handles(exception, trainer, self, grace_s):
            return
        self._setup_phase.fail(exception)
        if isinstance(exception, TooLittleData):
            return  # found alike on every rank: the command's one line (cli.main), no rank report
        env, peers = self.cluster_environment, self._peers
        # a stop asked for (SIGTERM) that a failure overtook, e.g. a peer stalled in a background
        # save: the exit code still says "terminated", and a restarting launcher does not restart
        signum = self.preemption.requested()
        code = 128 + signum if signum else 1
        report_failure(
            exception, self.layout, env, trainer=trainer, peers=peers, grace_s=grace_s, code=code
        )

    def checkpoint_layout(self) -> dict[str, Any]:
        o = self.options
        return {**self.parallel_dims.degrees, "schedule": o.schedule, "zero": o.zero}

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            trainer = getattr(self.lightning_module, "_trainer", None)
            failed = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
            self._engine.remove(whole=not failed)  # zero=3: the model whole again after fit
            self._engine = None
        super().teardown()


if TitanStrategy.strategy_name not in StrategyRegistry:  # a re-import must not raise
    StrategyRegistry.register("titan", TitanStrategy, description="DP x PP x EP x CP x TP")
