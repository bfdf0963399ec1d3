"""One training step of the same model, six ways: ours (TrainStep, zero=0, 1 or 2), torch DDP (with
AdamW or with ``ZeroRedundancyOptimizer`` over AdamW), torch FSDP2, torch.distributed.pipelining,
and torch's ``parallelize_module`` tensor parallelism (``torch_tp.py``).

Every runner does forward, backward, gradient synchronisation, clipping to norm 1 and an AdamW step on
the same ``StageModel`` and the same local batch; they differ only in the parallel machinery. The
objective is the same everywhere: mean token cross-entropy plus the mean per-sequence aux loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.grad_kinds import split_expert_parameters
from lightning_titan.model.lora import LoRA
from lightning_titan.parallel.dp.clipping import clip_grad_norm_
from lightning_titan.parallel.mesh import ParallelDims, ProcessGroups
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.train.engine import Engine
from lightning_titan.train.step import TrainStep

SEED = 1234
MAX_NORM = 1.0
LR = 1e-3


def build_stage(
    config: ModelConfig,
    dims: ParallelDims,
    groups: ProcessGroups,
    device: torch.device,
    split: StageSplit | None = None,
    lora: LoRA | None = None,
) -> StageModel:
    model = StageModel(
        config,
        pp_rank=dims.pp_rank,
        pp=dims.pp,
        ep_rank=dims.ep_rank,
        ep=dims.ep,
        ep_group=groups.ep if dims.ep > 1 else None,
        tp_group=groups.tp if dims.tp > 1 else None,
        cp_group=groups.cp if dims.cp > 1 else None,
        sequence_group=groups.sequence if dims.cp > 1 and dims.tp > 1 else None,
        split=split,
        lora=lora,
    )
    model.init_weights(SEED)
    return model.to(device)


class TitanRunner:
    """Our stack: Engine (schedule + bucketed or per-parameter reducers + composed clipping)."""

    def __init__(
        self,
        config: ModelConfig,
        dims: ParallelDims,
        groups: ProcessGroups,
        device: torch.device,
        *,
        schedule: str,
        num_microbatches: int,
        reducer: str = "bucketed",
        bucket_cap_mb: float = 25.0,
        zero: int = 0,
        split: StageSplit | None = None,
        lora: LoRA | None = None,
    ) -> None:
        self.model = build_stage(config, dims, groups, device, split, lora)
        self.engine = Engine(
            self.model,
            dims,
            groups,
            schedule=schedule,
            bucket_cap_mb=bucket_cap_mb,
            reducer=reducer,
            zero=zero,
        )
        self.engine.broadcast_replicated()
        trained = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters
        self.optimizer = torch.optim.AdamW(trained, lr=LR)
        self.engine.shard_optimizers([self.optimizer])  # zero=0: changes nothing
        self.train_step = TrainStep(self.engine, self.optimizer, max_norm=MAX_NORM)
        self.num_microbatches = num_microbatches

    def step(self, inputs: Tensor, targets: Tensor) -> None:
        # the model's loss, as TitanLM.loss_fn: under tp > 1 the logits are this rank's vocabulary shard
        self.train_step.run(
            self.model, inputs, targets, self.num_microbatches, self.model.token_loss_sum
        )

    def close(self) -> None:
        self.engine.remove()


class DDPRunner:
    """``torch.nn.parallel.DistributedDataParallel`` with its defaults (25 MiB buckets), which is what
    Lightning's ``DDPStrategy`` wraps; pure data parallelism only."""

    def __init__(
        self, config: ModelConfig, dims: ParallelDims, groups: ProcessGroups, device: torch.device
    ) -> None:
        if dims.pp != 1 or dims.ep != 1:
            raise ValueError(f"the DDP peer runs pure DP layouts, not pp={dims.pp} ep={dims.ep}")
        self.model = build_stage(config, dims, groups, device)
        self.ddp: nn.Module = nn.parallel.DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None
        )
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self, inputs: Tensor, targets: Tensor) -> None:
        logits, aux = self.ddp(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) + aux.mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class DDPZeroRunner(DDPRunner):
    """DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` over AdamW: the sharded-state
    setup a torch user would pick. It gives each whole parameter to one rank (sorted-greedy by size)
    and broadcasts the updated parameters from their owners after the step; pure DP layouts only."""

    def __init__(
        self, config: ModelConfig, dims: ParallelDims, groups: ProcessGroups, device: torch.device
    ) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        super().__init__(config, dims, groups, device)
        self.optimizer = ZeroRedundancyOptimizer(
            self.model.parameters(), optimizer_class=torch.optim.AdamW, lr=LR
        )


class FSDP2Runner(DDPRunner):
    """torch FSDP2: ``fully_shard`` on each block and on the root. ``reshard_after_forward=False``
    (the parameters stay gathered from forward to backward): it shards what ZeRO-2 shards (optimizer
    state and grads) and is timed against ours at zero=2; True: each block freed after its forward
    and gathered again for its backward, the next block's gather prefetched (ZeRO-3; the root, as
    FSDP2 does, kept for the backward), timed against ours at zero=3. Its grads and optimizer state
    are DTensor shards; torch's ``clip_grad_norm_`` composes their norm. Mixed precision as ours:
    fp32 parameters (FSDP2's default ``MixedPrecisionPolicy``), the step under the bench's autocast.
    Pure DP layouts only."""

    def __init__(
        self,
        config: ModelConfig,
        dims: ParallelDims,
        groups: ProcessGroups,
        device: torch.device,
        *,
        reshard_after_forward: bool = False,
    ) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if dims.pp != 1 or dims.ep != 1:
            raise ValueError(f"the FSDP2 peer runs pure DP layouts, not pp={dims.pp} ep={dims.ep}")
        if groups.expert_dp is None:
            raise ValueError("the FSDP2 peer shards over the DP group: run it on a process group")
        self.model = build_stage(config, dims, groups, device)
        mesh = DeviceMesh.from_group(groups.expert_dp, device.type)  # pure DP: the dp ranks
        policy = MixedPrecisionPolicy()  # fp32 weights, grads reduced in fp32: ours
        for block in self.model.layers.values():
            fully_shard(
                block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy
            )
        fully_shard(
            self.model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy
        )
        self.ddp = self.model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)


class _Chunk(nn.Module):
    """Chunk ``chunk`` of a stage as its own module, for one torch.distributed.pipelining stage: it
    registers only that chunk's layers (and the embedding or head where it has them), so each
    ``PipelineStage`` of a rank scales and zeroes its own parameters. It passes the running aux loss
    on with the activations, so every stage's aux loss reaches the last stage's loss (pipelining
    back-propagates only that)."""

    def __init__(self, stage: StageModel, chunk: int) -> None:
        super().__init__()
        start, end = stage.chunk_ranges[chunk]
        self.layers = nn.ModuleList(stage.layers[str(i)] for i in range(start, end))
        if stage.embeds(chunk):
            self.embed = stage.embed
        if stage.heads(chunk):
            self.norm, self.lm_head = stage.norm, stage.lm_head
        self._stage = (stage,)  # in a tuple: not a submodule, its other chunks' weights stay out
        self.chunk = chunk

    def forward(self, x: Tensor, aux_in: Tensor | None = None) -> tuple[Tensor, Tensor]:
        out, aux = self._stage[0](x, self.chunk)
        return out, aux if aux_in is None else aux + aux_in


def token_loss_sum(logits_MSV: Tensor, targets_MS: Tensor) -> Tensor:
    """TitanLM's objective for the engine: the sum of the token cross-entropies of a microbatch."""
    return F.cross_entropy(logits_MSV.float().flatten(0, 1), targets_MS.flatten(), reduction="sum")


def _pipe_loss(output: tuple[Tensor, Tensor], target: Tensor) -> Tensor:
    logits, aux = output
    # per microbatch; the schedule divides the grads by M (scale_grads=True): the mean over microbatches
    return F.cross_entropy(logits.float().flatten(0, 1), target.flatten()) + aux.mean()


# our schedule -> torch's. zb_h1: torch has no single-chunk ZB-H1 class; its ZB1P
# (ScheduleInterleavedZeroBubble, the paper's ZB-H1 generalised to chunks) runs it over one chunk
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zb_h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
}


class TorchPipeRunner:
    """``torch.distributed.pipelining`` over the same stage modules (``TORCH_SCHEDULES``; one
    ``PipelineStage`` per chunk, stage index the chunk's virtual stage as ours: chunk * P + rank,
    or under the V of zbv rank and 2P-1-rank), with the same composed
    clipping (a norm all-reduce over the pipeline); pure PP layouts only."""

    def __init__(
        self,
        config: ModelConfig,
        dims: ParallelDims,
        groups: ProcessGroups,
        device: torch.device,
        *,
        schedule: str,
        num_microbatches: int,
        split: StageSplit | None = None,
    ) -> None:
        from torch.distributed import pipelining

        if dims.dp != 1 or dims.ep != 1:
            raise ValueError(
                f"the pipelining peer runs pure PP layouts, not dp={dims.dp} ep={dims.ep}"
            )
        self.model = build_stage(config, dims, groups, device, split)
        v = self.model.num_chunks
        stages = [
            pipelining.PipelineStage(
                _Chunk(self.model, c), self.model.stage_ids[c], v * dims.pp, device, group=groups.pp
            )
            for c in range(v)
        ]
        kind = getattr(pipelining, TORCH_SCHEDULES[schedule])
        # the single-stage classes take one stage, the runtime ones (multi-chunk) a list
        stage_arg = (
            stages if issubclass(kind, pipelining.schedules.PipelineScheduleMulti) else stages[0]
        )
        self.schedule = kind(stage_arg, n_microbatches=num_microbatches, loss_fn=_pipe_loss)
        self.dims, self.groups = dims, groups
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.expert, self.non_expert = (
            [p for _, p in named] for named in split_expert_parameters(self.model)
        )

    def step(self, inputs: Tensor, targets: Tensor) -> None:
        # the ranks holding the embedding and the head (under the V both are rank 0)
        args = (inputs,) if self.model.is_first_stage else ()
        kwargs: dict[str, Any] = {"target": targets} if self.model.is_last_stage else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        # pure PP (checked above): every rank counts all of its parameters, summed over the stages
        clip_grad_norm_(self.expert + self.non_expert, MAX_NORM, group=self.groups.pp)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass
