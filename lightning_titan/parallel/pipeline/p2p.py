"""Point-to-point transfers of ``[m, S, D]`` activations and their grads between neighbouring stages.

Every method is a no-op at the end of the pipeline where it has no neighbour, so a schedule reads the same
on every stage. Each direction of a link carries one ordered stream per step: activations y_0 .. y_{M-1}
from the previous stage, grads g_0 .. g_{M-1} (in the schedule's backward order) from the next. With
virtual stages (``ring``) the ends are neighbours too (the last rank feeds the first rank's next chunk)
and the chunked schedule says when a message is due; the two streams carry their own tags (on pp=2
both come from the same rank), and their order also agrees per pair of ranks, as NCCL (which matches
by order) needs: the threaded test checks that over one channel per pair.

On gloo a send completes only after the receiver has posted the matching receive, and the payload moves
when the sender's side notices that; a stage busy computing notices late (3-5 ms per message on 2 shared
cores). So, on CPU, the receives of a stream's next ``AHEAD`` messages are posted as soon as the current
one is taken, before they are needed, and sends are not waited: the sender finds the receive already
posted and writes from its own thread. A send holds its tensor until it is waited (gloo never reports
a send done, so on CPU that is ``finish``); an activation is held until its backward anyway.
NCCL runs a communicator's batches in order on one stream (``batch_isend_irecv`` posts every batch on
the group's communicator), where an early receive would hold up the send it is waiting for: there each exchange posts its sends and receives together (``batch_isend_irecv``,
or the ``batch`` a test puts in its place: ``tests/support/nccl_strict.py`` runs this path on gloo with
NCCL's ordering) and waits for the ones with a receive. A send-only batch is not waited at once (that
would hold this rank's compute stream until the peer takes the message): the next batch with a
receive is, and, batches finishing in order, every send before it is done then and is dropped; at most
``SENDS_IN_FLIGHT`` send-only batches stay in flight, an older one is waited, so a step holds O(1) sent
buffers, not O(M).

Under autocast the wire carries the autocast dtype (``lightning_titan.parallel.wire``): the receiver's matmuls
compute in it anyway. The receiver widens what it takes back to the stage's dtype, so the residual
stream and its grads keep the dtype they have in one process, rounded once at the stage boundary.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.wire import wire_dtype
from lightning_titan.runtime import probes

# Each stream has its own tag: with virtual stages on pp=2 both neighbours are the same rank.
FORWARD_TAG, BACKWARD_TAG = 0, 1
AHEAD = 2  # receives posted ahead per stream on CPU
SENDS_IN_FLIGHT = 2  # send-only batches not waited yet, on the paired (GPU) path


def _started(work: dist.Work | None) -> dist.Work:
    assert work is not None  # torch returns None only to a rank outside the group
    return work


class _Inbox:
    """Receives from one neighbour, posted ahead of use when ``early``."""

    def __init__(self, links: StageLinks, peer: int | None, expected: int, tag: int) -> None:
        self.links, self.peer, self.tag = links, peer, tag
        self.unposted = expected if peer is not None else 0
        self.posted: deque[tuple[dist.Work, Tensor]] = deque()

    def post(self) -> None:
        if self.unposted:
            self.unposted -= 1
            buffer = self.links.new_buffer()
            work = _started(dist.irecv(buffer, self.peer, group=self.links.group, tag=self.tag))
            self.posted.append((work, buffer))

    def take(self) -> Tensor:
        if not self.posted:
            self.post()
        if not self.posted:
            raise RuntimeError(
                f"the schedule asked rank {self.peer} for more messages than StageLinks.start() announced"
            )
        work, buffer = self.posted.popleft()
        while len(self.posted) < AHEAD and self.unposted:  # the next receives, before this wait
            self.post()
        work.wait()
        return buffer.to(self.links.dtype)


class StageLinks:
    """This rank's links to the previous and next stage of its pipeline (its PP group), for one step.

    ``dtype`` is the stage's activation dtype (what a receive returns); messages travel in
    ``wire_dtype``, the autocast dtype when links are built under autocast. ``ring``: the stages
    form a ring (virtual stages: the last rank's chunk feeds the first rank's next chunk), so the
    first stage has a previous one and the last a next one; the schedule says when one is used."""

    def __init__(
        self,
        dims: ParallelDims,
        group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        device: torch.device,
        *,
        ring: bool = False,
    ) -> None:
        self.prev, self.next = dims.prev_stage_rank, dims.next_stage_rank
        if ring and dims.pp > 1:
            self.prev, self.next = (
                dims.stage_rank((dims.pp_rank - 1) % dims.pp),
                dims.stage_rank((dims.pp_rank + 1) % dims.pp),
            )
        self.group, self.dtype, self.device = group, dtype, device
        self.wire_dtype = wire_dtype(dtype, device)
        self.early = device.type == "cpu"
        # the paired path's batches: NCCL's on GPUs; a test's transport may stand in (module doc)
        self.batch: Callable[[list[dist.P2POp]], list[dist.Work]] = dist.batch_isend_irecv
        self.shape: tuple[int, ...] = ()
        self._from_prev = _Inbox(self, self.prev, 0, FORWARD_TAG)
        self._from_next = _Inbox(self, self.next, 0, BACKWARD_TAG)
        self._sends: deque[list[dist.Work]] = deque()  # batches in flight; each holds its tensors

    def start(self, shape: tuple[int, ...], forward: int, backward: int) -> None:
        """Announce the step: ``forward`` activations from the previous stage, ``backward`` grads from
        the next, each of ``shape``. On CPU the first receive of each stream is posted now."""
        self.shape = shape
        self._from_prev = _Inbox(self, self.prev, forward, FORWARD_TAG)
        self._from_next = _Inbox(self, self.next, backward, BACKWARD_TAG)
        if self.early:
            self._from_prev.post()
            self._from_next.post()

    def finish(self) -> None:
        """Wait for the sends still in flight (the step's last call)."""
        self._wait_sends(0)

    def _wait_sends(self, keep: int) -> None:
        """Wait for the oldest batches of sends until ``keep`` are in flight."""
        while len(self._sends) > keep:
            for work in self._sends.popleft():
                work.wait()

    def new_buffer(self) -> Tensor:
        return torch.empty(self.shape, dtype=self.wire_dtype, device=self.device)

    def exchange(
        self,
        activation: Tensor | None = None,
        grad: Tensor | None = None,
        recv_forward: bool = False,
        recv_backward: bool = False,
    ) -> tuple[Tensor | None, Tensor | None]:
        """Send ``activation`` to the next stage and ``grad`` to the previous one (those given), and
        take the next activation from the previous stage and grad from the next (those asked for),
        all in one batch: (activation, grad) received, None where not asked or no neighbour."""
        xs, gs = self.exchange_many(
            [] if activation is None else [activation],
            [] if grad is None else [grad],
            int(recv_forward),
            int(recv_backward),
        )
        return (xs[0] if xs else None), (gs[0] if gs else None)

    def exchange_many(
        self, to_next: list[Tensor], to_prev: list[Tensor], from_prev: int = 0, from_next: int = 0
    ) -> tuple[list[Tensor], list[Tensor]]:
        """``exchange`` sending the tensors ``to_next`` (on the forward stream) and ``to_prev`` (the
        backward one), in order, and taking the next ``from_prev`` messages of the previous stage's
        stream and ``from_next`` of the next one's, in the same batch: the lists received (empty
        where there is no neighbour)."""
        sends = [
            (t.detach().to(self.wire_dtype).contiguous(), peer, tag)
            for ts, peer, tag in (
                (to_next, self.next, FORWARD_TAG),
                (to_prev, self.prev, BACKWARD_TAG),
            )
            for t in ts
            if peer is not None
        ]
        boxes = [
            (box, count if box.peer is not None else 0)
            for box, count in ((self._from_prev, from_prev), (self._from_next, from_next))
        ]
        if not sends and not any(count for _, count in boxes):
            return [], []
        probes.fault("p2p")
        if self.early:
            if sends:  # not waited: gloo never reports a send done, finish() waits them
                self._sends.append(
                    [_started(dist.isend(t, p, group=self.group, tag=tag)) for t, p, tag in sends]
                )
            xs, gs = ([box.take() for _ in range(count)] for box, count in boxes)
            return xs, gs
        ops = [dist.P2POp(dist.isend, t, p, self.group, tag) for t, p, tag in sends]
        received: list[list[Tensor]] = []
        for box, count in boxes:
            received.append([self.new_buffer() for _ in range(count)])
            ops += [dist.P2POp(dist.irecv, b, box.peer, self.group, box.tag) for b in received[-1]]
        works = self.batch(ops)
        if not any(received):  # not waited at once: it would hold the compute stream (module doc)
            self._sends.append(works)
            self._wait_sends(SENDS_IN_FLIGHT)
            return [], []
        for work in works:
            work.wait()
        self._wait_sends(0)  # done already: the batches before this one finished before it
        xs, gs = ([t.to(self.dtype) for t in ts] for ts in received)
        return xs, gs

    def recv_forward(self) -> Tensor | None:
        return self.exchange(recv_forward=True)[0]

    def send_forward(self, activation: Tensor | None) -> None:
        self.exchange(activation=activation)

    def recv_backward(self) -> Tensor | None:
        return self.exchange(recv_backward=True)[1]

    def send_backward(self, grad: Tensor | None) -> None:
        self.exchange(grad=grad)

    def send_forward_recv_backward(self, activation: Tensor | None) -> Tensor | None:
        return self.exchange(activation=activation, recv_backward=True)[1]

    def send_backward_recv_forward(self, grad: Tensor | None) -> Tensor | None:
        return self.exchange(grad=grad, recv_forward=True)[0]
