"""Failing together during training: reports that name the rank, and non-finite steps.

- a rank that raises reports who it is and leaves; the supervisor brings the rest down
  (:func:`report_failure`); during setup, barriers and broadcasts are agreements so that a failing
  rank can join the one its peers wait in (``TitanStrategy.barrier``, ``runtime/agreement.py``);
- a non-finite loss or gradient norm is global, so every rank takes the same branch: stop, naming the
  stage and parameter where it began, or skip the update (:func:`check_finite`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_titan.lightning import supervisor
from lightning_titan.lightning.layout import Layout
from lightning_titan.parallel.dp.reducer import GradReducer
from lightning_titan.parallel.dp.zero_grads import grad_of
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.runtime.agreement import distributed


def report_failure(
    exception: BaseException,
    layout: Layout,
    env: Any,
    *,
    trainer: Any,
    peers: list[tuple[str, int]] | None,
    grace_s: float,
) -> None:
    """Print which rank failed and why (naming dead peers); a rank in a started job then leaves.
    ``env``: the cluster environment (None, or no process group yet: the launcher failed)."""
    started = distributed() or (env is not None and env.creates_processes_externally)
    if started:
        dims = layout.dims
        where = dims.label(dims.rank)
        if trainer is not None:
            where += f", global_step={trainer.global_step}"
        who, rank = f"rank {dims.rank}/{dims.world_size} ({where})", dims.rank
    else:  # no rank started yet (popen), or the parent of fork/spawn ranks
        who, rank = "the launcher", 0
    # this host's dead peers, shared with the other nodes; or what another node's rank found
    blamed = supervisor.blamed_peers(exception, rank=rank, peers=peers)
    blamed = supervisor.watched_blame(exception, blamed)
    supervisor.say(supervisor.failure_report(exception, who=who, blamed=blamed))
    if distributed():
        # a dead or stopped peer's fault: the report names it, and this rank's traceback (gloo's
        # "Timed out waiting ...ms", a closed connection) would bury that line
        supervisor.leave_after_failure(grace_s, traceback=not blamed)


def nonfinite_message(
    module: nn.Module,
    dims: ParallelDims,
    step: int,
    norm: float,
    loss: float | None,
    *,
    reducers: Sequence[GradReducer],
) -> str:
    """Where the non-finite values are: one gather of every rank's verdict on its own grads
    (``reducers``: the engine's; under zero=2 they hold this rank's rows of the grads they cut)."""
    grads = ((n, grad_of(p, reducers)) for n, p in module.named_parameters())
    first_bad = next((n for n, g in grads if g is not None and not torch.isfinite(g).all()), None)
    verdicts: list[Any] = [(dims.pp_rank, first_bad)]
    if distributed():
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
    *,
    reducers: Sequence[GradReducer],
) -> bool:
    """True when the step's gradient norm and loss (global, so every rank takes the same branch) are
    finite. Otherwise raise FloatingPointError naming where it began (``action="raise"``), or drop every
    gradient so that the optimizer step changes nothing and return False (``"skip"``)."""
    if all(math.isfinite(v) for v in norm_and_loss):
        return True
    norm, *loss = norm_and_loss
    message = nonfinite_message(
        module, dims, step, norm, loss[0] if loss else None, reducers=reducers
    )
    if action == "raise":
        raise FloatingPointError(
            f"{message}; no optimizer step was taken. Lower the learning rate, set "
            "gradient_clip_norm, use precision='32-true' to find the cause, or "
            "TitanStrategy(on_nonfinite='skip') to skip such steps"
        )
    rank_zero_warn(f"{message}; this step's update is skipped (on_nonfinite='skip')")
    for p in module.parameters():  # the optimizer skips parameters without a grad: no update
        p.grad = None
    return False


def unreduced_step_error() -> RuntimeError:
    return RuntimeError(
        "optimizer.step() was called on gradients that are not reduced yet: under manual "
        "optimization call `self.trainer.strategy.finish_gradients(loss)` after the backward "
        "and before optimizer.step() (TitanLM.training_step shows the order)"
    )
