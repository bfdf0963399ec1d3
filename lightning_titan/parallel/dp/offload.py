"""Optimizer offload (``offload_optimizer=True``): the optimizer steps fp32 host copies of the
tensors it would step on the device, so its state (AdamW's two moments) lives in host memory, as
do the fp32 masters of bf16 weights (``master.py``) and of ZeRO's rows (``zero.py``).

The masters design, one level further: whatever the optimizer was pointed at (a parameter, a ZeRO
leaf of its rows, a bf16 parameter's fp32 master or master rows) is its *device tensor*; the
optimizer steps a *host copy* of it instead. A step then is, after the clip:

    to host      each device tensor's reduced grad into its host copy's fp32 grad buffer
                 (``grads_to_host``; the device grad goes)
    step         the user's optimizer on the host copies, on the CPU
    copy back    each host copy into its device tensor (``copy_back``): a parameter or ZeRO view
                 takes its updated rows in place; a master is refilled for the write back into
                 the bf16 parameter and ZeRO's gather, then freed again (``release``)

So device memory holds no optimizer state and no fp32 master between steps (a bf16 weight and its
grad only); the host holds the masters (4 bytes a trained element), the moments (8) and a grad
buffer (4), each rank its ZeRO rows. On CUDA the host tensors are pinned, the copies to the device
are ``non_blocking`` on the current stream (the host goes on to the expert-bias update, zero_grad
and the next batch while they run), and the copy to the host records an event that the CPU step
waits on. A checkpoint sees the device tensors (``ZeroShards.of_leaf`` maps a host copy to the one
it stands for): the saved masters and moments are the fp32 ones a run without offload saves, so
either run resumes from the other's; after a load (``Engine.whole_params``) each host copy takes
its device tensor again (``refresh``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


def check_offloadable(optimizer: Optimizer) -> None:
    """Refuse, by name, an optimizer whose step cannot run on host tensors."""
    for group in optimizer.param_groups:
        if group.get("capturable"):
            name = type(optimizer).__qualname__
            raise ValueError(
                f"offload_optimizer=True steps {name} on the CPU; capturable=True keeps its step "
                f"on the device: build it with capturable=False (or use offload_optimizer=False)"
            )


class HostOptimizer:
    """The host copies of ``optimizers``' device tensors, which the optimizers step from here on.

    ``freed``: the device tensors that exist only for the optimizer (fp32 masters): their storage
    is released between steps (``release``) and refilled for the copy back (``fill``)."""

    def __init__(self, optimizers: Sequence[Optimizer], freed: Iterable[Tensor] = ()) -> None:
        self.device_of: dict[int, Tensor] = {}  # id(host copy) -> its device tensor
        self.pairs: list[tuple[Tensor, nn.Parameter]] = []
        freed_ids = {id(t) for t in freed}
        self.freed: list[Tensor] = []
        for optimizer in optimizers:
            check_offloadable(optimizer)
            if optimizer.state:
                raise RuntimeError(
                    "offload_optimizer=True moves an optimizer to the host before its first "
                    "step; this one already has state"
                )
            for group in optimizer.param_groups:
                group["params"] = [self._host_copy(t, freed_ids) for t in group["params"]]
        self.pinned = any(t.device.type == "cuda" for t, _ in self.pairs)
        self.grads: list[Tensor | None] = [None] * len(self.pairs)  # host fp32 grad buffers
        self._ready: torch.cuda.Event | None = None
        self.release()

    def _host_copy(self, tensor: Tensor, freed_ids: set[int]) -> nn.Parameter:
        pin = tensor.device.type == "cuda"
        host = torch.empty(tensor.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
        host.copy_(tensor.detach())
        copy = nn.Parameter(host)
        self.device_of[id(copy)] = tensor
        self.pairs.append((tensor, copy))
        if id(tensor) in freed_ids:
            self.freed.append(tensor)
        return copy

    def __len__(self) -> int:
        return len(self.pairs)

    def device_tensor(self, tensor: Tensor) -> Tensor:
        """The device tensor a host copy stands for (``tensor`` itself if it is none)."""
        return self.device_of.get(id(tensor), tensor)

    @torch.no_grad()
    def grads_to_host(self, drop: bool = False) -> None:
        """Just before the optimizer step: each host copy's grad is its device tensor's reduced,
        clipped grad in fp32 (None where that is, or every one with ``drop``: a skipped step)."""
        for i, (device, host) in enumerate(self.pairs):
            grad = None if drop else device.grad
            if grad is None:
                device.grad = None
                host.grad = None
                continue
            buffer = self.grads[i]
            if buffer is None:
                buffer = torch.empty(host.shape, dtype=torch.float32, pin_memory=self.pinned)
                self.grads[i] = buffer
            buffer.copy_(grad, non_blocking=self.pinned)
            host.grad = buffer
            device.grad = None  # the device's copy of the grad goes now (its host copy stays)
        if self.pinned:  # the CPU step reads the buffers only once the copies have landed
            ready = torch.cuda.Event()
            ready.record()
            ready.synchronize()

    @torch.no_grad()
    def copy_back(self) -> None:
        """Just after the optimizer step: each device tensor takes its updated host copy (the
        masters refilled first), before the masters' write back and ZeRO's gather read them."""
        self.fill()
        for device, host in self.pairs:
            device.copy_(host, non_blocking=self.pinned)

    @torch.no_grad()
    def refresh(self) -> None:
        """Each host copy takes its device tensor (a checkpoint load wrote those); the masters
        must be filled (``fill``)."""
        for device, host in self.pairs:
            host.copy_(device)

    def fill(self) -> None:
        """The freed device tensors their storage again (their values: the next copy back)."""
        for t in self.freed:
            nbytes = t.numel() * t.element_size()
            if t.untyped_storage().nbytes() < nbytes:
                t.untyped_storage().resize_(nbytes)

    def release(self) -> None:
        """The device masters' storage goes (their values are the host copies')."""
        for t in self.freed:
            t.untyped_storage().resize_(0)

    @torch.no_grad()
    def fill_from_host(self) -> None:
        """The freed device tensors refilled with their host copies' values (to be read whole)."""
        self.fill()
        freed = {id(t) for t in self.freed}
        for device, host in self.pairs:
            if id(device) in freed:
                device.copy_(host)
