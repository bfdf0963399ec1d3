"""Reduce-scatter and all-gather that cost on gloo what they should.

**Reduce-scatter**: less than the all-reduce it replaces.

torch's gloo backend has no reduce-scatter of its own: ``reduce_scatter_single`` copies the whole
input, all-reduces the copy and keeps its chunk (ProcessGroupGloo::reduce_scatter_tensor_coalesced),
so ZeRO-2 and TP's sequence-parallel reduction paid a full all-reduce plus copies for a result that
needs only half the traffic. On CPU tensors (gloo) this sends each rank its rows of everyone's input
with one all-to-all and sums the ``n`` pieces locally: every rank sends ``(n - 1) / n`` of the buffer,
what a ring reduce-scatter sends. Measured with ``python -m lightning_titan.tools.bench.collectives``
(docs/benchmarks.md), best of 10 on 2 and 4 ranks, 1-16 MB: 1.1-2.4x faster than gloo's own and
below its all-reduce in 5 of 6 sizes. On two ranks the peer's chunk goes straight into the output
and this rank's own is added there: no receive buffer, which on CPU is fresh pages (glibc hands a
freed buffer of megabytes back to the kernel) on every call. Other devices keep the backend's own
(NCCL's ring).

**All-gather** (ZeRO's parameters): gloo's ``all_gather_into_tensor`` gathers into a fresh flat
buffer of the whole output and copies it out (ProcessGroupGloo's allgather work), and above glibc's
mmap threshold (32 MB) that buffer is new pages every call: a 55 MB gather page-faulted 14,000 times
per call. On CPU tensors this runs one broadcast from each rank straight into its chunk of the
output, which is all the traffic an all-gather has: at 55 MB 20 against 61 ms on 2 ranks, 48-55
against 113-121 ms on 4 (median of 10, one thread per rank), the same at 25 MB and below.
"""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.distributed as dist
from torch import Tensor


class _SumOnWait(dist.Work):
    """The all-to-all's work; ``wait()`` also sums what it received into ``output``: the ``n``
    pieces stacked in ``received_NX``, or, on two ranks, this rank's own chunk ``own`` onto the
    peer's piece, which the all-to-all wrote into ``output`` itself."""

    def __init__(
        self, work: dist.Work, output: Tensor, received_NX: Tensor | None, own: Tensor | None
    ) -> None:
        super().__init__()
        self.work, self.output, self.received_NX, self.own = work, output, received_NX, own
        self.summed = False

    def wait(self, timeout: object = None) -> bool:
        if not self.summed:
            self.work.wait()
            if self.own is None:
                # the constructor gets one of the two; they are dropped only after this first wait
                assert self.received_NX is not None
                torch.sum(self.received_NX, dim=0, out=self.output.view(-1))
            else:
                self.output.view(-1).add_(self.own)
            self.received_NX = self.own = None  # the received copy goes with the first wait
            self.summed = True
        return True


@overload
def reduce_scatter(
    output: Tensor, input: Tensor, group: dist.ProcessGroup | None, async_op: Literal[True]
) -> dist.Work: ...
@overload
def reduce_scatter(
    output: Tensor, input: Tensor, group: dist.ProcessGroup | None, async_op: Literal[False] = False
) -> None: ...
def reduce_scatter(
    output: Tensor, input: Tensor, group: dist.ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """``dist.reduce_scatter_single(output, input, group=group, async_op=async_op)``: the sum over the
    group of ``input`` (contiguous, rank-major: chunk ``q`` is rank ``q``'s), this rank's chunk into
    ``output`` (contiguous), the result ready after ``wait()`` when ``async_op``."""
    if input.device.type != "cpu":
        return dist.reduce_scatter_single(output, input, group=group, async_op=async_op)
    n = dist.get_world_size(group)
    chunks = input.view(n, -1)
    if n == 2:  # the peer's chunk straight into the output: no receive buffer (fresh pages on CPU)
        me = dist.get_rank(group)
        sizes = [0, 0]
        sizes[1 - me] = chunks.shape[1]
        work = dist.all_to_all_single(
            output.view(-1), chunks[1 - me], sizes, sizes, group=group, async_op=True
        )
        pending = _SumOnWait(work, output, None, own=chunks[me])
    else:
        received = torch.empty_like(input)
        work = dist.all_to_all_single(received, input, group=group, async_op=True)
        pending = _SumOnWait(work, output, received.view(n, -1), own=None)
    if async_op:
        return pending
    pending.wait()
    return None


def all_gather_(output: Tensor, group: dist.ProcessGroup | None) -> None:
    """Every rank's chunk of ``output`` (contiguous, rank-major: chunk ``q`` is rank ``q``'s) into
    every rank's ``output``; this rank's chunk already holds its part (in place, as NCCL's all-gather
    with the input at its chunk of the output: no copy in)."""
    start_all_gather_(output, group).wait()


class _Works:
    """Several works waited as one (gloo's all-gather: one broadcast a rank)."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


def start_all_gather_(output: Tensor, group: dist.ProcessGroup | None) -> _Works:
    """``all_gather_`` issued and not waited: ``output`` must not be read (or this rank's chunk
    written) before ``wait()`` on what it returns. Every rank of ``group`` must issue its collectives
    in the same order (the backend pairs them by that order, not by what they are)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = output.view(n, -1)
    if output.device.type != "cpu":
        work = dist.all_gather_into_tensor(output, chunks[me], group=group, async_op=True)
        return _Works([] if work is None else [work])
    works = [dist.broadcast(chunks[q], group=group, group_src=q, async_op=True) for q in range(n)]
    return _Works([w for w in works if w is not None])
