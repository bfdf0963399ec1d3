"""The training objective, normalised in one place.

The loss of a step is the mean token loss over the counted targets of the GLOBAL batch (``loss_fn``:
TitanLM's sums the cross-entropy of one microbatch's tokens; a target ``IGNORE_INDEX`` adds nothing
and is not counted: a prompt's position in fine-tuning) plus the mean per-sequence aux loss (router
balance and z, summed over the stages). Each rank back-propagates its share of it, per microbatch:

    sum of the microbatch's token losses / (counted targets of the step / data ranks)
      +  sum of its aux / the rank's sequences

The reducers average over the data ranks (expert grads are summed over EP, then averaged the same
way; CP ranks' are summed), so that is the gradient of the global mean whatever the layout, however
the counted targets fall on the ranks and microbatches. The step's count needs one all-reduce before
the first forward (``count_targets``); with nothing ignored it is the rank's tokens, as every data
rank holds as many. Validation reads the same sums; ``global_means`` turns any step's sums into the
global means with one all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_titan.model.moe.layer import StepCounts
from lightning_titan.parallel.pipeline.stage import StepSums
from lightning_titan.parallel.tensor_parallel import IGNORE_INDEX
from lightning_titan.runtime import probes

LossFn = Callable[[Tensor, Tensor], Tensor]  # (logits [m, S, V], targets [m, S]) -> sum, 0-dim


@dataclass(frozen=True)
class Objective:
    """This rank's share of the global objective, for one microbatch (called by the pipeline stage)."""

    loss_fn: LossFn
    # the step's counted targets over the data ranks, 0-dim fp32 (count_targets): the token-loss
    # sums of every rank and microbatch divided by it average to the global mean
    tokens_per_data_rank: Tensor
    local_sequences: int

    def __call__(
        self, aux: Tensor, logits: Tensor | None = None, targets: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """``(what to back-propagate, the microbatch's token-loss sum)``; ``logits``/``targets`` on the
        stage that holds the head only (the sum is None elsewhere)."""
        share = aux.sum() / self.local_sequences
        if logits is None or targets is None:
            return share, None
        loss_sum = self.loss_fn(logits, targets)
        return share + loss_sum / self.tokens_per_data_rank, loss_sum


@dataclass
class StepLoss:
    """The step's global means over every data rank's sequences, the same on every rank (0-dim fp64
    tensors on the device: reading them is the caller's one host sync)."""

    loss: Tensor  # mean token loss (loss_fn) of the global batch
    aux: Tensor  # mean per-sequence aux loss (router balance + z), summed over stages
    # assignments over an expert's capacity in the step, all layers and data ranks (0 when dropless)
    dropped: Tensor
    # this rank's routing counts per MoE layer (training steps: what the expert-bias update spends)
    counts: StepCounts | None = None


def count_targets(targets: Tensor) -> Tensor:
    """The step's counted targets (not ``IGNORE_INDEX``) over every rank, divided by the world:
    ``targets`` [b, S] is this rank's batch, whole (each CP rank's too), the same on the ranks that
    hold one data rank's share (pp x tp x cp of them), so the mean over the world is the count per
    data rank. 0-dim fp32 on the device, at least 1 (a step with nothing counted then trains on its
    aux losses alone); one all-reduce, no host read."""
    count = (targets != IGNORE_INDEX).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        with probes.span("all_reduce", "counted targets"):
            dist.all_reduce(count)
        return (count.double() / dist.get_world_size()).clamp(min=1).float()
    return count.float().clamp(min=1)


def global_means(
    sums: StepSums, local_sequences: int, data_world: int, dropped: Tensor | None = None
) -> StepLoss:
    """One all-reduce over the world: the loss lives on the last stage, the loggers on rank 0; the
    dropped assignments of each layer on its stage's ranks (each counts its own tokens)."""
    tokens = sums.tokens.to(torch.float64)
    if dropped is None:
        dropped = torch.zeros_like(tokens)
    totals = torch.stack([sums.loss_sum.double(), sums.aux_sum.double(), tokens, dropped.double()])
    if dist.is_initialized() and dist.get_world_size() > 1:
        with probes.span("all_reduce", "loss"):
            dist.all_reduce(totals)
    global_sequences = local_sequences * data_world
    loss = totals[0] / totals[2].clamp(min=1)  # nothing counted: 0, not NaN
    return StepLoss(loss=loss, aux=totals[1] / global_sequences, dropped=totals[3])
