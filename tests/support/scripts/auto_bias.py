"""An ordinary LightningModule (automatic optimization) around a whole MoE model with aux-loss-free
balancing, under TitanStrategy(dp=2): rank 0 saves the final weights and expert biases.

python tests/support/scripts/auto_bias.py OUT.pt    (popen: re-runs this script per rank)
"""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_titan import ModelConfig, StageModel, TitanStrategy

CONFIG = ModelConfig(
    vocab_size=61, d_model=32, n_layers=2, n_heads=4, ffn_dim=24, n_experts=4, top_k=2,
    seq_len=8, router_bias_update_rate=1e-2,
)  # fmt: skip
# an odd number of steps: the ±rate moves of an expert cancel to zero only if one step had its
# load exactly at the mean
ROWS, PER_RANK, STEPS = 20, 2, 5


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, CONFIG.vocab_size, (ROWS, CONFIG.seq_len + 1), generator=g)


def new_model() -> StageModel:
    model = StageModel(CONFIG)
    model.init_weights(5)
    return model


def loss_of(model: StageModel, batch: torch.Tensor) -> torch.Tensor:
    logits, aux = model(batch[:, :-1])
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    return ce + aux.mean()


class Auto(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = new_model()

    def training_step(self, batch, batch_idx):
        return loss_of(self.model, batch[0])

    def configure_optimizers(self):
        # SGD, not AdamW: AdamW divides by the running RMS, which turns float-order differences in
        # small grads into 1e-6 weight differences within a few steps
        return torch.optim.SGD(self.parameters(), lr=0.5)


if __name__ == "__main__":
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=TitanStrategy(dp=2), max_steps=STEPS,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = Auto()
    trainer.fit(module, DataLoader(TensorDataset(tokens()), batch_size=PER_RANK))
    if trainer.is_global_zero:
        state = {k: v.detach().cpu() for k, v in module.model.state_dict().items()}
        torch.save(state, sys.argv[1])
