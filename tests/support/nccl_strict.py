"""An NCCL-strict point-to-point transport on gloo: the pipeline's GPU code path, run on CPU.

``StageLinks`` on GPUs posts each exchange's sends and receives as one ``batch_isend_irecv`` (one NCCL
group) and waits for the batches with a receive. NCCL runs a communicator's operations on one stream
in the order they were issued: a batch starts when the one before it has finished, and a send
finishes only once its peer's matching receive runs (beyond NCCL's in-flight buffer; here no message
fits any buffer, whatever its size). Sends and receives between two ranks match by order, not by tag.
gloo buffers a send and matches by tag, so a schedule that deadlocks on NCCL passes on it.
``StrictStream.batch`` stands in for ``batch_isend_irecv`` and gives gloo NCCL's rules:

- one stream (a thread) per rank and process group runs the batches one after another, in order;
- a batch tells each peer it receives from that its receive is posted (a small notice: the tag and
  size it expects) and posts the payload's receive; each of its sends waits for the peer's notice,
  checks it (NCCL would pair a send with a receive of another tag or size silently) and only then
  sends; every payload between two ranks travels on one tag, so they match by order as on NCCL;
- the batch ends when all of its messages have moved; then the next one starts.

It also counts the batches of sends still alive (their tensors held: not yet waited and dropped by
the links) whenever a batch is issued: ``most_live_sends``.

A stream that waits ``deadline_s`` for one message gives up (gloo closes the pair, so the peer's
stream stops too) and the batch's ``wait`` raises ``StrictP2PStuck`` saying what this rank waited
for: a deadlock fails a test within seconds and names the waiting ranks.
"""

from __future__ import annotations

import queue
import threading
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

NOTICE_TAG, PAYLOAD_TAG = 7001, 7002  # apart from the links' own tags (0, 1)


class StrictP2PStuck(RuntimeError):
    """A rank's p2p stream waited past its deadline: the message says for what."""


class _Batch:
    def __init__(self, ops: list[dist.P2POp], number: int) -> None:
        self.ops, self.number = ops, number
        self.done = threading.Event()
        self.error: BaseException | None = None


class _BatchWork:
    """What ``batch`` returns for each op: waiting on it waits for the whole batch, as on NCCL."""

    def __init__(self, batch: _Batch) -> None:
        self._batch = batch

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._batch.done.wait()
        if self._batch.error is not None:
            raise self._batch.error
        return True

    def is_completed(self) -> bool:
        return self._batch.done.is_set()


class StrictStream:
    """This rank's NCCL-like stream over ``group`` (module doc). ``close`` ends its thread."""

    def __init__(self, group: dist.ProcessGroup | None, deadline_s: float = 120.0) -> None:
        self.group, self.deadline = group, timedelta(seconds=deadline_s)
        self.rank = dist.get_rank()
        self.batches = 0
        self._sending: weakref.WeakSet[_Batch] = weakref.WeakSet()  # alive batches with sends
        self.most_live_sends = 0
        self.sent: dict[int, int] = {}  # messages per peer, for the names in errors
        self.received: dict[int, int] = {}
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="nccl-strict", daemon=True)
        self._thread.start()

    def batch(self, ops: list[dist.P2POp]) -> list[_BatchWork]:
        """``dist.batch_isend_irecv`` with NCCL's ordering: the ops start together, after every
        batch issued before them."""
        self.batches += 1
        self.most_live_sends = max(self.most_live_sends, len(self._sending))
        batch = _Batch(ops, self.batches)
        if any(op.op is dist.isend for op in ops):
            self._sending.add(batch)
        self._queue.put(batch)
        return [_BatchWork(batch)] * len(ops)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=self.deadline.total_seconds() + 5)

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            if self._failed is None:
                try:
                    self._run_batch(batch)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting host
                    self._failed = e
            batch.error = self._failed
            batch.done.set()
            del batch  # alive only while the links hold its works (most_live_sends)

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(self.deadline)
        except (
            RuntimeError
        ) as e:  # gloo: a timeout, or the peer's stream gave up and closed the pair
            raise StrictP2PStuck(
                f"rank {self.rank}'s p2p stream gave up in its batch {self._current}: {what} "
                f"(after at most {self.deadline.total_seconds():.0f} s: "
                f"{str(e).splitlines()[0][-70:]})"
            ) from None

    def _run_batch(self, batch: _Batch) -> None:
        sends = [op for op in batch.ops if op.op is dist.isend]
        recvs = [op for op in batch.ops if op.op is dist.irecv]
        self._current = batch.number
        posted = []  # (work, what): every receive is posted, and announced, before any send waits
        for op in recvs:
            n = self.received[op.peer] = self.received.get(op.peer, 0) + 1
            notice = torch.tensor([op.tag, op.tensor.numel()], dtype=torch.int64)
            what = f"its receive #{n} from rank {op.peer} (tag {op.tag}) to get its payload"
            posted.append((dist.irecv(op.tensor, op.peer, group=self.group, tag=PAYLOAD_TAG), what))
            posted.append((dist.isend(notice, op.peer, group=self.group, tag=NOTICE_TAG), what))
        notices = []
        for op in sends:
            n = self.sent[op.peer] = self.sent.get(op.peer, 0) + 1
            notice = torch.empty(2, dtype=torch.int64)
            notices.append(
                (dist.irecv(notice, op.peer, group=self.group, tag=NOTICE_TAG), notice, n)
            )
        for op, (work, notice, n) in zip(sends, notices, strict=True):
            what = (
                f"its send #{n} to rank {op.peer} (tag {op.tag}, {op.tensor.numel()} elements) "
                f"waits for rank {op.peer} to post the matching receive"
            )
            self._wait(work, what)
            tag, numel = notice.tolist()
            if (tag, numel) != (op.tag, op.tensor.numel()):
                raise StrictP2PStuck(
                    f"rank {self.rank}'s send #{n} to rank {op.peer} (tag {op.tag}, "
                    f"{op.tensor.numel()} elements) meets a receive of tag {tag}, {numel} elements: "
                    "NCCL matches by order and would pair them"
                )
            payload = dist.isend(op.tensor, op.peer, group=self.group, tag=PAYLOAD_TAG)
            posted.append((payload, f"its send #{n} to rank {op.peer} to finish"))
        for work, what in posted:
            self._wait(work, what)


def strict_links(make_links, stream: StrictStream):
    """Wrap an ``Engine._links`` factory: the links it builds take the GPU path over ``stream``."""

    def links(stage_model, device):
        made = make_links(stage_model, device)
        made.early = False
        made.batch = stream.batch
        return made

    return links
