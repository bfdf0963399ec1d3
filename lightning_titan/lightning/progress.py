"""The ``titan`` progress bar: optimizer steps out of ``max_steps``, the loss and tokens/s.

Lightning's bars count the batches of an epoch and print ``Epoch 0/-2`` when a run is bounded by
``max_steps`` (``max_epochs`` is then -1), and add the logger's version as ``v_num``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar

# logged key -> what the bar shows; the rest of the prog_bar keys (val_loss, ...) keep their names
SHOWN = {"train_loss": "loss", "tokens_per_sec": "tok/s"}


class StepProgressBar(TQDMProgressBar):
    """``train 37/200 [00:09<00:40, loss=4.512, tok/s=4,082]``: resumed runs start at their step."""

    @property
    def train_description(self) -> str:
        return "train"

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.max_steps <= 0:  # a run bounded by epochs: Lightning's epoch bar
            return super().on_train_epoch_start(trainer)
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        bar = self.train_progress_bar
        bar.set_description(self.train_description, refresh=False)
        bar.reset(total=trainer.max_steps)
        bar.initial = bar.n = trainer.global_step  # a resumed run: its rate counts from here

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, i: int
    ) -> None:
        if trainer.max_steps <= 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, i)
        bar, step = self.train_progress_bar, trainer.global_step
        if not bar.disable and self._should_update(step, bar.total):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version: in the run's folder name, not progress
        shown: dict[str, Any] = {SHOWN.get(k, k): v for k, v in items.items()}
        if isinstance(shown.get("tok/s"), float):
            shown["tok/s"] = f"{shown['tok/s']:,.0f}"
        return shown
