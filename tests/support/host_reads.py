"""Count what would be transfers between host and device on CUDA, on the CPU: ``HostReads`` the reads
back to the host (a TorchFunctionMode), ``HostToDevice`` the copies onto the device (a
TorchDispatchMode: it sees the ``lift_fresh`` that item assignment of a Python scalar dispatches)."""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

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


aten = torch.ops.aten
# ops that move a source tensor's values into another tensor (the source: their second argument)
_MOVES = {aten.copy_.default, aten.fill_.Tensor, aten.index_put_.default}


class HostToDevice(TorchDispatchMode):
    """Count what would be host-to-device copies on CUDA, where everything on the CPU is "host".

    A tensor made from Python data (``torch.tensor(data, device=...)``, ``as_tensor``, ``new_tensor``,
    and the Python scalar of ``t[i] = 1.0``) is built on the host and copied over: ``lift_fresh``.
    Such a tensor moved into another one (``copy_``, ``fill_`` from a tensor, ``.to``, an index put)
    or sent with ``.to(device)`` is one more (``t[i] = 1.0``: ``lift_fresh`` then ``copy_``, two calls). Kernels that take a
    Python scalar as an argument (``fill_(1.0)``, ``mul_(0.5)``, ``torch.full``) copy nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []
        self._host: dict[int, weakref.ref] = {}  # by id: a Tensor's == is elementwise

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.lift_fresh.default:
            self.calls.append("lift_fresh")
            self._host[id(out)] = weakref.ref(out)
        elif func in _MOVES:
            sources = args[1] if func is aten.index_put_.default else args[1:2]
            if any(self._is_host(t) for t in sources):
                self.calls.append(func.overloadpacket.__name__)
        elif (
            func is aten._to_copy.default and "device" in (kwargs or {}) and self._is_host(args[0])
        ):
            self.calls.append("_to_copy")  # .to(device)
        return out

    def _is_host(self, t: object) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t
