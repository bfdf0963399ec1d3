"""The layouts a model and a cluster allow: every (dp, pp, ep, cp, tp) and ZeRO level that the
strategy would accept, with each rank's model state, against the device's memory.

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
from lightning_titan.parallel.batching import local_batch_size
from lightning_titan.parallel.dp.zero import LEVELS
from lightning_titan.parallel.mesh import AXES, ParallelDims
from lightning_titan.plan.memory import fullest_state, layout_state
from lightning_titan.train.options import TrainOptions, check_trainer_clipping

GB = 1e9
# usable memory per device in bytes (the card's; CUDA's own context and the allocator's slack are the
# user's margin, see --reserve-gb)
DEVICES = {"h100-80gb": 80 * GB, "a100-80gb": 80 * GB, "a100-40gb": 40 * GB, "h200-141gb": 141 * GB}


@dataclass(frozen=True)
class Candidate:
    """One layout and ZeRO level, and the model state of its fullest rank."""

    degrees: dict[str, int]
    zero: int
    state_bytes: int  # params + grads + optimizer state on the rank that holds the most
    parts: dict[str, int]  # that rank's bytes by part (bench.memory.state_bytes' keys)

    @property
    def label(self) -> str:
        parts = [f"{a}{n}" for a, n in self.degrees.items() if n > 1] or ["single"]
        return "x".join(parts) + (f" zero{self.zero}" if self.zero else "")


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


def _rejection(config: ModelConfig, degrees: dict[str, int], zero: int, batch: int) -> str | None:
    """Why the strategy would refuse this layout (the first rule's message), or None."""
    dims = ParallelDims(**degrees)
    try:
        config.validate_layout(dims.pp, dims.ep, dims.tp, dims.cp)
        local_batch_size(batch, dims.data_world, f"dp*ep={dims.dp}*{dims.ep}")
        check_trainer_clipping(dims, TrainOptions(zero=zero), None)
    except ValueError as error:
        return str(error)
    return None


def candidates(
    config: ModelConfig, devices: int, global_batch: int
) -> tuple[list[Candidate], Counter[str]]:
    """The accepted layouts (every zero level where a data-parallel group exists), and how many
    were rejected by each rule (keyed by the start of its message: ``n_heads=4``, ...)."""
    accepted: list[Candidate] = []
    rejected: Counter[str] = Counter()
    for degrees in factorizations(devices):
        data_parallel = degrees["dp"] * degrees["ep"] * degrees["cp"] * degrees["tp"] > 1
        for zero in LEVELS if data_parallel else (0,):
            reason = _rejection(config, degrees, zero, global_batch)
            if reason is not None:
                rejected[reason.split(" ")[0].rstrip(":;,")] += 1
                continue
            fullest = fullest_state(config, degrees, zero)
            accepted.append(Candidate(degrees, zero, sum(fullest.values()), fullest))
    return accepted, rejected


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


def shortfall(best: Candidate, memory: float) -> str:
    """What the layout with the least state per rank lacks, for a model that fits nowhere."""
    short = best.state_bytes - memory
    return (
        f"the smallest model state per rank is {best.state_bytes / GB:.2f} GB ({best.label}), "
        f"{short / GB:.2f} GB more than the {memory / GB:.2f} GB a device has: add devices (ep and pp "
        "divide the state), or use zero=1/2 where a data-parallel group exists"
    )


def total_params(config: ModelConfig) -> int:
    """Parameters of the whole model (one rank of the one-process layout holds them all)."""
    (state,) = layout_state(config, dict.fromkeys(AXES, 1))
    return math.ceil((state["expert_params"] + state["non_expert_params"]) / 4)
