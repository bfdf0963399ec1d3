"""lightning_titan: Mixture-of-Experts training with DP, PP, EP, CP and TP composed, as a Lightning
strategy."""

from typing import Any

import lightning_titan._floor  # noqa: F401  (first: an older torch is named, not met as a stray error)
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.lora import LoRA
from lightning_titan.parallel.mesh import ParallelDims

__all__ = [
    "LoRA",
    "ModelConfig",
    "ParallelDims",
    "StageModel",
    "TitanDataModule",
    "TitanLM",
    "TitanStrategy",
]

# Lightning (~6 CPU-seconds to import) and `datasets` load only when one of these is asked for, so
# processes that run the engine alone (tests, benchmarks) never pay for them. Importing
# lightning_titan.lightning.strategy registers strategy="titan".
_LAZY = {
    "TitanLM": "lightning_titan.lightning.module",
    "TitanStrategy": "lightning_titan.lightning.strategy",
    "TitanDataModule": "lightning_titan.lightning.datamodule",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'lightning_titan' has no attribute {name!r}")


def _watch_the_launcher_if_a_rank() -> None:
    # a rank TitanLauncher started leaves when the launcher dies, from its first import on: before
    # Lightning is imported and before the rendezvous, where it would wait for timeout_minutes
    import os

    if os.environ.get("TITAN_LAUNCHER_PID"):
        from lightning_titan.runtime.orphans import watch_launcher

        watch_launcher()


def _register_if_lightning_is_loaded() -> None:
    # with Lightning already imported this costs nothing, and `strategy="titan"` works at once
    import sys

    if "lightning.pytorch" in sys.modules:
        import lightning_titan.lightning.strategy  # noqa: F401


_watch_the_launcher_if_a_rank()
_register_if_lightning_is_loaded()
