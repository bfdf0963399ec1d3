"""Checkpoints written in the background: a save copies this rank's shards to host memory and a
thread writes them while training goes on (torchtitan's ``async_with_pinned_mem``, DCP's ``async_save``).

Every promise of a synchronous save holds, because the thread runs the same write
(``sharded._write``): shards into a temporary sibling, checksums, ``COMPLETE``, the atomic swap. So
``path`` is the previous checkpoint or the new complete one, never a half one, whenever the process
stops. At most one save is in flight: the next save, a load and the end of training wait for it and
raise its error on every rank (the write agrees on errors as a synchronous save does).

- The thread's collectives run over a gloo group of their own (as torchtitan's async mode does), so
  they never interleave with training's collectives on the same communicator.
- The host copies are kept and reused by the next save (on CUDA pinned, so the copy is one DMA).
  They stay host tensors: a DTensor is rebuilt around its host shard with the same mesh and
  placements (``DTensor.from_local`` would move it back to the mesh's device). The copies run on the
  training stream without blocking it; the writer waits for an event recorded after them, on its
  own device, set once (``devices.py``).
- Every wait, and every collective of the thread's group, is bounded by ``timeout`` (the job's
  ``timeout_minutes``): a peer stopped or dead while a write is in flight fails the job as a
  collective of a synchronous save would, instead of holding this rank in ``wait`` for ever.
- Removing an older checkpoint (ModelCheckpoint's top-k) waits for the save in flight and is
  dropped if that save fails: a failed save never leaves fewer checkpoints than there were.
"""

from __future__ import annotations

import contextvars
import copy
import queue
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_titan.checkpoint import files
from lightning_titan.checkpoint.devices import DeviceHooks, Fence, hooks_for
from lightning_titan.runtime.agreement import distributed

WRITER_THREAD = "titan-checkpoint-writer"
DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's own default for a gloo group


@dataclass(frozen=True)
class Staged:
    """A save's state in host memory, and the fence its copies are complete after."""

    state: dict[str, Any]
    fence: Fence


class BackgroundSaves:
    """The save in flight (at most one), its host buffers, and the removals waiting for it.

    ``hooks``: the writer's device and fence (``devices.py``); None: CUDA hooks on the device of the
    first saved CUDA tensor, CPU hooks if there is none. Tests inject fakes here.
    ``timeout``: the longest ``wait`` blocks, and the writer group's collective timeout (the
    strategy passes its ``timeout_minutes``, the bound of a synchronous save's collectives)."""

    def __init__(
        self, hooks: DeviceHooks | None = None, timeout: timedelta = DEFAULT_TIMEOUT
    ) -> None:
        if not timeout.total_seconds() > 0:
            raise ValueError(f"timeout={timeout!r} must be > 0 (the job's timeout_minutes)")
        self._hooks = hooks
        self.timeout = timeout
        # one writer thread for the job, started by the first save: starting a thread per save
        # blocks the caller until the new thread first runs (tens of ms on busy cores)
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._done = threading.Event()
        self._done.set()
        self._error: BaseException | None = None
        self._after: list[Callable[[], None]] = []  # run once the write succeeded
        self._lock = threading.Lock()  # the thread's end against ``then``
        self._writing = False
        self._timed_out = False  # a wait for the write in flight timed out; it has not ended since
        self.seconds = 0.0  # how long the last background write took (staging excluded)
        self._buffers: dict[str, Tensor] = {}
        self._group: dist.ProcessGroup | None = None

    def group(self) -> dist.ProcessGroup | None:
        """The writer's process group; collective the first time (every rank saves together)."""
        if self._group is None and distributed():
            # its own timeout: a group made without one waits torch's 30 minutes, whatever the job's
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    def stage(self, state: dict[str, Any]) -> Staged:
        """``state`` with every tensor copied to host memory (a DTensor keeps its mesh and placements,
        so DCP writes the same shards); non-tensor values deep-copied. Buffers of the last save are
        reused. The copies are queued on the training stream; ``Staged.fence`` says when they are done."""
        if self._hooks is None:
            self._hooks = hooks_for(v for v in state.values() if isinstance(v, Tensor))
        staged: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, DTensor):
                staged[key] = host_dtensor(self._host_copy(key, value.to_local()), value)
            elif isinstance(value, Tensor):
                staged[key] = self._host_copy(key, value)
            else:
                staged[key] = copy.deepcopy(value)
        return Staged(staged, self._hooks.record_fence())

    def _host_copy(self, key: str, tensor: Tensor) -> Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            assert self._hooks is not None  # chosen by stage
            pin = self._hooks.pin_memory
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._buffers[key] = buffer
        return buffer.copy_(tensor.detach(), non_blocking=True)

    def start(self, write: Callable[[], None], fence: Fence) -> None:
        """Run ``write`` in the background (after the save in flight, if any), once ``fence`` (of
        the staged state it writes) has passed."""
        self.wait()
        if not distributed():  # DCP warns that one process saves alone: here it is the intent
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to save in a single"
            )

        def run() -> None:
            started = time.perf_counter()
            try:
                fence.synchronize()  # the host copies are complete: only now are their bytes read
                write()
                self.seconds = time.perf_counter() - started
                self._run_after()
            except BaseException as e:  # noqa: BLE001 - raised by wait(), on the training thread
                self._error = e
            finally:
                with self._lock:  # a failed save's removals and links are dropped: keep what was
                    self._after, self._writing = [], False
                self._done.set()

        self._writing = True
        self._done.clear()
        # in a copy of this context: what the training thread set there (e.g. the step) holds
        context = contextvars.copy_context()
        self._jobs.put(lambda: context.run(run))
        if self._thread is None:
            # a daemon: a process that stops without waiting (a failure) leaves the temporary
            # sibling, which the next save removes, and the previous checkpoint in place
            self._thread = threading.Thread(target=self._serve, name=WRITER_THREAD, daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        (self._hooks or DeviceHooks()).set_device()  # once: the device is per thread
        while True:
            self._jobs.get()()

    @property
    def in_flight(self) -> bool:
        """A save is being written."""
        return self._writing

    def wait(self) -> None:
        """Block until the save in flight is complete; raise its error (every rank raises it).
        TimeoutError after ``timeout``: the writer waits for a stopped peer, or on a hung file
        system (its collectives time out too, each after ``timeout``; the first of them is raised
        here when it comes sooner). Once a wait timed out, the next ones raise at once until the
        write ends: the failure's own handling (the strategy's teardown waits) adds no second
        timeout."""
        timeout_s = 0.0 if self._timed_out else self.timeout.total_seconds()
        if not self._done.wait(timeout_s):
            self._timed_out = True
            minutes = self.timeout.total_seconds() / 60
            raise TimeoutError(
                f"the checkpoint write in the background timed out: not done within "
                f"timeout_minutes={minutes:g}; a peer stopped or lost during the write, or a "
                "file system that hangs, holds it (raise timeout_minutes for a slow file system)"
            )
        self._timed_out = False
        error, self._error = self._error, None
        if error is not None:
            raise error

    def remove_after(self, path: str | Path) -> None:
        """Remove the checkpoint at ``path`` once the save in flight succeeded (now if none is)."""
        self.then(lambda: files.remove(path))

    def then(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the writer once the save in flight (and the jobs queued before) succeeded,
        without waiting for it here; dropped if it fails (``wait`` raises that error), also when it
        has failed already. At once, here, if no save is in flight."""
        with self._lock:
            if self._writing:
                self._after.append(job)
                return
            if self._error is not None:
                return  # every rank drops it: the failure was agreed, whether or not it has ended here
        job()

    def _run_after(self) -> None:
        """The jobs queued by ``then``, in order, including those queued while they run; the save
        stays in flight until the last is done, so a new job never overtakes a queued one. A job
        that fails does not stop the next (a removal is rank 0's alone, a link is every rank's
        collective); the first error is raised after the last."""
        error: BaseException | None = None
        while True:
            with self._lock:
                jobs, self._after = self._after, []
                if not jobs:
                    self._writing = False
                    break
            for job in jobs:
                try:
                    job()
                except BaseException as e:  # noqa: BLE001 - raised below, after the others ran
                    error = error or e
        if error is not None:
            raise error


def host_dtensor(local: Tensor, like: DTensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements and global shape whose shard is ``local``, where
    ``local`` is (``DTensor.from_local`` moves a shard to the mesh's device: on CUDA it would undo
    the staging and hold the state twice in device memory)."""
    return DTensor(local, like._spec, requires_grad=False)
