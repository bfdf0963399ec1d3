"""Token dispatch to expert owners and combine back, over the EP group (dropless, no Python loop over E).

``dispatch`` takes this rank's tokens ``x`` [T, D] and their top-K expert ids [T, K] and returns the rows
this rank's local experts must process, local-expert-major (all rows of local expert 0, then 1, ...).
``combine`` takes the experts' output in that same order and returns the router-weighted sum of each
token's K expert outputs, [T, D]. Steps, each undone in reverse by ``combine``:

1. sort the T*K assignments stably by expert id -> expert-major, hence destination-rank-major;
2. all-to-all of the per-expert counts (send_matrix [ep, E_local] -> recv_matrix [ep, E_local]);
3. all-to-all of the rows with split sizes (autograd-aware: the backward is the reverse all-to-all);
4. permute the received rows from source-rank-major to local-expert-major.

With one EP rank (no group, or a group of size 1) steps 2-4 are skipped: no collective at all.

Dropless, the split sizes depend on the routing: step 2's counts are read back to the host, one
device-to-host read per MoE layer per microbatch (on CUDA a stream sync, which inside an overlapped
pair also waits for the other half's queued kernels). With expert capacity (``slots``) the sizes are
static: each expert gets a fixed number of rows (``parallel/slots.py``), step 2 is skipped, and
nothing is read back.
Every rank of the EP group must call ``dispatch``/``combine`` in the same order, also with zero rows.

``start_dispatch`` / ``start_combine`` start step 3's exchange and return at once: ``wait()`` gives the
rows, so work that does not need them (the shared expert, ``model/moe/layer.py``) runs while they
travel, in the forward and in the backward (``parallel/all_to_all.py``). ``dispatch`` / ``combine``
wait at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_titan.parallel.all_to_all import Pending, all_to_all, done, start_all_to_all
from lightning_titan.parallel.overlap import hand_over
from lightning_titan.parallel.slots import PackSlots, SlotIndex, slot_index, swap_major
from lightning_titan.parallel.wire import wire_dtype
from lightning_titan.runtime import probes


def ep_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _PermuteRows(torch.autograd.Function):
    """``x[index]`` for a permutation ``index``; the backward is the gather by ``inverse`` (cheaper
    than the scatter-add autograd would otherwise use)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, index: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


class _PackTokens(torch.autograd.Function):
    """Expert-major rows ``x[token_of_row]``, each token K times. The backward sums each token's K row
    gradients with one ``embedding_bag`` over ``token_rows``: 3-4x faster on CPU than the scatter-add
    (``index_add_``) autograd derives for ``index_select`` with repeated indices."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, token_of_row: Tensor, token_rows: Tensor) -> Tensor:
        ctx.save_for_backward(token_rows)
        return x.index_select(0, token_of_row)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (token_rows,) = ctx.saved_tensors
        return F.embedding_bag(token_rows, grad.contiguous(), mode="sum"), None, None


def _inverse_permutation(index: Tensor) -> Tensor:
    positions = torch.arange(index.numel(), device=index.device)
    return torch.empty_like(index).scatter_(0, index, positions)


# torch's CPU sort is fbgemm's radix sort (linear and stable) for 1-D integer tensors of at least
# GRAIN_SIZE = 32768 elements, a comparison sort below that: 16k top-2 ids of 8k tokens sort 5-7x
# faster padded to 32k. Narrow keys mean fewer radix passes.
_RADIX_SORT_MIN = 32768
_PAD_FROM = 2048  # below this the comparison sort beats sorting 32k padded keys


def sort_by_expert(ids: Tensor, n_experts: int) -> Tensor:
    """Stable argsort of integer ``ids`` in ``[0, n_experts)`` (a permutation, int64)."""
    return sort_and_count(ids, n_experts)[0]


def sort_and_count(ids: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """(stable argsort of ``ids`` in ``[0, n_experts)``, [n_experts] int64 count of each id).

    The counts come from the sorted keys (a ``searchsorted`` of each id's first position), not from
    ``bincount``, which on CUDA reads the ids' min and max back to the host: two syncs per call.
    """
    keys = ids.to(torch.uint8 if n_experts < 255 else torch.int32)
    n = keys.numel()
    if keys.device.type == "cpu" and _PAD_FROM <= n < _RADIX_SORT_MIN:
        keys = torch.cat([keys, keys.new_full((_RADIX_SORT_MIN - n,), n_experts)])
    sorted_keys, order = torch.sort(keys, stable=True)
    sorted_keys, order = sorted_keys[:n], order[:n]  # the padding sorts last
    boundaries = torch.arange(n_experts + 1, dtype=keys.dtype, device=keys.device)
    return order, torch.searchsorted(sorted_keys, boundaries).diff()


@dataclass
class DispatchPlan:
    """What ``combine`` needs to undo a ``dispatch``."""

    order: Tensor  # [T*K] flat assignment ids (token * K + k) in expert-major order (stable)
    token_of_row: Tensor  # [T*K] token of each expert-major row (order // K)
    token_rows: Tensor  # [T, K] expert-major row of each token's k-th assignment
    tokens_per_expert: Tensor  # [E] long, this rank's assignments per global expert
    tokens_per_local_expert: list[int]  # [E_local] rows each local expert received (all sources)
    send_splits: list[int] | None = None  # rows sent to each EP rank; None with one EP rank
    recv_splits: list[int] | None = None  # rows received from each EP rank
    local_order: Tensor | None = None  # received row ids in local-expert-major order
    local_order_inverse: Tensor | None = None
    group: ProcessGroup | None = None
    dropped: bool = False  # some assignments were over capacity: combine pads their rows with zeros
    local_counts: Tensor | None = None  # [E_local] tokens_per_local_expert, on the device
    slots: int | None = None  # static rows per expert of this rank's tokens (parallel/slots.py)


def dispatch(
    x: Tensor,
    expert_ids: Tensor,
    n_experts: int,
    group: ProcessGroup | None = None,
    keep: Tensor | None = None,
    slots: int | None = None,
) -> tuple[Tensor, DispatchPlan]:
    """Route each of the T*K assignments of ``x`` [T, D] to the rank owning its expert.

    Returns the local experts' input rows, local-expert-major, and the plan for ``combine``.
    Expert ``e`` lives on EP rank ``e // (n_experts // ep)``. ``keep`` [T, K] bool (capacity,
    ``model/moe/capacity.py``): only those assignments are sent; ``tokens_per_expert`` counts them.
    ``slots`` (with ``keep``, at least the kept assignments of any expert): each expert's rows are
    that many, zero-padded, from every EP rank, and nothing is read back to the host.
    """
    rows, plan = start_dispatch(x, expert_ids, n_experts, group, keep, overlap=False, slots=slots)
    return rows.wait(), plan


def start_dispatch(
    x: Tensor,
    expert_ids: Tensor,
    n_experts: int,
    group: ProcessGroup | None = None,
    keep: Tensor | None = None,
    *,
    overlap: bool = True,
    slots: int | None = None,
) -> tuple[Pending[Tensor], DispatchPlan]:
    """``dispatch`` with the rows' exchange started, not waited for (``overlap=False``: waited for
    at once, also in the backward). The plan is complete on return; the rows come with ``wait()``."""
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)
    if keep is None:
        if slots is not None:
            raise ValueError(f"slots={slots} needs keep: static slots hold the kept assignments")
        order, counts = sort_and_count(flat_ids, n_experts)
    else:  # a dropped assignment sorts after every expert's rows, as if to expert n_experts
        flat_ids = torch.where(keep.reshape(-1), flat_ids, n_experts)
        order, all_counts = sort_and_count(flat_ids, n_experts + 1)
        counts = all_counts[:n_experts]
        if slots is not None:
            index = slot_index(flat_ids, order, all_counts, n_experts, slots, top_k)
            return _start_in_slots(x, index, counts, group, slots, overlap)
    token_rows = _inverse_permutation(order).view(-1, top_k)
    plan = DispatchPlan(order, order // top_k, token_rows, counts, [], dropped=keep is not None)
    # all T*K rows, the dropped ones last: slicing them off below gives them a zero gradient, which
    # the backward's per-token sum then ignores
    packed = _PackTokens.apply(x, plan.token_of_row, plan.token_rows)

    ep = ep_size(group)
    if group is None or ep == 1:
        plan.tokens_per_local_expert, plan.local_counts = counts.tolist(), counts
        if plan.dropped:
            packed = packed[: sum(plan.tokens_per_local_expert)]
        return done(packed), plan

    # under autocast the experts compute in the autocast dtype: send that, half the bytes of fp32,
    # the same values (an autograd cast: the grads travel back narrow too, and widen here)
    packed = packed.to(wire_dtype(packed.dtype, packed.device))
    packed = probes.fault("all_to_all", packed)
    n_local = n_experts // ep
    send_matrix = counts.view(ep, n_local)
    recv_matrix = torch.empty_like(send_matrix)
    with probes.span("in_flight", "counts"):
        with probes.span("all_to_all", "counts"):
            work = dist.all_to_all_single(recv_matrix, send_matrix, group=group, async_op=True)
        hand_over()  # in a forward-backward pair the other microbatch computes while they travel
        with probes.span("all_to_all", "counts"):
            cast(dist.Work, work).wait()
    # one device-to-host read for all three lists (each read is a stream sync on CUDA)
    sizes: list[int] = torch.cat(
        [send_matrix.sum(dim=1), recv_matrix.sum(dim=1), recv_matrix.sum(dim=0)]
    ).tolist()
    plan.send_splits, plan.recv_splits = sizes[:ep], sizes[ep : 2 * ep]
    plan.tokens_per_local_expert = sizes[2 * ep :]
    plan.local_counts = recv_matrix.sum(dim=0)
    plan.group = group
    if plan.dropped:
        packed = packed[: sum(plan.send_splits)]
    if overlap:
        pending = start_all_to_all(packed, plan.recv_splits, plan.send_splits, group, "dispatch")
    else:
        pending = done(all_to_all(packed, plan.recv_splits, plan.send_splits, group, "dispatch"))

    # While the rows travel: the received rows are (source rank, local expert) blocks, source-major;
    # a stable sort by local expert keeps sources in rank order inside each expert, which is the
    # layout combine reverses.
    local_expert_of_row = torch.arange(n_local, device=x.device).repeat(ep)
    local_expert_of_row = local_expert_of_row.repeat_interleave(
        recv_matrix.reshape(-1),
        output_size=sum(plan.recv_splits),  # known size: no device sync
    )
    plan.local_order = local_order = sort_by_expert(local_expert_of_row, n_local)
    plan.local_order_inverse = inverse = _inverse_permutation(local_order)
    return Pending(lambda: _PermuteRows.apply(pending.wait(), local_order, inverse)), plan


def _start_in_slots(
    x: Tensor,
    index: SlotIndex,
    counts: Tensor,
    group: ProcessGroup | None,
    slots: int,
    overlap: bool,
) -> tuple[Pending[Tensor], DispatchPlan]:
    """``start_dispatch`` with static sizes: ``slots`` rows per expert from every EP rank."""
    plan = DispatchPlan(index.assignment_of_slot, index.token_of_slot, index.token_slots, counts,
                        [], dropped=True, slots=slots)  # fmt: skip
    packed = PackSlots.apply(x, index.slot_token, index.token_slots, index.kept)
    n_experts, ep = counts.numel(), ep_size(group)
    n_local = n_experts // ep
    plan.tokens_per_local_expert = [ep * slots] * n_local
    # torch.full: a kernel taking the number, no host-to-device copy
    plan.local_counts = torch.full((n_local,), ep * slots, dtype=torch.long, device=x.device)
    if group is None or ep == 1:
        return done(packed), plan
    packed = probes.fault("all_to_all", packed.to(wire_dtype(packed.dtype, packed.device)))
    plan.send_splits = plan.recv_splits = [n_local * slots] * ep
    plan.group = group
    if overlap:
        pending = start_all_to_all(packed, plan.recv_splits, plan.send_splits, group, "dispatch")
    else:
        pending = done(all_to_all(packed, plan.recv_splits, plan.send_splits, group, "dispatch"))
    # received: (source rank, local expert) blocks of ``slots`` rows; the experts want them expert-major
    return Pending(lambda: swap_major(pending.wait(), ep, n_local)), plan


def combine(expert_out: Tensor, weights: Tensor, plan: DispatchPlan) -> Tensor:
    """Return each token's router-weighted sum of its K expert outputs, [T, D] (reverse of dispatch)."""
    return start_combine(expert_out, weights, plan, overlap=False).wait()


def start_combine(
    expert_out: Tensor, weights: Tensor, plan: DispatchPlan, *, overlap: bool = True
) -> Pending[Tensor]:
    """``combine`` with the rows' way back started, not waited for (``overlap``: as ``start_dispatch``)."""
    if plan.group is None:  # one EP rank
        return done(_unpack(expert_out, weights, plan))
    # dispatch sets the splits with the group (more than one EP rank)
    assert plan.send_splits is not None and plan.recv_splits is not None
    if plan.slots is None:
        source_major = _PermuteRows.apply(expert_out, plan.local_order_inverse, plan.local_order)
    else:
        ep = len(plan.send_splits)
        source_major = swap_major(expert_out, len(plan.tokens_per_local_expert), ep)
    splits = (plan.send_splits, plan.recv_splits)
    if not overlap:
        return done(
            _unpack(all_to_all(source_major, *splits, plan.group, "combine"), weights, plan)
        )
    pending = start_all_to_all(source_major, *splits, plan.group, "combine")
    return Pending(lambda: _unpack(pending.wait(), weights, plan))


def _unpack(expert_out: Tensor, weights: Tensor, plan: DispatchPlan) -> Tensor:
    if plan.dropped:  # zero rows for the dropped assignments: they add nothing, get no gradient
        expert_out = F.pad(expert_out, (0, 0, 0, plan.order.numel() - expert_out.shape[0]))
    return _WeightedUnpack.apply(
        expert_out, weights, plan.order, plan.token_of_row, plan.token_rows
    )


class _WeightedUnpack(torch.autograd.Function):
    """Expert-major rows [T*K, D] -> sum over k of ``weights[t, k] * row(t, k)``, [T, D].

    The forward is one ``embedding_bag`` (token t's bag: its K rows, weighted), which gathers and sums
    without materialising [T, K, D]: ~3x faster on CPU than K gathers and multiply-adds. Hand-written
    backward: each row's gradient is its token's gradient (the dispatch gather again) times its weight,
    and each weight's gradient is its row dotted with that same gathered gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        rows: Tensor,
        weights: Tensor,
        order: Tensor,
        token_of_row: Tensor,
        token_rows: Tensor,
    ) -> Tensor:
        w = weights.to(rows.dtype)  # Mixtral applies the fp32 router weights in the hidden dtype
        ctx.save_for_backward(rows, w, order, token_of_row, token_rows)
        ctx.weights_dtype = weights.dtype
        return F.embedding_bag(token_rows, rows.contiguous(), per_sample_weights=w, mode="sum")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        rows, w, order, token_of_row, token_rows = ctx.saved_tensors
        grad_of_row = grad.index_select(0, token_of_row)  # [T*K, D], expert-major
        grad_rows = grad_weights = None
        if ctx.needs_input_grad[1]:
            per_row = torch.linalg.vecdot(rows, grad_of_row)  # [T*K], expert-major
            grad_weights = per_row.index_select(0, token_rows.reshape(-1)).view(token_rows.shape)
            grad_weights = grad_weights.to(ctx.weights_dtype)
        if ctx.needs_input_grad[0]:
            # a static slot with no assignment (order = T*K) takes the zero after the weights
            row_weight = F.pad(w.reshape(-1), (0, 1)).index_select(0, order).unsqueeze(1)
            grad_rows = grad_of_row.mul_(row_weight)
        return grad_rows, grad_weights, None, None, None


# Reference for the benchmark and tests: a per-expert Python loop, the plain way to produce
# the assignments.


def dispatch_loop_reference(
    x: Tensor, expert_ids: Tensor, n_experts: int
) -> tuple[Tensor, list[Tensor]]:
    """Pack ``x`` expert-major with one Python iteration per expert; also return each expert's
    (token, k) index pairs for ``combine_loop_reference``."""
    flat_ids = expert_ids.reshape(-1)
    counts = torch.bincount(flat_ids, minlength=n_experts)
    offsets = torch.zeros(n_experts + 1, dtype=torch.long, device=x.device)
    offsets[1:] = torch.cumsum(counts, dim=0)
    packed = x.new_empty((flat_ids.numel(), x.shape[1]))
    indices_per_expert = []
    for expert in range(n_experts):
        indices = torch.argwhere(expert_ids == expert)
        indices_per_expert.append(indices)
        if indices.numel() == 0:
            continue
        start, end = offsets[expert].item(), offsets[expert + 1].item()
        packed[start:end] = x[indices[:, 0]]
    return packed, indices_per_expert


def combine_loop_reference(
    expert_out: Tensor, weights: Tensor, indices_per_expert: list[Tensor]
) -> Tensor:
    out = expert_out.new_zeros((weights.shape[0], expert_out.shape[1]))
    start = 0
    for indices in indices_per_expert:
        end = start + indices.shape[0]
        if end > start:
            w = weights[indices[:, 0], indices[:, 1]].to(expert_out.dtype).unsqueeze(-1)
            out.index_add_(0, indices[:, 0], expert_out[start:end] * w)
        start = end
    return out
