"""Static slots for the dispatch under expert capacity: each expert gets ``slots`` rows of this rank's
tokens whatever the routing, so the all-to-all's sizes are known on the host without reading the
counts back from the device (a stream sync per MoE layer per microbatch on CUDA).

The capacity (``model/moe/capacity.py``) keeps at most ``C`` of a sequence's assignments per expert,
and a rank holds ``b`` sequences of ``S_local`` tokens, each token on an expert at most once: so
``slots = b * min(C, S_local)`` rows hold every kept assignment of an expert. Slot rows are
expert-major (hence destination-rank-major), an expert's kept assignments first in the dispatch's
stable order, zeros after them; the zero rows' outputs are left out of the combine (no gradient).
Every EP rank must hold the same ``b * S_local`` tokens (the batching rules make it so,
``parallel/batching.py``): the all-to-all's sizes are the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def slots_per_expert(batch: int, seq_local: int, capacity: int) -> int:
    """The rows each expert gets of a rank's ``batch`` sequences of ``seq_local`` tokens."""
    return batch * min(capacity, seq_local)


@dataclass
class SlotIndex:
    """Where each assignment sits among the ``R = n_experts * slots`` slot rows (R + 1 with the
    combine's zero row for the dropped assignments); ``n = T * K`` assignments, ids ``t * K + k``."""

    slot_token: Tensor  # [R] the token in each slot, T where empty (the zero row after x)
    assignment_of_slot: Tensor  # [R + 1] the assignment in each slot, n where empty (and row R)
    token_of_slot: Tensor  # [R + 1] the token in each slot, 0 where empty (weighted by zero)
    token_slots: Tensor  # [T, K] each assignment's slot, R (the zero row) where dropped
    kept: Tensor  # [T, K] bool


def slot_index(
    flat_ids: Tensor, order: Tensor, counts: Tensor, n_experts: int, slots: int, top_k: int
) -> SlotIndex:
    """``flat_ids`` [n] each assignment's expert (``n_experts``: dropped), ``order`` [n] their stable
    argsort and ``counts`` [n_experts + 1] the count of each id (``sort_and_count``). All on the
    device: nothing is read back."""
    n, rows = flat_ids.numel(), n_experts * slots
    sorted_ids = flat_ids.index_select(0, order)
    starts = counts.cumsum(0) - counts
    place = torch.arange(n, device=flat_ids.device) - starts.index_select(0, sorted_ids)
    slot_sorted = torch.where(sorted_ids < n_experts, sorted_ids * slots + place, rows)
    token_slots = torch.empty_like(slot_sorted).scatter_(0, order, slot_sorted)
    # every dropped assignment writes row R: set it to "empty" after them
    assignment = torch.full((rows + 1,), n, dtype=order.dtype, device=order.device)
    assignment = assignment.scatter_(0, slot_sorted, order)[:rows]
    assignment = F.pad(assignment, (0, 1), value=n)
    filled = assignment < n
    token_of_slot = torch.where(filled, assignment // top_k, 0)
    slot_token = torch.where(filled, token_of_slot, n // top_k)[:rows]
    return SlotIndex(
        slot_token,
        assignment,
        token_of_slot,
        token_slots.view(-1, top_k),
        (flat_ids < n_experts).view(-1, top_k),
    )


class PackSlots(torch.autograd.Function):
    """The slot rows [R, D] of ``x`` [T, D] (zeros where empty). The backward sums each token's kept
    slots' gradients with one ``embedding_bag`` (its dropped assignments weighted by zero)."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, slot_token: Tensor, token_slots: Tensor, kept: Tensor
    ) -> Tensor:
        ctx.save_for_backward(torch.where(kept, token_slots, 0), kept)
        return F.pad(x, (0, 0, 0, 1)).index_select(0, slot_token)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        bags, kept = ctx.saved_tensors
        grad_x = F.embedding_bag(
            bags, grad.contiguous(), per_sample_weights=kept.to(grad.dtype), mode="sum"
        )
        return grad_x, None, None, None


def swap_major(rows: Tensor, outer: int, inner: int) -> Tensor:
    """Rows in [outer, inner, slots] blocks -> [inner, outer, slots] (source-major <-> expert-major:
    a fixed permutation, no index tensors)."""
    d = rows.shape[-1]
    return rows.view(outer, inner, -1, d).transpose(0, 1).reshape(-1, d)
