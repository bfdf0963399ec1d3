"""Data: an offline default corpus, tokenise and pack with `datasets`, layout-free resumable batches."""

from lightning_titan.data.datamodule import TitanDataModule
from lightning_titan.data.packing import Packer, split_inputs_targets
from lightning_titan.data.prepare import default_cache_dir, load_packed, prepare
from lightning_titan.data.sampler import LayoutFreeSampler, PackedSequences, epoch_order
from lightning_titan.data.streaming import StreamingWindows, StreamPosition
from lightning_titan.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "LayoutFreeSampler",
    "PackedSequences",
    "Packer",
    "StreamPosition",
    "StreamingWindows",
    "TitanDataModule",
    "default_cache_dir",
    "epoch_order",
    "load_packed",
    "load_tokenizer",
    "prepare",
    "split_inputs_targets",
]
