"""Count what would be device-to-host transfers on CUDA, on the CPU: a TorchFunctionMode."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
_SYNCING_OPS = {"bincount", "nonzero", "unique", "masked_select", "argwhere"}


class HostReads(TorchFunctionMode):
    """Count what would be device-to-host transfers on CUDA; ``repeat_interleave`` syncs there only
    without ``output_size``."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _HOST_READS or name in _SYNCING_OPS:
            self.calls.append(name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            if len(args) > 1 and isinstance(args[1], torch.Tensor):
                self.calls.append(name)
        return func(*args, **kwargs)
