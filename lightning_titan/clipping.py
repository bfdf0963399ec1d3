"""Gradient-norm clipping composed across expert and pipeline parallelism (DESIGN invariant 4).

After the reducers, non-expert grads are identical across the EP group (they live in the
non-expert-DP group) while each EP rank owns different experts, and each pipeline stage owns
different layers. So the norm of the whole model's gradient is

    norm^2 = sum over stages of (non-expert local norm^2 + sum over the EP group of expert norm^2)

which needs the expert part summed over EP first, then everything summed over PP. DP replicas
already hold identical grads, so DP is never reduced here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn


def _is_trivial(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


def _local_sq_norm(grads: list[Tensor], device: torch.device) -> Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = [torch.linalg.vector_norm(g, dtype=torch.float32).to(device) for g in grads]
    return torch.stack(norms).square().sum()


def clip_grad_norm_(
    expert_params: Iterable[nn.Parameter],
    non_expert_params: Iterable[nn.Parameter],
    max_norm: float | None,
    *,
    ep_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
) -> Tensor:
    """Return the pre-clip norm of the whole model's gradient, the same fp32 number on every rank.

    If ``max_norm`` is given, scale every local grad by ``min(1, max_norm / (norm + 1e-6))`` as
    ``torch.nn.utils.clip_grad_norm_`` does. A non-finite norm is returned without scaling so the
    caller can skip or stop. Grads that are None count as zero; groups None or of size 1 are skipped.
    """
    if max_norm is not None and not max_norm > 0:  # also rejects NaN
        raise ValueError(
            f"max_norm={max_norm!r} must be a positive number, or None to only measure the norm"
        )
    expert_params, non_expert_params = list(expert_params), list(non_expert_params)
    expert = [p.grad for p in expert_params if p.grad is not None]
    non_expert = [p.grad for p in non_expert_params if p.grad is not None]
    grads = expert + non_expert
    # The parameters' device also on a rank without grads: an NCCL group only takes CUDA tensors.
    params = expert_params + non_expert_params
    device = params[0].device if params else torch.device("cpu")

    expert_sq = _local_sq_norm(expert, device)
    if not _is_trivial(ep_group):
        dist.all_reduce(expert_sq, group=ep_group)
    total_sq = _local_sq_norm(non_expert, device) + expert_sq
    if not _is_trivial(pp_group):
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()

    if max_norm is not None and grads:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        # torch.where instead of `if total.isfinite()` keeps the device free of a host sync.
        coef = torch.where(total.isfinite(), coef, torch.ones_like(coef))
        for g in grads:
            g.mul_(coef)
    return total


def clip_counted_grad_norm_(
    grads: list[Tensor],
    counted: list[bool],
    max_norm: float | None,
    *,
    group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    device: torch.device,
) -> Tensor:
    """``clip_grad_norm_`` for grads cut into shards (ZeRO-2, ``zero_grads``): norm^2 is the sum over
    ``group`` and then over ``pp_group`` of the squares of the ``counted`` grads, so the caller counts
    each element of the stage's gradient on exactly one rank of ``group``. Every grad is scaled."""
    if max_norm is not None and not max_norm > 0:
        raise ValueError(
            f"max_norm={max_norm!r} must be a positive number, or None to only measure the norm"
        )
    norms = [
        # fp32 accumulation for the 16-bit dtypes, as _local_sq_norm; fp64 in its own precision
        torch.linalg.vector_norm(g, dtype=None if g.dtype == torch.float64 else torch.float32)
        .float()
        .to(device)
        for g, c in zip(grads, counted, strict=True)
        if c
    ]
    total_sq = torch.stack(norms).square().sum() if norms else torch.zeros((), device=device)
    for g in (group, pp_group):
        if not _is_trivial(g):
            dist.all_reduce(total_sq, group=g)
    total = total_sq.sqrt()
    if max_norm is not None and grads:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        coef = torch.where(total.isfinite(), coef, torch.ones_like(coef))  # no host sync
        for grad in grads:
            grad.mul_(coef)
    return total
