"""The MoE feed-forward: router over all E experts, dispatch to owners, local experts, combine."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_titan.model import lora as adapters
from lightning_titan.model.lora import LoRA
from lightning_titan.model.moe import capacity
from lightning_titan.model.moe.experts import GroupedExperts
from lightning_titan.model.moe.router import route
from lightning_titan.model.moe.shared import SharedExpert
from lightning_titan.parallel.dispatch import ep_size, start_combine, start_dispatch
from lightning_titan.parallel.slots import slots_per_expert


class MoELayer(nn.Module):
    """Mixtral's sparse MoE block, with this rank's experts ``expert_range`` of ``n_experts``.

    ``router`` is replicated (maps to HF ``block_sparse_moe.gate``); ``experts`` is sharded over the
    EP group. ``tokens_per_expert`` holds the last forward's [E] assignment counts of this rank's tokens.
    ``sequence_group``: the TP group under sequence parallelism, whose ranks hold the other slices of
    the sequences this rank routes (for the per-sequence aux losses).

    ``bias_update_rate`` > 0 turns on aux-loss-free balancing (``model/moe/balance.py``): a persistent
    ``expert_bias`` [E] fp32 steers the top-K choice, moved after each step by the step's counts.

    ``capacity_factor`` (None: dropless) caps each expert at ``floor(factor * S * K / E)`` of a
    sequence's assignments and drops the rest (``model/moe/capacity.py``); ``sequence_split`` = (cp, tp)
    says how ``sequence_group`` cuts each sequence. The counts above are the router's selections,
    before the drops; ``rows_per_local_expert`` holds the rows each local expert ran in the last
    forward (with capacity: its static slots, the kept assignments then zero rows, so that the
    dispatch reads nothing back to the host).

    The training forwards (grad enabled, not activation checkpointing's recompute, which saw the
    same tokens) add their selections and drops to the layer's own running counts, which the step
    takes once its forwards ran (``take_counts``; ``take_step_counts`` for every layer of a model):
    what the expert-bias update spends and the logged drops.
    With the bias on, ``unbiased_tokens_per_expert`` [E] holds the last forward's counts of the
    top-K the unbiased scores would have chosen (what the bias changed: ``ExpertLoad``, ``lightning/callbacks.py``).

    With ``overlap_all_to_all`` (the default) the tokens' exchanges run under work that does not need
    them: the shared expert's first half and the unbiased counts while the tokens go to their
    experts, its second half and the routing bookkeeping while they come back; in the backward the
    halves' gradients run while the tokens' gradients travel (``parallel/all_to_all.py``). False
    waits for each exchange at once (what ``titan bench --ep-overlap`` times against).
    """

    expert_bias: Tensor | None

    def __init__(
        self,
        d_model: int,
        ffn_dim: int,
        n_experts: int,
        top_k: int,
        *,
        expert_range: tuple[int, int] | None = None,
        ep_group: ProcessGroup | None = None,
        aux_loss_coef: float = 0.0,
        z_loss_coef: float = 0.0,
        sequence_group: ProcessGroup | None = None,
        bias_update_rate: float = 0.0,
        capacity_factor: float | None = None,
        sequence_split: tuple[int, int] = (1, 1),
        router_score: str = "softmax",
        norm_topk: bool = True,
        router_bias: bool = False,
        expert_proj_bias: bool = False,
        swiglu: tuple[float | None, float] = (None, 1.702),
        groups: tuple[int, int] = (1, 1),
        scaling: float = 1.0,
        expert_bias: bool = False,
        lora: LoRA | None = None,
        recompute: bool = False,
    ) -> None:
        super().__init__()
        expert_range = expert_range or (0, n_experts)
        n_local = expert_range[1] - expert_range[0]
        if not bias_update_rate >= 0:
            raise ValueError(
                f"bias_update_rate={bias_update_rate!r} must be >= 0 (0 turns the expert bias off)"
            )
        if ep_group is not None and n_local * ep_size(ep_group) != n_experts:
            raise ValueError(
                f"{n_local} local experts x EP group of {ep_size(ep_group)} ranks != n_experts="
                f"{n_experts}; give each EP rank n_experts / ep experts"
            )
        self.n_experts = n_experts
        self.top_k = top_k
        self.ep_group = ep_group
        self.sequence_group = sequence_group
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        # gpt-oss: a bias; ``lora``'s targets say which of router and experts get adapters
        self.router = adapters.linear(d_model, n_experts, router_bias, lora and lora.on("router"))
        self.router_score, self.norm_topk = router_score, norm_topk  # model/moe/router.py
        self.route = route  # or its compiled form (model/compiled.py)
        self.groups, self.scaling = groups, scaling  # DeepSeek-V3: group-limited, scaled
        # gpt-oss: biased projections and the clamped SwiGLU (limit, alpha) (model/moe/activation.py)
        self.experts = GroupedExperts(
            d_model, ffn_dim, expert_range, bias=expert_proj_bias, swiglu_limit=swiglu[0],
            swiglu_alpha=swiglu[1], lora=lora and lora.on("experts"), recompute=recompute,
        )  # fmt: skip
        self.register_buffer(
            "tokens_per_expert", torch.zeros(n_experts, dtype=torch.long), persistent=False
        )
        self.bias_update_rate = bias_update_rate
        # expert_bias: a loaded model's bias (DeepSeek-V3) is kept even when training leaves it still
        balancing = bias_update_rate > 0 or expert_bias
        # None when off: no key in the state dict, so checkpoints without balancing load as before
        self.register_buffer(
            "expert_bias", torch.zeros(n_experts, dtype=torch.float32) if balancing else None
        )
        self.capacity_factor = capacity_factor
        self.sequence_split = sequence_split
        # the running counts of the training forwards since the last take_counts(): [E] and 0-dim
        self._selected: Tensor | None = None
        self._dropped: Tensor | None = None
        self.rows_per_local_expert: list[int] = []
        self.unbiased_tokens_per_expert: Tensor | None = None
        self.overlap_all_to_all = True

    def forward(self, x: Tensor, shared: SharedExpert | None = None) -> tuple[Tensor, Tensor]:
        """``x`` [b, S, D] -> (output [b, S, D], aux [b] fp32 already weighted by the coefficients).
        ``shared``: the block's shared expert, added to the output (run under the exchanges)."""
        b, s, d = x.shape
        if self.ep_group is None and self.experts.n_local != self.n_experts:
            raise ValueError(
                f"this MoE layer holds {self.experts.n_local} of {self.n_experts} experts but has no "
                "ep_group to reach the others; pass the EP process group"
            )
        logits = self.router(x)
        routing = self.route(
            logits,
            self.top_k,
            self.sequence_group,
            self.expert_bias,
            score=self.router_score,
            norm_topk=self.norm_topk,
            groups=self.groups,
            scaling=self.scaling,
        )
        tokens = x.reshape(b * s, d)
        keep, slots = self._keep(routing.expert_ids, b, s)
        overlap = self.overlap_all_to_all
        pending_in, plan = start_dispatch(
            tokens, routing.expert_ids, self.n_experts, self.ep_group, keep, overlap=overlap,
            slots=slots,
        )  # fmt: skip
        # while the tokens travel to their experts
        hidden = None if shared is None else shared.up(x)
        if self.expert_bias is not None:
            self.unbiased_tokens_per_expert = self._unbiased_counts(logits)
        expert_in = pending_in.wait()
        expert_out = self.experts(expert_in, plan.tokens_per_local_expert, plan.local_counts)
        pending_out = start_combine(expert_out, routing.weights, plan, overlap=overlap)
        # while the expert outputs travel back
        shared_out = None if shared is None or hidden is None else shared.down(x, hidden)
        self.rows_per_local_expert = plan.tokens_per_local_expert
        selected = plan.tokens_per_expert
        if keep is not None:  # the router's load is its selections, the dropped ones included
            ids = routing.expert_ids.reshape(-1)
            selected = torch.zeros_like(selected).scatter_add_(0, ids, torch.ones_like(ids))
        self.tokens_per_expert = selected.detach()
        if self.training and torch.is_grad_enabled() and not recomputing():
            self._count(selected, None if keep is None else keep.numel() - keep.sum())
        aux = self.aux_loss_coef * routing.load_balance + self.z_loss_coef * routing.z_loss
        out = pending_out.wait().view(b, s, d)
        return (out if shared_out is None else out + shared_out), aux

    def _count(self, selected: Tensor, dropped: Tensor | None) -> None:
        selected = selected.detach()
        self._selected = selected.clone() if self._selected is None else self._selected + selected
        if dropped is not None:
            self._dropped = dropped if self._dropped is None else self._dropped + dropped

    def take_counts(self) -> tuple[Tensor | None, Tensor | None]:
        """The [E] selections and the 0-dim drops (None: no capacity) of the training forwards since
        the last take, which starts the count again. None, None: no training forward ran."""
        counts = self._selected, self._dropped
        self._selected = self._dropped = None
        return counts

    @torch.no_grad()
    def _unbiased_counts(self, logits: Tensor) -> Tensor:
        """[E] long: the assignments the router's scores alone would make (no bias), for ExpertLoad.
        The top-K of the logits is that of any score that grows with them (softmax, sigmoid)."""
        ids = torch.topk(logits.detach(), self.top_k, dim=-1).indices.reshape(-1)
        return torch.zeros(self.n_experts, dtype=torch.long, device=ids.device).scatter_add_(
            0, ids, torch.ones_like(ids)
        )

    def _keep(self, expert_ids: Tensor, b: int, s: int) -> tuple[Tensor | None, int | None]:
        """[T, K] bool: the assignments within capacity, and the static rows per expert that hold
        them (``parallel/slots.py``: the dispatch's sizes without a host read); None, None: dropless."""
        if self.capacity_factor is None:
            return None, None
        cp, tp = self.sequence_split
        limit = capacity.expert_capacity(
            self.capacity_factor, s * cp * tp, self.top_k, self.n_experts
        )
        keep = capacity.keep_mask(
            expert_ids, b, self.n_experts, limit, self.sequence_group, self.sequence_split
        )
        return keep, slots_per_expert(b, s, limit)


def recomputing() -> bool:
    """Whether this forward is activation checkpointing's recompute inside a backward: its tokens were
    counted by the first forward already."""
    return torch._C._current_graph_task_id() != -1


class StepCounts:
    """A step's routing counts per MoE layer (``take_step_counts``): ``selected`` [E] the
    assignments the router chose (what the expert-bias update spends), ``dropped`` the assignments
    over capacity (capacity layers only). A layer no training forward ran through is absent."""

    def __init__(self) -> None:
        self.selected: dict[MoELayer, Tensor] = {}
        self.dropped: dict[MoELayer, Tensor] = {}

    def total_dropped(self) -> Tensor | None:
        return torch.stack(list(self.dropped.values())).sum() if self.dropped else None


def take_step_counts(module: nn.Module) -> StepCounts:
    """Every MoE layer's counts under ``module`` since their last take (``MoELayer.take_counts``)."""
    counts = StepCounts()
    for layer in module.modules():
        if isinstance(layer, MoELayer):
            selected, dropped = layer.take_counts()
            if selected is not None:
                counts.selected[layer] = selected
            if dropped is not None:
                counts.dropped[layer] = dropped
    return counts
