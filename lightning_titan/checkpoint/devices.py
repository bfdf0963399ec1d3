"""The device side of a background save: which device the writer thread works on, and the fence
between the training stream's copies to host memory and the thread that writes them.

On CUDA the writer is a host thread of its own, whose current device is 0 until it sets one; torch's
DCP writer takes ``current_stream()`` of the current device, so without ``set_device`` every rank
would open a context on GPU 0 (and fail where GPUs are in exclusive-process mode). The host copies
are queued on the training stream without blocking it; an event recorded there after them is what
the writer waits for before it reads the bytes. On CPU there is no device and a copy is done when
``copy_`` returns: both are no-ops.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch import Tensor


class Fence(Protocol):
    """What the writer waits for before it reads the host copies (a ``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


class _Done:
    def synchronize(self) -> None:
        pass


class DeviceHooks:
    """CPU: the writer needs no device, and host copies are complete when they return."""

    pin_memory = False  # page-locked host buffers make a device-to-host copy one DMA
    device: torch.device | None = None

    def set_device(self) -> None:
        """Called once, on the writer thread, before its first write."""

    def record_fence(self) -> Fence:
        """Called on the training thread after the host copies were queued."""
        return _Done()


class CudaHooks(DeviceHooks):
    """The writer works on ``device`` (the rank's own), and waits for the training stream's copies."""

    pin_memory = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def set_device(self) -> None:
        torch.cuda.set_device(self.device)

    def record_fence(self) -> Fence:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event


def hooks_for(tensors: Iterable[Tensor]) -> DeviceHooks:
    """CUDA hooks on the device of the first CUDA tensor among ``tensors``; CPU hooks if none is."""
    for tensor in tensors:
        if tensor.device.type == "cuda":
            return CudaHooks(tensor.device)
    return DeviceHooks()


def contexts() -> list[int]:
    """The CUDA devices this process holds a context on ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    has_context = torch._C._cuda_hasPrimaryContext  # type: ignore[attr-defined]
    return [i for i in range(torch.cuda.device_count()) if has_context(i)]
