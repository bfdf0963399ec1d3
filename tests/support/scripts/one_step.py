"""One training step of TitanLM under Trainer + TitanStrategy(dp2 x pp2 x ep2, gradient_clip_norm,
zero=2) on a plain DataLoader, with an init that differs per rank (the case the broadcast of replicated
parameters exists for). Under zero=2 each rank gets only its rows of the reduced grads (the clip norm
is composed from them) and its SGD updates only those rows; the rest arrive by the all-gather. The
expert bias is on (zero during the step's forward, moved after it). Every rank saves what it saw to
OUT/rank<r>.pt; tests/distributed/test_strategy_step.py checks it.

python tests/support/scripts/one_step.py OUT   # fork: one import, eight ranks
"""

import sys
import zlib
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_titan import ModelConfig, TitanLM, TitanStrategy

CONFIG = ModelConfig(
    vocab_size=61, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=24, n_experts=4, top_k=2,
    seq_len=12, aux_loss_coef=0.05, z_loss_coef=0.01, router_bias_update_rate=1e-3,
)  # fmt: skip
LAYOUT = {"dp": 2, "pp": 2, "ep": 2}
SEED = 7
MAX_NORM = 0.05
LR = 1.0  # plain SGD: the update is the clipped gradient itself, so clipping shows in the weights
GLOBAL_BATCH = 8


def rank_noise(rank: int, name: str, shape: torch.Size) -> torch.Tensor:
    """What rank ``rank`` adds to ``name`` after the layout-free init (crc32: the same in every process)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}|{name}".encode()))
    return torch.randn(shape, generator=g) * 0.01


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


class PerRankInitLM(TitanLM):
    """A user's init that used per-rank randomness: replicas disagree until the strategy broadcasts."""

    def configure_model(self) -> None:
        fresh = self.model is None
        super().configure_model()
        if fresh:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.add_(rank_noise(self.global_rank, name, p.shape))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=LR)
        return {
            "optimizer": optimizer,
            "lr_scheduler": torch.optim.lr_scheduler.ConstantLR(optimizer, 1.0),
        }

    def on_train_start(self) -> None:  # after the strategy's setup: the broadcast is done
        self.record = {
            "initial": {n: p.detach().clone() for n, p in self.model.named_parameters()},
            "sampler": self.trainer.strategy.distributed_sampler_kwargs,
            "batches": [],
        }

    def training_step(self, batch, batch_idx):
        self.record["batches"].append([t.clone() for t in batch])
        super().training_step(batch, batch_idx)

    def log(self, name, value, *args, **kwargs):  # the step's pre-clip norm, as TitanLM logs it
        if name == "grad_norm":
            self.record["grad_norm"] = float(value)
        super().log(name, value, *args, **kwargs)

    def on_train_end(self) -> None:  # in each rank's own process (fork launch): save what it saw
        dims = self.trainer.strategy.parallel_dims
        optimizer = self.trainer.optimizers[0]
        self.record.update(
            final={n: p.detach().clone() for n, p in self.model.named_parameters()},
            biases={n: b.clone() for n, b in self.model.named_buffers() if "expert_bias" in n},
            coords=(dims.dp_rank, dims.pp_rank, dims.ep_rank),
            expert_range=self.model.expert_range,
            optimizer_numel=sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
        )
        torch.save(self.record, Path(self.out) / f"rank{self.global_rank}.pt")


def main(out: str) -> None:
    strategy = TitanStrategy(**LAYOUT, gradient_clip_norm=MAX_NORM, zero=2, start_method="fork")
    trainer = L.Trainer(
        accelerator="cpu", devices=8, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0,
    )  # fmt: skip
    module = PerRankInitLM(CONFIG, seed=SEED, warmup_steps=0)
    module.out = out
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // (LAYOUT["dp"] * LAYOUT["ep"]))
    trainer.fit(module, loader)


if __name__ == "__main__":
    main(sys.argv[1])
