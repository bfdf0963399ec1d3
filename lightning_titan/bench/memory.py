"""Memory the benchmark reports: activations saved for backward, model state, and process peaks.

On CPU the process RSS is dominated by the torch libraries and the allocator's caching, so the
schedule comparison counts what autograd keeps alive instead: the bytes of the tensors saved for
backward, each storage once, at their peak. That number is deterministic and device-independent.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_titan import zero
from lightning_titan.model import split_expert_parameters
from lightning_titan.tensor_parallel import tp_shards

PARTS = ("params", "grads", "optimizer")


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


def _nbytes(tensors: Iterable[Tensor]) -> int:
    """Bytes this rank holds: a DTensor (torch's TP peer) counts its local shard, not its global shape."""
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


def tp_cut_bytes(model: nn.Module) -> int:
    """Parameter bytes of the weights tensor parallelism cuts (attention q/k/v/o, embedding, LM
    head: ``tensor_parallel.TP_SHARD``), as this rank holds them; the rest of the non-expert
    parameters (norms, routers) is whole on every TP rank."""
    cut = tp_shards(model)
    return _nbytes(p for p in model.parameters() if id(p) in cut)


def state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, grad_bytes: dict[int, int] | None = None
) -> dict[str, int]:
    """Bytes of parameters, grads (as allocated at the step: one per parameter, or ``grad_bytes`` by
    parameter id where a rank keeps less: ZeRO-2's rows) and optimizer state, split into expert and
    non-expert parts. Under ZeRO the optimizer holds shards of the parameters: their state counts for
    the parameter they are cut from."""
    optimizer = local_optimizer(optimizer)
    expert, _ = split_expert_parameters(model)
    expert_ids = {id(p) for _, p in expert}
    out = {f"{part}_{kind}": 0 for part in ("expert", "non_expert") for kind in PARTS}
    for p in model.parameters():
        part = "expert" if id(p) in expert_ids else "non_expert"
        out[f"{part}_params"] += _nbytes([p])
        out[f"{part}_grads"] += (grad_bytes or {}).get(id(p), _nbytes([p]))
    for group in optimizer.param_groups:
        for leaf in group["params"]:
            part = "expert" if id(zero.full_param(leaf)) in expert_ids else "non_expert"
            state = optimizer.state.get(leaf, {}).values()
            out[f"{part}_optimizer"] += _nbytes(
                t for t in state if isinstance(t, Tensor) and t.dim()
            )
    return out


def zero2_grad_bytes(engine: Any) -> dict[int, int] | None:
    """Under zero=2, the grad bytes a rank keeps per parameter id: its rows (else None: whole)."""
    if engine is None or engine.zero != 2:
        return None
    return {
        pid: s.leaf.numel() * s.leaf.element_size()
        for g in engine.zero_groups
        for pid, s in g.shards.items()
    }


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: torch's ``ZeroRedundancyOptimizer`` keeps it in
    the local optimizer it wraps (``.optim``, over the parameters this rank owns); its own ``state``
    stays empty."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def state_total(state: dict[str, int], part: str) -> int:
    return sum(v for k, v in state.items() if k.startswith(part + "_"))


def reset_peak(device: torch.device) -> None:
    """Restart the peak: the allocator's on CUDA, the process high-water mark (VmHWM) on Linux."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux: ru_maxrss below is then the peak since the process started


def peak_bytes(device: torch.device) -> int:
    """Peak since ``reset_peak``: allocated bytes on CUDA, resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
