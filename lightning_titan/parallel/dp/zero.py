"""ZeRO-1 (and ZeRO-2's and ZeRO-3's rows): the ranks of a data-parallel group split the optimizer
state. ZeRO-3 (``zero3.py``) keeps only these rows of the parameters, gathered per block by buckets
of their own (``units``).

Each parameter is cut into row ranges along one dimension (dim 0; dim 1 for stacked experts, whose
dim 0 is the experts, and for a weight TP cuts along dim 0: ``cut_dim``), ``torch.chunk``-style:
rank ``q`` of an ``n``-rank group owns rows ``[q * c, (q + 1) * c)`` with ``c = ceil(rows / n)``
(the last ranks may own fewer, or none). The user's optimizer is kept, and only its
``param_groups`` lists change: each parameter is replaced by a leaf ``nn.Parameter`` that is a view
of the rank's rows, so the optimizer's in-place update writes straight into the model, and its
state (AdamW's two moments) exists for those rows only. Fused optimizers (``AdamW(fused=True)``)
step a tensor as one run of memory from its first element, so on strided rows (dim 1 of stacked
experts) they update other elements than the view's and write into the neighbouring rows (torch
2.13): for an optimizer a probe finds doing so, a leaf of strided rows is a dense copy instead,
taken from the rows before each step and written back into them before the gather. After the step the group all-gathers the
updated rows (bucketed: one collective per bucket) and the grads are dropped. Each rank packs its rows
into its chunk of a gather buffer kept from step to step (one per dtype, the size of the largest
bucket, which the gather would peak at anyway; ZeRO-2's reducer borrows it during backward): a new
one of tens of MB is fresh pages every step,
and at d_model 256 their faults cost more CPU than the copies (10,000 faults a step on dp2; the
gather 65 -> 39 ms per rank once the buffer was kept, after 94 -> 65 from gloo's all-gather to
``collectives.all_gather_``).

Grads are all-reduced in full as before (ZeRO-1), so the clipping norm is computed as without ZeRO;
the shard grads are views of the reduced grads, bound just before the optimizer step, after any
clipping or non-finite skip has acted on the full grads. Under ZeRO-2 (``parallel/dp/zero_grads.py``) the
reducer reduce-scatters straight into these rows instead, and its ``finish()`` sets each leaf's grad
to them (the full grads never come back), so clipping and a skip act on the leaves.

Checkpoints stay layout-free: a shard's state is saved as a ``DTensor`` over the group's mesh (its
rows of the full tensor), so DCP writes one logical tensor per parameter that loads under any zero
level and layout. A TP-cut weight's shard is a ``DTensor`` over the 2-D mesh (tp, zero group): TP
cuts one dim of the full model's tensor and ZeRO another, each ``torch.chunk``-style, which is how
DCP places uneven shards, so the 2-D offsets need no bookkeeping of ours.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_titan.parallel.collectives import all_gather_
from lightning_titan.parallel.dp.master import MasterWeights
from lightning_titan.parallel.dp.offload import HostOptimizer
from lightning_titan.parallel.dp.reducer import assign_buckets
from lightning_titan.parallel.mesh import group_mesh
from lightning_titan.parallel.tensor_parallel import TpShard, real_size
from lightning_titan.runtime import probes

LEVELS = (0, 1, 2, 3)


def owned_rows(size: int, n: int, q: int) -> tuple[int, int]:
    """Rank ``q``'s rows ``[start, stop)`` of ``size`` rows cut into ``n`` ``torch.chunk`` pieces."""
    chunk = math.ceil(size / n)
    start = min(q * chunk, size)
    return start, min(start + chunk, size)


@dataclass
class ZeroShard:
    """One parameter's rows ``[start, stop)`` along ``dim`` on this rank, and the leaf the optimizer
    updates (a view of them)."""

    param: nn.Parameter
    dim: int
    start: int
    stop: int
    leaf: nn.Parameter
    group: dist.ProcessGroup
    n: int
    tp: TpShard | None = None  # the weight is this TP rank's part of the full model's (tp > 1)
    master: bool = False  # the leaf is the fp32 master of the rows of a bf16 parameter (master.py)

    @property
    def dense(self) -> bool:
        """The leaf is a copy of the rows, not a view of them (they are strided: module doc)."""
        return self.leaf.data_ptr() != self.rows(self.param).data_ptr()

    def rows(self, tensor: Tensor, q: int | None = None) -> Tensor:
        """Rank ``q``'s rows of ``tensor`` (this rank's by default), a view."""
        start, stop = (self.start, self.stop) if q is None else owned_rows(self.size, self.n, q)
        return tensor.narrow(self.dim, start, stop - start)

    @property
    def size(self) -> int:
        return self.param.shape[self.dim]

    @property
    def chunk_numel(self) -> int:
        """Elements of the largest rank's rows: every rank's slot in a gather buffer has this size."""
        return math.ceil(self.size / self.n) * (self.param.numel() // max(1, self.size))


def cut_dim(param: Tensor, expert: bool, tp_dim: int | None = None) -> int | None:
    """The dimension to cut, or None when the parameter stays whole on every rank (a scalar, a
    one-dimensional expert tensor: every rank then applies the same update to all of it).

    Never the dim TP cuts (``tp_dim``): the saved shard is then a block of the full tensor, one
    ``torch.chunk`` split per dim, as a DTensor on the (tp, zero) mesh says. Rows of a TP slice
    would nest two splits in one dim, the inner one over the padded vocabulary rows that the
    checkpoint does not hold."""
    dim = 1 if expert or tp_dim == 0 else 0
    return dim if param.dim() > dim else None


class ZeroGroup:
    """The parameters reduced over one data-parallel group, their shards on this rank, and the
    bucketed all-gather that makes every rank's copy whole again after the optimizer step."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        expert_ids: set[int],
        group: dist.ProcessGroup,
        *,
        bucket_cap_mb: float,
        tp_shards: dict[int, TpShard] | None = None,
        units: Sequence[Sequence[nn.Parameter]] | None = None,
    ) -> None:
        """``tp_shards``: ``id(weight) -> TpShard`` of the weights TP cuts (``tp_shards(model)``).
        ``units`` (zero=3): the parameters gathered together before a block runs (``zero3.py``),
        each unit's shards gathered by its own buckets through a buffer of their own; None: the
        whole group is gathered once after the optimizer step (zero<=2)."""
        self.group = group
        self.n, self.q = dist.get_world_size(group), dist.get_rank(group)
        self.shards: dict[int, ZeroShard] = {}
        for p in params:
            tp = (tp_shards or {}).get(id(p))
            tp = tp if tp is not None and tp.size > 1 else None
            dim = cut_dim(p, id(p) in expert_ids, None if tp is None else tp.dim)
            if dim is None:
                continue
            start, stop = owned_rows(p.shape[dim], self.n, self.q)
            leaf = nn.Parameter(p.detach().narrow(dim, start, stop - start))
            self.shards[id(p)] = ZeroShard(p, dim, start, stop, leaf, group, self.n, tp=tp)
        self.dense_shards: list[ZeroShard] = []  # leaves that copy their rows (``densify``)
        cap = bucket_cap_mb * 1024 * 1024
        sharded = [s.param for s in self.shards.values()]
        self.buckets = [] if units is not None else self._buckets(sharded, cap)
        self.kept: dict[torch.dtype, Tensor] = {}  # the gather buffer of each dtype (module doc)
        for dtype in {b.dtype for b in self.buckets}:  # each the size of its dtype's largest bucket
            same = [b for b in self.buckets if b.dtype == dtype]
            self.reserve(same[0].shards[0].param, max(b.slot for b in same) * self.n)
        # zero=3: each unit's buckets, bound to a buffer of their own: the re-gathers run during
        # the backward, while ZeRO-2's reducer has borrowed ``kept`` for a reduce-scatter. A unit's
        # buckets lie one after another in it, so that all of them can be in flight at once (a
        # prefetch, ``zero3.py``): the buffer of a dtype is the size of the largest unit's buckets
        # of that dtype, and one unit at a time gathers through it
        self.unit_buckets = [
            self._buckets([p for p in unit if id(p) in self.shards], cap) for unit in units or ()
        ]
        self.unit_kept: dict[torch.dtype, Tensor] = {}
        flat = [b for unit in self.unit_buckets for b in unit]
        for dtype in {b.dtype for b in flat}:
            size = max(sum(b.slot for b in unit if b.dtype == dtype) for unit in self.unit_buckets)
            like = next(b for b in flat if b.dtype == dtype).shards[0].param
            buffer = self.unit_kept[dtype] = like.new_empty(size * self.n)
            for unit in self.unit_buckets:
                at = 0
                for b in (b for b in unit if b.dtype == dtype):
                    b.bind(buffer[at : at + b.slot * self.n], self.q)
                    at += b.slot * self.n

    def _buckets(self, params: list[nn.Parameter], cap: float) -> list[_GatherBucket]:
        return [
            _GatherBucket([self.shards[id(params[i])] for i in indices], self.n, self.q)
            for indices in assign_buckets(params, cap)
        ]

    def reserve(self, like: Tensor, numel: int) -> None:
        """The kept buffer of ``like``'s dtype (and device), grown to at least ``numel`` elements; every
        gather bucket of that dtype is bound to its start. ZeRO-2's reducer borrows it too, for a
        bucket's reduce-scatter input: it is idle from the end of one gather to the start of the next,
        and a fresh buffer of that size is fresh pages on CPU every step (``parallel/dp/zero_grads.py``)."""
        kept = self.kept.get(like.dtype)
        if kept is None or kept.numel() < numel:
            kept = self.kept[like.dtype] = like.new_empty(numel)
            for b in self.buckets:
                if b.dtype == like.dtype:
                    b.bind(kept[: b.slot * self.n], self.q)

    @torch.no_grad()
    def take_masters(self, masters: MasterWeights) -> None:
        """bf16 weights: each shard's leaf becomes the fp32 master of its rows (a dense copy of
        them), and the whole master goes (``parallel/dp/master.py``)."""
        for s in self.shards.values():
            master = masters.pop(s.param)
            if master is not None:
                s.leaf.data = s.rows(master.detach()).clone(memory_format=torch.contiguous_format)
                s.master = True
        self.dense_shards = [s for s in self.shards.values() if s.dense]

    @torch.no_grad()
    def restore_masters(self) -> None:
        """bf16 weights, the engine removed: each parameter whose master this group cut becomes
        its fp32 master, whole (one all-gather of the rows, padded to the largest rank's, each)."""
        for s in self.shards.values():
            if not s.master:
                continue
            rows = s.leaf.detach().movedim(s.dim, 0)
            padded = rows.new_zeros((math.ceil(s.size / self.n), *rows.shape[1:]))
            padded[: rows.shape[0]] = rows
            parts = [torch.empty_like(padded) for _ in range(self.n)]
            dist.all_gather(parts, padded, group=self.group)
            # a copy of its own: the padding past the last row not kept in its storage
            whole = torch.cat(parts)[: s.size].movedim(0, s.dim)
            s.param.data = whole.clone(memory_format=torch.contiguous_format)

    def densify(self) -> None:
        """For an optimizer that steps strided tensors wrongly (``steps_strided_views``): each leaf
        whose rows are strided becomes a dense copy of them (same leaf, new storage)."""
        for s in self.shards.values():
            if not s.leaf.is_contiguous():
                s.leaf.data = s.leaf.data.clone(memory_format=torch.contiguous_format)
        self.dense_shards = [s for s in self.shards.values() if s.dense]

    def bind_grads(self, grad_of: Callable[[nn.Parameter], Tensor | None] | None = None) -> None:
        """ZeRO-1, just before the optimizer step: each shard's grad is its rows of the reduced,
        clipped full grad (a view; a dense copy for a dense leaf), None where that is. ZeRO-2's
        reducer writes the shards' grads itself, in ``finish()`` (``parallel/dp/zero_grads.py``).
        ``grad_of``: where a parameter's reduced grad is (bf16 weights: the fp32 one of
        ``MasterWeights.grad_holder``); None: its ``.grad``."""
        for s in self.shards.values():
            full = s.param.grad if grad_of is None else grad_of(s.param)
            grad = None if full is None else s.rows(full)
            s.leaf.grad = grad.contiguous() if grad is not None and s.dense else grad

    @torch.no_grad()
    def take_rows(self) -> None:
        """Just before the optimizer step: each dense leaf takes its rows, which a checkpoint load
        or a broadcast may have written since the last step (a view leaf sees them already)."""
        for s in self.dense_shards:
            if not s.master:  # a master's rows are the fp32 original of the parameter's
                s.leaf.copy_(s.rows(s.param.detach()))

    def drop_grads(self) -> None:
        """A skipped step (non-finite): no shard has a grad, so the optimizer updates nothing."""
        for s in self.shards.values():
            s.leaf.grad = None

    @torch.no_grad()
    def gather(self) -> None:
        """Every rank's updated rows into every rank's parameters, one all-gather per bucket; then
        the full grads go (the optimizer step consumed them)."""
        for s in self.dense_shards:  # the updated rows back into the parameter (gathered from it)
            s.rows(s.param.detach()).copy_(s.leaf.detach())
        for bucket in self.buckets:
            torch._foreach_copy_(bucket.mine, bucket.own)
            with probes.span("all_gather", "zero params"):
                all_gather_(bucket.buffer, self.group)
            torch._foreach_copy_(bucket.dst, bucket.theirs)
        for s in self.shards.values():
            s.param.grad = None


class _GatherBucket:
    """One all-gather's shards and, worked out once, where each piece goes: this rank's rows into
    its slot of the gather buffer, every other rank's slot back into the parameters (one strided
    view of their rows on each side of this rank's where a parameter's rows split evenly; this
    rank's own rows are its optimizer's leaf, updated in place already). Each side is then one
    ``_foreach_copy_``: copying 43 parameters one ``copy_`` at a time cost as much CPU as the
    collective itself on this project's bench model."""

    def __init__(self, shards: list[ZeroShard], n: int, me: int) -> None:
        self.shards = shards
        # views of ``.data``: no autograd history and a version counter of their own, so that a
        # zero=3 gather between a forward and its backward is not an in-place change to autograd;
        # they hold the parameters' storage, which zero=3 frees and refills (resize_) in place
        self.own = [s.rows(s.param.data) for s in shards]
        self.pack: list[tuple[int, torch.Size, tuple[int, ...]]] = []
        self.dst: list[Tensor] = []
        self.unpack: list[tuple[int, torch.Size, tuple[int, ...]]] = []
        slot = sum(s.chunk_numel for s in shards)
        offset = 0
        for s, own in zip(shards, self.own, strict=True):
            self.pack.append((offset, own.shape, _contiguous_strides(own.shape)))
            if s.size % n == 0:  # the other ranks' rows at once: (ranks, *rows) against their slots
                rows_N = s.param.data.unflatten(s.dim, (n, s.size // n)).movedim(s.dim, 0)
                for lo, hi in ((0, me), (me + 1, n)):  # before this rank, after it
                    if hi > lo:
                        self.dst.append(rows_N[lo:hi])
                        strides = (slot, *_contiguous_strides(own.shape))
                        self.unpack.append((lo * slot + offset, rows_N[lo:hi].shape, strides))
            else:
                for q in [r for r in range(n) if r != me]:
                    rows = s.rows(s.param.data, q)
                    self.dst.append(rows)
                    self.unpack.append(
                        (q * slot + offset, rows.shape, _contiguous_strides(rows.shape))
                    )
            offset += s.chunk_numel
        self.slot = slot
        self.dtype = shards[0].param.dtype

    def bind(self, buffer: Tensor, me: int) -> None:
        """Gather through ``buffer`` (``n * slot`` contiguous elements of a buffer kept from step to
        step): the views of it that the copies in and out use, worked out once."""
        self.buffer = buffer
        base = buffer.storage_offset()  # ``as_strided`` counts from the storage's start
        self.mine = [
            buffer.as_strided(sh, st, base + me * self.slot + at) for at, sh, st in self.pack
        ]
        self.theirs = [buffer.as_strided(sh, st, base + at) for at, sh, st in self.unpack]


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def shard_optimizer(optimizer: Optimizer, groups: Sequence[ZeroGroup]) -> None:
    """Point ``optimizer`` at this rank's shards in place (its param groups, hyper-parameters and any
    scheduler stay); a parameter no shard covers stays whole. Only before the optimizer has state."""
    check_elementwise(optimizer)
    if not steps_strided_views(optimizer):
        for g in groups:
            g.densify()
    if optimizer.state:
        raise RuntimeError(
            "zero>0 shards an optimizer before its first step; this one already has state"
        )
    shards = ZeroShards(groups)
    for param_group in optimizer.param_groups:
        leaves = []
        for p in param_group["params"]:
            shard = shards.of_param(p)
            if shard is None:
                leaves.append(p)
            elif shard.stop > shard.start:  # a rank past the last row holds nothing of it
                leaves.append(shard.leaf)
        param_group["params"] = leaves


def check_elementwise(optimizer: Optimizer) -> None:
    """Refuse an optimizer whose update of an element reads other elements of its tensor (a factored,
    normalised or orthogonalised update, a line search): on a rank's rows it would train another
    model. Found by behaviour, not by name: a fresh optimizer of the same class and hyper-parameters
    takes three steps on a probe weight, once whole and once cut into two row ranges, and the two
    must agree. A class that cannot be probed (its constructor or ``step`` needs more) may declare
    ``elementwise = True``."""
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if getattr(cls, "elementwise", None) is True:
        return
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    if first is None:
        return
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        try:
            same = _cut_steps_as_whole(cls, hyper, first, split=0)
        except Exception as e:  # noqa: BLE001 - named in the error
            raise ValueError(
                f"zero>0 cannot check that {name} updates each element on its own (a probe step "
                f"failed: {type(e).__name__}: {e}); use zero=0 with it, or, if its update of an "
                f"element reads nothing else of the tensor, set `{cls.__qualname__}.elementwise = True`"
            ) from None
        if not same:
            raise ValueError(
                f"zero>0 cannot split {name}: its update of an element depends on the rest of the "
                "tensor (a probe weight updated whole and in two row ranges differs), so a rank "
                "updating its rows would train another model; use zero=0 with it, or an "
                "element-wise optimizer such as torch.optim.AdamW"
            )


def steps_strided_views(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` updates a strided view (an expert's rows, cut along dim 1) as it updates
    a dense tensor. Fused implementations (``AdamW(fused=True)``) step a tensor as one run of memory
    from its first element: on a view they update other elements than its own (torch 2.13). Found by
    behaviour, as ``check_elementwise``: the probe weight once whole and once as two column views."""
    cls = type(optimizer)
    first = next((p for g in optimizer.param_groups for p in g["params"]), None)
    if first is None:
        return True
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        try:
            if not _cut_steps_as_whole(cls, hyper, first, split=1):
                return False
        except Exception:  # noqa: BLE001 - an optimizer check_elementwise let through by declaration
            return False
    return True


def _cut_steps_as_whole(
    cls: type[Optimizer], hyper: dict[str, Any], like: Tensor, split: int
) -> bool:
    """Whether ``cls`` takes the probe weight to the same values cut in two along ``split`` as whole."""
    whole = _probe_steps(cls, hyper, like, split=None)
    cut = _probe_steps(cls, hyper, like, split=split)
    return torch.allclose(whole, cut, rtol=1e-5, atol=1e-7)


def _probe_steps(
    cls: type[Optimizer], hyper: dict[str, Any], like: Tensor, split: int | None
) -> Tensor:
    """A (6, 4) weight on ``like``'s device after three steps of ``cls`` on fixed grads, held whole or
    (``split``: the dim) cut in two halves: rows [0, 3) and [3, 6), or columns [0, 2) and [2, 4),
    each a view of one tensor; float32, whose rounding cannot tell the two apart where bf16's could."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(6, 4, generator=gen).to(like.device)
    grads = [torch.randn(6, 4, generator=gen).to(like.device) for _ in range(3)]

    def halves(t: Tensor) -> list[Tensor]:
        return [t] if split is None else list(t.chunk(2, dim=split))

    params = [nn.Parameter(t) for t in halves(start)]
    opt = cls([{"params": params, **hyper}])  # type: ignore[call-arg]  # a subclass's signature
    for g in grads:
        for p, part in zip(params, halves(g), strict=True):
            p.grad = part
        opt.step()
    return start.cpu() if split is not None else params[0].detach().cpu()


def as_dtensor(local: Tensor, shard: ZeroShard, shape: torch.Size) -> DTensor:
    """``local``, this rank's rows (dim 0) of a tensor of ``shape``, as a DTensor over the group: how
    DCP learns where the rows go (no copy: DCP reads into and writes from ``local`` itself). For a
    TP-cut weight (``shard.tp``; ``local`` is its state, ``shape`` this TP rank's), the real entries
    of ``local`` as a block of the full model's tensor over the (tp, zero) mesh."""
    mesh, placements = group_mesh(shard.group, local.device.type), [Shard(0)]
    if shard.tp is not None:
        tp = shard.tp
        local = local.narrow(tp.dim, 0, real_size(tp.full_size, tp.size, tp.rank))
        shape = torch.Size([tp.full_size if d == tp.dim else n for d, n in enumerate(shape)])
        mesh = tp_zero_mesh(tp.group, shard.group, local.device.type)
        placements = [Shard(tp.dim), Shard(shard.dim)]
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


@functools.cache
def tp_zero_mesh(
    tp_group: dist.ProcessGroup, zero_group: dist.ProcessGroup, device_type: str
) -> DeviceMesh:
    """The 2-D mesh (tp, zero) of the ranks holding a TP-cut weight's shards: entry ``[i, j]`` is
    member ``j`` of TP rank ``i``'s zero group. A rank's coordinates are mixed-radix digits, so
    moving along tp adds the same offset to every member (``parallel/mesh.py``)."""
    me = dist.get_rank()
    members = dist.get_process_group_ranks(zero_group)
    rows = [[z + t - me for z in members] for t in dist.get_process_group_ranks(tp_group)]
    return DeviceMesh.from_group(
        [tp_group, zero_group], device_type, torch.tensor(rows), mesh_dim_names=("tp", "zero")
    )


class ZeroShards:
    """This rank's ZeRO shards, found by the model parameter they cut or by the leaf an optimizer steps
    in its place: the table a checkpoint needs to key a sharded optimizer's state by the parameter's
    global name (``checkpoint/state.py``). The ``ZeroGroup``s own the shards; whoever owns those
    (the engine, and the strategy for as long as its optimizers hold the leaves) hands this table to
    the reader, rather than the shards riding on the tensors. Empty: no parameter is sharded (zero=0).

    Keyed by ``id``: every shard holds its parameter and its leaf, so the ids stay theirs while the
    table lives."""

    def __init__(
        self,
        groups: Iterable[ZeroGroup] = (),
        masters: MasterWeights | None = None,
        offload: HostOptimizer | None = None,
    ) -> None:
        """``masters`` (``param_dtype="bf16"``): the fp32 masters the optimizers step in place of
        the bf16 parameters, which a checkpoint saves as the weights (``parallel/dp/master.py``).
        ``offload`` (``offload_optimizer=True``): the host copies the optimizers step in place of
        those (``parallel/dp/offload.py``), each found as the device tensor it stands for."""
        groups = list(groups)
        self._by_param = {pid: s for g in groups for pid, s in g.shards.items()}
        self._by_leaf = {id(s.leaf): s for s in self._by_param.values()}
        self.masters = masters
        self.offload = offload

    def check_whole(self, what: str) -> None:
        """Refuse a checkpoint ``what`` ("save", "load") while a parameter exists only as this rank's
        rows (zero=3 between its uses): ``Engine.whole_params`` gathers them for it."""
        if any(s.param.numel() and not s.param.untyped_storage().nbytes() for s in self):
            raise ValueError(
                f"a checkpoint {what} under zero=3 needs the parameters whole: run it inside "
                "Engine.whole_params() (TitanStrategy does)"
            )

    def __iter__(self) -> Iterator[ZeroShard]:
        return iter(self._by_param.values())

    def __len__(self) -> int:
        return len(self._by_param)

    def of_param(self, param: Tensor) -> ZeroShard | None:
        """The shard of model parameter ``param`` on this rank, None where it is kept whole."""
        return self._by_param.get(id(param))

    def of_leaf(self, tensor: Tensor) -> ZeroShard | None:
        """The shard an optimizer's ``tensor`` stands for, None for a whole parameter."""
        if self.offload is not None:
            tensor = self.offload.device_tensor(tensor)
        return self._by_leaf.get(id(tensor))

    def full_param(self, tensor: Tensor) -> Tensor:
        """The model parameter an optimizer's tensor belongs to (itself unless it is a shard's leaf
        or a master)."""
        shard = self.of_leaf(tensor)
        if shard is not None:
            return shard.param
        if self.offload is not None:
            tensor = self.offload.device_tensor(tensor)
        return tensor if self.masters is None else self.masters.param_of(tensor)

    def weight(self, param: Tensor) -> Tensor:
        """What a checkpoint holds as ``param``'s value: its fp32 master, or itself."""
        master = None if self.masters is None else self.masters.of(param)
        return param if master is None else master


NO_SHARDS = ZeroShards()  # zero=0: every optimizer tensor is a whole parameter (nothing mutates it)
