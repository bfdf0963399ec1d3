"""A checkpoint of a tiny model written in one process, as TitanLM saves one (the stage held as
``model``), without a training run."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lightning_titan.checkpoint import save_sharded
from lightning_titan.model.decoder import ModelConfig, StageModel


def write_checkpoint(path: Path, config: ModelConfig, seed: int = 0) -> StageModel:
    """Save a model of ``config`` at ``path`` and return it. Its weights are the seed's init moved
    by noise: a rank that loads nothing (or the wrong tensors) holds other values."""
    model = StageModel(config)
    model.init_weights(seed)
    noise = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.02)
    holder = nn.Module()
    holder.model = model  # TitanLM's keys: model/model.<name>
    save_sharded(path, holder, [], {"hyper_parameters": {}}, layout={})
    return model.eval()
