"""Layout-free keys for a stage-local model and its optimizers, as views into the live tensors.

Every tensor gets a key that names the same thing under any (dp, pp, ep, tp) layout:

- ``model/<name>`` for a non-expert parameter or persistent buffer (global name; replicas share the
  key and DCP keeps one copy, which is right because replicas are equal); a TP-cut weight is a
  ``DTensor`` of the full model's shape over the TP group (``tensor_parallel.as_global``: the padded
  vocabulary rows are not saved), so it loads under any tp;
- ``model/<name>#expert=<e>`` for row ``e - start`` of a stacked expert tensor (one key per GLOBAL
  expert: two EP ranks never share a key, so DCP's de-duplication cannot drop a shard);
- ``optim/<i>/<param key>/<state name>`` for optimizer ``i``'s per-parameter state. State of an expert
  parameter with one row per local expert (AdamW ``exp_avg``/``exp_avg_sq``) is split per expert like
  the parameter; anything else (AdamW's scalar ``step``) is kept whole under the parameter's name.

The values are views (``param.detach()[row]``), so ``dcp.load`` writes straight into the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_titan.model.grad_kinds import split_expert_parameters
from lightning_titan.parallel.dp import zero
from lightning_titan.parallel.tensor_parallel import as_global, tp_shards

MODEL = "model/"


def expert_key(name: str, expert: int) -> str:
    return f"{name}#expert={expert}"


def split_expert_key(key: str) -> tuple[str, int | None]:
    """``"w#expert=3"`` -> ``("w", 3)``; a key without an expert -> ``(key, None)``."""
    name, sep, expert = key.rpartition("#expert=")
    return (name, int(expert)) if sep else (key, None)


def optim_prefix(index: int) -> str:
    return f"optim/{index}/"


def expert_starts(model: nn.Module) -> dict[int, int]:
    """``id(param) -> first global expert`` for every stacked expert parameter of ``model``."""
    expert, _ = split_expert_parameters(model)
    starts = {}
    for module in model.modules():
        expert_range = getattr(module, "expert_range", None)
        if expert_range is None:
            continue
        for p in module.parameters(recurse=False):
            starts[id(p)] = expert_range[0]
    fallback = getattr(model, "expert_range", None)
    expert_ids = {id(p) for _, p in expert}
    for name, p in expert:
        if id(p) not in starts:
            if fallback is None:
                raise ValueError(
                    f"expert parameter {name!r} has no owning module with an expert_range; "
                    "give the experts module an expert_range = (first, last + 1) global expert"
                )
            starts[id(p)] = fallback[0]
    return {pid: start for pid, start in starts.items() if pid in expert_ids}


def _rows(tensor: Tensor, param: Tensor) -> bool:
    """Whether an optimizer-state tensor holds one slice per local expert of ``param``."""
    return tensor.dim() == param.dim() and tensor.dim() > 0 and tensor.shape[0] == param.shape[0]


def model_entries(
    model: nn.Module, zero_shards: zero.ZeroShards = zero.NO_SHARDS
) -> dict[str, Tensor]:
    """Every trained parameter and persistent buffer of ``model`` under its layout-free key, as
    views. A frozen parameter (LoRA's base) is left out: it is rebuilt from where it came from (the
    ``init_from`` folder or the seed), so a LoRA checkpoint holds the adapters (a few MB). A bf16
    parameter with an fp32 master (``zero_shards.masters``) is its master: the checkpoint is the
    same fp32 one whatever the parameters' dtype, and a load writes the masters."""
    starts, shards = expert_starts(model), tp_shards(model)
    entries: dict[str, Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if not isinstance(value, Tensor):
            continue
        if isinstance(value, nn.Parameter) and not value.requires_grad:
            continue
        start = starts.get(id(value))
        rows = zero_shards.of_param(value)
        if rows is not None and rows.master:  # this rank's rows of the fp32 master
            entries.update(_shard_entries(MODEL, name, "", rows.leaf.detach(), rows, start))
            continue
        weight = zero_shards.weight(value).detach()  # a whole master for a bf16 parameter
        if start is None:
            shard = shards.get(id(value))
            entries[MODEL + name] = weight if shard is None else as_global(weight, shard)
        else:
            for row in range(weight.shape[0]):
                entries[MODEL + expert_key(name, start + row)] = weight[row]
    return entries


def param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_params(optimizer: Optimizer) -> Iterable[Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


@dataclass
class OptimizerEntries:
    """Optimizer state under layout-free keys; ``objects`` says where non-tensor values go back."""

    tensors: dict[str, Tensor] = field(default_factory=dict)
    objects: dict[str, tuple[dict, str]] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.tensors)
        out.update({key: state[name] for key, (state, name) in self.objects.items()})
        return out


def param_key(optimizer_index: int, name: str) -> str:
    return f"{optim_prefix(optimizer_index)}{name}/"


def optimizer_param_name(
    tensor: Tensor, names: dict[int, str], zero_shards: zero.ZeroShards
) -> str | None:
    """The global name of the parameter an optimizer's tensor is (or, under ZeRO, is a shard of)."""
    return names.get(id(zero_shards.full_param(tensor)))


def _shard_entries(
    prefix: str, name: str, suffix: str, value: Tensor, shard: zero.ZeroShard, start: int | None
) -> dict[str, Tensor]:
    """A ZeRO shard's tensor (its state, or a bf16 parameter's fp32 master rows) as its rows of the
    whole parameter's, under ``prefix + name + suffix`` (per expert for stacked experts), so that
    the checkpoint holds one logical tensor under any zero level."""
    if start is None:
        return {prefix + name + suffix: zero.as_dtensor(value, shard, shard.param.shape)}
    return {
        prefix + expert_key(name, start + row) + suffix: zero.as_dtensor(
            value[row], shard, shard.param.shape[1:]
        )
        for row in range(value.shape[0])
    }


def optimizer_entries(
    model: nn.Module, optimizers: list[Optimizer], zero_shards: zero.ZeroShards
) -> OptimizerEntries:
    """``zero_shards``: the ZeRO shards whose leaves the optimizers step in place of parameters
    (empty under zero=0), so that their state is keyed by the parameter's global name."""
    names, starts, shards = param_names(model), expert_starts(model), tp_shards(model)
    out = OptimizerEntries()
    for i, optimizer in enumerate(optimizers):
        for p in optimizer_params(optimizer):
            name = optimizer_param_name(p, names, zero_shards)
            if name is None:
                sharded = " (under zero>0, pass the ZeRO shards it steps: zero_shards=)"
                raise ValueError(
                    f"optimizer {i} holds a parameter of shape {tuple(p.shape)} that is not in the "
                    f"model{sharded if not zero_shards else ''}; build the optimizer from this "
                    "model's parameters"
                )
            state, shard = optimizer.state.get(p, {}), zero_shards.of_leaf(p)
            full = zero_shards.full_param(p)  # p itself, or the parameter of a shard or master
            start = starts.get(id(full))
            for state_name, value in state.items():
                key = param_key(i, name) + state_name
                if isinstance(value, Tensor) and shard is not None and value.shape == p.shape:
                    out.tensors.update(
                        _shard_entries(
                            optim_prefix(i), name, "/" + state_name, value.detach(), shard, start
                        )
                    )
                elif isinstance(value, Tensor) and start is not None and _rows(value, p):
                    for row in range(value.shape[0]):
                        key = param_key(i, expert_key(name, start + row)) + state_name
                        out.tensors[key] = value.detach()[row]
                elif isinstance(value, Tensor) and id(full) in shards and value.shape == p.shape:
                    out.tensors[key] = as_global(value.detach(), shards[id(full)])
                elif isinstance(value, Tensor):
                    out.tensors[key] = value.detach()
                else:
                    out.objects[key] = (state, state_name)
    return out


def key_param(key: str, optimizer_index: int) -> str | None:
    """The parameter name an ``optim/<i>/...`` key belongs to (None for other optimizers/model keys)."""
    prefix = optim_prefix(optimizer_index)
    if not key.startswith(prefix):
        return None
    param, _, _ = key[len(prefix) :].rpartition("/")
    return split_expert_key(param)[0]


def params_with_state(keys: Iterable[str], optimizer_index: int) -> set[str]:
    """Parameter names that optimizer ``optimizer_index`` has state for among checkpoint ``keys``."""
    return {name for key in keys if (name := key_param(key, optimizer_index)) is not None}


def init_optimizer_state(optimizer: Optimizer, params: list[Tensor]) -> None:
    """Create ``params``' optimizer state without changing any parameter: one step at lr=0, zero grads.

    Other parameters get no grad, so the step skips them and their state is untouched. AdamW's decoupled
    weight decay multiplies by ``1 - lr * wd`` = 1, so it is a no-op too.
    """
    if not params:
        return
    wanted = {id(p) for p in params}
    grads = {id(p): p.grad for p in optimizer_params(optimizer)}
    lrs = [group["lr"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            lr = group["lr"]
            group["lr"] = torch.zeros_like(lr) if isinstance(lr, Tensor) else 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p) if id(p) in wanted else None
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
            for p in group["params"]:
                p.grad = grads[id(p)]


def hyperparameters(optimizer: Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings (lr, betas, weight_decay, ...), without the parameters."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def restore_hyperparameters(optimizer: Optimizer, saved: list[dict[str, Any]]) -> None:
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        for key, value in values.items():
            current = group.get(key)
            if isinstance(current, Tensor) and isinstance(value, Tensor):
                current.copy_(value)  # keep the tensor object a compiled/capturable step refers to
            else:
                group[key] = value
