"""One training step, in order: the only place its sequence is written.

    step = TrainStep(engine, optimizer, scheduler, max_norm=1.0)
    result = step.run(stage_model, inputs, targets, num_microbatches, loss_fn)

``run`` is the whole step: every microbatch's forward and backward with the schedule, then
``update``: finish the gradients (wait for the reducers, agree on a requested stop, check that the
loss and norm are finite, clip by the norm composed over every axis), ZeRO's shard grads, the
optimizer step, ZeRO's gather, the expert-bias update, ``zero_grad`` and the LR step. TitanLM's
``training_step``, TitanStrategy's automatic optimization, the benchmarks and the test harness all
call it, so the step the suite proves equal to one process is the step users run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_titan.model.decoder import StageModel
from lightning_titan.model.moe.layer import StepCounts, take_step_counts
from lightning_titan.runtime import probes
from lightning_titan.train.engine import Engine
from lightning_titan.train.nonfinite import ACTIONS, check_finite
from lightning_titan.train.objective import LossFn, StepLoss


class Optimizer(Protocol):
    """What the step needs of an optimizer: a torch one, or Lightning's wrapper around it (whose
    ``step`` also counts ``global_step``)."""

    param_groups: list[dict[str, Any]]

    def step(self, closure: Any = None) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


class Scheduler(Protocol):
    def step(self) -> None: ...


class StopRequest(Protocol):
    """A request to stop after the step (SIGTERM, Ctrl+C): ``requested`` is this rank's signal
    number (0: none); the ranks agree on the largest, and ``agreed`` hears it (every rank, the same
    number) once the step's numbers are read."""

    def requested(self) -> int: ...

    def agreed(self, signal: int, step: int) -> None: ...


@dataclass(frozen=True)
class StepResult:
    """Every number the step produced: global values, the same on every rank, read from the device in
    the step's one host sync."""

    loss: float  # mean token loss of the global batch (NaN: the backward was not the schedule's)
    aux: float  # mean per-sequence aux loss, summed over the stages
    grad_norm: float  # before clipping, composed over every axis
    dropped: float  # assignments over an expert's capacity, all layers and data ranks
    finite: bool  # False: on_nonfinite="skip" dropped every grad, and the update changed nothing
    stop_signal: int = 0  # the signal every rank agreed to stop on after this step (0: none)


class TrainStep:
    """The step of ``engine``'s model with ``optimizer`` (already sharded by
    ``engine.shard_optimizers`` under zero > 0) and an optional LR ``scheduler``.

    ``max_norm``: clip the gradient norm to this (None: measure only). ``on_nonfinite``: ``"raise"``
    FloatingPointError on a non-finite loss or norm, or ``"skip"`` the update (``skipped`` counts).
    ``stop``: a stop request agreed within the step's host read (``lightning/preemption.py``).
    """

    def __init__(
        self,
        engine: Engine,
        optimizer: Optimizer,
        scheduler: Scheduler | None = None,
        *,
        max_norm: float | None = None,
        on_nonfinite: str = "raise",
        stop: StopRequest | None = None,
    ) -> None:
        if on_nonfinite not in ACTIONS:
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is unknown; choose one of {ACTIONS}")
        self.engine, self.optimizer, self.scheduler = engine, optimizer, scheduler
        self.max_norm, self.on_nonfinite, self.stop = max_norm, on_nonfinite, stop
        self.skipped = 0  # updates dropped by on_nonfinite="skip"

    def run(
        self,
        stage: StageModel,
        inputs: Tensor,
        targets: Tensor,
        num_microbatches: int,
        loss_fn: LossFn,
        *,
        backward: Callable[[Tensor], None] | None = None,
        index: int = 0,
        documents: Tensor | None = None,
    ) -> StepResult:
        """The whole step on this rank's batch ``inputs``/``targets`` [b, S]. ``backward``: how a
        loss is back-propagated (Lightning's ``manual_backward``; None: ``Tensor.backward``);
        ``index``: the step's number, for messages; ``documents`` [b, S]: a packed batch's
        document ids (``model/documents.py``)."""

        def forward_backward() -> StepLoss:
            # every microbatch's forward and backward, in the schedule's order; the reducers
            # all-reduce the grads while the last backward runs
            return self.engine.forward_backward(
                stage,
                inputs,
                targets,
                num_microbatches,
                loss_fn,
                backward=backward,
                documents=documents,
            )

        return self.update(forward_backward, index=index)

    def update(
        self,
        forward_backward: Callable[[], StepLoss | None],
        optimizer_step: Callable[[Callable[[], None]], Any] | None = None,
        *,
        index: int = 0,
    ) -> StepResult:
        """The step around ``forward_backward``, which runs its backwards and returns the global
        loss (``Engine.forward_backward``), or None where a loop of its own ran them (Lightning's
        automatic optimization; the MoE layers' counts are then taken here).

        ``optimizer_step(closure)``: calls ``closure`` (the backwards and their finish) and then
        updates, as Lightning's precision plugin does in automatic optimization (its hooks and
        clipping between the two see finished grads). None: the closure, then ``optimizer.step()``."""
        finished: list[tuple[StepResult, StepCounts]] = []

        def backward_and_finish() -> None:
            loss = forward_backward()
            counts = loss.counts if loss is not None else None
            if counts is None:  # a loop of its own ran the forwards: the layers' counts since
                counts = take_step_counts(self.engine.module)  # the last step took them
            result = self._finish(loss, index)
            finished.append((result, counts))
            # zero > 0: the shards' grads, after the clip and the skip acted on the full ones
            self.engine.bind_shard_grads(drop=not result.finite)

        if optimizer_step is None:
            backward_and_finish()
            with probes.span("optimizer", "optimizer.step"):
                self.optimizer.step()
        else:  # the update comes after the closure inside (no span of its own here)
            optimizer_step(backward_and_finish)
        result, counts = finished[0]
        # zero > 0: each rank updated its own rows, which every rank now gathers
        self.engine.gather_params()
        # the routers' expert biases move by the step's global loads (not on a skipped step)
        self.engine.update_router_bias(counts, skip=not result.finite)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if self.stop is not None:
            self.stop.agreed(result.stop_signal, index)
        return result

    def _finish(self, loss: StepLoss | None, index: int) -> StepResult:
        """Wait for the reducers, clip, and read the norm, the loss and the ranks' agreement on a
        stop in one host sync; then stop or skip on a non-finite loss or norm."""
        engine = self.engine
        stop = self._start_stop_agreement(engine.params[0].device)
        norm = engine.finish_gradients(self.max_norm)
        given = [] if loss is None else [loss.loss, loss.aux, loss.dropped]
        *values, stop_signal = torch.stack([t.double() for t in [norm, *given, stop()]]).tolist()
        norm_value, *rest = values
        loss_value, aux, dropped = rest if rest else (math.nan, math.nan, 0.0)
        finite = check_finite(
            engine.module, engine.dims, index, values[:2], self.on_nonfinite, engine.reducers
        )
        self.skipped += not finite
        return StepResult(loss_value, aux, norm_value, dropped, finite, int(stop_signal))

    def _start_stop_agreement(self, device: torch.device) -> Callable[[], Tensor]:
        """Start the all-reduce (max over the world) of this rank's stop request; the returned
        function waits for it (on CUDA the stream waits, not the host) and gives the agreed
        signal, 0-dim. With a ``stop`` every rank runs it every step, request or not."""
        # a fill on the device (torch.tensor would copy the number from the host: a sync on CUDA)
        flag = torch.full((), float(self.stop.requested() if self.stop else 0), device=device)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if self.stop is None or world == 1:
            return lambda: flag
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)

        def agreed() -> Tensor:
            work.wait()
            return flag

        return agreed
