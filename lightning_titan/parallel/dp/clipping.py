"""Gradient-norm clipping composed across pipeline, expert and tensor parallelism.

After the reducers, the ranks of one data-parallel replica (the ``model`` group: pp x ep x tp) hold
each parameter of the model either as a distinct part (each stage its layers, each EP rank its
experts, each TP rank its heads and vocabulary rows) or as an identical copy (non-expert parameters
across the EP group; the norms, routers and experts across the TP group). So the norm of the whole
model's gradient is one sum over the ``model`` group in which every rank counts the parameters it
holds a part of, and a copy only on the first rank of the axes it is copied over (``counted``):
exact values, no division by a replica count, one all-reduce. DP replicas hold identical grads, so
DP is never reduced here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn


def _is_trivial(group: dist.ProcessGroup | None) -> bool:
    return group is None or dist.get_world_size(group) == 1


def _local_sq_norm(grads: list[Tensor], device: torch.device) -> Tensor:
    """The sum of the squared norms of ``grads``, fp32 on ``device``: one ``_foreach_norm`` per dtype
    (fp32 accumulation for the 16-bit dtypes, fp64 in its own precision), as torch's
    ``clip_grad_norm_`` does."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    norms = [
        n.float().to(device)
        for dtype, group in by_dtype.items()
        for n in torch._foreach_norm(
            group, 2, dtype=None if dtype == torch.float64 else torch.float32
        )
    ]
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(norms).square().sum()


def _scale_(grads: list[Tensor], total: Tensor, max_norm: float) -> None:
    """Every grad times ``min(1, max_norm / (total + 1e-6))``, as torch's ``clip_grad_norm_``; by 1
    when ``total`` is not finite (``torch.where`` instead of an ``if``: no host sync)."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(grads, torch.where(total.isfinite(), coef, torch.ones_like(coef)))


def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float | None,
    *,
    counted: Iterable[nn.Parameter] | None = None,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Return the pre-clip norm of the whole model's gradient, the same fp32 number on every rank.

    ``counted``: the parameters whose squared grads this rank adds to the sum over ``group`` (default:
    all of ``params``). If ``max_norm`` is given, scale every grad of ``params`` by
    ``min(1, max_norm / (norm + 1e-6))`` as ``torch.nn.utils.clip_grad_norm_`` does. A non-finite norm
    is returned without scaling so the caller can skip or stop. Grads that are None count as zero; a
    group None or of size 1 is skipped.
    """
    if max_norm is not None and not max_norm > 0:  # also rejects NaN
        raise ValueError(
            f"max_norm={max_norm!r} must be a positive number, or None to only measure the norm"
        )
    params = list(params)
    counted = params if counted is None else list(counted)
    grads = [p.grad for p in params if p.grad is not None]
    # The parameters' device also on a rank without grads: an NCCL group only takes CUDA tensors.
    device = params[0].device if params else torch.device("cpu")
    total_sq = _local_sq_norm([p.grad for p in counted if p.grad is not None], device)
    if not _is_trivial(group):
        dist.all_reduce(total_sq, group=group)
    total = total_sq.sqrt()

    if max_norm is not None and grads:
        _scale_(grads, total, max_norm)
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
    total_sq = _local_sq_norm([g for g, c in zip(grads, counted, strict=True) if c], device)
    for g in (group, pp_group):
        if not _is_trivial(g):
            dist.all_reduce(total_sq, group=g)
    total = total_sq.sqrt()
    if max_norm is not None and grads:
        _scale_(grads, total, max_norm)
    return total
