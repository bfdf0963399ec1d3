"""The ``titan`` command: LightningCLI over TitanLM and TitanDataModule, plus ``export`` and ``bench``.

titan fit --config configs/dp_pp_ep.yaml
titan fit --config configs/dp_pp_ep.yaml --trainer.strategy.init_args.pp=4
python -m lightning_titan validate --config configs/single.yaml --ckpt_path last
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from lightning_titan.data import TitanDataModule
from lightning_titan.module import TitanLM

TRAINER_DEFAULTS = {
    "accelerator": "cpu",
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "runs"},
    },
}


class TitanCLI(LightningCLI):
    def after_fit(self) -> None:
        trainer = self.trainer
        if not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        lines = ["", "== titan fit: done"]
        if "train_loss" in metrics:
            lines.append(
                f"final train_loss   {float(metrics['train_loss']):.4f} (step {trainer.global_step})"
            )
        if "val_loss" in metrics:
            lines.append(f"final val_loss     {float(metrics['val_loss']):.4f}")
        if "tokens_per_sec" in metrics:
            lines.append(f"tokens/s (last)    {float(metrics['tokens_per_sec']):,.0f}")
        dims = getattr(trainer.strategy, "parallel_dims", None)
        if dims is not None:
            lines.append(
                f"layout             dp={dims.dp} pp={dims.pp} ep={dims.ep} ({dims.world_size} ranks)"
            )
        if trainer.logger is not None and trainer.logger.log_dir:
            lines.append(f"logs               {Path(trainer.logger.log_dir).resolve()}/metrics.csv")
        if trainer.checkpoint_callback is not None and trainer.checkpoint_callback.dirpath:
            lines.append(
                f"checkpoints        {Path(trainer.checkpoint_callback.dirpath).resolve()}"
            )
        print("\n".join(lines), flush=True)


def cli_components() -> tuple[type, type]:
    return TitanLM, TitanDataModule


def main(args: list[str] | None = None) -> None:
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "export":
        from lightning_titan.export import main as export_main

        return export_main(argv[1:])
    if argv and argv[0] == "bench":
        from lightning_titan.bench import main as bench_main

        bench_main(argv[1:])  # its results dict is for Python callers, not an exit status
        return None
    TitanCLI(
        *cli_components(),
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=1234,
        save_config_kwargs={"overwrite": True},
        args=argv,
    )


if __name__ == "__main__":
    main()
