"""The bytes autograd keeps for backward: a meter over ``saved_tensors_hooks``.

On CPU the process RSS is dominated by the torch libraries and the allocator's caching, so the planner
and the benchmark count what autograd keeps alive instead: the bytes of the tensors saved for
backward, each storage once, at their peak. That number is deterministic and device-independent.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


class _Held:
    """What autograd stores instead of a saved tensor while the meter is on; releases on collection."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: Tensor, meter: SavedTensorMeter, key: int) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class SavedTensorMeter:
    """Peak bytes of the storages autograd saves for backward inside ``with meter:``.

    A storage saved by several ops (or as several views) counts once; ``exclude`` (the parameters)
    is model state, not activation memory, and is not counted.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, list[int]] = {}  # storage ptr -> [nbytes, references]
        self.current = 0
        self.peak = 0
        self.added = 0  # every new storage's bytes, never decreased: what a stretch of code saved
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> object:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._exclude or storage.nbytes() == 0:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.added += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        # detached: a saved output held with its grad_fn is a cycle through autograd's C++ graph that
        # Python's gc cannot see, so nodes that never run without retain_graph (ZB-H1's input-path
        # nodes: B retains the graph, W runs the weight path only) kept the graph alive under the meter
        return _Held(tensor.detach(), self, key)

    @staticmethod
    def _unpack(held: Any) -> Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
