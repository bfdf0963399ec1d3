"""The TP peer a torch user would pick: ``torch.distributed.tensor.parallel.parallelize_module`` on the
whole ``StageModel`` (built without our TP), the Megatron + sequence-parallel plan torchtitan uses.

Per block: ``SequenceParallel`` norms, q/k/v ``ColwiseParallel``, o ``RowwiseParallel`` back to the
sequence shard; the embedding ``RowwiseParallel`` (vocab-parallel, reduce-scattered to the sequence
shard), the final norm ``SequenceParallel``, the LM head ``ColwiseParallel`` with ``loss_parallel``
(the cross-entropy on vocabulary-sharded logits; DTensor shards 257 rows unevenly, 129 / 128, no
padding). The MoE layer stays plain and local, as in ours: each TP rank routes its own sequence slice,
so the routers' and experts' grads (plain tensors) are summed over the TP group by hand, with the
norms' (left ``Partial`` by ``SequenceParallel``) in the same all-reduce, and the grad norm is composed
by hand (``clip_grad_norm_`` does not take DTensor and plain grads together).
Pure TP layouts only (dp = pp = ep = 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups, group_mesh


def _block_plan() -> dict:
    return {
        "attn_norm": SequenceParallel(),
        # Attention.forward(x, cos, sin, mask): gather x's sequence (all-gather), leave the RoPE
        # tables and the (context-parallel) mask
        "attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
        ),
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=Shard(1)),  # reduce-scatter to the slice
        "moe_norm": SequenceParallel(use_local_output=True),  # the MoE layer takes plain tensors
    }


def parallelize(model: StageModel, groups: ProcessGroups, device: torch.device) -> None:
    """Cut ``model`` (a whole single-stage model) over the TP group in place."""
    tp = dist.get_world_size(groups.tp)
    mesh = group_mesh(groups.tp, device.type)
    blocks: list[Any] = list(model.layers.values())
    for block in blocks:
        parallelize_module(block, mesh, _block_plan())
        # Attention views q/k/v with its head counts: a rank now computes 1/tp of them (as
        # torchtitan adjusts its attention's n_heads after parallelize_module)
        block.attn.n_heads //= tp
        block.attn.n_kv_heads //= tp
        block.moe.sequence_group = groups.tp  # per-sequence aux losses over the whole sequence
    parallelize_module(
        model,
        mesh,
        {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(
                input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
            ),
        },
    )


class TorchTPRunner:
    """``parallelize_module`` TP + SP over the same model; AdamW, clipping to the same norm."""

    def __init__(
        self,
        config: ModelConfig,
        dims: ParallelDims,
        groups: ProcessGroups,
        device: torch.device,
        *,
        seed: int,
        lr: float,
        max_norm: float,
    ) -> None:
        if dims.tp < 2 or dims.world_size != dims.tp:
            raise ValueError(
                f"the torch TP peer runs pure TP layouts (tp > 1, dp = pp = ep = 1), not {dims.label()}"
            )
        self.model = StageModel(config)
        self.model.init_weights(seed)
        self.model.to(device)
        parallelize(self.model, groups, device)
        params = list(self.model.parameters())
        # DTensor parameters (Any: their .grad is a DTensor too, which the stubs do not say)
        self.cut: list[Any] = [p for p in params if isinstance(p, DTensor)]
        self.plain: list[nn.Parameter] = [p for p in params if not isinstance(p, DTensor)]
        self.group, self.max_norm = groups.tp, max_norm
        # one group each: foreach kernels do not take DTensors and plain tensors in one list
        param_groups: list[dict[str, Any]] = [{"params": self.cut}, {"params": self.plain}]
        self.optimizer = torch.optim.AdamW(param_groups, lr=lr)

    def step(self, inputs: Tensor, targets: Tensor) -> None:
        with loss_parallel():
            logits, aux = self.model(inputs)
            ce = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            # aux: this rank's tokens' share of each sequence's aux loss; the TP sum makes it whole
            loss = ce.to_local() + aux.mean()  # type: ignore[attr-defined]  # a DTensor
            loss.backward()
        self._sum_token_grads()
        self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    @torch.no_grad()
    def _sum_token_grads(self) -> None:
        """One all-reduce over the TP group of the grads that are per-token partial sums: the plain
        ones (routers, experts) and the norms' (``SequenceParallel`` leaves their grads
        ``Partial(sum)``, which the optimizer would otherwise all-reduce tensor by tensor)."""
        partial = [p for p in self.cut if p.grad is not None and p.grad.placements[0].is_partial()]
        plain = [p for p in self.plain if p.grad is not None]
        grads = [p.grad.to_local() for p in partial] + [p.grad for p in plain if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        summed = flat.split([g.numel() for g in grads])
        for p, g in zip(partial, summed, strict=False):
            p.grad = DTensor.from_local(
                g.view_as(p.grad.to_local()), p.grad.device_mesh, [Replicate()], run_check=False
            )
        for grad, g in zip(grads[len(partial) :], summed[len(partial) :], strict=True):
            grad.copy_(g.view_as(grad))  # the plain params' own grads

    @torch.no_grad()
    def _clip(self) -> float:
        """Global norm (returned, pre-clip): sharded grads summed over the group, replicated and plain
        ones counted once."""
        device = self.plain[0].device  # an NCCL group takes CUDA tensors only
        sharded, whole = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(2))
        for p in self.cut:
            if p.grad is not None:
                local = p.grad.to_local().float().pow(2).sum()
                if any(isinstance(pl, Shard) for pl in p.grad.placements):
                    sharded += local
                else:
                    whole += local
        for q in self.plain:
            if q.grad is not None:
                whole += q.grad.float().pow(2).sum()
        dist.all_reduce(sharded, group=self.group)
        norm = (sharded + whole).sqrt().item()
        scale = min(1.0, self.max_norm / (norm + 1e-6))
        if scale < 1.0:
            for t in self.cut + self.plain:
                if t.grad is not None:
                    t.grad.mul_(scale)
        return norm

    def close(self) -> None:
        pass
