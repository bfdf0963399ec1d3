"""The layouts a model and a cluster allow: every (dp, pp, ep, cp, tp) and ZeRO level that the
strategy would accept, with each rank's model state, against the device's memory. Where a stage has
cp or tp ranks, each layout comes twice: as it is, and folded (``fold_ep``, MoE Parallel Folding:
the experts split over the stage's ep x cp x tp ranks, ``parallel/mesh.py``), named with ``xfold``.

The rules are the strategy's own (``ModelConfig.validate_layout``, ``batching.local_batch_size``,
``options.check_trainer_clipping``), called rather than restated, so a layout the planner offers is
one ``titan fit`` starts; a rejected one is counted under the rule that rejected it.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.lora import LoRA
from lightning_titan.parallel.batching import local_batch_size
from lightning_titan.parallel.dp.zero import LEVELS
from lightning_titan.parallel.mesh import AXES, ParallelDims
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.plan.cost import balanced_split
from lightning_titan.plan.memory import (
    FP32_STATE,
    StatePolicy,
    fullest_host_bytes,
    fullest_state,
    gathered_bytes,
    layout_state,
)
from lightning_titan.train.options import (
    TrainOptions,
    check_fold,
    check_trainer_clipping,
    zero3_reshards_after_forward,
)

PRICED = LEVELS  # the zero levels the planner prices
GB = 1e9
# usable memory per device in bytes (the card's; CUDA's own context and the allocator's slack are the
# user's margin, see --reserve-gb)
DEVICES = {"h100-80gb": 80 * GB, "a100-80gb": 80 * GB, "a100-40gb": 40 * GB, "h200-141gb": 141 * GB}


@dataclass(frozen=True)
class Candidate:
    """One layout and ZeRO level, and the model state of its fullest rank."""

    degrees: dict[str, int]
    zero: int
    state_bytes: int  # params + grads + optimizer state of the fullest rank, at the step's peak
    parts: dict[str, int]  # its bytes by part between steps (bench.memory.state_bytes' keys)
    stage_layers: tuple[int, ...] | None = None  # layers per pipeline stage; None: n_layers / pp
    gathered_bytes: int = 0  # zero=3: the parameters whole during the step beyond ``parts``
    policy: StatePolicy = FP32_STATE  # bf16 weights, optimizer offload
    host_bytes: int = 0  # offload: the fullest rank's host memory (``memory.host_bytes``)
    fold_ep: bool = False  # the experts over the ep x cp x tp ranks of a stage

    @property
    def dims(self) -> ParallelDims:
        """The layout as the strategy builds it (rank 0)."""
        return ParallelDims(**self.degrees, fold_ep=self.fold_ep)

    @property
    def label(self) -> str:
        parts = [f"{a}{n}" for a, n in self.degrees.items() if n > 1] or ["single"]
        parts += [FOLD] if self.fold_ep else []
        return "x".join(parts) + (f" zero{self.zero}" if self.zero else "")

    @property
    def split_label(self) -> str:
        """The layers per stage, runs of equal counts as ``count*stages`` (``4*15,1``); "" when
        even."""
        if self.stage_layers is None:
            return ""
        runs: list[list[int]] = []
        for n in self.stage_layers:
            if runs and runs[-1][0] == n:
                runs[-1][1] += 1
            else:
                runs.append([n, 1])
        return ",".join(f"{n}*{k}" if k > 1 else f"{n}" for n, k in runs)


FOLD = "fold"  # the last part of a folded layout's name: pp8xep16xtp2xfold


def folds(degrees: dict[str, int]) -> tuple[bool, ...]:
    """Unfolded, and folded where a stage has cp or tp ranks to fold into expert parallelism
    (without them folding changes nothing)."""
    return (False, True) if degrees["cp"] * degrees["tp"] > 1 else (False,)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(devices: int) -> list[dict[str, int]]:
    """Every (dp, pp, ep, cp, tp) whose product is ``devices``, in mesh order."""
    out = []
    for pp, ep, cp, tp in itertools.product(divisors(devices), repeat=4):
        rest = pp * ep * cp * tp
        if devices % rest == 0:
            out.append(dict(zip(AXES, (devices // rest, pp, ep, cp, tp), strict=True)))
    return out


def rejection(
    config: ModelConfig,
    degrees: dict[str, int],
    zero: int,
    batch: int,
    stage_layers: tuple[int, ...] | None = None,
    fold_ep: bool = False,
) -> str | None:
    """Why the strategy would refuse this layout (the first rule's message), or None."""
    dims = ParallelDims(**degrees, fold_ep=fold_ep)
    try:
        split = StageSplit(1, stage_layers)
        config.validate_layout(dims.pp, dims.ep, dims.tp, dims.cp, split, fold_ep=fold_ep)
        check_fold(fold_ep, zero)
        local_batch_size(batch, dims.data_world, f"dp*ep={dims.dp}*{dims.ep}")
        check_trainer_clipping(dims, TrainOptions(zero=zero), None)
    except ValueError as error:
        return str(error)
    return None


def splits(config: ModelConfig, pp: int) -> list[tuple[int, ...] | None]:
    """The ways the planner cuts the layers over ``pp`` stages: evenly (None) where ``pp`` divides
    them, and the split that balances the stages' predicted compute (``cost.balanced_split``: the
    head and loss on the last stage count as work) where it differs from the even one; [None] where
    no split fits (the strategy's rule then says why)."""
    even = config.n_layers % pp == 0
    out: list[tuple[int, ...] | None] = [None] if even else []
    if pp > 1:
        try:
            balanced = balanced_split(config, pp)
        except ValueError:
            balanced = None
        if balanced is not None and (not even or len(set(balanced)) > 1):
            out.append(balanced)
    return out or [None]


def candidates(
    config: ModelConfig,
    devices: int,
    global_batch: int,
    lora: LoRA | None = None,
    policy: StatePolicy = FP32_STATE,
) -> tuple[list[Candidate], Counter[str]]:
    """The accepted layouts (every zero level where a data-parallel group exists; each pipeline
    split of ``splits``; folded and not, ``folds``), and how many were rejected by each rule (keyed
    by the start of its message: ``n_heads=4``, ...); ``lora``: the state of LoRA's adapters over a
    frozen base; ``policy``: bf16 weights (any zero level) and optimizer offload (zero 0, 1 and 2
    only, as the strategy)."""
    accepted: list[Candidate] = []
    rejected: Counter[str] = Counter()
    cuts: dict[int, list[tuple[int, ...] | None]] = {}  # splits of each pp, found once
    for degrees in factorizations(devices):
        data_parallel = degrees["dp"] * degrees["ep"] * degrees["cp"] * degrees["tp"] > 1
        pp = degrees["pp"]
        if pp not in cuts:
            cuts[pp] = splits(config, pp)
        for layers, fold in itertools.product(cuts[pp], folds(degrees)):
            for zero in PRICED if data_parallel else (0,):
                if zero == 3 and policy.offload:
                    continue  # offload runs zero 0, 1 and 2
                if zero == 3 and pp > 1:
                    # the stage kept whole for the step: zero=2's peak and traffic (``gathered``)
                    continue
                found = candidate(config, degrees, zero, global_batch, layers, fold, lora, policy)
                if isinstance(found, str):
                    rejected[found.split(" ")[0].rstrip(":;,")] += 1
                else:
                    accepted.append(found)
    return accepted, rejected


def candidate(
    config: ModelConfig,
    degrees: dict[str, int],
    zero: int,
    global_batch: int,
    stage_layers: tuple[int, ...] | None = None,
    fold_ep: bool = False,
    lora: LoRA | None = None,
    policy: StatePolicy = FP32_STATE,
) -> Candidate | str:
    """One layout with its fullest rank's state, as ``candidates`` offers it, or the message of the
    strategy's rule that refuses it."""
    reason = rejection(config, degrees, zero, global_batch, stage_layers, fold_ep)
    if reason is not None:
        return reason
    fullest = fullest_state(config, degrees, zero, lora, stage_layers, policy, fold_ep)
    gathered = (
        fullest_gathered(config, degrees, lora, stage_layers, policy.param_dtype)
        if zero == 3
        else 0
    )
    state = sum(fullest.values()) + gathered
    host = (
        fullest_host_bytes(config, degrees, zero, lora, stage_layers, fold_ep)
        if policy.offload
        else 0
    )
    return Candidate(degrees, zero, state, fullest, stage_layers, gathered, policy, host, fold_ep)


def fullest_gathered(
    config: ModelConfig,
    degrees: dict[str, int],
    lora: LoRA | None = None,
    stage_layers: tuple[int, ...] | None = None,
    param_dtype: str = "fp32",
) -> int:
    """zero=3's ``gathered_bytes`` on the stage that gathers the most (the first rank of each), as
    the strategy runs it on ``degrees`` (``train.options.zero3_reshards_after_forward``; the
    planner's pp=1 schedule is 1f1b); ``param_dtype="bf16"``: gathered in bf16."""
    dims = ParallelDims(**degrees)
    split = StageSplit(1, stage_layers)
    per_block = zero3_reshards_after_forward(dims.pp, "1f1b")
    return max(
        gathered_bytes(config, ParallelDims(**degrees, rank=dims.rank_of(0, p, 0)), split, lora,
                       reshard_after_forward=per_block, param_dtype=param_dtype)
        for p in range(dims.pp)
    )  # fmt: skip


def check_request(devices: int, global_batch: int, device: str) -> None:
    """Bad input, named before anything is built."""
    if not isinstance(devices, int) or devices < 1:
        raise ValueError(f"--devices={devices!r} must be a positive number of devices")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"--global-batch={global_batch!r} must be a positive number of sequences")
    if device != "cpu" and device not in DEVICES:
        raise ValueError(
            f"--device={device!r} is unknown; choose one of {['cpu', *sorted(DEVICES)]} or give "
            "--memory-gb for another device"
        )


# what divides each part of a rank's state (memory.py): named in "nothing fits"
DIVIDED_BY = {
    "expert_params": "ep (the experts; folded, ep x cp x tp), pp (the layers), and zero=3 over the "
    "expert DP group",
    "non_expert_params": "tp (attention, embedding, head), pp, and zero=3 over the DP group",
    "expert_grads": "ep (folded, ep x cp x tp) and pp, and zero>=2 over the expert data-parallel "
    "group",
    "non_expert_grads": "tp and pp, and zero>=2 over the data-parallel group",
    "expert_optimizer": "ep (folded, ep x cp x tp) and pp, and zero>=1 over the expert "
    "data-parallel group",
    "non_expert_optimizer": "tp and pp, and zero>=1 over the data-parallel group",
}


def _most_layers(config: ModelConfig, pp: int, stage_layers: tuple[int, ...] | None) -> float:
    return max(stage_layers) if stage_layers else config.n_layers / pp


def _grown(config: ModelConfig, best: Candidate, lora: LoRA | None = None) -> list[str]:
    """For pp, ep and tp: the next degree the model allows beyond ``best``'s (for pp: the next
    whose stages hold fewer layers), on that many more devices, with the state it leaves per rank;
    nothing where the model allows no more."""
    out = []
    for axis in ("ep", "pp", "tp"):
        now = best.degrees[axis]
        limit = {"ep": config.n_experts, "pp": config.n_layers, "tp": config.n_heads}[axis]
        for degree in range(now + 1, limit + 1):
            degrees = {**best.degrees, axis: degree}
            layers = best.stage_layers
            if axis == "pp":  # the split whose fullest stage holds the fewest layers
                layers = min(splits(config, degree), key=lambda s: _most_layers(config, degree, s))
            if axis == "pp" and _most_layers(config, degree, layers) >= _most_layers(
                config, now, best.stage_layers
            ):
                continue  # a stage still holds as many layers: no less state
            try:
                split = StageSplit(1, layers)
                config.validate_layout(
                    degrees["pp"], degrees["ep"], degrees["tp"], degrees["cp"], split,
                    fold_ep=best.fold_ep,
                )  # fmt: skip
            except ValueError:
                continue
            state = sum(
                fullest_state(
                    config, degrees, best.zero, lora, layers, best.policy, best.fold_ep
                ).values()
            )
            if best.zero == 3:
                state += fullest_gathered(config, degrees, lora, layers, best.policy.param_dtype)
            devices = math.prod(degrees.values())
            out.append(f"{axis}={degree} ({devices} devices): {state / GB:.2f} GB")
            break
    return out


def shortfall(best: Candidate, memory: float, config: ModelConfig, lora: LoRA | None = None) -> str:
    """What the layout with the least state per rank lacks, for a model that fits nowhere: its
    largest term, and the remedies this model allows (the next pp, ep or tp that divides it, with
    the state it would leave; zero=2 where the smallest is below it)."""
    short = best.state_bytes - memory
    part, nbytes = max(best.parts.items(), key=lambda kv: kv[1])
    remedies = _grown(config, best, lora)
    data_parallel = math.prod(best.degrees.values()) > best.degrees["pp"]
    if best.zero < 2 and data_parallel:
        remedies.insert(0, "zero=2 (splits the grads and AdamW moments)")
    if best.policy.param_dtype == "fp32":
        remedies.append("--param-dtype bf16 (2-byte weights over fp32 masters)")
    if not best.policy.offload:
        remedies.append("--offload-optimizer (AdamW's moments and the masters in host memory)")
    advice = (
        "; try " + ", or ".join(remedies)
        if remedies
        else "; no pp, ep or tp this model allows divides it further: use a device with more "
        "memory (--memory-gb)"
    )
    return (
        f"the smallest model state per rank is {best.state_bytes / GB:.2f} GB ({best.label}), "
        f"{short / GB:.2f} GB more than the {memory / GB:.2f} GB a device has; its largest term is "
        f"{part} {nbytes / GB:.2f} GB, divided by {DIVIDED_BY[part]}{advice}"
    )


def total_params(config: ModelConfig) -> int:
    """Parameters of the whole model (one rank of the one-process layout holds them all)."""
    (state,) = layout_state(config, dict.fromkeys(AXES, 1))
    return math.ceil((state["expert_params"] + state["non_expert_params"]) / 4)
