"""ZeRO-2: the bucketed reducer reduce-scatters grads into the ZeRO-1 row shards (``parallel/dp/zero.py``).

Each bucket's flat buffer is rank-major: slot ``q`` holds rank ``q``'s rows of every parameter of the
bucket (padded to the largest rank's rows, ``ZeroShard.chunk_numel``), a whole copy of a parameter
with nothing to cut (a scalar), and the flags GradReducer's all-reduce carries (one "has a grad" per
parameter, then "all its hooks fired" and "launched from a hook"), written into every slot. One
reduce-scatter per bucket then leaves each rank its own slot: its rows of the summed grads and the
flags summed over the group, as the all-reduce would have. The launch-order rule (parallel/dp/reducer.py's module
doc) is GradReducer's, unchanged: only what a bucket holds and which collective it runs differ.

Memory. A hook copies its parameter's grad into the bucket and drops it (``p.grad = None``). A
bucket's input buffer (the full grads, rank-major) lives from its first copy to the end of its
reduce-scatter in ``finish()``; what a rank keeps is each bucket's output slot, about 1/n of the
grads, and the shard grads the optimizer steps are views of it. The first bucket to fill borrows the
ZeRO group's kept gather buffer as its input (idle between gathers; grown at init to fit the largest
bucket), the others get a new one: on CPU a new one of megabytes is fresh pages every step, which cost
a dp4 step 1,700 page faults and about 6 ms of its backward at d_model 64 (the default model has one
bucket, so it now allocates none).

Clipping. After ``finish()`` each element of the stage's gradient sits on exactly one rank of the
stage's sequence-DP group (its dp x ep x cp x tp ranks): a row of a TP-cut weight on one rank of
the dp x ep x cp group of the TP rank holding that part, a norm's or router's row on one rank of
them all, an expert row on one dp x cp x tp rank of the EP rank that owns the expert. So the
squares of the shard grads summed over that group, then over the stages, are the whole model's
norm^2; a grad left whole on every rank of its reducer's group (a parameter with nothing to cut)
is counted on that group's first rank only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_titan.parallel.collectives import reduce_scatter
from lightning_titan.parallel.dp.clipping import clip_counted_grad_norm_
from lightning_titan.parallel.dp.master import MasterWeights
from lightning_titan.parallel.dp.reducer import GradReducer, _Bucket
from lightning_titan.parallel.dp.zero import ZeroGroup, ZeroShard
from lightning_titan.parallel.mesh import ProcessGroups
from lightning_titan.runtime import probes


@dataclass
class _ShardBucket(_Bucket):
    # per parameter: its shard (None: kept whole), its offset in a slot, the elements it takes there
    layout: list[tuple[ZeroShard | None, int, int]] = field(default_factory=list)
    grads_numel: int = 0  # elements of one slot before its flags
    output: Tensor | None = None  # this rank's slot: reduced rows, then the summed flags

    @property
    def numel(self) -> int:
        return self.grads_numel

    @property
    def slot_numel(self) -> int:
        return self.grads_numel + len(self.params) + 2


class ShardedGradReducer(GradReducer):
    """GradReducer whose buckets end in this rank's rows only (see the module doc).

    ``zero_group`` holds the shards of ``params`` over ``zero_group.group``; after ``finish()`` a
    sharded parameter's reduced rows are the grad of its shard's leaf, the tensor the optimizer steps
    (its ``p.grad`` is None), a parameter kept whole has its reduced ``p.grad`` as under GradReducer.
    """

    sums_in_buckets = False  # a bucket's input is made in the step's last backward (module doc)

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        zero_group: ZeroGroup,
        *,
        scale: float,
        bucket_cap_mb: float = 25.0,
        mode: str = "bucketed",
        masters: MasterWeights | None = None,
    ) -> None:
        """``masters`` (bf16 weights): the buckets of parameters with an fp32 master reduce-scatter
        in fp32, into the shards' leaves (their fp32 masters) and the masters of whole ones."""
        if mode != "bucketed":
            raise ValueError(
                f"zero=2 reduce-scatters flat buckets, reducer={mode!r} has none; use "
                "reducer='bucketed' with zero=2 (or zero<=1 with the per-parameter baseline)"
            )
        self.zero_group = zero_group  # _make_bucket, called by the base __init__, reads it
        super().__init__(
            params, zero_group.group, scale=scale, bucket_cap_mb=bucket_cap_mb, mode=mode,
            masters=masters,
        )  # fmt: skip
        self._borrower: dict[torch.dtype, _Bucket] = {}  # the bucket whose input is the kept buffer

    def rows_of(self, param: Tensor) -> ZeroShard | None:
        """The shard whose rows this reducer leaves of ``param``'s grad (None: kept whole, or not
        one of its parameters); after ``finish()`` they are the grad of the shard's leaf."""
        return self.zero_group.shards.get(id(param))

    def _make_bucket(self, params: list[nn.Parameter]) -> _Bucket:
        layout, total = [], 0
        for p in params:
            shard = self.zero_group.shards.get(id(p))
            size = p.numel() if shard is None else shard.chunk_numel
            layout.append((shard, total, size))
            total += size
        bucket = _ShardBucket(params, [offset for _, offset, _ in layout], None, layout=layout)
        bucket.grads_numel = total
        # bf16 weights: their grads summed in fp32 (the buffer's dtype, not the parameters')
        has_master = self.masters is not None and self.masters.of(params[0]) is not None
        dtype = torch.float32 if has_master else params[0].dtype
        bucket.output = params[0].new_zeros(bucket.slot_numel, dtype=dtype)
        self.zero_group.reserve(bucket.output, self._world * bucket.slot_numel)
        bucket.reset()
        return bucket

    def _fill(self, bucket: _Bucket, slot: int) -> None:
        """Every rank's rows of this slot's grad into that rank's slot, then drop the full grad."""
        assert isinstance(bucket, _ShardBucket) and bucket.output is not None
        param, n = bucket.params[slot], self._world
        if bucket.buffer is None:  # this step's input, until its reduce-scatter is done
            numel, dtype = n * bucket.slot_numel, bucket.output.dtype
            if dtype not in self._borrower:  # the first bucket to fill borrows the kept one
                self._borrower[dtype] = bucket
                bucket.buffer = self.zero_group.kept[dtype][:numel]
            else:
                bucket.buffer = bucket.output.new_empty(numel)
        slots_N = bucket.buffer.view(n, bucket.slot_numel)
        shard, offset, size = bucket.layout[slot]
        grad = param.grad
        dst_N = slots_N[:, offset : offset + size]
        if grad is None:
            dst_N.zero_()
        elif shard is None:
            dst_N.copy_(grad.reshape(1, -1).expand(n, -1))
        elif shard.size % n == 0:  # no padding: one strided copy, every rank's rows at once
            rows_N = grad.unflatten(shard.dim, (n, shard.size // n)).movedim(shard.dim, 0)
            dst_N.view(rows_N.shape).copy_(rows_N)
        else:
            for q in range(n):
                rows = shard.rows(grad, q)
                dst_N[q, : rows.numel()].view(rows.shape).copy_(rows)
                dst_N[q, rows.numel() :].zero_()  # past the last row: padding
        flag = bucket.grads_numel + slot  # a device fill: an item assignment copies from the host
        slots_N[:, flag : flag + 1].fill_(float(grad is not None))
        param.grad = None  # ZeRO-2: the bucket holds it now; only this rank's rows come back
        bucket.filled[slot] = True
        bucket.num_filled += 1

    def _start(self, b: int, bucket: _Bucket, where: str) -> dist.Work:
        assert isinstance(bucket, _ShardBucket)
        assert bucket.buffer is not None and bucket.output is not None
        slots_N = bucket.buffer.view(self._world, bucket.slot_numel)
        slots_N[:, -2:-1].fill_(float(bucket.all_hooked))
        slots_N[:, -1:].fill_(float(where == "hook"))
        with probes.span("all_reduce", "grad bucket reduce-scatter", bucket=b):
            return reduce_scatter(bucket.output, bucket.buffer, self.group, async_op=True)

    def _write_back(self, bucket: _Bucket) -> list[float] | None:
        assert isinstance(bucket, _ShardBucket) and bucket.output is not None
        bucket.buffer = None  # the full-size input goes: the slot is what this rank keeps
        out = bucket.output
        if self._borrower.get(out.dtype) is bucket:
            del self._borrower[out.dtype]  # the gather may use the kept buffer again
        if self.scale != 1.0:  # after the sum: 1/n of the multiplications, the flags left as counts
            out[: bucket.grads_numel].mul_(self.scale)
        flags = out[bucket.grads_numel :].tolist()  # one device-to-host read per bucket
        for slot, (p, (shard, offset, _)) in enumerate(
            zip(bucket.params, bucket.layout, strict=True)
        ):
            has_grad = flags[slot] > 0  # on some rank of the group; else None, as in one process
            if shard is None:  # bf16 weights: its master's grad (fp32)
                self._holder(p).grad = (
                    out[offset : offset + p.numel()].view(p.shape).clone() if has_grad else None
                )
            else:
                numel = shard.leaf.numel()
                shard.leaf.grad = (
                    out[offset : offset + numel].view(shard.leaf.shape) if has_grad else None
                )
        return flags[-2:]


def grad_of(param: Tensor, reducers: Sequence[GradReducer]) -> Tensor | None:
    """The grad this rank holds of ``param``: ``param.grad``, or where one of ``reducers`` (the
    engine's) cuts it, ZeRO-2's reduced rows (what a non-finite diagnosis reads)."""
    if param.grad is not None:
        return param.grad
    for r in reducers:
        shard = r.rows_of(param) if isinstance(r, ShardedGradReducer) else None
        if shard is not None:
            return shard.leaf.grad
    return None


def clip_shard_grads_(
    reducers: Sequence[GradReducer],
    zero_groups: Sequence[ZeroGroup],
    max_norm: float | None,
    groups: ProcessGroups,
) -> Tensor:
    """The pre-clip global norm from this rank's shard grads (module doc), the same on every rank;
    scales the shards and whole grads by ``max_norm`` as ``clip_grad_norm_`` does."""
    shards = {pid: s for g in zero_groups for pid, s in g.shards.items()}
    grads = [s.leaf.grad for s in shards.values() if s.leaf.grad is not None]
    counted = [True] * len(grads)
    for r in reducers:
        # a grad left whole is the same on every rank of its group: count it on the first one
        first = r.group is None or dist.get_rank(r.group) == 0
        for p in r.params:
            grad = r.reduced_grad(p)  # bf16 weights: the master's
            if id(p) not in shards and grad is not None:
                grads.append(grad)
                counted.append(first)
    device = next((p.device for r in reducers for p in r.params), torch.device("cpu"))
    return clip_counted_grad_norm_(
        grads, counted, max_norm, group=groups.sequence_dp, pp_group=groups.pp, device=device
    )
