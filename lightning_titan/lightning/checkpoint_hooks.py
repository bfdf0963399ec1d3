"""Sharded checkpoints for the strategy's Lightning hooks: every rank writes and reads its own shards,
nothing is gathered, and a checkpoint saved under one layout loads under any other."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim import Optimizer

from lightning_titan.checkpoint import lock
from lightning_titan.checkpoint.sharded import load_sharded, save_sharded
from lightning_titan.runtime.agreement import agree


class ShardedCheckpoints:
    """``save``/``load`` under the layout's record; ``claim`` locks the checkpoint directories.

    ``allow_config_change``: model-config fields a resume may change deliberately, e.g.
    ``("rope_theta",)``; any other field of the saved config that differs is an error."""

    def __init__(self, allow_config_change: tuple[str, ...] = ()) -> None:
        self.allow_config_change = allow_config_change

    def save(
        self,
        path: str,
        checkpoint: dict[str, Any],
        module: nn.Module,
        optimizers: list[Optimizer],
        layout: dict[str, Any],
    ) -> None:
        """Collective. ``checkpoint``: Lightning's dict; its state dicts are written as shards.
        ``layout``: the degrees, schedule and zero level, a record (the state loads under any)."""
        global_batch_size = _global_batch_size(module)
        if global_batch_size is not None:
            layout = {**layout, "global_batch_size": global_batch_size}
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_sharded(path, module, optimizers, meta, layout=layout)

    def load(
        self,
        path: str,
        module: nn.Module,
        optimizers: list[Optimizer],
        weights_only: bool | None,
    ) -> dict[str, Any]:
        """Collective: the module's and the optimizers' shards for this layout, and Lightning's dict."""
        global_batch_size = _global_batch_size(module)
        expect = {} if global_batch_size is None else {"global_batch_size": global_batch_size}
        return load_sharded(
            path,
            module,
            optimizers,
            expect_layout=expect,
            weights_only=weights_only,
            allow_config_change=self.allow_config_change,
        )

    @staticmethod
    def claim(trainer: Any, global_rank: int) -> None:
        """Collective: global rank 0 locks every ModelCheckpoint directory for this job's life, so a
        second job on one of them is refused at setup, not at its first save (which also locks)."""
        error = None
        if global_rank == 0:
            try:
                for callback in trainer.checkpoint_callbacks:
                    if getattr(callback, "dirpath", None):
                        lock.acquire(callback.dirpath)
            except Exception as e:  # noqa: BLE001 - every rank raises it
                error = e
        agree(error)


def _global_batch_size(module: nn.Module) -> int | None:
    """The data module's global batch, recorded in a checkpoint and checked on resume."""
    datamodule = getattr(getattr(module, "trainer", None), "datamodule", None)
    return getattr(datamodule, "global_batch_size", None)
