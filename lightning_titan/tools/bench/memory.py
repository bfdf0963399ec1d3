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

from lightning_titan.model.grad_kinds import split_expert_parameters
from lightning_titan.parallel.tensor_parallel import tp_shards
from lightning_titan.plan.memory import PARTS


def _nbytes(tensors: Iterable[Tensor]) -> int:
    """Bytes this rank holds: a DTensor (torch's TP peer) counts its local shard, not its global shape."""
    local = (t.to_local() if isinstance(t, DTensor) else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


def _storage(t: Tensor) -> int:
    """The address of a tensor's storage; a DTensor's is its local shard's (it has none itself)."""
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage().data_ptr()


def tp_cut_bytes(model: nn.Module) -> int:
    """Parameter bytes of the weights tensor parallelism cuts (attention q/k/v/o, embedding, LM
    head: ``tensor_parallel.tp_shards``), as this rank holds them; the rest of the non-expert
    parameters (norms, routers) is whole on every TP rank."""
    cut = tp_shards(model)
    return _nbytes(p for p in model.parameters() if id(p) in cut)


def state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, engine: Any = None
) -> dict[str, int]:
    """Bytes of parameters, grads (as allocated at the step: one per parameter, or, under the
    ``engine``'s zero=2, its rows) and optimizer state, split into expert and non-expert parts. Under
    ZeRO the optimizer holds shards of the parameters: their state counts for the parameter they are
    cut from, which a shard's leaf, a view of its rows, shares its storage with (a dense leaf, a copy
    of strided rows, is found in the ``engine``'s shards). bf16 weights (the ``engine``'s masters):
    a weight's fp32 master counts as its optimizer state (cut as that is under ZeRO), and its
    grad as the fp32 one the reducer hands the master."""
    optimizer = local_optimizer(optimizer)
    masters = None if engine is None else engine.masters
    grad_bytes = zero2_grad_bytes(engine)
    # zero=3: a sharded parameter holds its rows only (its leaf), between steps; bf16 weights:
    # none (the leaf is the fp32 master of the rows, counted with the optimizer state)
    param_bytes = None
    if engine is not None and engine.zero == 3:
        param_bytes = {
            pid: 0 if s.master else s.leaf.numel() * s.leaf.element_size()
            for g in engine.zero_groups
            for pid, s in g.shards.items()
        }
    # a shard's leaf stands for its parameter (a dense one has a storage of its own; under zero=3
    # the parameters' storages are freed, all at address 0, so they are told apart by id)
    shard_param = {} if engine is None else {
        id(s.leaf): s.param for g in engine.zero_groups for s in g.shards.values()
    }  # fmt: skip
    shard_param.update({id(m): p for p, m in masters or ()})  # a whole master: its parameter
    # the optimizer's tensors that are masters (bf16 weights): counted with its state
    is_master = {id(m) for _, m in masters or ()} | {
        id(s.leaf) for g in engine.zero_groups for s in g.shards.values() if s.master
    } if masters is not None else set()  # fmt: skip
    expert, _ = split_expert_parameters(model)
    expert_ids = {id(p) for _, p in expert}
    expert_storage = {_storage(p) for _, p in expert}
    out = {f"{part}_{kind}": 0 for part in ("expert", "non_expert") for kind in PARTS}
    for p in model.parameters():
        part = "expert" if id(p) in expert_ids else "non_expert"
        out[f"{part}_params"] += (param_bytes or {}).get(id(p), _nbytes([p]))
        if p.requires_grad:  # a frozen parameter (LoRA's base) gets no grad
            reduced = p if masters is None else masters.grad_holder(p)  # fp32 for a bf16 weight
            whole = _nbytes([p]) // p.element_size() * reduced.element_size()
            out[f"{part}_grads"] += (grad_bytes or {}).get(id(p), whole)
    for group in optimizer.param_groups:
        for leaf in group["params"]:
            param = shard_param.get(id(leaf))
            is_expert = (
                id(param) in expert_ids if param is not None else _storage(leaf) in expert_storage
            )
            part = "expert" if is_expert else "non_expert"
            state = optimizer.state.get(leaf, {}).values()
            out[f"{part}_optimizer"] += _nbytes(
                t for t in state if isinstance(t, Tensor) and t.dim()
            ) + (_nbytes([leaf]) if id(leaf) in is_master else 0)
    return out


def zero2_grad_bytes(engine: Any) -> dict[int, int] | None:
    """Under zero>=2, the grad bytes a rank keeps per parameter id: its rows (else None: whole)."""
    if engine is None or engine.zero < 2:
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
