"""The end of a step, after its backward, for TitanStrategy: wait for the gradient reducers, check
that the step's loss and gradient norm are finite, clip by the norm composed across every axis, and
hear the ranks' agreement on a SIGTERM, all in one host read."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_titan.lightning import preemption
from lightning_titan.lightning.failures import check_finite, unreduced_step_error
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.train.engine import Engine, GradStats
from lightning_titan.train.objective import StepLoss
from lightning_titan.train.options import TrainOptions


class StepEnd:
    """Finishes each step's gradients; ``skipped`` counts the updates dropped by ``on_nonfinite="skip"``.

    Under manual optimization it also refuses an ``optimizer.step()`` on gradients a backward left
    unfinished. That guard is this object's own state, not a value of the step handed on: it records
    the order of three calls Lightning makes (``on_backward`` from ``TitanStrategy.backward``, then
    ``finish``, then ``check_finished`` from ``TitanStrategy.optimizer_step``), and no return value
    can carry it, since ``manual_backward`` drops what ``backward`` returns and ``optimizer.step()``
    passes nothing from the module to the strategy. Only the methods below read or write it.
    """

    def __init__(self, stop: preemption.Preemption) -> None:
        self.stop = stop
        self._unfinished = False  # a backward ran since the last finish
        self.skipped = 0

    def on_backward(self) -> None:
        """A backward accumulates into the grads: a step waits for ``finish`` now."""
        self._unfinished = True

    def finish(
        self,
        engine: Engine,
        module: pl.LightningModule,
        dims: ParallelDims,
        options: TrainOptions,
        device: torch.device,
        step: StepLoss | None,
    ) -> GradStats:
        """``TitanStrategy.finish_gradients``: ``step`` (the global loss, from
        ``engine.forward_backward``) is read with the norm and the SIGTERM flag in one host sync."""
        stop = preemption.start_agreement(device)  # on SIGTERM, over the world
        norm = engine.finish_gradients(options.gradient_clip_norm)
        self._unfinished = False
        trainer = module.trainer
        given = [] if step is None else [step.loss, step.aux, step.dropped]
        *values, stopping = torch.stack([t.double() for t in [norm, *given, stop()]]).tolist()
        self.stop.decide(stopping, trainer)
        at, action = trainer.global_step, options.on_nonfinite
        finite = check_finite(module, dims, at, values[:2], action, reducers=engine.reducers)
        self.skipped += not finite
        engine.bind_shard_grads(drop=not finite)  # zero>0: after the clip and the skip
        return GradStats(values[0], finite, *values[1:])

    def check_finished(self) -> None:
        """Manual optimization: the module finishes the gradients before ``optimizer.step()``."""
        if self._unfinished:
            raise unreduced_step_error()
