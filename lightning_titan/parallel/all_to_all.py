"""The EP row all-to-all, started now and waited for where its rows are first needed, with autograd.

    pending = start_all_to_all(x, output_splits, input_splits, group, "dispatch")  # rows in flight
    ...                                     # independent work: the shared expert, the router's stats
    rows = pending.wait()                   # the first use of the received rows

Autograd sees one exchange as two nodes, ``_Start`` then ``_Wait``, and runs them in reverse: the
backward of ``_Wait`` starts the reverse exchange of the gradient and the backward of ``_Start`` waits
for it. Among the nodes ready to run, autograd's engine runs the one created last in the forward
first, so the backward of work the forward placed between start and wait (created between the two
nodes) runs while the gradient travels: the overlap of the forward carries over to the backward.

On NCCL ``work.wait()`` makes the current stream wait for the collective (no host sync); on gloo it
blocks the host until this rank's transfer is done. Traced, each exchange records two spans: kind
``in_flight`` from start to the end of its wait (``tracing.BACKGROUND_KINDS``: time that overlaps
compute), and kind ``all_to_all`` around its launch and around its wait (the exposed time, which the
step's time breakdown counts).

Inside a forward-backward pair (``parallel/overlap.py``) every started exchange hands the rank to the
other microbatch, whose work then runs under it, the blocking exchange's included.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_titan.parallel import overlap
from lightning_titan.runtime import probes

T = TypeVar("T")


class Pending(Generic[T]):
    """A result on its way; ``wait()`` returns it (call it once)."""

    def __init__(self, finish: Callable[[], T]) -> None:
        self._finish: Callable[[], T] | None = finish

    def wait(self) -> T:
        finish, self._finish = self._finish, None
        if finish is None:
            raise RuntimeError("wait() called twice on one pending all-to-all; keep its result")
        return finish()


def done(value: T) -> Pending[T]:
    """A result already here (one EP rank: nothing travels)."""
    return Pending(lambda: value)


class _Exchange:
    """One all-to-all in flight: its work, its output rows and its open ``in_flight`` span."""

    def __init__(
        self,
        x: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: ProcessGroup,
        name: str,
    ) -> None:
        self.name = name
        self.rows = x.new_empty((sum(output_splits), *x.shape[1:]))
        self.sent: Tensor | None = x.contiguous()  # alive until the transfer ends
        self.flight: AbstractContextManager[Any] = probes.span("in_flight", name)
        self.flight.__enter__()
        with probes.span("all_to_all", name):  # the launch: on a busy CPU box it can take a while
            self.work = dist.all_to_all_single(
                self.rows, self.sent, output_splits, input_splits, group=group, async_op=True
            )
        overlap.hand_over()  # in a forward-backward pair the other microbatch computes meanwhile

    def wait(self) -> Tensor:
        with probes.span("all_to_all", self.name):
            self.work.wait()
        self.flight.__exit__(None, None, None)
        self.sent = None
        return self.rows


class _Link:
    """What the two autograd nodes of one exchange share: the splits and the exchange in flight
    (forward: the rows; backward: their gradient). Cleared at each wait, so no received rows stay
    alive through the graph."""

    def __init__(
        self, output_splits: list[int], input_splits: list[int], group: ProcessGroup, name: str
    ) -> None:
        self.splits, self.group, self.name = (output_splits, input_splits), group, name
        self.exchange: _Exchange | None = None

    def start(self, x: Tensor, backward: bool) -> Tensor:
        output_splits, input_splits = self.splits
        if backward:  # the gradient goes back the way the rows came
            output_splits, input_splits = input_splits, output_splits
        name = f"{self.name}_grad" if backward else self.name
        self.exchange = _Exchange(x, output_splits, input_splits, self.group, name)
        return self.exchange.rows

    def wait(self) -> Tensor:
        exchange, self.exchange = self.exchange, None
        assert exchange is not None, "an all-to-all waited for before it started"
        return exchange.wait()


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, link: _Link) -> Tensor:
        ctx.link = link
        return link.start(x, backward=False)  # not filled yet: only _Wait reads it

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return ctx.link.wait(), None  # ``grad`` is the one _Wait's backward is sending


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: Tensor, link: _Link) -> Tensor:
        ctx.link = link
        link.wait()
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.link.start(grad, backward=True)
        # hand _Start the gradient being sent (its shape): it returns the received one once waited
        return grad, None


def start_all_to_all(
    x: Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup, name: str
) -> Pending[Tensor]:
    """Start sending rows ``x[sum(input_splits[:i]) : ...]`` to rank i of ``group``; differentiable.
    Every rank of ``group`` must start its exchanges in the same order."""
    link = _Link(output_splits, input_splits, group, name)
    rows = _Start.apply(x, link)
    return Pending(lambda: _Wait.apply(rows, link))


class _Blocking(torch.autograd.Function):
    """The exchange waited for at once, forward and backward: nothing overlaps it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, link: _Link) -> Tensor:
        ctx.link = link
        link.start(x, backward=False)
        return link.wait()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        ctx.link.start(grad, backward=True)
        return ctx.link.wait(), None


def all_to_all(
    x: Tensor,
    output_splits: list[int],
    input_splits: list[int],
    group: ProcessGroup,
    name: str = "tokens",
) -> Tensor:
    """The blocking exchange: as ``start_all_to_all(...).wait()`` with nothing in between, and its
    backward waits for the gradient's exchange at once too."""
    return _Blocking.apply(x, _Link(output_splits, input_splits, group, name))
