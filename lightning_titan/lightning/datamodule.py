"""TitanDataModule: the data pipeline (``data/pipeline.py``) as a LightningDataModule.

    data:                     # in a titan config: the default corpus, no network
      global_batch_size: 8    # seq_len is the model's (titan links data.seq_len to it)

What Lightning adds is read off the Trainer: the data rank and world (TitanStrategy's: every stage of
one pipeline reads the same shard), the training position (the fit loop's count of batches, which
Lightning restores on resume; the train loader carries it too, ``data/loader.py``) and the
hyper-parameters it logs and checkpoints.
"""

from __future__ import annotations

import lightning.pytorch as L

from lightning_titan.data.pipeline import DataPipeline


class TitanDataModule(DataPipeline, L.LightningDataModule):
    __doc__ = DataPipeline.__doc__  # the arguments: the CLI's help and the reference read them here

    def __init__(
        self,
        seq_len: int = 64,
        global_batch_size: int = 8,
        source: str | list[str] | None = None,
        text_column: str = "text",
        source_config: str | None = None,
        source_split: str = "train",
        tokenizer: str = "auto",
        seed: int = 0,
        val_fraction: float = 0.01,
        streaming: bool = False,
        shuffle_buffer: int = 1000,
        steps_per_epoch: int | None = None,
        val_batches: int = 4,
        max_bytes: int | None = None,
        num_workers: int = 0,
        num_proc: int | None = None,
        cache_dir: str | None = None,
        format: str = "auto",
        train_on: str = "responses",
        pack: bool | None = None,
    ) -> None:
        # the signature is written out (not **kwargs): LightningCLI and the reference read it
        super().__init__(
            seq_len=seq_len,
            global_batch_size=global_batch_size,
            source=source,
            text_column=text_column,
            source_config=source_config,
            source_split=source_split,
            tokenizer=tokenizer,
            seed=seed,
            val_fraction=val_fraction,
            streaming=streaming,
            shuffle_buffer=shuffle_buffer,
            steps_per_epoch=steps_per_epoch,
            val_batches=val_batches,
            max_bytes=max_bytes,
            num_workers=num_workers,
            num_proc=num_proc,
            cache_dir=cache_dir,
            format=format,
            train_on=train_on,
            pack=pack,
        )
        # `seed` is left out: TitanLM has a `seed` hparam too, and Lightning refuses to log two different
        # values under one key (the data seed is in this module's state_dict in every checkpoint instead)
        self.save_hyperparameters(ignore=["seed"])

    def _unbound_layout(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        try:  # TitanStrategy: every stage of one pipeline reads the same shard
            dims = self.trainer.strategy.parallel_dims  # type: ignore[attr-defined]
            return dims.data_rank, dims.data_world
        except (AttributeError, RuntimeError):
            return self.trainer.global_rank, self.trainer.world_size

    def setup(self, stage: str | None = None) -> None:
        trainer = self.trainer
        if self.streaming and stage == "fit" and trainer is not None:
            if trainer.max_steps == -1 and not self.steps_per_epoch:
                raise ValueError(
                    "streaming=True with steps_per_epoch=None is an endless stream and the Trainer has "
                    "no max_steps: set trainer max_steps, or data steps_per_epoch (batches per epoch)"
                )
        super().setup(stage)

    def _consumed(self) -> int:
        # under fit, read off the loop state Lightning itself restores on resume (its count of batches
        # over every epoch), so prefetched batches do not count and Lightning's epoch rule does not
        # matter: a run that reached max_steps closed its epoch, and a longer one resumed from it goes
        # on with the same data epoch
        trainer = self.trainer
        if trainer is not None and trainer.state.fn == "fit":
            return int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)
        return super()._consumed()
