"""ZeRO-3: each rank keeps only its rows of every sharded parameter between the parameter's uses.

The rows are the ZeRO-1 shards' leaves (``zero.py``), dense copies with their own storage, which the
optimizer steps; the full parameter's storage is freed (``untyped_storage().resize_(0)``, as FSDP1
does: the parameter object stays, and so do its views and the tensors autograd saved of it, all
holding the same storage, which a gather refills in place). The model is cut into units: each
decoder block, and the rest of the stage (embedding, final norm, head) as one more.

When a unit's parameters are whole depends on ``reshard_after_forward`` (FSDP's name for the
choice). True, where one stage runs its microbatches one at a time (pp=1 under gpipe or 1f1b):

- a block: gathered by a forward pre-hook, freed by its forward post-hook; gathered again by a hook
  on the grad of its output hidden states (the first grad to reach the block's weights: the
  per-sequence aux loss's grad reaches the block earlier, but only through nodes that read no
  weight, the router's softmax waiting for both), and freed by a hook on the grad of its input
  (the block's backward is done: every node reading a weight lies on a path to its input). Each
  forward and backward of every microbatch gathers once (``reshard_after_forward``). Activation
  checkpointing's recompute runs the block's forward inside its backward, after the gather: the
  block is then kept whole for the backward that reads what the recompute saved.
- prefetch (FSDP2's): the gather that makes block ``i`` whole in the forward also issues block
  ``i + 1``'s all-gather, not waited (``async_op``), whose pre-hook then only waits for it and copies
  it out (block 0's is issued by the stage's pre-hook, under the embedding); in the backward, block
  ``i``'s gather issues block ``i - 1``'s. The next block's collective runs while this one
  computes. The peak is two blocks whole beyond the rows and the rest: the one computing and the
  one in flight (its storage filled by the gather). No forward prefetch from activation
  checkpointing's recompute (the next block's backward is done by then).
- the last block is kept whole from its forward into its backward, the next thing to read it
  (torchtitan leaves its last block unresharded for the same reason): its backward gather, which
  nothing could hide, is saved. Another forward first (gpipe's next microbatch) frees it at its
  first block, so the peak stays two blocks; its backward then gathers it again.
  A prefetched unit is waited before anything reads its storage or the gather buffer is reused: at
  its own gather, at any other unit's gather (one unit in flight at a time), at its release and at
  ``release_all``.
- the rest: gathered before the stage's forward and kept until the step's grads are reduced
  (``release_all``): the head runs first in the backward and the embedding last, so it would be
  gathered twice a microbatch for little memory.

False, under a pipeline (pp > 1) and the schedules that run one microbatch's forward beside another's
backward or split the backward (B then W): every unit is gathered once, before the step's first
forward (``gather_for_step``), and kept whole until the step's grads are reduced (``release_all``).
A stage's blocks are then read by microbatches in flight at once, in whatever order the schedule
runs them, and nothing is gathered in a forward or a backward (none on an overlapped thread): the
stage whole during the step, its rows only between steps, one all-gather a parameter a step. While
whole, each leaf is a view of its rows in the parameter (no second copy of them: the step's peak is
zero=2's); freeing the unit copies them out again.

bf16 weights (``param_dtype="bf16"``, ``master.py``): each leaf is the fp32 master of its rows, a
tensor of its own (never a view into the bf16 parameter, not even while the stage is kept whole),
and the gathered parameters are bf16: packing the gather buffer casts each rank's master rows to
bf16, so the all-gather moves half the bytes and a gathered block holds 2 bytes a parameter.
Between steps a rank holds only its fp32 master rows (and their grads and moments), no bf16 copy of
them. A checkpoint load writes the masters' rows, which ``take_rows`` then leaves alone.

The grads are ZeRO-2's (``zero_grads.py``): reduce-scattered into the leaves (bf16 weights: in fp32,
into the masters' grads). Every rank of a group
runs the same stage's blocks in the same order, so the gathers match across ranks. A prefetch is
issued at the same point of that order on every rank (the hook of the block before it, whose
position among the reducer's reduce-scatters on the same group is the same on every rank: the
autograd engine runs a graph's ready nodes in one fixed order), which it must be: gloo and NCCL
pair a group's collectives by the order each rank issues them, not by what they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_titan.parallel.collectives import start_all_gather_
from lightning_titan.parallel.dp.zero import ZeroGroup
from lightning_titan.runtime import probes


class _ReleaseAfterBackward(torch.autograd.Function):
    """The identity on a block's input; its backward (the block's own is done then) frees the block."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, release: Any) -> Tensor:
        ctx.release = release
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.release()
        return grad, None


class ShardedParams:
    """The units of a stage whose parameters zero=3 gathers and frees (module doc).

    ``blocks``: the modules gathered around their own forward and backward (the decoder blocks);
    ``stage``: the module whose forward needs the rest of the parameters (its embedding, norm, head).
    ``groups``: the ZeroGroups built with ``units=self.units`` (each unit: a block's parameters, then
    the rest). ``reshard_after_forward``: each block freed after its forward and gathered again for
    its backward (True), or the whole stage kept from the step's first forward to its end (False).
    """

    def __init__(
        self, stage: nn.Module, blocks: Sequence[nn.Module], *, reshard_after_forward: bool = True
    ) -> None:
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        self.blocks = list(blocks)
        self.units: list[list[nn.Parameter]] = [list(b.parameters()) for b in blocks]
        self.units.append([p for p in stage.parameters() if id(p) not in in_blocks])
        self.rest = len(self.units) - 1
        self.groups: list[ZeroGroup] = []
        self.gathered = [True] * len(self.units)  # whole until ``shard`` frees them
        # a block from its output's grad to its input's: a forward then is activation
        # checkpointing's recompute, which the backward after it reads (kept whole)
        self.in_backward = [False] * len(self.units)
        self.sharded = False
        self.reshard_after_forward = reshard_after_forward
        # the unit whose all-gather is issued and not waited yet (a prefetch), and its works (one
        # list a group); a pending unit is not ``gathered`` until ``_finish_pending``
        self.pending: tuple[int, list[list[Any]]] | None = None
        # the blocks' gathers from the hooks: found in flight (prefetched) or run there and then;
        # wasted: a prefetch freed (or out of order) before its block used it
        self.counts = {"prefetched": 0, "gathered": 0, "kept": 0, "wasted": 0}
        # the last block, kept whole from its forward into its backward, which comes next
        self.kept: int | None = None
        self._handles: list[RemovableHandle] = [stage.register_forward_pre_hook(self._pre_stage)]
        for u, block in enumerate(self.blocks if reshard_after_forward else ()):
            self._handles.append(block.register_forward_pre_hook(self._pre_block(u)))
            self._handles.append(block.register_forward_hook(self._post_block(u)))

    def shard(self, groups: Sequence[ZeroGroup]) -> None:
        """Once the optimizer steps the leaves: keep only the rows from here on."""
        self.groups = list(groups)
        for g in self.groups:
            keep_rows_only(g)
        self.gathered = [False] * len(self.units)
        self.sharded = True

    def gather(self, unit: int) -> None:
        if not self.sharded or self.gathered[unit]:
            return
        if self.pending is not None:  # one unit in flight at a time: the gather buffer is its
            if self._finish_pending() == unit:
                return
            self.counts["wasted"] += 1
        in_place = not self.reshard_after_forward
        for g in self.groups:
            finish_gather(g, unit, start_gather(g, unit), leaves_in_place=in_place)
        self.gathered[unit] = True

    def prefetch(self, unit: int) -> None:
        """Issue unit ``unit``'s all-gather and return; ``gather(unit)`` waits for it."""
        if not self.sharded or self.gathered[unit] or not 0 <= unit < len(self.blocks):
            return
        if self.pending is not None:
            if self.pending[0] == unit:
                return
            self._finish_pending()
            self.counts["wasted"] += 1
        self.pending = (unit, [start_gather(g, unit) for g in self.groups])

    def _finish_pending(self) -> int:
        """Wait for the unit in flight and copy it out into its parameters; that unit."""
        assert self.pending is not None
        unit, works = self.pending
        self.pending = None
        for g, work in zip(self.groups, works, strict=True):
            finish_gather(g, unit, work, leaves_in_place=not self.reshard_after_forward)
        self.gathered[unit] = True
        return unit

    def _use(self, unit: int) -> None:
        """A block's gather from a hook, counted (``counts``)."""
        if self.sharded and not self.gathered[unit]:
            hit = self.pending is not None and self.pending[0] == unit
            self.counts["prefetched" if hit else "gathered"] += 1
        elif self.kept == unit:
            self.counts["kept"] += 1
            self.kept = None
        self.gather(unit)

    def release(self, unit: int) -> None:
        if self.kept == unit:
            self.kept = None
        if self.pending is not None and self.pending[0] == unit:
            self._finish_pending()  # the collective writes the storage until waited
            self.counts["wasted"] += 1
        if self.sharded and self.gathered[unit]:
            for g in self.groups:
                release_unit(g, unit)
            self.gathered[unit] = False

    def _backward_starts(self, unit: int) -> None:
        self.in_backward[unit] = True
        self._use(unit)
        self.prefetch(unit - 1)  # the block whose backward comes next

    def _backward_done(self, unit: int) -> None:
        self.in_backward[unit] = False
        self.release(unit)

    def gather_for_step(self) -> None:
        """Before a step's (or an evaluation's) first forward, on the schedule's thread: every unit
        whole for the step (``reshard_after_forward=False``); otherwise the hooks gather each unit
        at its use."""
        if not self.reshard_after_forward:
            self.gather_all()

    def release_all(self) -> None:
        """After the step's grads are reduced: nothing but the rows until the next forward."""
        if self.pending is not None:
            self.release(self.pending[0])
        for unit in range(len(self.units)):
            self.release(unit)

    def gather_all(self) -> None:
        """Every parameter whole (to read or write the model: a checkpoint, a test); ``take_rows``
        then ``release_all`` undo it."""
        for unit in range(len(self.units)):
            self.gather(unit)

    @torch.no_grad()
    def take_rows(self) -> None:
        """Each leaf from its rows of the whole parameter, which a checkpoint load may have
        written since ``gather_all``."""
        for g in self.groups:
            for s in g.shards.values():
                if not s.master:  # an fp32 master's rows: what a load wrote, finer than the bf16
                    s.leaf.copy_(s.rows(s.param.data))

    def _pre_stage(self, module: nn.Module, args: tuple) -> None:
        # a forward outside a step (kept whole: every unit; a no-op once ``gather_for_step`` ran)
        if self.reshard_after_forward:
            self.gather(self.rest)
            self.prefetch(0)  # under the embedding
        else:
            self.gather_all()

    def _pre_block(self, unit: int) -> Any:
        def hook(module: nn.Module, args: tuple) -> tuple | None:
            recompute = self.in_backward[unit]  # the next block's backward is done already
            if not recompute and self.kept is not None and self.kept != unit:
                self.release(self.kept)  # another forward came first (gpipe's next microbatch)
            self._use(unit)
            if not recompute:
                self.prefetch(unit + 1)  # the block whose forward comes next
            x = args[0] if args else None
            if self.sharded and torch.is_grad_enabled() and isinstance(x, Tensor):
                if x.requires_grad:
                    done = lambda: self._backward_done(unit)  # noqa: E731
                    return (_ReleaseAfterBackward.apply(x, done), *args[1:])
            return None

        return hook

    def _post_block(self, unit: int) -> Any:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self.in_backward[unit]:  # the recompute: its backward comes next
                return
            x = output[0] if isinstance(output, tuple) else output
            backward = self.sharded and isinstance(x, Tensor) and x.requires_grad
            if backward and unit == len(self.blocks) - 1:
                self.kept = unit  # its backward is the next to read it: not gathered again
            else:
                self.release(unit)
            if backward:
                x.register_hook(lambda grad: self._backward_starts(unit))

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def keep_rows_only(group: ZeroGroup) -> None:
    """Once the optimizer holds ``group``'s leaves: every leaf becomes a dense copy of its rows and
    each sharded parameter's storage is freed (resized to nothing; the parameter object, its views
    and the tensors autograd saved of it keep the storage, which ``start_gather`` fills again)."""
    for s in group.shards.values():
        if not s.dense:  # a dense leaf (``densify``) has its own storage already
            s.leaf.data = s.leaf.data.clone(memory_format=torch.contiguous_format)
    for s in group.shards.values():
        s.param.data.untyped_storage().resize_(0)
    group.dense_shards = list(group.shards.values())


@torch.no_grad()
def start_gather(group: ZeroGroup, unit: int) -> list[Any]:
    """Unit ``unit``'s sharded parameters of ``group``: their storage allocated, every rank's rows
    (its leaves) packed into the unit's gather buffer and one all-gather per bucket issued, not
    waited; ``finish_gather`` completes it. bf16 weights: the buffer is bf16, the parameters'
    dtype, and packing casts the leaves (the fp32 masters' rows) into it: half the bytes gathered. Until then nothing may read those storages or the
    buffer, nor another unit of ``group`` gather (they share the buffer)."""
    works = []
    for bucket in group.unit_buckets[unit]:
        for s in bucket.shards:
            storage = s.param.data.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(s.param.numel() * s.param.element_size())
        torch._foreach_copy_(bucket.mine, [s.leaf.detach() for s in bucket.shards])
        works.append(start_all_gather_(bucket.buffer, group.group))
    return works


@torch.no_grad()
def finish_gather(
    group: ZeroGroup, unit: int, works: list[Any], leaves_in_place: bool = False
) -> None:
    """``start_gather``'s parameters whole: each bucket waited, then copied out of the buffer (the
    other ranks' rows) and from the leaves (this rank's). Written through ``.data`` views, which
    autograd does not version: the backward reads the tensors its forward saved, refilled here.
    ``leaves_in_place``: each leaf then becomes a view of its rows in the whole parameter (kept
    whole for a step: one copy of the rows; ``release_unit`` makes it a dense copy again)."""
    for bucket, work in zip(group.unit_buckets[unit], works, strict=True):
        with probes.span("all_gather", "zero=3 params"):
            work.wait()  # before any read of the buffer or the storage
        leaves = [s.leaf.detach() for s in bucket.shards]
        torch._foreach_copy_(bucket.dst, bucket.theirs)
        torch._foreach_copy_(bucket.own, leaves)
        if leaves_in_place:
            for s in bucket.shards:
                if not s.master:  # an fp32 master stays its own tensor beside the bf16 weight
                    s.leaf.data = s.rows(s.param.data)


def release_unit(group: ZeroGroup, unit: int) -> None:
    """Unit ``unit``'s sharded parameters of ``group`` back to their rows only (storage freed; a
    leaf that is a view of its rows there copied out first)."""
    for bucket in group.unit_buckets[unit]:
        for s in bucket.shards:
            if not s.dense:
                s.leaf.data = s.leaf.data.clone(memory_format=torch.contiguous_format)
            s.param.data.untyped_storage().resize_(0)
