"""The strategy's Lightning checkpoint hooks: every rank writes its own shards, nothing is gathered.

A mixin of ``TitanStrategy`` (it needs ``parallel_dims``, ``options``, ``broadcast``,
``lightning_module`` and ``optimizers``), so that the strategy module stays Lightning glue.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from lightning_titan.checkpoint import lock
from lightning_titan.checkpoint.sharded import load_sharded, remove_checkpoint, save_sharded
from lightning_titan.runtime.agreement import agree


class ShardedCheckpointHooks:
    # Config fields a resume may change deliberately, e.g. ("rope_theta",); any other field of the
    # saved model config that differs from the model's is an error (``load_sharded``).
    allow_config_change: tuple[str, ...] = ()

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage-local model and the optimizer must exist to load into

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already loaded it, resharded for this layout

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the shards are written by save_checkpoint; no full copy is gathered

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    def _global_batch_size(self: Any) -> int | None:
        datamodule = getattr(self.lightning_module.trainer, "datamodule", None)
        return getattr(datamodule, "global_batch_size", None)

    def save_checkpoint(
        self: Any, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                "TitanStrategy.save_checkpoint does not take storage_options (it writes DCP shards)"
            )
        dims = self.parallel_dims
        o = self.options  # the zero level is a record only: the state loads under any other
        layout = {
            "dp": dims.dp,
            "pp": dims.pp,
            "ep": dims.ep,
            "tp": dims.tp,
            "cp": dims.cp,
            "schedule": o.schedule,
            "zero": o.zero,
        }
        if self._global_batch_size() is not None:
            layout["global_batch_size"] = self._global_batch_size()
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        path = self.broadcast(str(filepath))
        save_sharded(path, self.lightning_module, self.optimizers, meta, layout=layout)

    def load_checkpoint(
        self: Any, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        batch = self._global_batch_size()
        expect = {} if batch is None else {"global_batch_size": batch}
        return load_sharded(
            path, self.lightning_module, self.optimizers, expect_layout=expect,
            weights_only=weights_only, allow_config_change=self.allow_config_change,
        )  # fmt: skip

    def on_train_start(self: Any) -> None:
        super().on_train_start()  # type: ignore[misc]
        self.claim_checkpoint_dirs(self.lightning_module.trainer)

    def claim_checkpoint_dirs(self: Any, trainer: Any) -> None:
        """Collective: global rank 0 locks every ModelCheckpoint directory for this job's life, so a
        second job on one of them is refused at setup, not at its first save (which also locks)."""
        error = None
        if self.global_rank == 0:
            try:
                for callback in trainer.checkpoint_callbacks:
                    if getattr(callback, "dirpath", None):
                        lock.acquire(callback.dirpath)
            except Exception as e:  # noqa: BLE001 - every rank raises it
                error = e
        agree(error)

    def remove_checkpoint(self, filepath: Any) -> None:
        remove_checkpoint(filepath)
