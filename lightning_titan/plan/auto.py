"""``TitanStrategy(layout="auto")``: train under the layout ``titan plan`` ranks first.

The choice is ``titan plan``'s: every layout the strategy accepts for this model, world and global
batch, with every step option (schedule, microbatches, virtual stages; the model's own activation
checkpointing setting is kept), whose model state and activations fit this device's memory, ranked
by predicted step time, priced in the Trainer's precision (``plan/precision.py``). On the CPU the cost model times this machine (a probe of about a second),
so ranks could disagree: the strategy takes global rank 0's choice and broadcasts it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_titan.model.decoder import ModelConfig
from lightning_titan.plan.devices import GPUS, Device, cpu_device, on_nodes
from lightning_titan.plan.layouts import DEVICES, GB, candidates, shortfall
from lightning_titan.plan.memory import FP32_STATE, StatePolicy
from lightning_titan.plan.precision import FP32, Precision, precision_of
from lightning_titan.plan.rank import Ranked, ranked
from lightning_titan.train.options import TrainOptions, Workload

# what the strategy's own arguments default to: layout="auto" sets these itself
CHOSEN_DEFAULTS = {
    "dp": -1,
    "pp": 1,
    "ep": 1,
    "tp": 1,
    "cp": 1,
    "zero": 0,
    "schedule": "1f1b",
    "virtual_stages": 1,
    "num_microbatches": None,
    "stage_layers": None,
    "fold_ep": False,
}


@dataclass(frozen=True)
class Choice:
    """What ``layout="auto"`` sets: the degrees and the step options."""

    degrees: dict[str, int]
    zero: int
    schedule: str
    virtual_stages: int
    num_microbatches: int
    summary: str  # one line: the layout, its options and its predicted step
    stage_layers: tuple[int, ...] | None = None  # layers per stage (None: even)
    fold_ep: bool = False  # the experts over the ep x cp x tp ranks of a stage

    def applied_to(self, options: TrainOptions) -> TrainOptions:
        """``options`` with the chosen step options, as if they had been given."""
        return replace(
            options,
            zero=self.zero,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
            num_microbatches=self.num_microbatches,
            stage_layers=self.stage_layers,
        )


def check_auto_arguments(given: dict[str, Any]) -> None:
    """layout="auto" chooses the axes and step options: any of them given is a contradiction."""
    clash = {k: v for k, v in given.items() if k in CHOSEN_DEFAULTS and v != CHOSEN_DEFAULTS[k]}
    if clash:
        raise ValueError(
            f"layout='auto' chooses {', '.join(CHOSEN_DEFAULTS)} itself, but {clash} was given; "
            "leave them out, or drop layout='auto' and give the whole layout"
        )


def model_config(config: ModelConfig | None) -> ModelConfig:
    if config is None:
        raise ValueError(
            "layout='auto' plans from the model's ModelConfig: the LightningModule needs a "
            "`config` attribute holding one (TitanLM has it); otherwise give the layout"
        )
    return config


def global_batch(batch: int | None) -> int:
    if batch is None or batch < 1:
        raise ValueError(
            "layout='auto' needs the global batch to plan for: train with a data module that has "
            "`global_batch_size` (titan's data modules do), or give the layout yourself"
        )
    return batch


def this_device(device: torch.device, world: int, nodes: int, config: ModelConfig) -> Device:
    """The catalogue's entry for this GPU (matched by name and memory), or this machine's CPU probed
    for ``world`` ranks: what ``titan plan --device`` would use."""

    if device.type != "cuda":
        return cost_device("cpu", device_memory("cpu", None, world), world, nodes, config)
    name = torch.cuda.get_device_name(device).lower()
    memory = float(torch.cuda.get_device_properties(device).total_memory)
    chip = next((k for k in ("h200", "h100", "a100") if k in name), None)
    if chip is None:
        raise ValueError(
            f"layout='auto' has no cost model for {name!r}; the catalogue holds "
            f"{sorted(GPUS)}: give the layout yourself (titan plan --device ... suggests one)"
        )
    key = min((k for k in GPUS if k.startswith(chip)), key=lambda k: abs(GPUS[k].memory - memory))
    return cost_device(key, memory, world, nodes, config)


def choose(
    config: ModelConfig,
    batch: int,
    world: int,
    device: Device,
    precision: Precision = FP32,
    compiled: bool = False,
    policy: StatePolicy = FP32_STATE,
) -> Choice:
    """The first row ``titan plan`` would print, as the strategy's arguments; a clear error where
    nothing is accepted or nothing fits (``compiled``: the model is, which rules out the overlapped
    schedules; ``policy``: the strategy's bf16 weights and optimizer offload)."""
    found, _ = candidates(config, world, batch, policy=policy)
    if not found:
        raise ValueError(
            f"layout='auto': no layout of {world} devices splits this model and a global batch of "
            f"{batch} evenly; change the devices or the batch"
        )
    fits = [c for c in found if c.state_bytes <= device.memory]
    if not fits:
        smallest = min(found, key=lambda c: c.state_bytes)
        raise ValueError(
            f"layout='auto': nothing fits: {shortfall(smallest, device.memory, config)}"
        )
    recompute = (config.recompute,)
    rows = ranked(config, fits, batch, device, recompute, precision, compiled, keep=1)
    if not rows:
        raise ValueError(
            "layout='auto': the model state fits but no step option's activations do; use "
            "activation checkpointing, a smaller batch or more devices"
        )
    return _as_choice(rows[0])


def _as_choice(r: Ranked) -> Choice:
    o = r.options
    split = f" stage_layers {r.candidate.split_label}" if r.candidate.stage_layers else ""
    summary = (
        f"{r.label.split(' ')[0]}{split} zero={r.candidate.zero} {r.options_label}, predicted "
        f"{r.cost.step * 1e3:,.3g} ms per step"
    )
    return Choice(
        dict(r.candidate.degrees),
        r.candidate.zero,
        o.schedule,
        o.virtual_stages,
        o.microbatches,
        summary,
        o.virtual_layers or r.candidate.stage_layers,  # per virtual stage where interleaved
        r.candidate.fold_ep,
    )


@dataclass(frozen=True)
class Hardware:
    """What ``layout="auto"`` plans for besides the model and the batch: the strategy's nodes and
    processes per node, this rank's device and the Trainer's precision; how the strategy keeps the
    weights and the optimizer (``param_dtype``, ``offload_optimizer``)."""

    nodes: int
    processes: int  # per node
    device: torch.device
    precision: str = "32-true"
    policy: StatePolicy = FP32_STATE

    @property
    def world(self) -> int:
        return self.nodes * self.processes


def choose_for(work: Workload, hardware: Hardware) -> Choice:
    """``choose`` for the model, batch and compile setting of ``work`` on ``hardware``."""
    config = model_config(work.config)
    world = hardware.world
    device = this_device(hardware.device, world, hardware.nodes, config)
    precision = precision_of(hardware.precision)
    batch = global_batch(work.global_batch_size)
    return choose(config, batch, world, device, precision, work.compiled, hardware.policy)


def agree(mine: Choice | None, work: Workload, hardware: Hardware) -> Choice:
    """Global rank 0's choice on every rank (one broadcast over the world group), or the error it
    met, raised on every rank, so no rank waits on one that failed."""
    import torch.distributed as dist

    sent: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            sent = [mine or choose_for(work, hardware)]
        except ValueError as error:
            sent = [str(error)]
    dist.broadcast_object_list(sent, src=0)
    if isinstance(sent[0], str):
        raise ValueError(sent[0])
    return sent[0]


def device_memory(device: str, memory_gb: float | None, devices: int) -> float:
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ValueError(f"--memory-gb={memory_gb} must be > 0")
        return memory_gb * GB
    if device == "cpu":  # ranks on this machine share its memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / devices
    return DEVICES[device]


def cost_device(
    device: str, memory: float, devices: int, nodes: int, config: ModelConfig
) -> Device:
    """The catalogue's GPU, or this machine probed for ``devices`` CPU ranks (about a second)."""
    if device == "cpu":
        if nodes != 1:
            raise ValueError(f"--nodes={nodes}: --device cpu is this one machine; use --nodes 1")
        return cpu_device(devices, config.n_experts, config.top_k, memory)
    return on_nodes(replace(GPUS[device], memory=memory), devices, nodes)
