"""The bytes autograd keeps for backward: a meter over ``saved_tensors_hooks``.

On CPU the process RSS is dominated by the torch libraries and the allocator's caching, so the planner
and the benchmark count what autograd keeps alive instead: the bytes of the tensors saved for
backward, each storage once, at their peak. That number is deterministic and device-independent.

A saved storage can shrink after it was saved: selective recompute (``model/recompute.py``) frees
the storage of a norm's or an activation's output once its consumer saved it, and refills it in the
backward. Whoever resizes a storage autograd may hold says so (``storage_resized``), and a meter
then reads its live storages' sizes again (``held``) before it counts the next save, so ``current``
and ``peak`` are what was really held.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

_resizes = 0  # storages freed or refilled in this process so far (``storage_resized``)


def storage_resized() -> None:
    """Say that a storage autograd may hold was freed or refilled in place (``model/recompute.py``):
    every meter reads its live storages' sizes again before it counts the next save."""
    global _resizes
    _resizes += 1


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
        # storage -> [a tensor on it, its bytes as last read, references]
        self._live: dict[int, list[Any]] = {}
        self.current = 0  # the live storages' bytes as last read (``held`` reads them again)
        self.peak = 0
        self.added = 0  # every new storage's bytes, never decreased: what a stretch of code saved
        self._resizes_seen = _resizes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> object:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in self._exclude or storage.nbytes() == 0:
            return tensor
        # the storage object, not its data pointer: a freed storage's memory may be handed to the
        # next one while the first is still live (freed, to be refilled)
        key = storage._cdata
        # detached: a saved output held with its grad_fn is a cycle through autograd's C++ graph that
        # Python's gc cannot see, so nodes that never run without retain_graph (ZB-H1's input-path
        # nodes: B retains the graph, W runs the weight path only) kept the graph alive under the meter
        held = tensor.detach()
        if self._resizes_seen != _resizes:  # a live storage may have been freed or refilled
            self.held()
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [held, storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.added += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[2] += 1
        return _Held(held, self, key)

    @staticmethod
    def _unpack(held: Any) -> Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def held(self) -> int:
        """The bytes the live saved storages hold now, each read again (``current`` set to it)."""
        self._resizes_seen = _resizes
        for entry in self._live.values():
            entry[1] = entry[0].untyped_storage().nbytes()
        self.current = sum(entry[1] for entry in self._live.values())
        return self.current

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[2] -= 1
        if entry[2] == 0:
            self.current -= entry[1]
            del self._live[key]

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
