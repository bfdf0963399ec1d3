"""Every step option a layout allows (schedule, microbatches, virtual stages, recompute), each
predicted (``plan/cost.py``), ranked by predicted step time.

The options pass the strategy's own checks (``TrainOptions``, ``check_microbatches``, the layer
split, ``check_overlap``), like the layouts do (``plan/layouts.py``): so the overlapped schedules
(``1f1b_overlap`` on pp=1, ``dualpipev`` on pp >= 2 with M >= 2 pp) are offered only with ep > 1,
without activation checkpointing and without ``compile``.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.schedules import (
    CHUNKED,
    SCHEDULES,
    V_SHAPED,
    check_microbatches,
)
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.plan.activations import peak_bytes
from lightning_titan.plan.cost import StepCost, StepOptions, predict
from lightning_titan.plan.devices import Device
from lightning_titan.plan.layouts import Candidate, divisors
from lightning_titan.plan.precision import FP32, Precision
from lightning_titan.train.options import TrainOptions, check_overlap

VIRTUAL_STAGES = 2  # interleaved 1F1B is offered with two chunks per rank (zbv has exactly two)


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    options: StepOptions
    cost: StepCost
    activation_bytes: float  # the fullest stage's peak (plan/activations.py)

    @property
    def memory_bytes(self) -> float:
        return self.candidate.state_bytes + self.activation_bytes

    @property
    def label(self) -> str:
        return self.candidate.label

    @property
    def options_label(self) -> str:
        return self.options.label(self.candidate.degrees["pp"])


def _accepted(
    config: ModelConfig, degrees: dict[str, int], options: StepOptions, compiled: bool
) -> bool:
    pp, v = degrees["pp"], options.virtual_stages
    try:
        train = TrainOptions(schedule=options.schedule, virtual_stages=v)
        check_microbatches(options.schedule, options.microbatches, pp, v)
        StageSplit(v).counts(config.n_layers, pp)
        check_overlap(
            ParallelDims(**degrees), train, recompute=options.recompute, compiled=compiled
        )
    except ValueError:
        return False
    return True


def step_options(
    config: ModelConfig,
    degrees: dict[str, int],
    local_batch: int,
    recompute: tuple[bool, ...] = (False, True),
    compiled: bool = False,
) -> list[StepOptions]:
    """Schedules x microbatch counts (divisors of the per-rank batch) x recompute that ``degrees``
    accept (``compiled``: the model is compiled); pp = 1: 1F1B (the microbatches are gradient
    accumulation: less activation memory) or, with ep > 1, 1f1b_overlap from two microbatches.
    GPipe from two microbatches too: with one it runs 1F1B's order, the same row twice."""
    pp = degrees["pp"]
    schedules = ["1f1b", "1f1b_overlap"] if pp == 1 else sorted(SCHEDULES)
    out = []
    for ckpt in recompute:
        for schedule in schedules:
            v = VIRTUAL_STAGES if schedule in {**CHUNKED, **V_SHAPED} else 1
            for m in divisors(local_batch):
                options = StepOptions(schedule, m, v, ckpt)
                if schedule in ("1f1b_overlap", "gpipe") and m == 1:
                    continue  # one microbatch: nothing to pair or reorder, 1F1B itself
                if _accepted(config, degrees, options, compiled):
                    out.append(options)
    return out


def ranked(
    config: ModelConfig,
    found: list[Candidate],
    global_batch: int,
    device: Device,
    recompute: tuple[bool, ...] = (False, True),
    precision: Precision = FP32,
    compiled: bool = False,
) -> list[Ranked]:
    """Every candidate with every step option whose state and activations fit the device's
    memory, fastest predicted first; activations and payloads in ``precision``'s dtypes
    (``compiled``: the model is compiled, which the overlapped schedules refuse)."""
    rows = []
    for c in found:
        params = (c.parts["non_expert_params"] // 4, c.parts["expert_params"] // 4)
        local = global_batch // (c.degrees["dp"] * c.degrees["ep"])
        for options in step_options(config, c.degrees, local, recompute, compiled):
            activations = peak_bytes(config, c.degrees, options, global_batch, precision)
            if c.state_bytes + activations > device.memory:
                continue
            cost = predict(
                config, c.degrees, c.zero, options, global_batch, device, params, precision
            )
            rows.append(Ranked(c, options, cost, activations))
    rows.sort(key=lambda r: (r.cost.step, r.candidate.state_bytes))
    return rows
