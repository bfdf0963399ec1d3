"""Manual optimization under TitanStrategy: stepping on gradients a backward left unreduced must
raise; a module of one's own that runs its backward inside the strategy's training step trains.

python tests/support/scripts/manual_step.py skip|step    (two data-parallel ranks)
"""

import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_titan import TitanStrategy


class Manual(L.LightningModule):
    def __init__(self, through_the_step: bool) -> None:
        super().__init__()
        self.net, self.through_the_step = nn.Linear(4, 1), through_the_step
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch

        def backward() -> None:
            self.manual_backward(nn.functional.mse_loss(self.net(x), y))

        if self.through_the_step:  # the strategy's step around this module's own backward
            self.trainer.strategy.train_step.update(backward, index=self.global_step)
        else:
            backward()
            self.optimizers().step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=TitanStrategy(dp=2), max_steps=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Manual(through_the_step=sys.argv[1] == "step"), DataLoader(data, batch_size=2))
    if trainer.is_global_zero:
        print("TRAINED", trainer.global_step, flush=True)
