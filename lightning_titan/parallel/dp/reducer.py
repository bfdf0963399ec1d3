"""Bucketed, hook-driven gradient all-reduce that overlaps communication with backward.

Parameters are packed into flat buckets in reverse registration order (backward produces the last
layers' grads first). Each parameter's post-accumulate-grad hook moves its grad into its bucket's
slice (the grad is dropped: one copy of it): the backwards under ``no_sync()`` sum into the slices,
and on the backward that completes gradient accumulation a bucket whose slices are all filled is
ready; ready buckets launch their async all-reduce strictly in bucket order, so every rank of the
group enters the same collectives in the same order (NCCL needs it) while backward keeps computing
earlier layers. ``finish()`` launches whatever is left, waits, and hands each reduced grad back as a
view of its bucket.

Order across groups. Backward also runs other groups' collectives (the EP all-to-alls), and NCCL needs
every rank to enqueue collectives of different communicators in the same relative order: a rank that
launches a bucket from a hook between two all-to-alls while its peer launches the same bucket from
``finish()`` (its hooks never all fired: a parameter unused there) can deadlock. So a bucket launches
from a hook only if, in the previous step, every hook of that bucket fired on every rank of the group
(one flag per bucket, reduced with the bucket itself: no extra collective); the first step and every
bucket that ever missed a hook on some rank launch from ``finish()``, in bucket order, on every rank.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_titan.parallel.dp.master import MasterWeights
from lightning_titan.runtime import probes

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
    # together so that a parameter no rank used keeps grad None (as in one process, and as DDP does),
    # then two flags: "all its hooks fired" and "launched from a hook" (after the sum: the counts of
    # such ranks; see the module doc).
    # None in "per_param" mode, which reduces p.grad in place.
    buffer: Tensor | None
    filled: list[bool] = field(default_factory=list)
    # the slots the step's backwards under no_sync() summed into the buffer (GradReducer._add)
    summed: list[bool] = field(default_factory=list)
    num_filled: int = 0
    num_hooked: int = 0  # slots filled by a hook (the rest by finish)
    hooked_launch: bool = False  # launched from a hook (else from finish)
    work: dist.Work | None = None

    def reset(self) -> None:
        self.filled = [False] * len(self.params)
        self.summed = [False] * len(self.params)
        self.num_filled = self.num_hooked = 0
        self.hooked_launch = False
        self.work = None
        if self.buffer is not None:  # every parameter has a grad until _fill finds none
            self.buffer[self.numel :].fill_(1.0)  # a device fill (see _start)

    @property
    def numel(self) -> int:
        """Elements of the grads, without the flags."""
        return self.offsets[-1] + self.params[-1].numel()

    @property
    def all_hooked(self) -> bool:
        return self.num_hooked == len(self.params)


class GradReducer:
    """Bucketed, hook-driven, overlapped all-reduce of the grads of one set of parameters over one group.

    ``scale`` multiplies every grad before the SUM all-reduce (gloo has no AVG). ``group`` None or of
    size 1 means no collective: ``finish()`` only scales. ``mode="per_param"`` is the simplest
    baseline (one all-reduce per parameter, on ``p.grad`` in place), kept for the benchmark; it obeys
    the same launch-order rule.

    Run the backwards that only accumulate inside ``with reducer.no_sync():`` (their hooks only sum
    into the buckets), the one that completes the step's accumulation outside it; call ``finish()`` every step on every
    rank of the group before the optimizer step.
    """

    # the backwards under no_sync() sum their grads into the persistent buckets (ZeRO-2's are made
    # per step, in its last backward: its grads accumulate on the parameters)
    sums_in_buckets = True

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup | None,
        *,
        scale: float,
        bucket_cap_mb: float = 25.0,
        mode: str = "bucketed",
        masters: MasterWeights | None = None,
    ) -> None:
        """``masters`` (``param_dtype="bf16"``): the buckets of parameters with an fp32 master are
        fp32, and the reduced grad goes to the master's ``.grad`` (``parallel/dp/master.py``)."""
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
        if masters is not None and len(masters) and mode != "bucketed":
            raise ValueError(
                f"param_dtype='bf16' reduces the grads in fp32 buckets; reducer={mode!r} reduces "
                "each bf16 grad in place: use reducer='bucketed' with it"
            )
        params = [p for p in params if p.requires_grad]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter appears twice in params; pass each parameter once")
        self.params = params
        self.group = group
        self.scale = float(scale)
        self.mode = mode
        self.masters = masters
        # inside no_sync(): the hooks only sum each grad into its bucket (``_add``; nothing
        # launches). State of the reducer's own, set and restored by its context manager around the
        # caller's backward: autograd, not the caller, calls the hooks
        self._accumulating = False
        # Test/benchmark record of the last finished step: (bucket index, "hook" | "finish"), and the
        # launch order that step agreed on (see launch_order).
        self.last_launch_log: list[tuple[int, str]] = []
        self.last_launch_order: list[int] = []
        self._launch_log: list[tuple[int, str]] = []
        self._world = 1 if group is None else dist.get_world_size(group)
        self._trivial = self._world == 1
        self._buckets: list[_Bucket] = []
        self._launched: list[bool] = []
        # buckets that launch from a hook this step: agreed by every rank of the group (module doc)
        self._from_hooks: list[bool] = []
        self._demoted: set[int] = set()  # once a hook was missing somewhere, finish() only
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        if self._trivial:
            return  # nothing to overlap: finish() scales in place
        cap = 0.0 if mode == "per_param" else bucket_cap_mb * _MIB
        for b, indices in enumerate(assign_buckets(params, cap)):
            self._buckets.append(self._make_bucket([params[i] for i in indices]))
            self._launched.append(False)
            self._from_hooks.append(False)  # the first step cannot know: launch from finish()
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
            # bf16 grads of parameters with an fp32 master are summed in fp32 (the copy in casts)
            has_master = self.masters is not None and self.masters.of(params[0]) is not None
            dtype = torch.float32 if has_master else params[0].dtype
            buffer = torch.zeros(total + len(params) + 2, dtype=dtype, device=params[0].device)
        bucket = _Bucket(params, offsets, buffer)
        bucket.reset()
        return bucket

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """The backwards run inside only accumulate: each grad is summed into its bucket and
        dropped (``sums_in_buckets``; else it accumulates on ``p.grad``), nothing launches (the last
        backward of the step runs outside, or ``finish()`` reduces what was accumulated)."""
        outer, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = outer

    @property
    def bucket_params(self) -> list[list[nn.Parameter]]:
        """The parameters of each bucket, in bucket order (empty when there is no collective)."""
        return [list(b.params) for b in self._buckets]

    def _hook(self, b: int, slot: int) -> Callable[[Tensor], None]:
        def on_grad_accumulated(param: Tensor) -> None:
            bucket = self._buckets[b]
            if self._accumulating:
                if self.sums_in_buckets and bucket.buffer is not None:
                    self._add(bucket, slot)
                return
            if bucket.filled[slot]:
                raise RuntimeError(
                    f"the grad of a parameter of shape {tuple(param.shape)} (bucket {b}) became ready "
                    "twice before finish(): run the backwards that only accumulate inside "
                    "reducer.no_sync(), the last one outside it, and call finish() every step"
                )
            self._fill(bucket, slot)
            bucket.num_hooked += 1
            if bucket.num_filled == len(bucket.params) and self._from_hooks[b]:
                self._launch_ready_hooked()

        return on_grad_accumulated

    def _add(self, bucket: _Bucket, slot: int) -> None:
        """A backward under ``no_sync()``: this slot's grad summed into its bucket (in the bucket's
        dtype: fp32 under bf16 weights) and dropped, so the step holds one copy of its grads
        however many microbatches it runs; ``_fill`` adds the last backward's."""
        param = bucket.params[slot]
        assert param.grad is not None  # the hook fires once a grad is accumulated
        view = self._slice(bucket, slot)
        if bucket.summed[slot]:
            view.add_(param.grad)
        else:
            view.copy_(param.grad)
            bucket.summed[slot] = True
        param.grad = None

    def _fill(self, bucket: _Bucket, slot: int) -> None:
        """Take this slot's grad; a missing grad (parameter unused this step) contributes zeros."""
        param = bucket.params[slot]
        if bucket.buffer is not None and bucket.summed[slot]:  # the sum of the earlier backwards
            if param.grad is not None:
                self._slice(bucket, slot).add_(param.grad)
                param.grad = None
        elif bucket.buffer is not None:
            view = self._slice(bucket, slot)
            if param.grad is None:
                view.zero_()
                flag = self._flag_index(bucket, slot)
                bucket.buffer[flag : flag + 1].fill_(0.0)
            else:
                view.copy_(param.grad)
                param.grad = None  # the bucket holds it now; the reduced grad comes back a view
        elif param.grad is None:
            param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        elif not param.grad.is_contiguous():
            param.grad = param.grad.contiguous()  # collectives need a dense tensor
        bucket.filled[slot] = True
        bucket.num_filled += 1

    @staticmethod
    def _slice(bucket: _Bucket, slot: int) -> Tensor:
        assert bucket.buffer is not None  # "bucketed" mode: its callers check
        param, start = bucket.params[slot], bucket.offsets[slot]
        return bucket.buffer[start : start + param.numel()].view(param.shape)

    @staticmethod
    def _flag_index(bucket: _Bucket, slot: int) -> int:
        return bucket.numel + slot

    @property
    def unfinished(self) -> bool:
        """A backward outside ``no_sync()`` filled a slot since the last ``finish()``."""
        return any(b.num_filled for b in self._buckets)

    @property
    def launch_order(self) -> list[int]:
        """This step's bucket order: the hook buckets, then the others, each in bucket order. Built
        from reduced values only, so every rank of the group has the same list, and launching strictly
        in it (hooks a prefix, ``finish()`` the rest) gives one collective sequence on every rank."""
        hooked = [b for b, yes in enumerate(self._from_hooks) if yes]
        return hooked + [b for b, yes in enumerate(self._from_hooks) if not yes]

    def _launch_ready_hooked(self) -> None:
        for b in self.launch_order:
            if not self._from_hooks[b]:
                return  # the rest launch from finish()
            if not self._launched[b]:
                bucket = self._buckets[b]
                if bucket.num_filled < len(bucket.params):
                    return
                self._launch(b, "hook")

    def _launch(self, b: int, where: str) -> None:
        bucket = self._buckets[b]
        bucket.work = self._start(b, bucket, where)
        self._launch_log.append((b, where))
        self._launched[b] = True
        bucket.hooked_launch = where == "hook"

    def _start(self, b: int, bucket: _Bucket, where: str) -> dist.Work:
        """Scale the bucket's grads and start its async all-reduce."""
        if bucket.buffer is None:
            flat = bucket.params[0].grad
            assert flat is not None  # _fill gave every filled slot a grad
        else:
            # device fills, whose Python scalar is a kernel argument (an item assignment of it
            # would be a copy from the host: lift_fresh + copy_, a sync on CUDA)
            bucket.buffer[-2:-1].fill_(float(bucket.all_hooked))
            bucket.buffer[-1:].fill_(float(where == "hook"))
            flat = bucket.buffer[: bucket.numel]  # the flags stay unscaled counts
        if self.scale != 1.0:
            flat.mul_(self.scale)
        with probes.span("all_reduce", "grad bucket launch", bucket=b):
            return dist.all_reduce(
                flat if bucket.buffer is None else bucket.buffer, group=self.group, async_op=True
            )

    def finish(self) -> None:
        """Launch every bucket not launched yet (in ``launch_order``), wait for all, write the reduced
        grads back, and agree on which buckets may launch from hooks next step.

        A parameter whose hook never fired in the last backward counts with what the backwards
        under ``no_sync()`` summed (or accumulated on ``p.grad``) or zeros if it has none, so unused parameters never hang the group; one
        that no rank of the group used keeps ``grad = None``, exactly as in a single process.
        """
        if self._trivial:
            for p in self.params:
                holder = self._holder(p)
                if holder is not p:  # the master's fp32 grad; the bf16 one goes
                    holder.grad = None if p.grad is None else p.grad.to(holder.dtype)
                    p.grad = None
                if holder.grad is not None and self.scale != 1.0:
                    holder.grad.mul_(self.scale)
            return
        order = self.launch_order
        for b in order:
            if not self._launched[b]:
                bucket = self._buckets[b]
                for slot, filled in enumerate(bucket.filled):
                    if not filled:
                        self._fill(bucket, slot)
                self._launch(b, "finish")
        counts = self._hook_counts()
        for b, bucket in enumerate(self._buckets):
            assert bucket.work is not None  # every bucket was launched just above
            with probes.span("wait", "grad all-reduce"):
                bucket.work.wait()
            flags = self._write_back(bucket)
            if flags is not None:
                counts[b] = flags
            bucket.reset()
        self._agree_on_hooks(counts)
        self.last_launch_log, self._launch_log = self._launch_log, []
        self.last_launch_order = order

    def _write_back(self, bucket: _Bucket) -> list[float] | None:
        """The reduced grads into ``p.grad`` (None where no rank had one); the bucket's two hook
        counts, or None in "per_param" mode (reduced in place, no flags)."""
        if bucket.buffer is None:
            return None
        # one device-to-host read per bucket (each is a stream sync on CUDA)
        flags = bucket.buffer[bucket.numel :].tolist()
        for slot, param in enumerate(bucket.params):
            # a view of the bucket, not a copy (DDP's gradient_as_bucket_view): one copy of the
            # grads a step, which the next step's fill overwrites once the optimizer has read it
            p = self._holder(param)  # bf16 weights: the master takes the fp32 sum
            p.grad = None if flags[slot] == 0 else self._slice(bucket, slot)
        return flags[-2:]

    def _holder(self, param: nn.Parameter) -> nn.Parameter:
        """Where ``param``'s reduced grad goes: its fp32 master, or itself."""
        return param if self.masters is None else self.masters.grad_holder(param)

    def reduced_grad(self, param: nn.Parameter) -> Tensor | None:
        """``param``'s reduced grad after ``finish()`` (bf16 weights: its master's, fp32)."""
        return self._holder(param).grad

    def _hook_counts(self) -> list[list[float]]:
        """Per bucket, on how many ranks (all its hooks fired, it launched from a hook). "bucketed"
        reads them from the flags that travelled with the bucket (filled in after the waits);
        "per_param" has no room for flags and pays one small all-reduce, after every bucket, at the
        same place on every rank."""
        if self.mode == "bucketed":
            return [[0.0, 0.0] for _ in self._buckets]
        device = self._buckets[0].params[0].device
        mine = [[float(b.all_hooked), float(b.hooked_launch)] for b in self._buckets]
        counts = torch.tensor(mine, device=device)
        dist.all_reduce(counts, group=self.group)
        return counts.tolist()

    def _agree_on_hooks(self, counts: list[list[float]]) -> None:
        """Next step's hook buckets, the same list on every rank (built from reduced values only)."""
        for b, (all_hooked, hook_launches) in enumerate(counts):
            if 0 < hook_launches < self._world:
                self._demoted.add(b)
                warnings.warn(
                    f"grad bucket {b} launched from a backward hook on some ranks and from finish() "
                    "on others (a parameter used on some ranks only): under NCCL that order can "
                    "deadlock against other groups' collectives. It launches from finish() from now on.",
                    stacklevel=3,
                )
            self._from_hooks[b] = all_hooked == self._world and b not in self._demoted
            self._launched[b] = False

    def remove(self) -> None:
        """Remove the grad hooks; ``finish()`` then still reduces ``p.grad``, only without overlap."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
