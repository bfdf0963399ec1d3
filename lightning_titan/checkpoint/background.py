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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_titan.checkpoint import files
from lightning_titan.runtime.agreement import distributed


class BackgroundSaves:
    """The save in flight (at most one), its host buffers, and the removals waiting for it."""

    def __init__(self) -> None:
        # one writer thread for the job, started by the first save: starting a thread per save
        # blocks the caller until the new thread first runs (tens of ms on busy cores)
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._done = threading.Event()
        self._done.set()
        self._error: BaseException | None = None
        self._removals: list[Path] = []
        self._lock = threading.Lock()  # the thread's end against ``remove_after``
        self._writing = False
        self.seconds = 0.0  # how long the last background write took (staging excluded)
        self._buffers: dict[str, Tensor] = {}
        self._group: dist.ProcessGroup | None = None

    def group(self) -> dist.ProcessGroup | None:
        """The writer's process group; collective the first time (every rank saves together)."""
        if self._group is None and distributed():
            self._group = dist.new_group(backend="gloo")
        return self._group

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with every tensor copied to host memory (a DTensor keeps its placement, so DCP
        writes the same shards); non-tensor values deep-copied. Buffers of the last save are reused."""
        staged: dict[str, Any] = {}
        for key, value in state.items():
            if isinstance(value, DTensor):
                local = self._host_copy(key, value.to_local())
                staged[key] = DTensor.from_local(
                    local,
                    value.device_mesh,
                    value.placements,
                    run_check=False,
                    shape=value.shape,
                    stride=value.stride(),
                )
            elif isinstance(value, Tensor):
                staged[key] = self._host_copy(key, value)
            else:
                staged[key] = copy.deepcopy(value)
        if any(t.device.type == "cuda" for t in state.values() if isinstance(t, Tensor)):
            torch.cuda.current_stream().synchronize()  # the copies are non-blocking
        return staged

    def _host_copy(self, key: str, tensor: Tensor) -> Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            pin = tensor.device.type == "cuda"
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            self._buffers[key] = buffer
        return buffer.copy_(tensor.detach(), non_blocking=True)

    def start(self, write: Callable[[], None]) -> None:
        """Run ``write`` in the background (after the save in flight, if any)."""
        self.wait()
        if not distributed():  # DCP warns that one process saves alone: here it is the intent
            warnings.filterwarnings(
                "ignore", message=".*assuming the intent is to save in a single"
            )

        def run() -> None:
            started = time.perf_counter()
            try:
                write()
                with self._lock:
                    removals, self._removals, self._writing = self._removals, [], False
                for path in removals:
                    files.remove(path)
            except BaseException as e:  # noqa: BLE001 - raised by wait(), on the training thread
                self._error = e
            finally:
                with self._lock:  # a failed save's removals are dropped: keep what there was
                    self._removals, self._writing = [], False
                self.seconds = time.perf_counter() - started
                self._done.set()

        self._writing = True
        self._done.clear()
        # in a copy of this context: what the training thread set there (e.g. the step) holds
        context = contextvars.copy_context()
        self._jobs.put(lambda: context.run(run))
        if self._thread is None:
            # a daemon: a process that stops without waiting (a failure) leaves the temporary
            # sibling, which the next save removes, and the previous checkpoint in place
            self._thread = threading.Thread(
                target=self._serve, name="titan-checkpoint-writer", daemon=True
            )
            self._thread.start()

    def _serve(self) -> None:
        while True:
            self._jobs.get()()

    @property
    def in_flight(self) -> bool:
        """A save is being written."""
        return self._writing

    def wait(self) -> None:
        """Block until the save in flight is complete; raise its error (every rank raises it)."""
        self._done.wait()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def remove_after(self, path: str | Path) -> None:
        """Remove the checkpoint at ``path`` once the save in flight succeeded (now if none is)."""
        with self._lock:
            if self._writing:
                self._removals.append(Path(path))
                return
        files.remove(path)
