"""TitanLM: the LightningModule that holds one rank's stage of the MoE decoder and runs the schedule."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torchmetrics.aggregation import MeanMetric

from lightning_titan.hf import load as hf_load
from lightning_titan.lightning.strategy import TitanStrategy
from lightning_titan.model import compiled, flops
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.model.lora import LoRA
from lightning_titan.parallel.batching import unpack_batch
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.schedules import SPLIT_BACKWARD
from lightning_titan.parallel.pipeline.split import StageSplit

_PROGRESS_BAR = ("train_loss", "tokens_per_sec")  # the metrics the progress bar shows


def check_base_precision(lora: LoRA | None, precision: str) -> None:
    """A bf16 LoRA base needs bf16 autocast: an fp32 matmul cannot read a bf16 weight."""
    if lora is not None and lora.base_dtype == "bf16" and "bf16" not in str(precision):
        raise ValueError(
            f"lora base_dtype='bf16' keeps the frozen weights in bf16, which precision="
            f"{precision!r} cannot multiply with its fp32 activations; use "
            "--trainer.precision=bf16-mixed, or base_dtype='fp32'"
        )


class TitanLM(L.LightningModule):
    """A Mixtral-style MoE language model trained with manual optimization under TitanStrategy.

    Args:
        model: the model's shape; every layout builds its stage of this same model.
        learning_rate: peak AdamW learning rate.
        min_lr_ratio: the cosine schedule decays to ``learning_rate * min_lr_ratio``.
        warmup_steps: linear warmup from 0, then cosine decay.
        lr_decay_steps: steps over which the cosine decays (None: the whole run, ``max_steps``); set it to
            keep the schedule fixed when a run is stopped and resumed with another ``max_steps``.
        weight_decay: AdamW weight decay for matrices (not for norms).
        betas: AdamW betas.
        seed: initial weights depend on this seed and the global parameter names only.
        init_from: a Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, gpt-oss or DeepSeek-V3 folder
            (config.json + safetensors) to start from instead: the model's shape and options are read from it (a
            ``model`` field set away from its default must agree) and each rank loads only its own
            layers and experts. A resumed checkpoint still wins. A data module with tokenizer="auto"
            uses the folder's tokenizer when it has one.
        peak_flops: one device's peak FLOP/s for the logged ``mfu`` (None: a GPU's dense bf16 peak
            from ``flops.GPU_BF16_PEAK``, else a short matmul probe on each rank at train start).
        optimizer: another optimizer than AdamW, built on the same two groups (the matrices, then the
            norms at weight_decay 0) with its own arguments, e.g. ``partial(torch.optim.SGD, lr=0.1,
            momentum=0.9)``; on the command line ``--model.optimizer=torch.optim.SGD
            --model.optimizer.lr=0.1``. ``learning_rate``, ``betas`` and ``weight_decay`` are then
            unused; the warmup and cosine schedule still scale its learning rate. Under zero>0 it
            must update each element on its own (checked by a probe step).
        compile: ``torch.compile`` each block's attention, router and experts' activation, and the
            last stage's head and loss (``model/compiled.py``; the MoE's dispatch and the expert
            GEMMs stay eager). The first step compiles (rank 0 prints how long); later steps reuse
            the graphs. Losses agree with eager within float rounding, not bit for bit
            (docs/concepts.md); under zb_h1 and zbv the attention and the head stay eager.
        lora: train LoRA adapters on the projections it targets and freeze the rest
            (``model/lora.py``), e.g. ``--model.lora.rank=16 --model.lora.targets='[attention,
            experts]'``: only the adapters get grads, reducers and optimizer state; the adapters
            start at PEFT's init on the base (``seed``, or ``init_from``'s weights).
    """

    def __init__(
        self,
        model: ModelConfig | None = None,
        learning_rate: float = 3e-3,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 10,
        lr_decay_steps: int | None = None,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        seed: int = 1234,
        init_from: str | None = None,
        peak_flops: float | None = None,
        optimizer: OptimizerCallable | None = None,
        compile: bool = False,
        lora: LoRA | None = None,
    ) -> None:
        super().__init__()
        if not learning_rate > 0:
            raise ValueError(f"learning_rate={learning_rate!r} must be > 0 (e.g. 3e-3)")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay!r} must be >= 0 (e.g. 0.1; 0: off)")
        if not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={min_lr_ratio!r} must be in [0, 1]")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps!r} must be >= 0")
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(
                f"peak_flops={peak_flops!r} must be > 0 (one device's FLOP/s, e.g. 989e12), or None "
                "to take it from the device catalogue or a matmul probe"
            )
        if not isinstance(compile, bool):
            raise ValueError(f"compile={compile!r} must be True or False")
        if lr_decay_steps is not None and lr_decay_steps < 1:
            raise ValueError(
                f"lr_decay_steps={lr_decay_steps!r} must be >= 1, or None for the whole run"
            )
        self.config = model if model is not None else ModelConfig()
        if init_from is not None:  # its shape, and every tensor there, before any rank starts
            self.config = hf_load.config_from_folder(init_from, self.config)
            hf_load.check_folder(init_from, self.config)
        self.make_optimizer = optimizer  # a callable: not a hyper-parameter a checkpoint can hold
        self.lora = lora
        self.save_hyperparameters(ignore=["model", "optimizer", "lora"])
        self.hparams["model"] = vars(self.config)
        self.hparams["lora"] = None if lora is None else vars(lora)
        self.automatic_optimization = False
        self.model: StageModel | None = None
        self.val_loss = MeanMetric(sync_on_compute=False)  # values are global already
        self.peak_flops_total = 0.0  # every rank's device peak summed, set at train start

    # -- building --------------------------------------------------------------------------------------
    @property
    def strategy(self) -> TitanStrategy:
        strategy = self.trainer.strategy
        if not isinstance(strategy, TitanStrategy):
            raise TypeError(
                f"TitanLM trains under TitanStrategy, not {type(strategy).__name__}: use "
                "Trainer(strategy=TitanStrategy(dp=..., pp=..., ep=...)) or strategy='titan'"
            )
        return strategy

    def check_layout(
        self, dims: ParallelDims, datamodule: Any = None, split: StageSplit | None = None
    ) -> None:
        """Raise ValueError unless this model splits over ``dims`` (its layers as ``split`` says) and
        ``datamodule``'s batches fit it.

        TitanStrategy runs this before any rank starts (and on every rank before the process group)."""
        self.config.validate_layout(
            dims.pp, dims.ep, dims.tp, dims.cp, split, fold_ep=bool(dims.fold_ep)
        )
        if hasattr(datamodule, "use_model_folder"):  # tokenizer="auto": the folder's, if it has one
            datamodule.use_model_folder(self.hparams["init_from"])
        if datamodule is not None and hasattr(datamodule, "check_model"):
            datamodule.check_model(vocab_size=self.config.vocab_size, seq_len=self.config.seq_len)

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning calls this on every fit/validate
            return
        check_base_precision(self.lora, self.trainer.precision)
        dims = self.strategy.parallel_dims  # checked against the model by check_layout already
        groups = self.strategy.groups
        self.model = StageModel(
            self.config,
            pp_rank=dims.pp_rank,
            pp=dims.pp,
            ep_rank=dims.expert_rank,  # fold_ep: the place in the folded EP group
            ep=dims.expert_world,
            ep_group=groups.ep,
            tp_group=groups.tp,
            cp_group=groups.cp,
            sequence_group=groups.sequence,
            split=self.strategy.options.split,
            lora=self.lora,
        )
        # a resumed checkpoint is loaded after this (restore_checkpoint_after_setup) and replaces both
        if self.hparams["init_from"] is not None:
            hf_load.load_stage(self.model, self.hparams["init_from"])
            self.model.init_adapters(self.hparams["seed"])
        else:
            self.model.init_weights(self.hparams["seed"])
        if self.hparams.get("compile"):  # older checkpoints' hparams lack it
            schedule = self.strategy.options.schedule
            if schedule in SPLIT_BACKWARD:  # model/compiled.py: the B/W split needs them eager
                rank_zero_info(f"compile: schedule={schedule!r} compiles the routers only")
            compiled.compile_stage(self.model, split_backward=schedule in SPLIT_BACKWARD)

    @property
    def stage(self) -> StageModel:
        """This rank's stage of the model (built by ``configure_model``, inside the Trainer)."""
        if self.model is None:
            raise RuntimeError("the stage model is built by configure_model, inside Trainer.fit")
        return self.model

    def configure_optimizers(self) -> Any:
        trained = [p for p in self.parameters() if p.requires_grad]  # LoRA: the adapters only
        decay = [p for p in trained if p.ndim >= 2]  # matrices; not norms
        no_decay = [p for p in trained if p.ndim < 2]
        if self.make_optimizer is not None:
            optimizer = self.make_optimizer(
                [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]
            )
        else:
            optimizer = torch.optim.AdamW(
                [
                    {"params": decay, "weight_decay": self.hparams["weight_decay"]},
                    {"params": no_decay, "weight_decay": 0.0},
                ],
                lr=self.hparams["learning_rate"],
                betas=tuple(self.hparams["betas"]),
            )
        total = self.hparams["lr_decay_steps"] or max(
            1, int(self.trainer.estimated_stepping_batches)
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_factor(total))
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    def _lr_factor(self, total_steps: int) -> Callable[[int], float]:
        warmup, floor = self.hparams["warmup_steps"], self.hparams["min_lr_ratio"]

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        return factor

    def on_train_start(self) -> None:
        """The MFU's denominator: each rank's device peak (probed side by side after a barrier on a
        CPU box, so that the probes share the cores as the ranks will), summed over the world;
        the end summary prints the fit's mean MFU against it."""
        peak = self.hparams["peak_flops"]
        if peak is None:
            self.strategy.barrier("peak flops")
            dtype = torch.bfloat16 if "bf16" in str(self.trainer.precision) else torch.float32
            peak, _ = flops.device_peak(self.strategy.root_device, dtype)
        total = torch.tensor(float(peak), dtype=torch.float64, device=self.strategy.root_device)
        self.peak_flops_total = float(self.strategy.reduce(total, reduce_op="sum"))

    # -- steps -----------------------------------------------------------------------------------------
    def forward(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """The stage's own forward (logits only on a single-stage layout)."""
        return self.stage(tokens)

    def loss_fn(self, logits_MSV: Tensor, targets_MS: Tensor) -> Tensor:
        """The sum of the token losses of one microbatch (the engine makes it the global mean).

        Runs on the last stage; override it to train another objective. Under tp > 1 ``logits_MSV``
        holds this rank's vocabulary shard only (``StageModel.token_loss_sum`` reduces over it)."""
        return self.stage.token_loss_sum(logits_MSV, targets_MS)

    def _microbatches(self, inputs: Tensor) -> int:
        """M for this rank's batch ``inputs`` [b, S] (checked against the schedule)."""
        return self.strategy.options.microbatches(
            inputs.shape[0], pp=self.strategy.parallel_dims.pp
        )

    def training_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets, documents = unpack_batch(batch)  # documents: packed records' ids
        strategy, start = self.strategy, time.perf_counter()
        # the whole step (train/step.py): every microbatch's forward and backward in the schedule's
        # order, the grads reduced (overlapped with the last backward), checked and clipped, the
        # update (ZeRO: each rank its rows, then gathered), the routers' expert biases, the LR step;
        # the global numbers come back in one host read
        step = strategy.train_step.run(
            self.stage,
            inputs,
            targets,
            self._microbatches(inputs),
            self.loss_fn,
            backward=self.manual_backward,
            index=self.global_step,
            documents=documents,
        )

        tokens = inputs.numel() * strategy.parallel_dims.data_world
        seconds = time.perf_counter() - start
        if self.hparams.get("compile") and self.global_step == 1:  # the step that compiled
            rank_zero_info(compiled.compile_report(seconds))
        achieved = flops.step_flops(self.config, tokens) / seconds  # model FLOPs, all ranks
        # the same keys on every rank, values already global: the loggers live on rank 0, the loss
        # on the last stage
        metrics = {
            "train_loss": step.loss,
            "aux_loss": step.aux,
            "grad_norm": step.grad_norm,
            "lr": strategy.train_step.optimizer.param_groups[0]["lr"],
            "tokens_per_sec": tokens / seconds,
            "flops_per_sec": achieved,
            "mfu": achieved / self.peak_flops_total if self.peak_flops_total else 0.0,
        }
        if self.config.capacity_factor is not None:  # the config is the same on every rank
            assignments = tokens * self.config.top_k * self.config.n_layers
            metrics["dropped_assignments"] = step.dropped  # over capacity, summed over layers
            metrics["dropped_fraction"] = step.dropped / assignments
        for name, value in metrics.items():
            # host numbers (the step's one read brought the device's) as CPU tensors: Lightning
            # copies a Python float onto the module's device (a host-to-device copy per metric per
            # step on CUDA), which its progress bar and loggers then read back
            self.log(name, torch.tensor(float(value)), prog_bar=name in _PROGRESS_BAR)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets, documents = unpack_batch(batch)
        strategy = self.strategy
        step = strategy.engine.forward_only(
            self.stage,
            inputs,
            targets,
            self._microbatches(inputs),
            self.loss_fn,
            documents=documents,
        )
        self.val_loss.update(step.loss)

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("val_loss", loss, prog_bar=True)
        self.log("val_perplexity", torch.exp(loss))

    test_step = validation_step

    def on_test_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log("test_loss", loss)
        self.log("test_perplexity", torch.exp(loss))
