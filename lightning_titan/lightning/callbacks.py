"""Lightning callbacks that measure a run: the pipeline timeline per rank, and the load on each expert.

    trainer = L.Trainer(..., strategy=TitanStrategy(pp=2, ep=2),
                        callbacks=[PipelineTimeline(steps=[20, 21]), ExpertLoad()])

or from the CLI: ``titan fit ... --trainer.callbacks+=lightning_titan.lightning.callbacks.PipelineTimeline``.
Both make the same collectives on every rank (the loss and the layers live on some stages, the
loggers on rank 0), then log the same keys everywhere.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_titan.lightning import plots
from lightning_titan.model.moe.layer import MoELayer
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.runtime import tracing


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def run_folder(trainer: L.Trainer) -> Path:
    """The run's log folder (the logger's version folder; without a logger the Trainer's root):
    where a callback's files go beside metrics.csv. A collective: every rank calls it, in step."""
    return Path(trainer.log_dir or trainer.default_root_dir)


def in_run_folder(trainer: L.Trainer, path: str | Path) -> Path:
    """``path`` as given if absolute, else inside the run's log folder (every rank calls it)."""
    return Path(path) if Path(path).is_absolute() else run_folder(trainer) / path


def _dims(trainer: L.Trainer) -> ParallelDims:
    dims = getattr(trainer.strategy, "parallel_dims", None)
    return dims or ParallelDims(trainer.world_size, 1, 1, trainer.global_rank)


class PipelineTimeline(Callback):
    """Record the chosen training steps on every rank; after the last one, write a Chrome trace of all
    ranks (``trace.json``, pid = rank: open in ui.perfetto.dev), a Gantt chart (``timeline.png``) and
    ``bubbles.json``, and log ``timeline/bubble_stage{p}`` (measured) beside
    ``timeline/bubble_theory`` = (P-1)/(M+P-1) (interleaved over v chunks: (P-1)/(v*M+P-1)).

    Args:
        steps: global steps to record (0-based optimizer steps); skip the first ones (warm-up).
        out_dir: where rank 0 writes the files; a relative path is inside the run's log folder
            (beside metrics.csv), an absolute one is used as given.
        log: log the bubble fractions through the LightningModule's loggers.
    """

    def __init__(
        self, steps: Sequence[int] = (5, 6), out_dir: str = "timeline", log: bool = True
    ) -> None:
        if not steps or any(not isinstance(s, int) or s < 0 for s in steps):
            raise ValueError(f"steps={steps!r} must be a non-empty list of step indices >= 0")
        self.steps = sorted(set(steps))
        self.out_dir = Path(out_dir)  # resolved against the run's folder at train start
        self.log = log
        self.spans: list[tracing.Span] = []  # all ranks' spans once written
        self.bubbles: list[dict] = []  # tracing.bubble_breakdown, per stage
        self._mine: list[tracing.Span] = []
        self._done = False

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.out_dir = in_run_folder(trainer, self.out_dir)

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step in self.steps and not self._done:
            trainer.strategy.barrier("timeline")  # every rank starts the step together
            cuda = trainer.strategy.root_device.type == "cuda"
            tracing.start(trainer.global_rank, step=trainer.global_step, synchronize=cuda)

    @override
    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not tracing.is_recording():
            return
        self._mine += tracing.stop()
        if trainer.global_step - 1 >= self.steps[-1]:
            self._write(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        tracing.stop()
        if self._mine and not self._done:  # training ended before the last chosen step
            self._write(trainer, None)

    def _write(self, trainer: L.Trainer, pl_module: L.LightningModule | None) -> None:
        self._done = True
        gathered: list[Any] = [self._mine]
        if _distributed():
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, self._mine)
        self.spans = [s for rank_spans in gathered for s in rank_spans]
        dims = _dims(trainer)
        pipelines = dims.all_groups("pp")
        self.bubbles = tracing.bubble_breakdown(self.spans, pipelines) if dims.pp > 1 else []
        times = tracing.time_by_kind(self.spans)
        if trainer.is_global_zero:
            self._save(dims, times)
        if self.log and pl_module is not None and self.bubbles:
            metrics = {f"timeline/bubble_stage{b['stage']}": b["measured"] for b in self.bubbles}
            metrics["timeline/bubble_theory"] = self.bubbles[0]["theory"]
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def _save(self, dims: ParallelDims, times: dict[str, float]) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        labels = {r: f"rank {r} ({dims.label(r)})" for r in range(dims.world_size)}
        (self.out_dir / "trace.json").write_text(json.dumps(plots.chrome_trace(self.spans, labels)))
        last = max(s.step for s in self.spans)
        if plots.available():
            title = f"step {last}, {dims.label()}: measured"
            last_spans = [s for s in self.spans if s.step == last]
            plots.plot_gantt(last_spans, self.out_dir / "timeline.png", labels, title=title)
        summary = {"steps": self.steps, "ms_per_step_and_rank": times, "bubbles": self.bubbles}
        (self.out_dir / "bubbles.json").write_text(json.dumps(summary, indent=1))
        lines = [f"PipelineTimeline: steps {self.steps} -> {self.out_dir.resolve()}"]
        lines += [
            f"  stage {b['stage']}: bubble measured {b['measured']:.3f}, {_theory_label(b)}; "
            f"with free send/recv {b['compute_only']:.3f}, and steady compute "
            f"{b['steady_compute']:.3f}"
            for b in self.bubbles
        ]
        lines.append(
            "  ms per step and rank: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
        )
        rank_zero_info("\n".join(lines))


def _theory_label(bubble: dict) -> str:
    """The formula with its M and, interleaved, v: M counts microbatches, not the v*M forwards."""
    m, v = bubble["num_microbatches"], bubble.get("virtual_stages", 1)
    if bubble.get("split_backward") and v == 1:
        return (
            f"theory (P-1)/(3M+P-1) = {bubble['theory']:.3f} (M={m}, zero-bubble: W in the bubbles)"
        )
    if v == 1:
        return f"theory (P-1)/(M+P-1) = {bubble['theory']:.3f} (M={m})"
    return f"theory (P-1)/(v*M+P-1) = {bubble['theory']:.3f} (M={m}, v={v})"


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertLoad(Callback):
    """Log the share of token assignments each expert of each layer received, over the global batch,
    and plot it over training (rank 0, ``plot_path``: a relative path is inside the run's log
    folder, beside metrics.csv; an absolute one is used as given; None: no plot).

    Every rank counts its own tokens in its own stage's layers (a forward hook on each MoE layer, train
    forwards only); one all-reduce over the world sums them into a [layers, experts] table that every
    rank then logs under the same keys: ``expert_load/layer{l}/expert{e}`` (if ``log_per_expert``) and
    ``expert_load/layer{l}/max_over_mean`` (1.0 = perfectly balanced). With the expert bias on
    (``router_bias_update_rate``) also ``expert_load/layer{l}/max_over_mean_unbiased``: the load of
    the top-K the router's scores alone would have chosen for the same tokens, so one run shows what
    the bias does. The plot's last panel is max/mean per layer over training, both; the end of
    training prints them (rank 0).
    """

    def __init__(
        self,
        every_n_steps: int = 1,
        plot_path: str | None = "expert_load.png",
        log_per_expert: bool = True,
    ) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps!r} must be a positive int")
        self.every_n_steps = every_n_steps
        self.plot_path = plot_path
        self.log_per_expert = log_per_expert
        self.history: list[tuple[int, list[list[float]]]] = []  # (step, [layer][expert] shares)
        # (step, [layer] max/mean with the bias if any, [layer] max/mean without it or None)
        self.balance: list[tuple[int, list[float], list[float] | None]] = []
        self._counts: dict[int, torch.Tensor] = {}
        self._unbiased: dict[int, torch.Tensor] = {}
        self._with_bias = False
        self._hooks: list[Any] = []
        self._shape = (0, 0)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        layers: dict[int, MoELayer] = {}
        for name, module in pl_module.named_modules():
            if isinstance(module, MoELayer):
                match = _LAYER.search(name + ".")
                layers[int(match.group(1)) if match else len(layers)] = module
        # the global table's shape: this rank holds only its stage's layers
        shape = torch.tensor(
            [
                max(layers, default=-1) + 1,
                max((m.n_experts for m in layers.values()), default=0),
                any(m.expert_bias is not None for m in layers.values()),
            ]
        )
        if _distributed():
            shape = shape.to(trainer.strategy.root_device)
            dist.all_reduce(shape, op=dist.ReduceOp.MAX)
        n_layers, n_experts, with_bias = shape.tolist()
        self._shape = (int(n_layers), int(n_experts))
        self._with_bias = bool(with_bias)  # the same on every rank: the same keys and table
        if self.plot_path:
            self.plot_path = str(in_run_folder(trainer, self.plot_path))
        for layer, module in layers.items():
            self._hooks.append(module.register_forward_hook(self._counter(layer)))

    def _counter(self, layer: int) -> Callable[[MoELayer, Any, Any], None]:
        def count(module: MoELayer, inputs: Any, output: Any) -> None:
            if module.training and torch.is_grad_enabled():
                counts = module.tokens_per_expert.detach().double()
                self._counts[layer] = self._counts.get(layer, 0) + counts
                if module.unbiased_tokens_per_expert is not None:
                    unbiased = module.unbiased_tokens_per_expert.double()
                    self._unbiased[layer] = self._unbiased.get(layer, 0) + unbiased

        return count

    @override
    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        n_layers, n_experts = self._shape
        if n_layers == 0 or trainer.global_step % self.every_n_steps:
            return
        # [actual (+ unbiased), layers, experts]: one all-reduce and one host read for both
        tables = torch.zeros(
            1 + self._with_bias,
            n_layers,
            n_experts,
            dtype=torch.float64,
            device=trainer.strategy.root_device,
        )
        for i, counts_by_layer in enumerate((self._counts, self._unbiased)[: len(tables)]):
            for layer, counts in counts_by_layer.items():
                tables[i, layer] += counts.to(tables.device)
        self._counts.clear()
        self._unbiased.clear()
        if _distributed():
            # each layer's counts live on its stage's ranks only, one per token shard: a plain sum
            dist.all_reduce(tables)
        table = tables[0]
        shares = table / table.sum(-1, keepdim=True).clamp_min(1)
        max_over_mean = tables.max(-1).values / tables.mean(-1).clamp_min(1e-12)  # [1 or 2, L]
        # one device-to-host read for the whole table (an .item() per expert is a sync each on CUDA)
        host = torch.cat([max_over_mean.flatten(), shares.flatten()]).tolist()
        ratios, flat = host[: max_over_mean.numel()], host[max_over_mean.numel() :]
        shares_list = [flat[i * n_experts : (i + 1) * n_experts] for i in range(n_layers)]
        unbiased = ratios[n_layers:] if self._with_bias else None
        metrics = {}
        for layer in range(n_layers):
            metrics[f"expert_load/layer{layer}/max_over_mean"] = ratios[layer]
            if unbiased is not None:
                metrics[f"expert_load/layer{layer}/max_over_mean_unbiased"] = unbiased[layer]
            if self.log_per_expert:
                for e in range(n_experts):
                    metrics[f"expert_load/layer{layer}/expert{e}"] = shares_list[layer][e]
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
        self.history.append((trainer.global_step, shares_list))
        self.balance.append((trainer.global_step, ratios[:n_layers], unbiased))

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if not trainer.is_global_zero or not self.history:
            return
        rank_zero_info(balance_summary(self.balance))
        if self.plot_path and plots.available():
            Path(self.plot_path).parent.mkdir(parents=True, exist_ok=True)
            plots.plot_expert_load(self.history, self.plot_path, self.balance)
            rank_zero_info(f"ExpertLoad: wrote {Path(self.plot_path).resolve()}")


def balance_summary(balance: Sequence[tuple[int, list[float], list[float] | None]]) -> str:
    """Max/mean load per layer, first and last logged step and the mean over training; with the
    bias on, the unbiased choice's beside it."""
    lines = [
        f"ExpertLoad: max/mean load per layer over {len(balance)} logged steps "
        "(first -> last, mean; 1.0 = balanced)"
    ]
    for layer in range(len(balance[0][1])):
        for label, index in (("", 1), (" unbiased", 2)):
            values = [row[index][layer] for row in balance if row[index] is not None]  # type: ignore[index]
            if values:
                lines.append(
                    f"  layer {layer}{label}: {values[0]:.2f} -> {values[-1]:.2f}, "
                    f"mean {sum(values) / len(values):.2f}"
                )
    return "\n".join(lines)
