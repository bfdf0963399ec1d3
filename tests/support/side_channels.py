"""What the no-side-channel tests look for: facts hung on tensors and modules from outside their own
code (an attribute named ``_titan_...``), where an argument or a table of the owner should carry them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

PREFIX = "_titan_"


def _tensors_of(model: nn.Module, optimizers: Iterable[Optimizer]) -> Iterator[tuple[str, Any]]:
    for name, p in model.named_parameters():
        yield name, p
        yield f"{name}.grad", p.grad
    for name, b in model.named_buffers():
        yield name, b
    for i, optimizer in enumerate(optimizers):
        for g, group in enumerate(optimizer.param_groups):
            for j, p in enumerate(group["params"]):  # under ZeRO: the shards' leaves
                yield f"optimizer {i} group {g} param {j}", p
                yield f"optimizer {i} group {g} param {j}.grad", p.grad
                for key, value in optimizer.state.get(p, {}).items():
                    yield f"optimizer {i} group {g} param {j} state {key}", value


def titan_attributes(model: nn.Module, optimizers: Iterable[Optimizer] = ()) -> list[str]:
    """``"<where>: <attribute>"`` for each attribute named ``_titan_...`` on a module of ``model``, its
    parameters, their grads, its buffers, or the optimizers' tensors, grads and state."""
    found = []
    for name, module in model.named_modules():
        found += [f"module {name or '<root>'}: {a}" for a in vars(module) if a.startswith(PREFIX)]
    for where, tensor in _tensors_of(model, optimizers):
        if isinstance(tensor, Tensor):
            found += [f"{where}: {a}" for a in vars(tensor) if a.startswith(PREFIX)]
    return found
