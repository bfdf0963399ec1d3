"""``stage_layers="auto"``: layers per (virtual) stage chosen from a short probe of what they cost.

The probe times, on one device, the forward + backward of one microbatch through the embedding, one
block, and the final norm + LM head + loss (``probe_costs``). ``split.balance`` then gives each virtual stage
as many layers as keeps the slowest one fastest: stage s costs ``layers_s * block`` plus the
embedding on the first and the head on the last. One rank probes and broadcasts the result, so every
rank builds the same split (timings differ between ranks). Under ep or tp each rank's share of a block
is smaller, but in the same proportion for every stage, so the single-device ratios still hold.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.split import StageCosts, balance


def probe_models(config: ModelConfig) -> tuple[StageModel, StageModel | None]:
    """One-layer models whose block is an MoE block, and a dense one when the model has dense
    layers (None otherwise)."""
    model = StageModel(replace(config, n_layers=1, dense_layers=0))
    model.init_weights(0)
    if not config.dense_layers:
        return model, None
    dense = StageModel(replace(config, n_layers=1, dense_layers=1))
    dense.init_weights(0)
    return model, dense


def probe_costs(
    config: ModelConfig, microbatch: int, device: torch.device, repeats: int = 3
) -> StageCosts:
    """Median forward + backward times of the parts of a one-layer model (after one warm-up run);
    a model with dense first layers (DeepSeek-V3) has its dense block timed apart."""
    model, dense_model = probe_models(config)
    model.to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (microbatch, config.seq_len), generator=g).to(device)
    block, cos_sin = model.layers["0"], model._rope(config.seq_len, device)

    def embed() -> torch.Tensor:
        return model.embed(ids).sum()

    def one_block(block: torch.nn.Module = block) -> torch.Tensor:
        x = torch.randn(microbatch, config.seq_len, config.d_model, device=device)
        out, aux = block(x.requires_grad_(), *cos_sin)
        return out.sum() + aux.sum()

    def head() -> torch.Tensor:
        x = torch.randn(microbatch, config.seq_len, config.d_model, device=device)
        logits = model.lm_head(model.norm(x.requires_grad_()))
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(), reduction="sum")

    def seconds(part: Callable[[], torch.Tensor]) -> float:
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            part().backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])

    dense = 0.0
    if dense_model is not None:
        dense = seconds(lambda: one_block(dense_model.to(device).layers["0"]))
    return StageCosts(seconds(embed), seconds(one_block), seconds(head), dense)


def agree(
    config: ModelConfig, pp: int, virtual_stages: int, microbatch: int, device: torch.device
) -> tuple[tuple[int, ...], StageCosts]:
    """The split every rank uses: probed on global rank 0, broadcast to the world."""
    payload: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        probed = probe_costs(config, microbatch, device)
        split = balance(probed, config.n_layers, pp * virtual_stages, config.dense_layers)
        payload = [(tuple(split), probed)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0, device=device if device.type == "cuda" else None)
    counts: tuple[int, ...] = payload[0][0]
    costs: StageCosts = payload[0][1]
    return counts, costs


def resolve(
    config: ModelConfig | None,
    dims: ParallelDims,
    virtual_stages: int,
    microbatch: int,
    device: torch.device,
) -> tuple[int, ...]:
    """The layers of each (virtual) stage for ``stage_layers="auto"``, agreed by every rank and said
    on rank 0. ``config``: the model's (None: the LightningModule has none)."""
    if config is None:
        raise ValueError(
            "stage_layers='auto' probes the model's blocks: the LightningModule needs a ModelConfig "
            "`config` (TitanLM has one); give stage_layers as a list of counts instead"
        )
    counts, costs = agree(config, dims.pp, virtual_stages, microbatch, device)
    if dims.rank == 0:
        chunks = f" x virtual_stages={virtual_stages}" if virtual_stages > 1 else ""
        print(
            f"[titan] stage_layers='auto' chose {list(counts)} for pp={dims.pp}{chunks} "
            f"({costs.describe()})",
            flush=True,
        )
    return counts
