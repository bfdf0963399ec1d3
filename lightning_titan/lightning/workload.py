"""The plain values the layers below read off Lightning's objects: ``train/`` checks and resolves the
step options against a ``Workload``, ``plan/`` plans ``layout="auto"`` for it on ``Hardware``."""

from __future__ import annotations

from typing import Any

from lightning_titan.model.config import ModelConfig
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.plan.auto import Hardware
from lightning_titan.plan.memory import StatePolicy
from lightning_titan.train.options import Workload


def workload(module: Any, datamodule: Any, trainer: Any = None) -> Workload:
    """The model, data and clipping of a run: TitanLM's config and compile flag, the data module's
    global batch, the Trainer's own clipping, the module's ``check_layout`` (each where it has one)."""
    config = getattr(module, "config", None)
    batch = getattr(datamodule, "global_batch_size", None)
    check: Any = getattr(module, "check_layout", None)

    def check_layout(
        dims: ParallelDims, split: StageSplit
    ) -> None:  # the module's check, with its data
        check(dims, datamodule, split=split)

    return Workload(
        config=config if isinstance(config, ModelConfig) else None,
        compiled=bool(getattr(module, "hparams", {}).get("compile", False)),
        global_batch_size=batch if isinstance(batch, int) else None,
        trainer_clip=getattr(trainer, "gradient_clip_val", None),
        check_layout=check_layout if callable(check) else None,
    )


def hardware(strategy: Any) -> Hardware:
    """The strategy's nodes, processes per node, this rank's device and the Trainer's precision."""
    precision = getattr(strategy.precision_plugin, "precision", "32-true")
    options = strategy.options  # how it keeps the weights and the optimizer: priced with them
    policy = StatePolicy(options.param_dtype, options.offload_optimizer)
    return Hardware(
        strategy.num_nodes, strategy.num_processes, strategy.root_device, precision, policy
    )
