"""An ordinary LightningModule (automatic optimization) under a given strategy; rank 0 saves the final weights.

python tests/support/scripts/dropin.py titan OUT.pt            # popen: re-runs this script per rank
torchrun --nproc_per_node 2 tests/support/scripts/dropin.py titan OUT.pt
python tests/support/scripts/dropin.py ddp OUT.pt
"""

import sys

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_titan import TitanStrategy


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(8, 32),
            nn.GELU(),
            nn.LayerNorm(32),
            nn.Linear(32, 32),
            nn.GELU(),
            nn.Linear(32, 1),
        )
        self.unused = nn.Linear(4, 4)  # never gets a grad: must not hang either strategy

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)


def main(kind: str, out: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, :1] * x[:, 1:2]).sin() + 0.1 * torch.randn(256, 1, generator=g)
    strategy = (
        TitanStrategy(dp=2, bucket_cap_mb=0.001, zero=2)
        if kind == "titan"
        else DDPStrategy(find_unused_parameters=True)
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        accumulate_grad_batches=2,
        gradient_clip_val=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Regressor()
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=16))
    if trainer.is_global_zero:
        final = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        torch.save({"initial": initial, "final": final}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
