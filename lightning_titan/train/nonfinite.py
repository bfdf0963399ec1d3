"""A step whose loss or gradient norm is not finite: stop, naming where it began, or skip its update.

Both numbers are global (every rank reads the same), so every rank takes the same branch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_titan.parallel.dp.reducer import GradReducer
from lightning_titan.parallel.dp.zero_grads import grad_of
from lightning_titan.parallel.mesh import ParallelDims

ACTIONS = ("raise", "skip")


def nonfinite_message(
    module: nn.Module,
    dims: ParallelDims,
    step: int,
    norm: float,
    loss: float | None,
    reducers: Sequence[GradReducer],
) -> str:
    """Where the non-finite values are: one gather of every rank's verdict on its own grads
    (``reducers``: the engine's; under zero=2 they hold this rank's rows of the grads they cut)."""
    grads = ((n, grad_of(p, reducers)) for n, p in module.named_parameters())
    first_bad = next((n for n, g in grads if g is not None and not torch.isfinite(g).all()), None)
    verdicts: list[Any] = [(dims.pp_rank, first_bad)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        verdicts = [None] * dist.get_world_size()
        dist.all_gather_object(verdicts, (dims.pp_rank, first_bad))
    bad = sorted({(pp, rank, name) for rank, (pp, name) in enumerate(verdicts) if name})
    parts = [f"non-finite values at step {step}"]
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
    return "; ".join(parts) + f" (layout {dims.label()})"


def check_finite(
    module: nn.Module,
    dims: ParallelDims,
    step: int,
    norm_and_loss: list[float],
    action: str,
    reducers: Sequence[GradReducer],
) -> bool:
    """True when the step's gradient norm and loss are finite. Otherwise raise FloatingPointError
    naming where it began (``action="raise"``), or drop every gradient so that the optimizer step
    changes nothing and return False (``"skip"``; rank 0 warns)."""
    if all(math.isfinite(v) for v in norm_and_loss):
        return True
    norm, *loss = norm_and_loss
    message = nonfinite_message(module, dims, step, norm, loss[0] if loss else None, reducers)
    if action == "raise":
        raise FloatingPointError(
            f"{message}; no optimizer step was taken. Lower the learning rate, set "
            "gradient_clip_norm, use precision='32-true' to find the cause, or "
            "TitanStrategy(on_nonfinite='skip') to skip such steps"
        )
    if dims.rank == 0:
        warnings.warn(
            f"{message}; this step's update is skipped (on_nonfinite='skip')", stacklevel=2
        )
    for p in module.parameters():  # the optimizer skips parameters without a grad: no update
        p.grad = None
    return False
