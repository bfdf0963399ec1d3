"""The strategy's training options, validated once, where they are given.

The reducer, the clipping and the schedules trust these values; a wrong one fails at
``TitanStrategy(...)`` with a message that names it and says what would be right.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from lightning_titan.model.config import FULL, ModelConfig
from lightning_titan.parallel.batching import (
    check_microbatch_args,
    local_batch_size,
    num_microbatches,
)
from lightning_titan.parallel.dp.master import parameter_dtype
from lightning_titan.parallel.dp.zero import LEVELS as ZERO_LEVELS
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.schedules import (
    CHUNKED,
    OVERLAPPED,
    SCHEDULES,
    V_SHAPED,
    check_microbatches,
    default_microbatches,
)
from lightning_titan.parallel.pipeline.split import AUTO, StageSplit
from lightning_titan.train import auto_split

# the names of parallel/pipeline/schedules.py's SCHEDULES, for the CLI's help and type checks
Schedule = Literal["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zbv", "1f1b_overlap", "dualpipev"]
REDUCERS = ("bucketed", "per_param")
ON_NONFINITE = ("raise", "skip")
START_METHODS = ("popen", "spawn", "fork", "forkserver")
PRECISIONS = ("32-true", "bf16-mixed")


def _choose(values: Any) -> str:
    names = [repr(v) for v in values]
    return (
        f"choose {' or '.join(names)}" if len(names) == 2 else f"choose one of {', '.join(names)}"
    )


def _positive(value: Any) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


@dataclass(frozen=True)
class Workload:
    """What the options are checked and resolved against: plain values the Lightning glue reads off
    the LightningModule, the data module and the Trainer (``lightning/workload.py``)."""

    config: ModelConfig | None = None  # the model's (TitanLM's); None for a module without one
    compiled: bool = False  # the module compiles its stage (TitanLM(compile=True))
    global_batch_size: int | None = None  # the data module's, where it has one
    trainer_clip: float | None = None  # Trainer(gradient_clip_val=...), Lightning's own clipping
    # the module's own check that it splits over the layout and its data fits it (TitanLM's)
    check_layout: Callable[[ParallelDims, StageSplit], None] | None = None

    @property
    def recompute(self) -> bool:
        """The model recomputes whole blocks in the backward (``activation_checkpointing="full"``);
        selective recompute runs no block, collective or routing again, so it is not counted."""
        return self.config is not None and self.config.recompute == FULL


@dataclass(frozen=True)
class TrainOptions:
    """Everything about a step that is not the layout (see ``TitanStrategy`` for each meaning)."""

    schedule: str = "1f1b"
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    bucket_cap_mb: float = 25.0
    reducer: str = "bucketed"
    gradient_clip_norm: float | None = None
    timeout_minutes: float = 30.0
    on_nonfinite: str = "raise"
    start_method: str = "popen"
    max_restarts: int = 0
    zero: int = 0
    param_dtype: str = "fp32"
    offload_optimizer: bool = False
    virtual_stages: int = 1
    stage_layers: Sequence[int] | str | None = None  # a tuple once validated, or "auto"

    @staticmethod
    def chunks_for(schedule: str, virtual_stages: int | None) -> int:
        """``virtual_stages`` as given, or when None the schedule's own: zbv's V needs two chunks."""
        if virtual_stages is not None:
            return virtual_stages
        return 2 if schedule in V_SHAPED else 1

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is unknown; {_choose(sorted(SCHEDULES))}")
        split = StageSplit(self.virtual_stages, self.stage_layers)  # types and signs
        object.__setattr__(self, "stage_layers", split.stage_layers)
        if self.schedule in V_SHAPED and self.virtual_stages != 2:
            raise ValueError(
                f"schedule={self.schedule!r} places exactly two chunks on every rank (the V): "
                f"virtual_stages={self.virtual_stages} does not work; use "
                f"TitanStrategy(schedule={self.schedule!r}, virtual_stages=2)"
            )
        if self.schedule in CHUNKED and self.virtual_stages < 2:
            raise ValueError(
                f"schedule={self.schedule!r} needs virtual_stages >= 2 (model chunks per rank), "
                f"got {self.virtual_stages}; e.g. TitanStrategy(schedule={self.schedule!r}, "
                "virtual_stages=2)"
            )
        if self.virtual_stages > 1 and self.schedule not in {**CHUNKED, **V_SHAPED}:
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs a schedule over several chunks per "
                f"rank, not schedule={self.schedule!r}; {_choose(sorted({**CHUNKED, **V_SHAPED}))} "
                "(or virtual_stages=1)"
            )
        check_microbatch_args(self.num_microbatches, self.microbatch_size)
        if not _positive(self.bucket_cap_mb):
            raise ValueError(
                f"bucket_cap_mb={self.bucket_cap_mb!r} must be > 0 MiB "
                "(25 is a good default; a tiny value gives one parameter per bucket)"
            )
        if self.reducer not in REDUCERS:
            raise ValueError(f"reducer={self.reducer!r} is unknown; {_choose(REDUCERS)}")
        if self.gradient_clip_norm is not None and not _positive(self.gradient_clip_norm):
            raise ValueError(
                f"gradient_clip_norm={self.gradient_clip_norm!r} must be > 0, or None to disable "
                "clipping"
            )
        if not _positive(self.timeout_minutes):
            raise ValueError(f"timeout_minutes={self.timeout_minutes!r} must be > 0")
        if self.on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"on_nonfinite={self.on_nonfinite!r} is unknown; {_choose(ON_NONFINITE)}"
            )
        if self.zero not in ZERO_LEVELS or isinstance(self.zero, bool):
            raise ValueError(
                f"zero={self.zero!r} is not a ZeRO level; choose 0 (every replica holds the whole "
                "optimizer state), 1 (each data-parallel group splits it), 2 (and the gradients) "
                "or 3 (and the parameters)"
            )
        if self.zero >= 2 and self.reducer != "bucketed":
            raise ValueError(
                f"zero={self.zero} reduce-scatters flat gradient buckets; reducer={self.reducer!r} "
                f"has none: use reducer='bucketed' with zero={self.zero}"
            )
        parameter_dtype(self.param_dtype)
        if self.param_dtype != "fp32" and self.reducer != "bucketed":
            raise ValueError(
                f"param_dtype={self.param_dtype!r} needs reducer='bucketed' (got "
                f"reducer={self.reducer!r}): its grads are reduced in fp32 buckets; or use "
                "param_dtype='fp32'"
            )
        check_offload(self.offload_optimizer, self.zero)
        if self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method={self.start_method!r} is unknown; {_choose(START_METHODS)}"
            )
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts!r} must be an int >= 0 (0: none)")
        if self.max_restarts and self.start_method != "popen":
            raise ValueError(
                f"max_restarts={self.max_restarts} restarts ranks the popen launcher starts, not "
                f"start_method={self.start_method!r}'s: use start_method='popen' (or torchrun "
                "--max-restarts)"
            )

    def microbatches(self, local_batch: int, *, pp: int) -> int:
        """How many microbatches a per-rank batch of ``local_batch`` sequences is split into."""
        m = num_microbatches(
            local_batch,
            num_microbatches=self.num_microbatches,
            microbatch_size=self.microbatch_size,
            pp=default_microbatches(self.schedule, pp),
        )
        check_microbatches(self.schedule, m, pp, self.virtual_stages)
        return m

    @property
    def engine_args(self) -> dict[str, Any]:
        """The options ``train.engine.Engine`` takes, by name."""
        return {
            "schedule": self.schedule,
            "bucket_cap_mb": self.bucket_cap_mb,
            "reducer": self.reducer,
            "zero": self.zero,
            "param_dtype": self.param_dtype,
            "offload_optimizer": self.offload_optimizer,
        }

    def resolved(self, work: Workload, dims: ParallelDims, device: torch.device) -> TrainOptions:
        """With ``stage_layers="auto"``: the counts probed on global rank 0 and broadcast (the same on
        every rank, before any rank builds its stage; rank 0 says what it chose). Else ``self``."""
        if self.stage_layers != AUTO:
            return self
        # the probe times the step's microbatch, where the batch is known
        batch = work.global_batch_size
        local = batch // dims.data_world if batch is not None and batch >= dims.data_world else 1
        microbatch = max(1, local // self.microbatches(local, pp=dims.pp))
        counts = auto_split.resolve(work.config, dims, self.virtual_stages, microbatch, device)
        return replace(self, stage_layers=counts)

    @property
    def split(self) -> StageSplit:
        """How the layers are cut over the pipeline's ranks and their chunks (zbv: in a V)."""
        return StageSplit(self.virtual_stages, self.stage_layers, v_shape=self.schedule in V_SHAPED)

    @property
    def grace_s(self) -> float:
        """How long a rank whose job failed may take to leave before it is killed."""
        return min(30.0, self.timeout_minutes * 60)


def check_offload(offload_optimizer: object, zero: int) -> None:
    """``offload_optimizer``: a bool, and zero 0, 1 or 2 (zero=3's rows are gathered around each
    block's use, which the host copies are not wired into)."""
    if not isinstance(offload_optimizer, bool):
        raise ValueError(f"offload_optimizer={offload_optimizer!r} must be True or False")
    if offload_optimizer and zero == 3:
        raise ValueError(
            "offload_optimizer=True with zero=3 is not built (its rows are gathered around each "
            "block's use); use zero=2 with it (the optimizer state and grads split as well), or "
            "offload_optimizer=False"
        )


def check_fold(fold_ep: object, zero: int) -> None:
    """``fold_ep`` (MoE Parallel Folding, ``parallel/mesh.py``): a bool, and zero 0, 1 or 2 (the
    planner refuses what the strategy refuses by this same rule)."""
    if not isinstance(fold_ep, bool):
        raise ValueError(f"fold_ep={fold_ep!r} must be true or false")
    if fold_ep and zero == 3:
        raise ValueError(
            "fold_ep=True with zero=3 is not built yet (its gathers are untested over the folded "
            "expert groups); use zero 0, 1 or 2 with fold_ep, or fold_ep=False"
        )


def preflight(dims: ParallelDims, options: TrainOptions, work: Workload) -> None:
    """Checks that need the model and the data but no process group. They run in the launcher before
    any rank starts and again on every rank before ``init_process_group`` (torchrun, fork), so a
    mistake fails in seconds with the same message everywhere and no rank waits in a collective."""
    check_trainer_clipping(dims, options, work.trainer_clip)
    check_overlap(dims, options, recompute=work.recompute, compiled=work.compiled)
    if work.check_layout is not None:  # TitanLM: layers/experts split, data fits the model
        work.check_layout(dims, options.split)
    batch = work.global_batch_size
    if batch is not None and batch > 0:
        local = local_batch_size(batch, dims.data_world, f"dp*ep={dims.dp}*{dims.ep}")
        options.microbatches(local, pp=dims.pp)


# the schedules under which zero=3 frees each block after its forward (one stage, its microbatches
# one after another); under the others the stage is kept whole for the step
ZERO3_PER_BLOCK_SCHEDULES = ("gpipe", "1f1b")


def zero3_reshards_after_forward(pp: int, schedule: str) -> bool:
    """zero=3's choice (``parallel/dp/zero3.py``): each block gathered for its forward and again for
    its backward where one stage runs its microbatches one at a time (pp=1 under gpipe or 1f1b);
    under a pipeline, an overlapped or a split-backward schedule, the stage gathered once a step and
    kept whole until its grads are reduced (as FSDP2 does under pipeline parallelism: a stage's
    microbatches would otherwise gather every block twice each)."""
    return pp == 1 and schedule in ZERO3_PER_BLOCK_SCHEDULES


def check_overlap(
    dims: ParallelDims, options: TrainOptions, *, recompute: bool, compiled: bool
) -> None:
    """An overlapped schedule hides the expert-parallel all-to-alls: it needs some (ep > 1), and it
    runs the forward and the backward of two microbatches on two threads, which activation
    checkpointing's recompute (a forward inside the backward) and compiled regions are not built
    for."""
    if options.schedule not in OVERLAPPED:
        return
    if dims.expert_world == 1:  # fold_ep: tp or cp ranks exchange tokens too
        raise ValueError(
            f"schedule={options.schedule!r} overlaps the expert-parallel all-to-alls, and ep=1 has "
            "none; use schedule='1f1b' (or 'zbv' with pp > 1), or ep > 1"
        )
    check_overlap_threads(options, recompute=recompute, compiled=compiled)


def check_overlap_threads(options: TrainOptions, *, recompute: bool, compiled: bool) -> None:
    """The half of ``check_overlap`` that needs no layout (the CLI runs it while it parses)."""
    if options.schedule not in OVERLAPPED:
        return
    for field, on in (("activation_checkpointing", recompute), ("compile", compiled)):
        if on:
            raise ValueError(
                f"schedule={options.schedule!r} does not run with {field}=true (the forward of one "
                f"microbatch and the backward of another share the rank on two threads); set "
                f"{field}=false or use schedule='1f1b' / 'zbv'"
            )


def check_trainer_clipping(dims: ParallelDims, options: TrainOptions, clip: float | None) -> None:
    """Lightning's own clipping (``Trainer(gradient_clip_val=clip)``) sees only this rank's grads: right
    for pure DP, wrong once a stage, expert shard or ZeRO shard holds part of the model."""
    if clip and (dims.pp > 1 or dims.expert_world > 1 or dims.tp > 1 or options.zero):
        raise ValueError(
            f"Trainer(gradient_clip_val={clip}) would clip each rank's part of the gradient by its own "
            f"norm under pp={dims.pp} ep={dims.ep} tp={dims.tp} zero={options.zero}; use "
            f"TitanStrategy(gradient_clip_norm={clip}) instead, which clips by the whole model's norm"
        )


def check_precision(precision: str) -> None:
    """``precision``: the Trainer's (its precision plugin's ``precision``)."""
    if precision == "16-mixed":
        raise ValueError(
            "precision='16-mixed' is not supported by TitanStrategy: its GradScaler would scale the "
            "activation grads that stages send each other and unscale after our clipping. Use "
            "precision='bf16-mixed' (or '32-true')"
        )
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported by TitanStrategy; use one of {PRECISIONS}"
        )
