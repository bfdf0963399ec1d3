"""Model state per rank, predicted without running the layout: parameters, grads and optimizer state.

The shapes come from the model itself, built on the meta device one stage at a time (no memory, no
process group): each parameter's global name, full shape and grad group kind
(``model.grad_group_kinds``), and the dimension tensor parallelism cuts (``tensor_parallel``). A
layout then gives every rank its part of each tensor the way the strategy cuts it:

- experts: ``1/ep`` of the stacked experts (dim 0), ``1/(ep*cp*tp)`` folded (``dims.expert_world``);
- TP-cut weights: ``padded / tp`` rows or columns (the vocabulary padded to a multiple of tp);
- under ZeRO, the rows ``zero.owned_rows`` gives this rank of the parameter's own data-parallel group
  (the group of its grad kind), of its optimizer state (zero >= 1), of its grad (zero >= 2) and of
  the parameter itself between steps (zero = 3), cut along the dim ``zero.cut_dim`` picks (never
  the one TP cuts). What zero=3 gathers during a step comes on top: ``gathered_bytes``.

Bytes are those ``bench.memory.state_bytes`` measures on a rank after a step (fp32 weights, grads and
AdamW's two moments; bf16-mixed keeps fp32 weights too), keyed the same way, so the two compare
exactly (``tests/distributed/test_bench.py``).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass

import torch

from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.grad_kinds import EXPERT, grad_group_kinds
from lightning_titan.model.lora import LoRA, store_base_
from lightning_titan.parallel.dp.zero import cut_dim, owned_rows
from lightning_titan.parallel.mesh import AXES, ParallelDims
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.parallel.tensor_parallel import padded_vocab, tp_shards

BYTES = 4  # fp32 weights, grads and moments
BF16_BYTES = 2  # param_dtype="bf16": the weights the forward reads (over fp32 masters)
MOMENTS = 2  # AdamW: exp_avg and exp_avg_sq (its step count is a scalar: not counted)

PARTS = ("params", "grads", "optimizer")  # what a rank holds per parameter: state_bytes' keys
# offload_optimizer: the host holds, per trained element the rank owns, the fp32 copy the CPU steps
# (the weight, or a bf16 weight's master), AdamW's two moments and a grad buffer
# (``parallel/dp/offload.py``)
HOST_BYTES = BYTES * (1 + MOMENTS + 1)


@dataclass(frozen=True)
class StatePolicy:
    """How the trained weights and the optimizer are kept: ``TitanStrategy(param_dtype=...,
    offload_optimizer=...)``."""

    param_dtype: str = "fp32"
    offload: bool = False

    @property
    def label(self) -> str:
        """ "" for the default; else ``"bf16 weights"``, ``"optimizer offload"`` or both."""
        words = ["bf16 weights"] if self.param_dtype != "fp32" else []
        return ", ".join(words + (["optimizer offload"] if self.offload else []))


FP32_STATE = StatePolicy()


@dataclass(frozen=True)
class StageTensor:
    """One parameter of a stage as the full model has it."""

    name: str
    shape: tuple[int, ...]
    kind: str  # model.EXPERT, TP_SHARDED or SEQUENCE: the group its grad is summed over
    tp_dim: int | None  # the dim TP cuts, None when whole on every TP rank
    trained: bool = True  # False: LoRA's frozen base (no grad, no optimizer state)
    itemsize: int = BYTES  # the weight's bytes an element (LoRA's base may be bf16)


def stage_tensors(
    config: ModelConfig,
    pp: int,
    pp_rank: int,
    split: StageSplit | None = None,
    lora: LoRA | None = None,
) -> tuple[StageTensor, ...]:
    """The parameters pipeline rank ``pp_rank`` of ``pp`` holds (its chunks as ``split`` cuts the
    layers; None: evenly) at full size (ep = tp = 1), built on meta; with ``lora``, its adapters
    too, the base frozen and stored as ``lora.base_dtype`` says."""
    split = split or StageSplit()
    key = (repr(config), pp, pp_rank, repr(split), repr(lora))  # ModelConfig is not hashable
    if key not in _STAGES:
        _STAGES[key] = _build_stage_tensors(config, pp, pp_rank, split, lora)
    return _STAGES[key]


_STAGES: dict[tuple[str, int, int, str, str], tuple[StageTensor, ...]] = {}


def _build_stage_tensors(
    config: ModelConfig, pp: int, pp_rank: int, split: StageSplit, lora: LoRA | None
) -> tuple[StageTensor, ...]:
    with torch.device("meta"):
        model = StageModel(config, pp_rank=pp_rank, pp=pp, split=split, lora=lora)
        if lora is not None:
            store_base_(model, lora)
    cut = {pid: shard.dim for pid, shard in tp_shards(model).items()}
    return tuple(
        StageTensor(name, tuple(p.shape), kind, cut.get(id(p)), p.requires_grad, p.element_size())
        for name, p, kind in grad_group_kinds(model)
    )


def local_shape(t: StageTensor, dims: ParallelDims) -> tuple[int, ...]:
    """The part of ``t`` rank ``dims.rank`` holds: its experts, its TP rows or columns (padded)."""
    shape = list(t.shape)
    if t.kind == EXPERT:
        shape[0] //= dims.expert_world  # fold_ep: over ep x cp x tp
    if t.tp_dim is not None:
        shape[t.tp_dim] = padded_vocab(shape[t.tp_dim], dims.tp) // dims.tp
    return tuple(shape)


@functools.cache
def _owned_numel(shape: tuple[int, ...], expert: bool, tp_dim: int | None, n: int, q: int) -> int:
    """Elements of a ``shape`` tensor that rank ``q`` of an ``n``-rank ZeRO group owns (never cut
    along the dim TP cuts, ``tp_dim``)."""
    numel = math.prod(shape)
    dim = cut_dim(torch.empty(shape, device="meta"), expert, tp_dim)
    if n == 1 or dim is None:
        return numel  # kept whole: no group to split over, or a tensor with no rows to cut
    start, stop = owned_rows(shape[dim], n, q)
    return numel // shape[dim] * (stop - start)


def _is_cut(
    shape: tuple[int, ...], expert: bool, tp_dim: int | None, dims: ParallelDims, n: int
) -> bool:
    """Whether ZeRO cuts a ``shape`` tensor into rows over an ``n``-rank group (``cut_dim``)."""
    dim = cut_dim(torch.empty(shape, device="meta"), expert, tp_dim if dims.tp > 1 else None)
    return n > 1 and dim is not None


def group_place(dims: ParallelDims, kind: str) -> tuple[int, int]:
    """(size, this rank's index) of its group of grad kind ``kind``: ``dims.group_ranks`` without
    listing the world's groups. A group varies the axes ``dims.group_axes(kind)`` and sorts its ranks, which
    orders them by those axes' coordinates in mesh order: the index is their mixed-radix number."""
    coords, size, index = dims.coords(dims.rank), 1, 0
    for axis in AXES:
        if axis in dims.group_axes(kind):
            degree = getattr(dims, axis)
            size, index = size * degree, index * degree + coords[axis]
    return size, index


def rank_state(
    config: ModelConfig,
    dims: ParallelDims,
    zero: int = 0,
    split: StageSplit | None = None,
    lora: LoRA | None = None,
    param_dtype: str = "fp32",
    offload: bool = False,
) -> dict[str, int]:
    """Bytes of ``{expert,non_expert}_{params,grads,optimizer}`` on rank ``dims.rank`` (``lora``:
    grads and optimizer state of the adapters only, the base in its stored dtype).
    ``param_dtype="bf16"``: the trained weights 2 bytes an element, their fp32 masters counted with
    the optimizer state (cut as it is under ZeRO), the grads fp32 (``parallel/dp/master.py``); at
    zero=3 a cut weight holds no bf16 bytes between steps (its rows are the masters: 16 bytes a
    parameter over the group, what ``gathered_bytes`` gathers in bf16 on top).
    ``offload``: the optimizer state and the masters are on the host (``host_bytes``), none here."""
    masters = param_dtype != "fp32"
    out = {f"{part}_{kind}": 0 for part in ("expert", "non_expert") for kind in PARTS}
    # each distinct (shape, kind, cut, ...) once, times how many the stage has (its layers repeat
    # them); each grad kind's group found once (a search over the world's groups)
    tensors = stage_tensors(config, dims.pp, dims.pp_rank, split, lora)
    shapes = Counter((t.shape, t.kind, t.tp_dim, t.trained, t.itemsize) for t in tensors)
    places: dict[str, tuple[int, int]] = {}
    for (full, kind, tp_dim, trained, itemsize), count in shapes.items():
        part = "expert" if kind == EXPERT else "non_expert"
        shape = local_shape(StageTensor("", full, kind, tp_dim), dims)
        numel = math.prod(shape)
        if not trained:  # LoRA's frozen base: whole, no grad, no state
            out[f"{part}_params"] += itemsize * numel * count
            continue
        owned = numel
        if zero:
            n, q = places.setdefault(kind, group_place(dims, kind))
            owned = _owned_numel(shape, kind == EXPERT, tp_dim if dims.tp > 1 else None, n, q)
        if masters:  # the trained weights in bf16 (LoRA's frozen base kept its own above)
            itemsize = BF16_BYTES
        held = owned if zero == 3 else numel
        if zero == 3 and masters and _is_cut(shape, kind == EXPERT, tp_dim, dims, n):
            held = 0  # its rows are the fp32 masters only, cast to bf16 when a gather packs them
        out[f"{part}_params"] += itemsize * held * count
        out[f"{part}_grads"] += BYTES * (owned if zero >= 2 else numel) * count
        if not offload:
            out[f"{part}_optimizer"] += BYTES * (MOMENTS + masters) * owned * count
    return out


def host_bytes(
    config: ModelConfig,
    dims: ParallelDims,
    zero: int = 0,
    split: StageSplit | None = None,
    lora: LoRA | None = None,
) -> int:
    """offload_optimizer: the host memory rank ``dims.rank`` holds, ``HOST_BYTES`` per trained
    element it owns (its ZeRO rows under zero > 0), whatever ``param_dtype``."""
    total = 0
    for t in stage_tensors(config, dims.pp, dims.pp_rank, split, lora):
        if not t.trained:
            continue
        shape = local_shape(t, dims)
        owned = math.prod(shape)
        if zero:
            n, q = group_place(dims, t.kind)
            owned = _owned_numel(shape, t.kind == EXPERT, t.tp_dim if dims.tp > 1 else None, n, q)
        total += HOST_BYTES * owned
    return total


def gathered_bytes(
    config: ModelConfig,
    dims: ParallelDims,
    split: StageSplit | None = None,
    lora: LoRA | None = None,
    reshard_after_forward: bool = True,
    param_dtype: str = "fp32",
) -> int:
    """zero=3: the bytes of parameters whole during a step on rank ``dims.rank``, beyond the rows
    ``rank_state`` counts (``parallel/dp/zero3.py``). ``reshard_after_forward`` (pp=1 under gpipe or
    1f1b): the block computing, the next one prefetched, and the rest of the stage (embedding,
    final norm, head) whole beside the rows, so the two largest blocks plus the rest; otherwise the
    whole stage, kept for the step, the rows inside it. ``param_dtype="bf16"``: the gathered
    weights 2 bytes an element, and the kept stage whole beside the rows (the fp32 masters are
    tensors of their own, not views into it)."""
    masters = param_dtype != "fp32"
    units: Counter[str] = Counter()
    for t in stage_tensors(config, dims.pp, dims.pp_rank, split, lora):
        if not t.trained:
            continue
        shape = local_shape(t, dims)
        numel = math.prod(shape)
        n, q = group_place(dims, t.kind)
        owned = _owned_numel(shape, t.kind == EXPERT, t.tp_dim if dims.tp > 1 else None, n, q)
        if n == 1 or owned == numel:
            continue  # no group cuts it: whole in the state already
        block = t.name.split(".")[1] if t.name.startswith("layers.") else ""
        whole = numel if reshard_after_forward or masters else numel - owned
        units[block] += (BF16_BYTES if masters else t.itemsize) * whole
    if not reshard_after_forward:
        return sum(units.values())
    rest = units.pop("", 0)
    return rest + sum(sorted(units.values())[-2:])


def fullest_host_bytes(
    config: ModelConfig,
    degrees: dict[str, int],
    zero: int = 0,
    lora: LoRA | None = None,
    stage_layers: tuple[int, ...] | None = None,
    fold_ep: bool = False,
) -> int:
    """``host_bytes`` of the rank that holds the most (the first rank of each stage, as
    ``fullest_state``)."""
    dims, split = ParallelDims(**degrees), StageSplit(1, stage_layers)
    return max(
        host_bytes(config, ParallelDims(**degrees, rank=dims.rank_of(0, p, 0), fold_ep=fold_ep),
                   zero, split, lora)
        for p in range(dims.pp)
    )  # fmt: skip


def trained_params(
    config: ModelConfig,
    dims: ParallelDims,
    lora: LoRA | None = None,
    split: StageSplit | None = None,
) -> tuple[int, int]:
    """(non-expert, expert) elements of the trained parameters rank ``dims.rank`` holds (its layers
    as ``split`` cuts them; None: evenly): what its gradient reductions carry and its optimizer
    steps (all of them without ``lora``)."""
    counts = [0, 0]
    for t in stage_tensors(config, dims.pp, dims.pp_rank, split, lora):
        if t.trained:
            counts[t.kind == EXPERT] += math.prod(local_shape(t, dims))
    return counts[0], counts[1]


def layout_state(
    config: ModelConfig,
    degrees: dict[str, int],
    zero: int = 0,
    lora: LoRA | None = None,
    fold_ep: bool = False,
) -> list[dict]:
    """``rank_state`` of every rank of the layout ``degrees`` (dp, pp, ep, cp, tp; ``fold_ep``:
    folded), in rank order."""
    world = math.prod(degrees.values())
    return [
        rank_state(config, ParallelDims(**degrees, rank=r, fold_ep=fold_ep), zero, lora=lora)
        for r in range(world)
    ]


def step_grad_bytes(
    config: ModelConfig,
    dims: ParallelDims,
    zero: int,
    accumulating: bool,
    split: StageSplit | None = None,
    lora: LoRA | None = None,
    param_dtype: str = "fp32",
) -> int:
    """The grads a step holds on rank ``dims.rank`` beyond ``rank_state``'s: at zero >= 2 over
    several microbatches (``accumulating``), the whole grads the backwards before the last
    accumulate on the parameters, in the weights' dtype, beside the rows; the reducer makes a
    bucket's input only in the last backward (``parallel/dp/zero_grads.py``). A grad no group
    reduces is the state's whole grad itself. zero <= 1 sums every backward's grads into its
    buckets, which are the state's grads (the reduced grads are views of them); one microbatch:
    each grad goes into its bucket as it is made, nothing beyond."""
    if zero < 2 or not accumulating:
        return 0
    masters = param_dtype != "fp32"
    sizes: dict[str, int] = {}  # each grad kind's group, found once
    total = 0
    for t in stage_tensors(config, dims.pp, dims.pp_rank, split, lora):
        if t.trained and sizes.setdefault(t.kind, group_place(dims, t.kind)[0]) > 1:
            total += (BF16_BYTES if masters else t.itemsize) * math.prod(local_shape(t, dims))
    return total


def fullest_step_grad_bytes(
    config: ModelConfig,
    degrees: dict[str, int],
    zero: int,
    accumulating: bool,
    lora: LoRA | None = None,
    stage_layers: tuple[int, ...] | None = None,
    param_dtype: str = "fp32",
    fold_ep: bool = False,
) -> int:
    """``step_grad_bytes`` on the stage that holds the most (the first rank of each)."""
    dims = ParallelDims(**degrees, fold_ep=fold_ep)
    split = StageSplit(1, stage_layers)
    return max(
        step_grad_bytes(
            config, ParallelDims(**degrees, rank=dims.rank_of(0, p, 0), fold_ep=fold_ep), zero,
            accumulating, split, lora, param_dtype,
        )
        for p in range(dims.pp)
    )  # fmt: skip


def fullest_state(
    config: ModelConfig,
    degrees: dict[str, int],
    zero: int = 0,
    lora: LoRA | None = None,
    stage_layers: tuple[int, ...] | None = None,
    policy: StatePolicy = FP32_STATE,
    fold_ep: bool = False,
) -> dict[str, int]:
    """``rank_state`` of the rank that holds the most (the layers cut as ``stage_layers`` says, one
    count per stage; None: evenly; ``fold_ep``: the experts folded), without counting every rank: on each stage
    the first rank of every group (a ``torch.chunk``-style ZeRO split gives the first rank the
    largest rows; the other axes cut equal shapes), then the fullest stage (64 devices: seconds
    instead of minutes)."""
    dims = ParallelDims(**degrees)
    split = StageSplit(1, stage_layers)
    firsts = [dims.rank_of(0, p, 0) for p in range(dims.pp)]
    states = [
        rank_state(
            config, ParallelDims(**degrees, rank=r, fold_ep=fold_ep), zero, split, lora,
            policy.param_dtype, policy.offload,
        )
        for r in firsts
    ]  # fmt: skip
    return max(states, key=lambda s: sum(s.values()))
