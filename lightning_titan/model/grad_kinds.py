"""Which group each parameter's gradient is summed over: the experts' (expert-data-parallel), the
TP-sharded weights' (non-expert data-parallel) or the sequence-parallel region's (the norms and
routers, whole on every rank of a stage)."""

from __future__ import annotations

from torch import nn

from lightning_titan.model.moe.experts import GroupedExperts
from lightning_titan.parallel.tensor_parallel import tp_shards


def split_expert_parameters(
    module: nn.Module,
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """(expert, non_expert) named parameters in ``module.parameters()`` order.

    Expert parameters are those of ``GroupedExperts`` modules (sharded over EP, reduced over expert-DP);
    everything else, the router included, is replicated over the stage's EP group.
    """
    expert_ids = {
        id(p) for m in module.modules() if isinstance(m, GroupedExperts) for p in m.parameters()
    }
    expert: list[tuple[str, nn.Parameter]] = []
    non_expert: list[tuple[str, nn.Parameter]] = []
    for name, p in module.named_parameters():
        (expert if id(p) in expert_ids else non_expert).append((name, p))
    return expert, non_expert


# The group kind (GROUPS, parallel/mesh.py) over which each kind of parameter's grad is summed; the
# axes it is held whole (copied) on inside one data-parallel replica, where the norm counts it once,
# are ``ParallelDims.copied_over(kind)`` (experts over tp, or none under fold_ep).
EXPERT, TP_SHARDED, SEQUENCE = "expert_dp", "non_expert_dp", "sequence_dp"


def grad_group_kinds(module: nn.Module) -> list[tuple[str, nn.Parameter, str]]:
    """(name, parameter, group kind) in ``module.parameters()`` order.

    Experts (``GroupedExperts``) are split by EP and copied on the TP ranks, which route their own
    tokens: their grads sum over dp x tp (under fold_ep the TP ranks split them too: over dp).
    TP-sharded weights (``tensor_parallel.tp_shards``: attention, embedding, LM head) are copied on
    the EP ranks: dp x ep. Everything else (norms, routers) runs in
    the sequence-parallel region, whole on every rank of a stage: dp x ep x tp.
    """
    expert_ids = {id(p) for _, p in split_expert_parameters(module)[0]}
    sharded_ids = set(tp_shards(module))  # weights and the biases cut with them
    out = []
    for name, p in module.named_parameters():
        if id(p) in expert_ids:
            kind = EXPERT
        elif id(p) in sharded_ids:
            kind = TP_SHARDED
        else:
            kind = SEQUENCE
        out.append((name, p, kind))
    return out
