"""The lines ``titan fit`` prints when training ends: the final loss, how long the run took and how
fast it trained (mean tokens/s and MFU after the first step), the memory peak per rank, the layout,
and where the metrics, the loss curve and the checkpoints went."""

from __future__ import annotations

import csv
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_titan.lightning import plots
from lightning_titan.model import flops
from lightning_titan.model.decoder import ModelConfig, StageModel


class FitCounts(Callback):
    """Measures the fit on every rank and puts the totals among the callback metrics when training
    ends: the fork/spawn launcher carries those (not global_step, not the strategy's counters, not
    this callback) back to the process that prints the summary.

    The mean leaves out the fit's first step (compilation, the allocator's and the collectives'
    warm-up); a step's time is its ``training_step`` hooks' span, so validation and checkpoint
    writes, which the wall time holds, do not count against the rate."""

    def __init__(self) -> None:
        self._step_start = 0.0
        self._steps = 0  # of this fit (a resumed run starts again at 0)
        self._tokens = 0  # of the steps after the first
        self._seconds = 0.0

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        seconds = time.perf_counter() - self._step_start
        self._steps += 1
        if self._steps == 1:
            return
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        self._tokens += inputs.numel() * data_world(trainer)  # TitanLM's count of the global batch
        self._seconds += seconds

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        metrics = trainer.callback_metrics
        metrics["titan_steps"] = torch.tensor(trainer.global_step)
        skipped = skipped_steps(trainer.strategy)
        if skipped is not None:
            metrics["titan_skipped_steps"] = torch.tensor(skipped)
        if self._seconds > 0:
            metrics["titan_tokens_per_sec"] = torch.tensor(self._tokens / self._seconds)
            metrics["titan_timed_steps"] = torch.tensor(self._steps - 1)
            config, peak = (
                getattr(pl_module, "config", None),
                getattr(pl_module, "peak_flops_total", 0),
            )
            if isinstance(config, ModelConfig) and peak:
                achieved = flops.step_flops(config, self._tokens) / self._seconds
                metrics["titan_mfu"] = torch.tensor(achieved / peak, dtype=torch.float64)
                metrics["titan_peak_flops"] = torch.tensor(float(peak), dtype=torch.float64)
        kind, peak_bytes = peak_memory(trainer.strategy.root_device)
        # every rank calls this hook in the same place: one all-reduce of (peak, -peak) gives rank 0
        # the highest and the lowest
        mine = torch.tensor([peak_bytes, -peak_bytes], dtype=torch.float64)
        high, low = trainer.strategy.reduce(mine.to(trainer.strategy.root_device), reduce_op="max")
        metrics[f"titan_peak_{kind}_bytes_max"] = high.cpu()
        metrics[f"titan_peak_{kind}_bytes_min"] = -low.cpu()


# what each kind of peak is, as the summary names it
MEMORY_KINDS = {"cuda": "CUDA max allocated", "host": "host max RSS"}


def peak_memory(device: torch.device) -> tuple[str, int]:
    """(kind, bytes): CUDA's max allocated on a GPU rank, else the process's max resident set."""
    if device.type == "cuda":
        return "cuda", torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return "host", rss if sys.platform == "darwin" else rss * 1024  # Linux counts KiB


def data_world(trainer: Any) -> int:
    """Ranks that read different sequences (``DP x EP``; another strategy's world size)."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    return int(dims.data_world) if dims is not None else int(trainer.world_size)


def skipped_steps(strategy: Any) -> int | None:
    """Updates dropped by ``on_nonfinite="skip"`` (None: not a TitanStrategy)."""
    skipped: int | None = getattr(strategy, "skipped_steps", None)
    return skipped


def fit_counts(trainer: Any) -> tuple[int, int | None]:
    """(optimizer steps, steps skipped for non-finite values or None) of the fit that just ended."""
    metrics = trainer.callback_metrics
    steps = int(metrics.get("titan_steps", trainer.global_step))
    skipped = metrics.get("titan_skipped_steps", skipped_steps(trainer.strategy))
    return steps, None if skipped is None else int(skipped)


def duration(seconds: float) -> str:
    """``9.5 s``, ``3 min 12 s``, ``2 h 03 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min {int(seconds % 60):02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def size(n: float) -> str:
    """Bytes as ``412 MiB`` or ``1.23 GiB``."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def speed_lines(metrics: dict[str, Any]) -> list[str]:
    """The mean tokens/s and MFU after the first step, n/a where not measured or no peak is known."""
    if "titan_tokens_per_sec" not in metrics:
        return ["tokens/s           n/a (one step: the mean leaves out the first)"]
    timed = int(metrics["titan_timed_steps"])
    lines = [f"tokens/s           {float(metrics['titan_tokens_per_sec']):,.0f} (mean of the "
             f"{timed} step{'s' if timed > 1 else ''} after the first)"]  # fmt: skip
    if "titan_mfu" in metrics:
        peak = float(metrics["titan_peak_flops"]) / 1e12
        lines.append(f"MFU                {float(metrics['titan_mfu']):.2%} of {peak:.3g} TFLOP/s "
                     "(every rank's peak summed)")  # fmt: skip
    else:
        lines.append("MFU                n/a (no device peak known)")
    return lines


def memory_line(metrics: dict[str, Any]) -> str | None:
    """The lowest and highest memory peak of a rank (None: not measured)."""
    for kind, what in MEMORY_KINDS.items():
        if f"titan_peak_{kind}_bytes_max" in metrics:
            low = float(metrics[f"titan_peak_{kind}_bytes_min"])
            high = float(metrics[f"titan_peak_{kind}_bytes_max"])
            span = size(high) if size(low) == size(high) else f"{size(low)} to {size(high)}"
            return f"peak memory        {span} a rank ({what})"
    return None


LOSS_CURVE = "loss_curve.png"  # beside metrics.csv in the run folder


def losses(metrics_csv: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(train, val): the (step, loss) pairs of a CSVLogger's file, by step. A step logged twice (a
    restarted attempt redoes the steps after its checkpoint, appending) keeps its last row."""
    with open(metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))

    def curve(key: str) -> list[tuple[int, float]]:
        return sorted({int(r["step"]): float(r[key]) for r in rows if r.get(key)}.items())

    return curve("train_loss"), curve("val_loss")


def draw_loss_curve(trainer: Any) -> str:
    """Rank 0, as the fit ends: the run folder's ``metrics.csv`` (every attempt of this run; a run
    resumed with ``--ckpt_path`` has a new folder, its curve starting where it resumed) drawn as
    ``loss_curve.png`` beside it. Returns its path, or why there is none, for the summary."""
    logger = trainer.logger
    if not isinstance(logger, CSVLogger) or not logger.log_dir:
        return "n/a (drawn from the CSVLogger's metrics.csv; this run logs elsewhere)"
    folder = Path(logger.log_dir)
    if not plots.available():
        return "n/a (pip install matplotlib)"
    metrics = folder / "metrics.csv"
    few = "no step logged yet: the Trainer logs every log_every_n_steps (50 by default) steps"
    if not metrics.is_file():
        return f"n/a ({few})"
    try:
        train, val = losses(metrics)
    except (OSError, ValueError, KeyError) as err:  # a damaged file: the run itself went well
        return f"n/a ({metrics}: {type(err).__name__}: {err})"
    if not train:
        return f"n/a (no train_loss in {metrics}: {few})"
    path = folder / LOSS_CURVE
    plots.plot_loss_curve(train, val, path, title=f"{folder.parent.name}/{folder.name}")
    return str(path.resolve())


def fit_summary(
    trainer: Any, module: Any, wall_seconds: float | None = None, loss_curve: str | None = None
) -> str:
    """``loss_curve``: what ``draw_loss_curve`` returned (None: not drawn, no line)."""
    metrics = trainer.callback_metrics
    steps, skipped = fit_counts(trainer)
    lines = ["", "== titan fit: done"]
    if "train_loss" in metrics:
        lines.append(f"final train_loss   {float(metrics['train_loss']):.4f} (step {steps})")
    if "val_loss" in metrics:
        lines.append(f"final val_loss     {float(metrics['val_loss']):.4f}")
    if wall_seconds is not None:
        lines.append(f"wall time          {duration(wall_seconds)}")
    lines += speed_lines(metrics)
    if skipped is not None:
        lines.append(f"skipped steps      {skipped} of {steps} (non-finite loss or grads)")
    dims = getattr(trainer.strategy, "parallel_dims", None)
    memory = memory_line(metrics)
    if memory:
        ranks = dims.world_size if dims is not None else trainer.world_size
        lines.append(memory + ("" if ranks == 1 else f" over {ranks} ranks"))
    if dims is not None:
        lines.append(f"layout             {dims.label()} ({dims.world_size} ranks)")
    with torch.device("meta"):  # the whole model's size, without its memory
        whole = StageModel(module.config, lora=getattr(module, "lora", None))
    params = sum(p.numel() for p in whole.parameters())
    trained = sum(p.numel() for p in whole.parameters() if p.requires_grad)
    lines.append(f"model              {params:,} parameters")
    if trained < params:  # LoRA: the adapters
        lines.append(f"trained            {trained:,} parameters ({trained / params:.2%}, LoRA)")
    if trainer.logger is not None and trainer.logger.log_dir:
        logs = Path(trainer.logger.log_dir).resolve()  # TensorBoard's: its event files
        if isinstance(trainer.logger, CSVLogger):
            logs = logs / "metrics.csv"
        lines.append(f"logs               {logs}")
    if loss_curve is not None:
        lines.append(f"loss curve         {loss_curve}")
    if trainer.checkpoint_callback is not None and trainer.checkpoint_callback.dirpath:
        lines.append(f"checkpoints        {Path(trainer.checkpoint_callback.dirpath).resolve()}")
    return "\n".join(lines)


def skipped_warning(trainer: Any) -> str | None:
    """A run whose updates were mostly dropped (on_nonfinite="skip") did not train: say so loudly."""
    steps, skipped = fit_counts(trainer)
    if not skipped or skipped * 2 < steps:
        return None
    return (
        f"WARNING: {skipped} of {steps} optimizer steps were skipped for a non-finite loss or gradient "
        "(on_nonfinite='skip'): the model barely trained; lower learning_rate, set gradient_clip_norm, "
        "check the data, or use on_nonfinite='raise' to stop at the first one"
    )
