"""lightning_titan: DP x PP x EP training of Mixture-of-Experts decoders as a Lightning strategy."""

import os

from lightning_titan.model import ModelConfig, StageModel
from lightning_titan.parallel_dims import ParallelDims

__all__ = [
    "ModelConfig",
    "ParallelDims",
    "StageModel",
    "TitanDataModule",
    "TitanLM",
    "TitanStrategy",
]

# Importing Lightning costs ~6 CPU-seconds per process; engine-only processes (tests and benchmarks
# spawned by lightning_titan.launch) set this variable to skip it.
if not os.environ.get("LIGHTNING_TITAN_ENGINE_ONLY"):
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_titan.module import TitanLM
    from lightning_titan.strategy import TitanStrategy

    if TitanStrategy.strategy_name not in StrategyRegistry:  # a re-import must not raise
        TitanStrategy.register_strategies(StrategyRegistry)


def __getattr__(name: str):
    # the data module pulls in `datasets`; import it only when asked for
    if name == "TitanDataModule":
        from lightning_titan.data import TitanDataModule

        return TitanDataModule
    raise AttributeError(f"module 'lightning_titan' has no attribute {name!r}")
