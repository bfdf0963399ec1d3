"""Two popen ranks under TitanStrategy with a CSV logger, and a failure at step 3:

python tests/support/scripts/dead_rank.py stuck OUT    # rank 1 dies; rank 0 blocks in a wait that never
                                               # fails (as NCCL does not notice a dead peer)
python tests/support/scripts/dead_rank.py caught OUT   # both ranks raise, catch the error, wait past the
                                               # grace period and write OUT/survived_<rank>
python tests/support/scripts/dead_rank.py stop OUT     # rank 1 stops itself (SIGSTOP); collective timeout 5 s
python tests/support/scripts/dead_rank.py plain OUT    # no failure (the test breaks the launcher itself)

A third argument, NODES, runs it on that many nodes of 2 ranks (started by torchrun, one per node).
"""

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.utils.data import DataLoader, TensorDataset

from lightning_titan import TitanStrategy

FAIL_AT = 3
TIMEOUT_MINUTES = 0.5  # the grace period is derived from it: 30 s
STALL_TIMEOUT_S = 5  # "stop": the collective timeout once training runs (the rendezvous keeps 30 s)


class Regressor(L.LightningModule):
    def __init__(self, mode: str):
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        if self.global_step == FAIL_AT:
            sys.stderr.write(f"rank {self.global_rank} reached the failure step at {time.time()}\n")
            if self.mode == "caught":
                raise RuntimeError(f"rank {self.global_rank} fails on purpose")
            if self.mode == "stop" and self.global_rank == 1:
                os.kill(os.getpid(), signal.SIGSTOP)
            if self.mode in ("stop", "plain"):
                return nn.functional.mse_loss(self.net(batch[0]), batch[1])
            if self.global_rank == 1:
                os._exit(7)
            threading.Event().wait()  # a collective that never notices the dead peer
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_start(self):
        if self.mode == "stop":  # a short timeout, but not for the rendezvous on a loaded machine
            timeout = timedelta(seconds=STALL_TIMEOUT_S)
            groups = vars(self.trainer.strategy.groups).values()
            for group in [None, *(g for g in groups if isinstance(g, dist.ProcessGroup))]:
                _set_pg_timeout(timeout, group)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-2)


def main(mode: str, out: str, num_nodes: int = 1) -> None:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=num_nodes,
        strategy=TitanStrategy(dp=2 * num_nodes, timeout_minutes=TIMEOUT_MINUTES),
        max_steps=20,
        log_every_n_steps=1,
        logger=CSVLogger(out, name="run"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(Regressor(mode), DataLoader(data, batch_size=8))
    except Exception as err:  # noqa: BLE001 - the point: a script that handles the failure
        if mode != "caught":
            raise
        sys.stderr.write(f"rank {trainer.global_rank} caught {type(err).__name__}\n")
        time.sleep(TIMEOUT_MINUTES * 60 + 4)  # past the grace period
        Path(out, f"survived_{trainer.global_rank}").write_text("ok")
        sys.stderr.flush()
        os._exit(0)  # the process group of a failed run is not torn down: skip its destructor


if __name__ == "__main__":
    main(*sys.argv[1:3], *map(int, sys.argv[3:]))
