"""Bucketed, hook-driven gradient all-reduce that overlaps communication with backward.

Parameters are packed into flat buckets in reverse registration order (backward produces the last
layers' grads first). On the backward that completes gradient accumulation, each parameter's
post-accumulate-grad hook copies its grad into its bucket's slice; a bucket whose slices are all
filled is ready, and ready buckets launch their async all-reduce strictly in bucket order, so every
rank of the group enters the same collectives in the same order (DESIGN invariant 6) while backward
keeps computing earlier layers. ``finish()`` launches whatever is left, waits, and writes back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_titan.tracing import span

MODES = ("bucketed", "per_param")
_MIB = 1024 * 1024


def assign_buckets(params: Sequence[nn.Parameter], cap_bytes: float) -> list[list[int]]:
    """Indices of ``params`` per bucket: filled in reverse order up to ``cap_bytes`` per bucket.

    Each (dtype, device) has its own open bucket because a flat buffer holds one dtype; a parameter
    larger than the cap gets a bucket of its own. Buckets are numbered in the order they are opened.
    """
    buckets: list[list[int]] = []
    sizes: list[int] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], int] = {}
    for index in reversed(range(len(params))):
        param = params[index]
        nbytes = param.numel() * param.element_size()
        key = (param.dtype, param.device)
        b = open_bucket.get(key)
        if b is None or sizes[b] + nbytes > cap_bytes:
            b = len(buckets)
            buckets.append([])
            sizes.append(0)
            open_bucket[key] = b
        buckets[b].append(index)
        sizes[b] += nbytes
    return buckets


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    offsets: list[int]
    # Flat buffer in "bucketed" mode: the grads, then one "has a grad" flag per parameter, reduced
    # together so that a parameter no rank used keeps grad None (as in one process, and as DDP does).
    # None in "per_param" mode, which reduces p.grad in place.
    buffer: Tensor | None
    filled: list[bool] = field(default_factory=list)
    num_filled: int = 0
    work: dist.Work | None = None

    def reset(self) -> None:
        self.filled = [False] * len(self.params)
        self.num_filled = 0
        self.work = None


class GradReducer:
    """Bucketed, hook-driven, overlapped all-reduce of the grads of one set of parameters over one group.

    ``scale`` multiplies every grad before the SUM all-reduce (gloo has no AVG). ``group`` None or of
    size 1 means no collective: ``finish()`` only scales. ``mode="per_param"`` is the write-up's seed
    baseline (one all-reduce per parameter, on ``p.grad`` in place), kept for the benchmark; it obeys
    the same launch-order rule.

    Set ``sync`` False for the backwards that only accumulate (hooks then do nothing) and True before
    the one that completes the step's accumulation; call ``finish()`` every step on every rank of the
    group before the optimizer step.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup | None,
        *,
        scale: float,
        bucket_cap_mb: float = 25.0,
        mode: str = "bucketed",
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not a reducer mode; choose one of {MODES}")
        if not (isinstance(bucket_cap_mb, (int, float)) and math.isfinite(bucket_cap_mb)) or (
            bucket_cap_mb <= 0
        ):
            raise ValueError(
                f"bucket_cap_mb={bucket_cap_mb!r} must be a positive finite number of MiB "
                "(a tiny value gives one parameter per bucket)"
            )
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale={scale!r} must be a positive finite factor (1/group size)")
        params = [p for p in params if p.requires_grad]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in params; pass each parameter once")
        self.params = params
        self.group = group
        self.scale = float(scale)
        self.mode = mode
        self.sync = True
        # Test/benchmark record of the last finished step: (bucket index, "hook" | "finish").
        self.last_launch_log: list[tuple[int, str]] = []
        self._launch_log: list[tuple[int, str]] = []
        self._trivial = group is None or dist.get_world_size(group) == 1
        self._buckets: list[_Bucket] = []
        self._next_launch = 0
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        if self._trivial:
            return  # nothing to overlap: finish() scales in place
        cap = 0.0 if mode == "per_param" else bucket_cap_mb * _MIB
        for b, indices in enumerate(assign_buckets(params, cap)):
            self._buckets.append(self._make_bucket([params[i] for i in indices]))
            for slot, i in enumerate(indices):
                hook = self._hook(b, slot)
                self._handles.append(params[i].register_post_accumulate_grad_hook(hook))

    def _make_bucket(self, params: list[nn.Parameter]) -> _Bucket:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        buffer = None
        if self.mode == "bucketed":
            buffer = torch.zeros(
                total + len(params), dtype=params[0].dtype, device=params[0].device
            )
        bucket = _Bucket(params, offsets, buffer)
        bucket.reset()
        return bucket

    @property
    def bucket_params(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in launch order (empty when there is no collective)."""
        return [list(b.params) for b in self._buckets]

    def _hook(self, b: int, slot: int):
        def on_grad_accumulated(param: Tensor) -> None:
            if not self.sync:
                return
            bucket = self._buckets[b]
            if bucket.filled[slot]:
                raise RuntimeError(
                    f"the grad of a parameter of shape {tuple(param.shape)} (bucket {b}) became ready "
                    "twice before finish(): set reducer.sync = False for the backwards that only "
                    "accumulate and True just before the last one, and call finish() every step"
                )
            self._fill(bucket, slot)
            if bucket.num_filled == len(bucket.params):
                self._launch_ready("hook")

        return on_grad_accumulated

    def _fill(self, bucket: _Bucket, slot: int) -> None:
        """Take this slot's grad; a missing grad (parameter unused this step) contributes zeros."""
        param = bucket.params[slot]
        if bucket.buffer is not None:
            view = self._slice(bucket, slot)
            if param.grad is None:
                view.zero_()
            else:
                view.copy_(param.grad)
            bucket.buffer[self._flag_index(bucket, slot)] = float(param.grad is not None)
        elif param.grad is None:
            param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        elif not param.grad.is_contiguous():
            param.grad = param.grad.contiguous()  # collectives need a dense tensor
        bucket.filled[slot] = True
        bucket.num_filled += 1

    @staticmethod
    def _slice(bucket: _Bucket, slot: int) -> Tensor:
        param, start = bucket.params[slot], bucket.offsets[slot]
        return bucket.buffer[start : start + param.numel()].view(param.shape)

    @staticmethod
    def _flag_index(bucket: _Bucket, slot: int) -> int:
        return bucket.buffer.numel() - len(bucket.params) + slot

    def _launch_ready(self, where: str) -> None:
        # Strictly in bucket order, so every rank issues the same collective sequence.
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.num_filled < len(bucket.params):
                return
            flat = bucket.buffer if bucket.buffer is not None else bucket.params[0].grad
            if self.scale != 1.0:
                flat.mul_(self.scale)
            with span("all_reduce", "grad bucket launch", bucket=self._next_launch):
                bucket.work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._launch_log.append((self._next_launch, where))
            self._next_launch += 1

    def finish(self) -> None:
        """Launch every bucket not launched yet (in order), wait for all, write the reduced grads back.

        A parameter whose hook never fired counts with its current ``p.grad`` (accumulated by
        non-sync backwards) or zeros if it has none, so unused parameters never hang the group; one
        that no rank of the group used keeps ``grad = None``, exactly as in a single process.
        """
        if self._trivial:
            for p in self.params:
                if p.grad is not None and self.scale != 1.0:
                    p.grad.mul_(self.scale)
            return
        for bucket in self._buckets[self._next_launch :]:
            for slot, filled in enumerate(bucket.filled):
                if not filled:
                    self._fill(bucket, slot)
        self._launch_ready("finish")
        for bucket in self._buckets:
            with span("wait", "grad all-reduce"):
                bucket.work.wait()
            if bucket.buffer is not None:
                for slot, p in enumerate(bucket.params):
                    reduced = self._slice(bucket, slot)
                    if bucket.buffer[self._flag_index(bucket, slot)] == 0:
                        p.grad = None
                    elif p.grad is None:
                        p.grad = reduced.clone()
                    else:
                        p.grad.copy_(reduced)
            bucket.reset()
        self._next_launch = 0
        self.last_launch_log, self._launch_log = self._launch_log, []

    def remove(self) -> None:
        """Remove the grad hooks; ``finish()`` then still reduces ``p.grad``, only without overlap."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
