"""LoRA: low-rank adapters on a frozen base (Hu et al., 2021), the way PEFT defines them.

A target projection ``y = x W^T (+ b)`` becomes ``y = x W^T (+ b) + scale * B(A(dropout(x)))`` with
``A`` [rank, in] and ``B`` [out, rank] (``lora_A.weight`` and ``lora_B.weight``, PEFT's names and
orientation), ``scale = alpha / rank``. PEFT's default init: ``A`` from kaiming-uniform (a = sqrt(5),
so uniform in +-1/sqrt(in)), ``B`` zero, so training starts at the base model. Here ``A`` is drawn
from (seed, global name) like every weight (``model/init.py``): every layout starts equal.

Under tensor parallelism the factors are cut to match the base weight's cut: a column-parallel
projection (rows cut) cuts ``B``'s rows and holds ``A`` whole, its grad a partial sum over the TP
ranks' heads; a row-parallel one (columns cut) cuts ``A``'s columns and holds ``B`` whole, and the
adapter's output is a partial sum that the projection's own reduction adds up. The whole factors
are then summed over the group like a norm's grads (``grad_kinds.SEQUENCE``), the cut ones reduced like
the base weight's (``grad_kinds.TP_SHARDED``): ``grad_group_kinds`` tells them apart by ``tp_cuts``.

The routed experts' adapters are per expert, stacked like their weights (``GroupedExperts``:
``w1_lora_A`` [E, D, rank] and ``w1_lora_B`` [E, rank, F] for ``y = x @ w1``), and run in grouped
GEMMs beside the base's.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_titan.parallel.tensor_parallel import TpCuts, TpShard

# the targets a user names: groups, and the projections in them (the attention's by its kind)
ATTENTION = ("q", "k", "v", "o", "q_a", "q_b", "kv_a", "kv_b")
GROUPS = {"attention": ATTENTION, "mlp": ("mlp",), "shared": ("shared",)}
TARGETS = (*ATTENTION, "mlp", "shared", "router", "experts")
ADAPTER_MARK = "lora_"  # in the name of every adapter parameter, and of no base one
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LoRA:
    """Which projections get adapters, and their shape.

    Args:
        rank: the adapters' rank r (``A`` [r, in], ``B`` [out, r]).
        alpha: the adapter's output is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``).
        dropout: dropout on the adapter's input (PEFT's ``lora_dropout``); each rank draws its own
            masks, so runs with dropout are not equal across layouts (with 0 they are).
        targets: ``attention`` (every attention projection: q, k, v, o, or latent attention's q_a,
            q_b, kv_a, kv_b, o), one of those by name, ``mlp`` (the dense layers' SwiGLU), ``shared``
            (the shared expert), ``router``, ``experts`` (each routed expert's gate, up and down).
        base_dtype: ``"bf16"`` keeps the frozen projection and expert weights in bf16 (half their
            bytes; embedding, norms and biases stay fp32), for runs under ``bf16-mixed``, whose
            autocast computes those matmuls in bf16 anyway: the same numbers as an fp32 base there.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attention",)
    base_dtype: str = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"lora rank={self.rank!r} must be an int >= 1 (e.g. 8 or 16)")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)):
            raise ValueError(f"lora alpha={self.alpha!r} must be a finite number (e.g. 2 x rank)")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora dropout={self.dropout!r} must be in [0, 1) (0: off)")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(
                f"lora base_dtype={self.base_dtype!r} must be one of {sorted(BASE_DTYPES)}"
            )
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        object.__setattr__(self, "targets", targets)
        if not targets:
            raise ValueError(f"lora targets is empty; name some of {(*GROUPS, *TARGETS)}")
        for t in targets:
            if t not in GROUPS and t not in TARGETS:
                raise ValueError(
                    f"lora target {t!r} is not one of {(*GROUPS, *TARGETS)} (e.g. targets: "
                    "[attention, experts])"
                )

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def wants(self, target: str) -> bool:
        """Whether projection ``target`` (one of ``TARGETS``) gets an adapter."""
        return any(t == target or target in GROUPS.get(t, ()) for t in self.targets)

    def on(self, target: str) -> LoRA | None:
        """Itself where ``target`` gets an adapter, else None (what the modules take)."""
        return self if self.wants(target) else None


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is an adapter's (no base parameter's name has ``lora_`` in it:
    latent attention's ``kv_lora_rank`` names no parameter)."""
    return ADAPTER_MARK in name


class LoRAFactor(nn.Linear):
    """One factor of an adapter (no bias): its own type so that init tells it from a base weight."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` (its ``weight`` and ``bias`` named as before) with an adapter beside it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, lora: LoRA) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.lora_A = LoRAFactor(in_features, lora.rank)
        self.lora_B = LoRAFactor(lora.rank, out_features)
        self.scale = lora.scale
        self.dropout = nn.Dropout(lora.dropout) if lora.dropout else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) + self.adapter(x)

    def adapter(self, x: Tensor) -> Tensor:
        """The adapter's part of the output: ``scale * B(A(dropout(x)))``."""
        return self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    @torch.no_grad()
    def merge_adapters_(self) -> None:
        """``W += scale * B A``, then ``B = 0``."""
        update = self.lora_B.weight @ self.lora_A.weight
        self.weight.add_(update.to(self.weight.dtype), alpha=self.scale)
        self.lora_B.weight.zero_()


def linear(in_features: int, out_features: int, bias: bool, lora: LoRA | None) -> nn.Linear:
    """A projection: with an adapter where ``lora`` is given (``LoRA.on(target)``)."""
    if lora is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return LoRALinear(in_features, out_features, bias, lora)


def without_bias(module: nn.Linear, x: Tensor) -> Tensor:
    """``module(x)`` without its bias (adapter included): for a bias added after a TP reduction."""
    out = F.linear(x, module.weight)
    return out + module.adapter(x) if isinstance(module, LoRALinear) else out


def factor_cuts(cuts: TpCuts) -> TpCuts:
    """The cuts of the adapters' factors of the TP-cut projections in ``cuts``: a column-parallel
    one (dim 0) cuts ``B``'s rows, a row-parallel one (dim 1) ``A``'s columns."""
    out: TpCuts = {}
    for module, shard in cuts.items():
        if isinstance(module, LoRALinear):
            factor = module.lora_B if shard.dim == 0 else module.lora_A
            out[factor] = TpShard(shard.dim, shard.full_size, shard.group)
    return out


def freeze_base(model: nn.Module) -> int:
    """Leave only the adapters trainable; returns how many parameters still train."""
    trainable = 0
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
        trainable += p.numel() if p.requires_grad else 0
    return trainable


@runtime_checkable
class MergesAdapters(Protocol):
    """A module with adapters of its own weights (``LoRALinear``, the routed experts)."""

    def merge_adapters_(self) -> None: ...


@torch.no_grad()
def merge_(model: nn.Module) -> None:
    """Fold every adapter under ``model`` into its base weight and zero its ``B``: the same model,
    its adapters now part of the base (what an export of the merged model writes). One process:
    the whole factors, no TP cut."""
    for module in model.modules():
        if isinstance(module, MergesAdapters):
            module.merge_adapters_()


@torch.no_grad()
def store_base_(model: nn.Module, lora: LoRA) -> None:
    """Cast the frozen matrices that matmuls read (``nn.Linear`` weights, the experts' ``w1``, ``w3``,
    ``w2``) to ``lora.base_dtype``; the embedding, norms and biases keep their dtype."""
    dtype = BASE_DTYPES[lora.base_dtype]
    for module in model.modules():
        names: tuple[str, ...] = ("weight",) if isinstance(module, nn.Linear) else ()
        if not names and isinstance(module, MergesAdapters):  # the routed experts' stacked weights
            names = ("w1", "w3", "w2")
        for name in names:
            p = getattr(module, name)
            if isinstance(p, nn.Parameter) and not p.requires_grad and p.dtype != dtype:
                p.data = p.data.to(dtype)


def kaiming_bound(fan_in: int) -> float:
    """PEFT's (torch's Linear) ``kaiming_uniform_(a=sqrt(5))``: uniform in +-1/sqrt(fan_in)."""
    return 1.0 / math.sqrt(fan_in)


def seeded_uniform(
    shape: torch.Size, bound: float, seed: int, name: str, expert: int = -1
) -> Tensor:
    """Uniform in +-``bound`` from (seed, global name, global expert) only (``model/init.py``)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"lora|{seed}|{name}|{expert}".encode()))
    return (torch.rand(shape, generator=generator, device="cpu") * 2 - 1) * bound
