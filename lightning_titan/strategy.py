"""TitanStrategy: DP x PP x EP as a Lightning strategy.

trainer = L.Trainer(accelerator="cpu", devices=8,
                    strategy=TitanStrategy(dp=2, pp=2, ep=2, schedule="1f1b"))
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_titan import faults, supervisor
from lightning_titan.checkpoint import _agree, load_sharded, remove_checkpoint, save_sharded
from lightning_titan.engine import Engine
from lightning_titan.launch import cpu_threads_per_rank
from lightning_titan.parallel_dims import (
    ParallelDims,
    ProcessGroups,
    build_process_groups,
    resolve_degrees,
)
from lightning_titan.pipeline.schedules import SCHEDULES

START_METHODS = ("popen", "spawn", "fork", "forkserver")


class TitanStrategy(ParallelStrategy):
    """Data, pipeline and expert parallelism composed, for a stage-local model built in ``configure_model``.

    Args:
        dp: data-parallel replicas (-1: fill what pp and ep leave of the world).
        pp: pipeline stages; the model's layers split evenly across them.
        ep: expert-parallel ranks per stage; the experts split evenly across them.
        schedule: pipeline schedule, ``"1f1b"`` or ``"gpipe"``.
        num_microbatches: microbatches per step on every rank (default: ``pp``). Exclusive with
            ``microbatch_size``.
        microbatch_size: sequences per microbatch; the count follows from the per-rank batch.
        bucket_cap_mb: size of a gradient all-reduce bucket.
        reducer: ``"bucketed"`` (overlapped with backward) or ``"per_param"`` (one all-reduce per
            parameter; a baseline for benchmarks).
        gradient_clip_norm: clip the global gradient norm (composed over stages and expert shards) to this
            value; None disables clipping (the norm is still computed and logged).
        timeout_minutes: collective timeout; a rank that hangs brings the others down after this long
            (one that dies or raises does so within seconds).
        on_nonfinite: a NaN/inf loss or gradient norm ``"raise"`` s FloatingPointError on every rank
            (naming the step and the stages), or ``"skip"`` s that step's update (a warning says so).
        start_method: ``"popen"`` re-runs the script per rank; ``"fork"`` for notebooks.
        process_group_backend: default ``nccl`` on CUDA, ``gloo`` on CPU.
    """

    strategy_name = "titan"

    def __init__(
        self,
        dp: int = -1,
        pp: int = 1,
        ep: int = 1,
        schedule: Literal["1f1b", "gpipe"] = "1f1b",
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        bucket_cap_mb: float = 25.0,
        reducer: Literal["bucketed", "per_param"] = "bucketed",
        gradient_clip_norm: float | None = None,
        timeout_minutes: float = 30.0,
        on_nonfinite: Literal["raise", "skip"] = "raise",
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        process_group_backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_args(
            schedule=schedule, num_microbatches=num_microbatches, microbatch_size=microbatch_size,
            bucket_cap_mb=bucket_cap_mb, reducer=reducer, gradient_clip_norm=gradient_clip_norm,
            timeout_minutes=timeout_minutes, start_method=start_method, on_nonfinite=on_nonfinite,
        )  # fmt: skip
        self._degrees = (dp, pp, ep)
        resolve_degrees(
            dp, pp, ep, _product_or_fill(dp, pp, ep)
        )  # type/sign errors now, world size later
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.microbatch_size = microbatch_size
        self.bucket_cap_mb = bucket_cap_mb
        self.reducer_mode = reducer
        self.gradient_clip_norm = gradient_clip_norm
        self.timeout_minutes = timeout_minutes
        self.on_nonfinite = on_nonfinite
        self._start_method = start_method
        self._process_group_backend = process_group_backend
        self._num_nodes = 1
        self._dims: ParallelDims | None = None
        self._groups: ProcessGroups | None = None
        self._engine: Engine | None = None
        self.last_grad_norm: Tensor | None = None
        # the step's global loss, set by the module before optimizer.step(): checked with the grad norm
        self.step_loss: float | None = None
        self.skipped_steps = 0  # steps whose update on_nonfinite="skip" dropped
        # From the process group's start to the end of setup(), every collective of ours is an
        # agreement (one object gather), so a rank that fails there can join the one its peers wait in.
        self._setup_phase = False
        self._peers: list[tuple[str, int]] | None = None

    # -- layout ------------------------------------------------------------------------------------
    @property
    def parallel_dims(self) -> ParallelDims:
        if self._dims is None:
            raise RuntimeError("parallel_dims is known once the Trainer is built (set_world_ranks)")
        return self._dims

    @property
    def groups(self) -> ProcessGroups:
        if self._groups is None:
            raise RuntimeError("process groups exist only after setup_environment()")
        return self._groups

    def microbatches_for(self, local_batch: int) -> int:
        """How many microbatches a per-rank batch of ``local_batch`` sequences is split into."""
        if self.microbatch_size is not None:
            if local_batch % self.microbatch_size:
                raise ValueError(
                    f"the per-rank batch of {local_batch} sequences is not divisible by "
                    f"microbatch_size={self.microbatch_size}; choose a divisor of {local_batch}"
                )
            return local_batch // self.microbatch_size
        m = self.num_microbatches if self.num_microbatches is not None else self.parallel_dims.pp
        if local_batch % m:
            raise ValueError(
                f"the per-rank batch of {local_batch} sequences cannot be split into num_microbatches={m}; "
                f"choose a divisor of {local_batch} (per-rank batch = global batch / (dp*ep))"
            )
        return m

    def preflight(self, module: Any, datamodule: Any) -> None:
        """Checks that need the model and the data but no process group. They run in the launcher before
        any rank starts and again on every rank before ``init_process_group`` (torchrun, fork), so a
        mistake fails in seconds with the same message everywhere and no rank waits in a collective."""
        dims = self.parallel_dims
        check_layout = getattr(module, "check_layout", None)
        if callable(check_layout):
            check_layout(dims, datamodule)  # TitanLM: layers/experts split, data fits the model
        batch = getattr(datamodule, "global_batch_size", None)
        if isinstance(batch, int) and batch > 0:
            if batch % dims.data_world:
                raise ValueError(
                    f"global_batch_size={batch} is not divisible by the number of data ranks "
                    f"dp*ep={dims.dp}*{dims.ep}={dims.data_world}; choose a multiple of {dims.data_world}"
                )
            self.microbatches_for(batch // dims.data_world)

    @property
    def _grace_s(self) -> float:
        """How long a rank whose job failed may take to leave before it is killed."""
        return min(30.0, self.timeout_minutes * 60)

    # -- Lightning plumbing --------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
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
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        world = self.num_nodes * self.num_processes
        dp, pp, ep = resolve_degrees(*self._degrees, world)
        self._dims = ParallelDims(dp, pp, ep, self.global_rank)
        _check_precision(self.precision_plugin)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "popen":
            self._launcher = supervisor.TitanLauncher(
                self.preflight, self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self.root_device.type == "cpu":
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.num_processes))
            torch.set_num_threads(cpu_threads_per_rank(local_world))
        module = self.lightning_module
        self.preflight(module, getattr(getattr(module, "_trainer", None), "datamodule", None))
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        _init_dist_connection(
            self.cluster_environment, backend, timeout=timedelta(minutes=self.timeout_minutes),
            device_id=self.root_device if self.root_device.type == "cuda" else None,
        )  # fmt: skip
        self._setup_phase = True
        self._groups = build_process_groups(self.parallel_dims)
        self._peers = supervisor.gather_peers()
        supervisor.watch_launcher(self._grace_s)

    @override
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self._end_setup_phase()  # a rank that failed in configure_model is heard before any broadcast
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._build_engine()
        self._engine.broadcast_replicated()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _build_engine(self) -> None:
        if self._engine is not None:
            self._engine.remove()
        self._engine = Engine(
            self.lightning_module, self.parallel_dims, self.groups, schedule=self.schedule,
            bucket_cap_mb=self.bucket_cap_mb, reducer=self.reducer_mode,
        )  # fmt: skip

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the engine exists only after the strategy's setup()")
        return self._engine

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        # automatic optimization with accumulate_grad_batches > 1 calls this on the non-final batches
        self.engine.set_grad_sync(False)
        try:
            yield
        finally:
            self.engine.set_grad_sync(True)

    def finish_gradients(self) -> Tensor:
        """Wait for the reducers, then clip by the composed global norm. Returns the pre-clip norm.

        A non-finite norm or ``step_loss`` raises FloatingPointError, or with ``on_nonfinite="skip"``
        drops every gradient so the optimizer step changes nothing. Both numbers are the same on every
        rank, so every rank takes the same branch."""
        norm = self.engine.finish_gradients(self.gradient_clip_norm)
        self.last_grad_norm = norm
        loss, self.step_loss = self.step_loss, None
        if torch.isfinite(norm) and (loss is None or math.isfinite(loss)):
            return norm
        message = self._nonfinite_message(norm.item(), loss)
        if self.on_nonfinite == "raise":
            raise FloatingPointError(
                f"{message}; no optimizer step was taken. Lower the learning rate, set "
                "gradient_clip_norm, use precision='32-true' to find the cause, or "
                "TitanStrategy(on_nonfinite='skip') to skip such steps"
            )
        rank_zero_warn(f"{message}; this step's update is skipped (on_nonfinite='skip')")
        # the optimizer skips parameters without a grad: no update, no state change
        for p in self.lightning_module.parameters():
            p.grad = None
        self.skipped_steps += 1
        return norm

    def _nonfinite_message(self, norm: float, loss: float | None) -> str:
        """Where the non-finite values are: one gather of every rank's verdict on its own grads."""
        first_bad = next(
            (n for n, p in self.lightning_module.named_parameters()
             if p.grad is not None and not torch.isfinite(p.grad).all()),
            None,
        )  # fmt: skip
        dims = self.parallel_dims
        verdicts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, (dims.pp_rank, first_bad))
        bad = sorted({(pp, rank, name) for rank, (pp, name) in enumerate(verdicts) if name})
        parts = [f"non-finite values at step {self.lightning_module.trainer.global_step}"]
        if loss is not None and not math.isfinite(loss):
            parts.append(f"the loss is {loss} (computed on the last stage, pp_rank={dims.pp - 1})")
        parts.append(f"the gradient norm is {norm}")
        if bad:
            stages = sorted({pp for pp, _, _ in bad})
            # backward runs the last stage first: the latest stage with bad grads is the origin
            pp, rank, name = bad[-1]
            parts.append(
                f"non-finite gradients on stage(s) pp_rank={stages}, first (in backward order) on "
                f"stage {pp} (e.g. {name!r} on rank {rank})"
            )
        return "; ".join(parts) + f" (layout dp={dims.dp} pp={dims.pp} ep={dims.ep})"

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        def closure_then_reduce() -> Any:
            result = closure()  # backward (automatic optimization) or nothing (manual)
            self.finish_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        faults.set_step(self.lightning_module.trainer.global_step)
        return super().training_step(*args, **kwargs)

    # -- failures: on every rank, naming the rank (lightning_titan.supervisor) ---------------------------
    def _end_setup_phase(self) -> None:
        if self._setup_phase and _distributed_is_initialized():
            self._agree()
        self._setup_phase = False

    def _agree(self, error: BaseException | None = None, payload: Any = None) -> list[Any]:
        try:
            return _agree(error, payload)
        except BaseException:
            self._setup_phase = False  # agreed: the peers raise it too, nobody waits for another
            raise

    @override
    def on_exception(self, exception: BaseException) -> None:
        if self._setup_phase and _distributed_is_initialized():
            # the peers wait in one of our setup collectives (a barrier, a broadcast): all agreements
            try:
                self._agree(exception)
            except BaseException:  # noqa: BLE001 - this rank raises its own error below
                pass
        self._setup_phase = False
        env = self.cluster_environment
        if _distributed_is_initialized() or (env is not None and env.creates_processes_externally):
            dims, trainer = self.parallel_dims, getattr(self.lightning_module, "_trainer", None)
            where = f"dp={dims.dp_rank} pp={dims.pp_rank} ep={dims.ep_rank}"
            if trainer is not None:
                where += f", global_step={trainer.global_step}"
            who = f"rank {self.global_rank}/{self.world_size} ({where})"
        else:  # no rank started yet (popen), or the parent of fork/spawn ranks
            who = "the launcher"
        report = supervisor.failure_report(
            exception, who=who, rank=self.global_rank, peers=self._peers
        )
        supervisor.say(report)
        if _distributed_is_initialized():
            supervisor.leave_after_failure(self._grace_s)

    # -- checkpoints: sharded, under global names, loadable under any layout (lightning_titan.checkpoint) --
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

    def _layout(self) -> dict[str, Any]:
        dims = self.parallel_dims
        layout = {"dp": dims.dp, "pp": dims.pp, "ep": dims.ep, "schedule": self.schedule}
        datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
        if getattr(datamodule, "global_batch_size", None) is not None:
            layout["global_batch_size"] = datamodule.global_batch_size
        return layout

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "TitanStrategy.save_checkpoint does not take storage_options (it writes DCP shards)"
            )
        path = self.broadcast(str(filepath))
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_sharded(path, self.lightning_module, self.optimizers, meta, layout=self._layout())

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        expect = {k: v for k, v in self._layout().items() if k == "global_batch_size"}
        return load_sharded(path, self.lightning_module, self.optimizers, expect_layout=expect)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        remove_checkpoint(filepath)

    # -- collectives Lightning calls -----------------------------------------------------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        if self._setup_phase and _distributed_is_initialized():
            self._agree()
        elif _distributed_is_initialized():
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        if self._setup_phase:
            return self._agree(None, obj if self.global_rank == src else None)[src]
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(
        self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> Tensor:
        return _all_gather_ddp_if_available(tensor, group=group, sync_grads=sync_grads)

    @override
    def teardown(self) -> None:
        if self._engine is not None:
            self._engine.remove()
            self._engine = None
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="DP x PP x EP (lightning_titan)"
        )


def _product_or_fill(dp: int, pp: int, ep: int) -> int:
    """A world size that makes the given degrees consistent, only to type-check them early."""
    product = 1
    for value in (dp, pp, ep):
        if isinstance(value, int) and value > 0:
            product *= value
    return product


def _check_args(
    *,
    schedule,
    num_microbatches,
    microbatch_size,
    bucket_cap_mb,
    reducer,
    gradient_clip_norm,
    timeout_minutes,
    start_method,
    on_nonfinite,
) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; choose one of {sorted(SCHEDULES)}")
    if num_microbatches is not None and microbatch_size is not None:
        raise ValueError(
            f"num_microbatches={num_microbatches} and microbatch_size={microbatch_size} are both set; set one"
        )
    for name, value in (
        ("num_microbatches", num_microbatches),
        ("microbatch_size", microbatch_size),
    ):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} must be a positive int (or None)")
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be > 0 (25 is a good default)")
    if reducer not in ("bucketed", "per_param"):
        raise ValueError(f"reducer={reducer!r} is unknown; choose 'bucketed' or 'per_param'")
    if gradient_clip_norm is not None and not gradient_clip_norm > 0:
        raise ValueError(
            f"gradient_clip_norm={gradient_clip_norm!r} must be > 0, or None to disable clipping"
        )
    if not timeout_minutes > 0:
        raise ValueError(f"timeout_minutes={timeout_minutes!r} must be > 0")
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite={on_nonfinite!r} is unknown; choose 'raise' or 'skip'")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is unknown; choose one of {START_METHODS}")


def _check_precision(plugin: Any) -> None:
    precision = getattr(plugin, "precision", "32-true")
    if precision == "16-mixed":
        raise ValueError(
            "precision='16-mixed' is not supported by TitanStrategy: its GradScaler would scale the activation "
            "grads that stages send each other and unscale after our clipping. Use precision='bf16-mixed' "
            "(or '32-true')"
        )
    if precision not in ("32-true", "bf16-mixed"):
        raise ValueError(
            f"precision={precision!r} is not supported by TitanStrategy; use '32-true' or 'bf16-mixed'"
        )
