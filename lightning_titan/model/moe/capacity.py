"""Optional expert capacity (``ModelConfig.capacity_factor``): drop the assignments an expert has no
room for, the same ones under every layout.

The capacity is per SEQUENCE: each expert takes at most ``C = floor(capacity_factor * S * K / E)`` of
one sequence's ``S * K`` assignments. A sequence is never split by dp, pp, ep or microbatching, so
those cannot change which assignments are dropped; cp and tp split it, so the ranks of the
``sequence`` group all-gather the sequence's expert ids (integers, no gradient) and each takes its
own tokens' decisions from the whole sequence's queue.

The queue of an expert, within one sequence: every first choice (k = 0) in position order, then every
second choice, ... (GShard's priority: a token loses its second expert before anyone loses a first).
Positions are the global ones (context parallelism holds chunks ``r`` and ``2cp-1-r``; tensor
parallelism then a contiguous slice of those), so the queue does not depend on the split.

A dropped assignment is not dispatched (its expert's static slots, ``parallel/slots.py``, hold the
kept ones and zero rows); the token's output is the sum of its kept experts' outputs with their
router weights, so a token that loses all K passes through on the residual alone.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_titan.parallel.context_parallel import positions


def expert_capacity(capacity_factor: float, seq_len: int, top_k: int, n_experts: int) -> int:
    """The assignments of one sequence an expert takes: ``floor(factor * S * K / E)``."""
    return math.floor(capacity_factor * seq_len * top_k / n_experts)


def sequence_positions(seq_len: int, cp: int, tp: int, device: torch.device) -> Tensor:
    """[cp * tp, S / (cp * tp)] the global positions each rank of the ``sequence`` group holds, in
    group order (``cp_rank * tp + tp_rank``: tp varies fastest in the mesh)."""
    per_rank = seq_len // (cp * tp)
    rows = []
    for cp_rank in range(cp):
        mine = positions(seq_len, cp, cp_rank, device)
        rows += [mine[t * per_rank : (t + 1) * per_rank] for t in range(tp)]
    return torch.stack(rows)


def queue_position(expert_ids_BSK: Tensor, n_experts: int) -> Tensor:
    """[b, S, K] each assignment's place in its expert's queue within its sequence (0 = first),
    the queue ordered by (k, position): ``expert_ids_BSK`` must be in position order."""
    b, s, k = expert_ids_BSK.shape
    # priority order per sequence: k-major, then position; one key per (sequence, expert)
    flat_BN = expert_ids_BSK.transpose(1, 2).reshape(b, k * s)
    keys = (flat_BN + n_experts * torch.arange(b, device=flat_BN.device).unsqueeze(1)).reshape(-1)
    sorted_keys, order = torch.sort(keys, stable=True)
    # an assignment's place = its index in the sorted keys - the index of its key's first one
    first = torch.searchsorted(sorted_keys, sorted_keys)
    place_sorted = torch.arange(keys.numel(), device=keys.device) - first
    place = torch.empty_like(place_sorted).scatter_(0, order, place_sorted)
    return place.view(b, k, s).transpose(1, 2)


@torch.no_grad()
def keep_mask(
    expert_ids_TK: Tensor,
    batch: int,
    n_experts: int,
    capacity: int,
    sequence_group: ProcessGroup | None = None,
    split: tuple[int, int] = (1, 1),
) -> Tensor:
    """[T, K] bool: which of this rank's ``T = batch * S_local`` tokens' assignments their expert
    keeps. ``split`` = (cp, tp): how ``sequence_group`` cuts each sequence (see the module doc)."""
    cp, tp = split
    parts = cp * tp
    ids_BSK = expert_ids_TK.view(batch, -1, expert_ids_TK.shape[1])
    if parts == 1:
        return (queue_position(ids_BSK, n_experts) < capacity).reshape_as(expert_ids_TK)
    if sequence_group is None or dist.get_world_size(sequence_group) != parts:
        raise ValueError(
            f"capacity under cp={cp} x tp={tp} needs the sequence group of {parts} ranks, got "
            f"{'None' if sequence_group is None else dist.get_world_size(sequence_group)}"
        )
    b, s_local, k = ids_BSK.shape
    gathered = [torch.empty_like(ids_BSK) for _ in range(parts)]
    dist.all_gather(gathered, ids_BSK.contiguous(), group=sequence_group)
    where_PS = sequence_positions(s_local * parts, cp, tp, ids_BSK.device)
    whole_BSK = ids_BSK.new_empty(b, s_local * parts, k)
    whole_BSK[:, where_PS.reshape(-1)] = torch.cat(gathered, dim=1)
    keep_BSK = queue_position(whole_BSK, n_experts) < capacity
    mine = where_PS[dist.get_rank(sequence_group)]
    return keep_BSK[:, mine].reshape_as(expert_ids_TK)
