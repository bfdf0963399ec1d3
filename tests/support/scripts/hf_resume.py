"""TitanLM(init_from=HF_DIR) under Trainer + TitanStrategy(pp2 x ep2, fork) on a plain DataLoader.

python tests/support/scripts/hf_resume.py HF_DIR OUT first     # one step from the folder, checkpoint in OUT/ckpt
python tests/support/scripts/hf_resume.py HF_DIR OUT resumed   # init_from again, resumed from OUT/ckpt/last.ckpt
python tests/support/scripts/hf_resume.py HF_DIR OUT resumed 1,1,2,2   # ... under dp,pp,ep,tp = 1,1,2,2

Every rank saves its weights before its first step (after the strategy's broadcast and any checkpoint
restore) and at train end, and the first step's loss, to OUT/<run>_rank<r>.pt; tests/distributed/test_hf_load.py
checks them: the start is the folder's model on a fresh run and the checkpoint's on a resumed one.
"""

import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from lightning_titan import ModelConfig, TitanLM, TitanStrategy
from lightning_titan.parallel.tensor_parallel import tp_shards

LAYOUT = {"dp": 1, "pp": 2, "ep": 2}
TRAINING = ModelConfig(seq_len=12, aux_loss_coef=0.0, z_loss_coef=0.0)  # 12: tp2 divides it
GLOBAL_BATCH = 8


def global_tokens(vocab_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, vocab_size, (GLOBAL_BATCH, TRAINING.seq_len + 1), generator=g)


class RecordingLM(TitanLM):
    record: dict | None = None

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.record is None:  # the weights the first step starts from
            start = {n: p.detach().clone() for n, p in self.model.named_parameters()}
            self.record = {"start": start}

    def log(self, name, value, *args, **kwargs):
        if name == "train_loss" and "loss" not in self.record:
            self.record["loss"] = float(value)
        super().log(name, value, *args, **kwargs)

    def on_train_end(self) -> None:  # in each rank's own process (fork launch)
        self.record["end"] = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        self.record["expert_range"] = self.model.expert_range
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.record["cut"] = {names[i]: s.dim for i, s in tp_shards(self.model).items()}
        dims = self.trainer.strategy.parallel_dims
        self.record["tp"] = (dims.tp, dims.tp_rank)
        torch.save(self.record, Path(self.out) / f"{self.run}_rank{self.global_rank}.pt")


def main(hf_dir: str, out: str, run: str, layout: str = "") -> None:
    first = run == "first"
    degrees = (
        dict(zip(("dp", "pp", "ep", "tp"), map(int, layout.split(",")), strict=True))
        if layout
        else LAYOUT
    )
    callbacks = [ModelCheckpoint(dirpath=Path(out) / "ckpt", every_n_train_steps=1, save_last=True)]
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=TitanStrategy(**degrees, start_method="fork"),
        max_steps=1 if first else 2, logger=False, enable_checkpointing=first,
        callbacks=callbacks if first else [], enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0,
    )  # fmt: skip
    module = RecordingLM(TRAINING, init_from=hf_dir, learning_rate=1e-2, warmup_steps=0)
    module.out, module.run = out, run
    tokens = global_tokens(module.config.vocab_size)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // (degrees["dp"] * degrees["ep"]))
    ckpt = None if first else str(Path(out) / "ckpt" / "last.ckpt")
    trainer.fit(module, loader, ckpt_path=ckpt)


if __name__ == "__main__":
    main(*sys.argv[1:5])
