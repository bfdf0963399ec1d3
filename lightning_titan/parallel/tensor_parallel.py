"""Megatron-style tensor parallelism with sequence parallelism, as explicit autograd functions.

Between blocks every TP rank holds ``1/tp`` of each sequence (``[b, S/tp, D]``, positions
``[r * S/tp, (r + 1) * S/tp)``): norms, residual adds and the whole MoE layer run there, on no
replicated activation. Attention gathers the sequence (``gather_sequence``), computes its own heads
(q, k, v column-parallel), and its row-parallel output projection gives a partial sum that
``scatter_sequence`` reduce-scatters back to the rank's slice. The embedding and the LM head are
vocab-parallel; ``vocab_parallel_cross_entropy`` computes the loss from the local vocabulary shard
with three all-reduces of ``[tokens]`` numbers, never the full logits.

Each function's backward is the other collective (all-gather <-> reduce-scatter), so every rank's
grads are those of the loss it back-propagates: its own shard of the computation.

Ours rather than DTensor's ``parallelize_module``: our reducers, clipping and checkpoints work on
plain local tensors with global names, the MoE layer stays per-token and local, and the padded
vocabulary needs a loss that DTensor's ``loss_parallel`` does not mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Shard

from lightning_titan.parallel.collectives import reduce_scatter
from lightning_titan.parallel.mesh import group_mesh
from lightning_titan.parallel.wire import wire_dtype
from lightning_titan.runtime import probes


@dataclass(frozen=True)
class TpShard:
    """Which dim of a module's ``weight`` the TP group cuts, and that dim's size in the full model
    (padded up to a multiple of tp when it does not divide: the vocabulary)."""

    dim: int
    full_size: int
    group: ProcessGroup | None = None

    @property
    def size(self) -> int:
        return tp_size(self.group)

    @property
    def rank(self) -> int:
        return tp_rank(self.group)


# what a module that cuts weights declares (CutsWeights): each module it cut (one it holds, or
# itself) -> which dim of that module's weight is cut
TpCuts = dict[nn.Module, TpShard]


@runtime_checkable
class CutsWeights(Protocol):
    """A module that cuts weights over the TP group when it is built declares each as its own:
    ``tp_cuts[m]`` says which dim of module ``m``'s ``weight`` is cut (``m``: a module it holds,
    e.g. attention's ``wq``, or itself). So the model holds these facts, where ``tp_shards`` reads
    them, and no tensor or module has them hung on it from outside."""

    @property
    def tp_cuts(self) -> TpCuts: ...


def as_global(local: Tensor, shard: TpShard) -> Tensor:
    """This rank's (padded) part of a TP-cut tensor as a DTensor of the full model's shape holding
    the real entries only: how a checkpoint stores it under its global name, loadable under any tp
    (no copy: DCP reads into and writes from ``local`` itself). Without TP, ``local`` itself."""
    if shard.size == 1:
        return local
    real = local.narrow(shard.dim, 0, real_size(shard.full_size, shard.size, shard.rank))
    shape = list(local.shape)
    shape[shard.dim] = shard.full_size
    return DTensor.from_local(
        real,
        group_mesh(shard.group, local.device.type),
        [Shard(shard.dim)],
        run_check=False,
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )


def tp_cut_modules(module: nn.Module) -> TpCuts:
    """Every module under ``module`` (itself included) whose ``weight`` TP cuts, and its cut, as the
    modules that cut them declared (``CutsWeights``)."""
    cuts: TpCuts = {}
    for owner in module.modules():
        if isinstance(owner, CutsWeights):
            cuts.update(owner.tp_cuts)
    return cuts


def tp_shards(module: nn.Module) -> dict[int, TpShard]:
    """``id(weight) -> TpShard`` for every TP-cut weight under ``module``, and for the bias of a
    column-parallel (dim 0) one, which is cut with its rows (Qwen2-MoE's q/k/v biases)."""
    out = {}
    for m, s in tp_cut_modules(module).items():
        out[id(m.weight)] = s
        if s.dim == 0 and isinstance(getattr(m, "bias", None), Tensor):
            out[id(m.bias)] = s
    return out


def tp_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group: ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rounded up to a multiple of ``tp`` (Megatron pads it so that every rank holds
    as many rows; the padded rows' logits are masked out of the loss and they are never saved)."""
    return math.ceil(vocab_size / tp) * tp


def real_size(full_size: int, tp: int, rank: int) -> int:
    """How many of rank ``rank``'s ``padded / tp`` entries along a cut dim are real, not padding:
    the ``torch.chunk`` split of ``full_size``, which is how checkpoints store them."""
    per_rank = padded_vocab(full_size, tp) // tp
    return max(0, min(per_rank, full_size - rank * per_rank))


def local_slice(full: Tensor, dim: int, tp: int, rank: int) -> Tensor:
    """Rank ``rank``'s part of ``full`` along ``dim``, zero-padded to ``padded / tp`` entries."""
    per_rank = padded_vocab(full.shape[dim], tp) // tp
    part = full.narrow(
        dim, min(rank * per_rank, full.shape[dim]), real_size(full.shape[dim], tp, rank)
    )
    missing = per_rank - part.shape[dim]
    if missing:
        pad = [0, 0] * (full.dim() - 1 - dim) + [0, missing]
        part = F.pad(part, pad)
    return part


def _gather(x: Tensor, group: ProcessGroup, dim: int, kind: str) -> Tensor:
    """All-gather along ``dim``, rank-major (a ``kind`` span: "tp" or "cp")."""
    n = dist.get_world_size(group)
    local = x.movedim(dim, 0).contiguous()
    out = local.new_empty((local.shape[0] * n, *local.shape[1:]))
    with probes.span(kind, "all_gather"):
        dist.all_gather_single(out, local, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: Tensor, group: ProcessGroup, dim: int, kind: str) -> Tensor:
    """Sum over the group, each rank keeping its ``1/n`` of ``dim``."""
    n = dist.get_world_size(group)
    full = x.movedim(dim, 0).contiguous()
    out = full.new_empty((full.shape[0] // n, *full.shape[1:]))
    with probes.span(kind, "reduce_scatter"):
        reduce_scatter(out, full, group)
    return out.movedim(0, dim)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, dim: int, kind: str) -> Tensor:
        ctx.group, ctx.dim, ctx.kind = group, dim, kind
        return _gather(x, group, dim, kind)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        # every rank's downstream (its heads, its vocabulary shard, its queries) used the whole
        # gathered tensor: the slice's grad is the sum of theirs
        return _reduce_scatter(grad, ctx.group, ctx.dim, ctx.kind), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim, "tp")

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, ctx.group, ctx.dim, "tp"), None, None


def gather_along(x: Tensor, group: ProcessGroup | None, dim: int, kind: str = "tp") -> Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order, differentiable (the backward
    reduce-scatters); identity for a group of one. ``kind`` names the axis in traces ("tp" for the
    sequence-parallel collectives, "cp" for the keys and values)."""
    return x if tp_size(group) == 1 else _Gather.apply(x, group, dim, kind)


def gather_sequence(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """``[b, S/tp, D]`` on each rank -> ``[b, S, D]`` on every rank (identity without TP).

    Under autocast it travels, and comes back, in the autocast dtype (``parallel/wire.py``): the
    matmuls it feeds would cast it to that anyway; its grads are reduce-scattered in it too."""
    if tp_size(group) == 1:
        return x
    return gather_along(x.to(wire_dtype(x.dtype, x.device)), group, 1)


def scatter_sequence(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Partial sums ``[b, S, D]`` on each rank -> their sum's slice ``[b, S/tp, D]`` (identity
    without TP), in ``x``'s dtype. Under autocast the sum travels in the autocast dtype: the
    attention's output projection is in it already; the embedding rows (each row nonzero on one
    rank only) are rounded to it once, as a pipeline stage boundary rounds the residual stream."""
    if tp_size(group) == 1:
        return x
    return _ReduceScatter.apply(x.to(wire_dtype(x.dtype, x.device)), group, 1).to(x.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        targets: Tensor,
        vocab_start: int,
        vocab_size: int,
        group: ProcessGroup,
    ) -> Tensor:
        # padded rows (global id >= vocab_size) are not in the vocabulary: -inf, so softmax gives 0
        ids = torch.arange(vocab_start, vocab_start + logits.shape[-1], device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, float("-inf"))
        row_max = logits.max(dim=-1).values
        with probes.span("tp", "loss max"):
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        exp = torch.exp(logits - row_max.unsqueeze(-1))
        sum_exp = exp.sum(dim=-1)
        local = (targets >= vocab_start) & (targets < vocab_start + logits.shape[-1])
        local_target = torch.where(local, targets - vocab_start, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = torch.where(local, target_logit - row_max, 0.0)
        stats = torch.stack([sum_exp, target_logit])
        with probes.span("tp", "loss sums"):
            dist.all_reduce(stats, group=group)  # one collective for both sums
        sum_exp, target_logit = stats
        ctx.save_for_backward(exp, sum_exp, local, local_target)
        return torch.log(sum_exp) - target_logit

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        exp, sum_exp, local, local_target = ctx.saved_tensors
        grad_logits = exp / sum_exp.unsqueeze(-1)
        grad_logits.scatter_add_(-1, local_target.unsqueeze(-1), -local.to(exp.dtype).unsqueeze(-1))
        return grad_logits * grad.unsqueeze(-1), None, None, None, None


# a target with this id counts for nothing: no loss, no grad, not in the token count (torch's
# cross_entropy's default ignore_index; a prompt's or a padding's position in a fine-tuning batch)
IGNORE_INDEX = -100


def vocab_parallel_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: ProcessGroup | None,
) -> Tensor:
    """Per-token cross-entropy ``[N]`` (fp32) from this rank's vocabulary shard ``logits`` [N, V/tp]
    holding global ids ``[vocab_start, vocab_start + V/tp)``; the same values on every TP rank; 0
    (and no grad) where the target is ``IGNORE_INDEX``."""
    logits = logits.float()
    if tp_size(group) == 1:
        return torch.nn.functional.cross_entropy(
            logits[:, :vocab_size], targets, reduction="none", ignore_index=IGNORE_INDEX
        )
    losses = _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, vocab_size, group)
    # an ignored row's target lies in no rank's shard: its loss came out as log(sum exp) alone
    return torch.where(targets == IGNORE_INDEX, 0.0, losses)
