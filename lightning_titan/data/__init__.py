"""Data: an offline default corpus, tokenise and pack with `datasets`, layout-free resumable batches.

No module here imports Lightning; ``TitanDataModule``, the pipeline as a LightningDataModule, is in
``lightning_titan.lightning.datamodule``.
"""

from typing import Any

from lightning_titan.data.packing import Packer, split_inputs_targets
from lightning_titan.data.pipeline import DataPipeline
from lightning_titan.data.prepare import default_cache_dir, load_packed, prepare
from lightning_titan.data.sampler import LayoutFreeSampler, PackedSequences, epoch_order
from lightning_titan.data.streaming import StreamingWindows, StreamPosition
from lightning_titan.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DataPipeline",
    "HFTokenizer",
    "LayoutFreeSampler",
    "PackedSequences",
    "Packer",
    "StreamPosition",
    "StreamingWindows",
    "default_cache_dir",
    "epoch_order",
    "load_packed",
    "load_tokenizer",
    "prepare",
    "split_inputs_targets",
]


def __getattr__(name: str) -> Any:
    # `lightning_titan.data.TitanDataModule`, the data module's name in code and configs written before
    # it moved to the Lightning glue: it is loaded (and Lightning with it) only when asked for, by name,
    # so that this package stays Lightning-free and the layers hold
    if name == "TitanDataModule":
        import importlib

        return importlib.import_module("lightning_titan.lightning.datamodule").TitanDataModule
    raise AttributeError(f"module 'lightning_titan.data' has no attribute {name!r}")
