"""Train the MoE decoder with data, pipeline and expert parallelism through Lightning's Trainer API.

python examples/train.py                                  # 8 CPU ranks: (dp, pp, ep) = (2, 2, 2)
python examples/train.py --pp 4 --ep 2 --schedule gpipe   # dp=-1 fills the rest: (1, 4, 2)
python examples/train.py --accelerator gpu --devices 8    # one node, 8 GPUs over NCCL
python examples/train.py --resume runs/train/checkpoints/last.ckpt --pp 1 --ep 4   # any layout
bash examples/torchrun.sh                                 # torchrun makes the processes
sbatch examples/slurm.sbatch                              # SLURM, several nodes

Without torchrun or SLURM, Lightning starts one process per rank itself by re-running this script.
Logs go to <out>/logs/version_N/metrics.csv, sharded checkpoints to <out>/checkpoints/.
For every option of the strategy, model and data, use the CLI instead: titan fit --help.
"""

from __future__ import annotations

import argparse

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_titan import ModelConfig, TitanDataModule, TitanLM, TitanStrategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    layout = parser.add_argument_group("layout: dp * pp * ep = devices * num_nodes")
    layout.add_argument("--dp", type=int, default=-1, help="data-parallel replicas (-1: the rest)")
    layout.add_argument("--pp", type=int, default=2, help="pipeline stages (divides n_layers)")
    layout.add_argument(
        "--ep", type=int, default=2, help="expert-parallel ranks (divides n_experts)"
    )
    layout.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    layout.add_argument("--num-microbatches", type=int, default=None, help="default: pp")
    layout.add_argument("--accelerator", default="cpu", help="cpu (gloo) or gpu (nccl)")
    layout.add_argument("--devices", type=int, default=8, help="ranks per node")
    layout.add_argument("--num-nodes", type=int, default=1)
    model = parser.add_argument_group("model (the rest: lightning_titan.ModelConfig)")
    model.add_argument("--d-model", type=int, default=64)
    model.add_argument("--n-layers", type=int, default=4)
    model.add_argument("--n-experts", type=int, default=8)
    model.add_argument("--seq-len", type=int, default=64)
    run = parser.add_argument_group("run")
    run.add_argument("--max-steps", type=int, default=200)
    run.add_argument(
        "--global-batch-size", type=int, default=16, help="sequences per step, all ranks"
    )
    run.add_argument("--learning-rate", type=float, default=3e-3)
    run.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    run.add_argument("--out", default="runs/train", help="logs and checkpoints go here")
    run.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    L.seed_everything(1234)
    strategy = TitanStrategy(
        dp=args.dp, pp=args.pp, ep=args.ep, schedule=args.schedule,
        num_microbatches=args.num_microbatches, gradient_clip_norm=1.0,
    )  # fmt: skip
    checkpoint_every = max(1, min(100, args.max_steps))
    trainer = L.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes,
        strategy=strategy, precision=args.precision, max_steps=args.max_steps,
        val_check_interval=checkpoint_every, limit_val_batches=4, log_every_n_steps=1,
        logger=CSVLogger(args.out, name="logs"),
        callbacks=[
            ModelCheckpoint(f"{args.out}/checkpoints", save_last=True, every_n_train_steps=checkpoint_every),
            LearningRateMonitor(logging_interval="step"),
        ],
    )  # fmt: skip
    config = ModelConfig(
        d_model=args.d_model, n_layers=args.n_layers, n_experts=args.n_experts, seq_len=args.seq_len
    )
    module = TitanLM(config, learning_rate=args.learning_rate)
    data = TitanDataModule(seq_len=config.seq_len, global_batch_size=args.global_batch_size)
    trainer.fit(module, datamodule=data, ckpt_path=args.resume)
    if trainer.is_global_zero:
        dims = strategy.parallel_dims
        loss = trainer.callback_metrics.get("train_loss")
        print(f"done: dp={dims.dp} pp={dims.pp} ep={dims.ep}, step {trainer.global_step}, "
              f"train_loss {float(loss):.4f}, logs {trainer.logger.log_dir}")  # fmt: skip


if __name__ == "__main__":
    main()
