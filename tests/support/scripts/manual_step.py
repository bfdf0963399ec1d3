"""Manual optimization under TitanStrategy: stepping before the gradients are finished must raise.

python tests/support/scripts/manual_step.py skip|finish    (one rank: the guard is the strategy's, not the reducers')
"""

import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_titan import TitanStrategy


class Manual(L.LightningModule):
    def __init__(self, finish: bool) -> None:
        super().__init__()
        self.net, self.finish = nn.Linear(4, 1), finish
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self.net(x), y))
        if self.finish:
            self.trainer.strategy.finish_gradients()
        self.optimizers().step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=TitanStrategy(dp=1), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Manual(finish=sys.argv[1] == "finish"), DataLoader(data, batch_size=2))
    if trainer.is_global_zero:
        print("TRAINED", trainer.global_step, flush=True)
