"""Sharded checkpoints for the strategy's Lightning hooks: every rank writes and reads its own shards,
nothing is gathered, and a checkpoint saved under one layout loads under any other."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch import nn
from torch.optim import Optimizer

from lightning_titan.checkpoint import files, lock
from lightning_titan.checkpoint.background import DEFAULT_TIMEOUT, BackgroundSaves
from lightning_titan.checkpoint.sharded import (
    link_sharded,
    load_sharded,
    remove_checkpoint,
    save_sharded,
)
from lightning_titan.parallel.dp.zero import NO_SHARDS, ZeroShards
from lightning_titan.runtime.agreement import agree


class ShardedCheckpoints:
    """``save``/``load`` under the layout's record; ``claim`` locks the checkpoint directories.

    ``allow_config_change``: model-config fields a resume may change deliberately, e.g.
    ``("rope_theta",)``; any other field of the saved config that differs is an error.
    ``async_save``: saves while training runs return once the state is in host memory and are
    written in the background (``checkpoint/background.py``); any other save (the one of a stopping
    job, ``trainer.save_checkpoint`` after fit) first waits for that and is written at once.
    ``timeout``: how long a wait for the background write may take, and its collectives (the
    job's ``timeout_minutes``, which bounds a synchronous save's collectives).

    One write per checkpoint event: ModelCheckpoint with ``save_top_k`` and ``save_last`` saves twice
    at one step, the top-k checkpoint then ``last``; ``last`` is then the top-k one's shard files
    under a second name (hard links, ``link_sharded``) with its own ``meta.pt``, made after that
    write without waiting for it."""

    def __init__(
        self,
        allow_config_change: tuple[str, ...] = (),
        async_save: bool = False,
        timeout: timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        self.allow_config_change = allow_config_change
        self.background = BackgroundSaves(timeout=timeout) if async_save else None
        # (path, global step) of the last checkpoint written in full in training: what a `last` of
        # the same step links to
        self._written: tuple[str, int] | None = None

    def save(
        self,
        path: str,
        checkpoint: dict[str, Any],
        module: nn.Module,
        optimizers: list[Optimizer],
        layout: dict[str, Any],
        zero_shards: ZeroShards = NO_SHARDS,
    ) -> None:
        """Collective. ``checkpoint``: Lightning's dict; its state dicts are written as shards.
        ``layout``: the degrees, schedule and zero level, a record (the state loads under any).
        ``zero_shards``: the ZeRO shards the optimizers step, if any (``save_sharded``)."""
        global_batch_size = _global_batch_size(module)
        if global_batch_size is not None:
            layout = {**layout, "global_batch_size": global_batch_size}
        meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        state = getattr(getattr(module, "_trainer", None), "state", None)
        training = state is not None and (state.fn, state.status) == (
            TrainerFn.FITTING,
            TrainerStatus.RUNNING,
        )
        background = self.background if training else None
        if background is None:
            self.wait()
        trainer: Any = getattr(module, "_trainer", None)
        source = self._same_event(str(path), trainer) if training else None
        if source is not None:
            link_sharded(
                path, source, module, optimizers, meta, layout=layout, background=background
            )
            return
        self._written = None  # until this save is in: a failed one is nothing to link to
        save_sharded(
            path,
            module,
            optimizers,
            meta,
            layout=layout,
            background=background,
            zero_shards=zero_shards,
        )
        if training:
            self._written = (str(path), trainer.global_step)

    def _same_event(self, path: str, trainer: Any) -> str | None:
        """The checkpoint written in full at this step if ``path`` is a ModelCheckpoint's ``last``
        (Lightning names it before saving), else None: ``last`` of one event links to it."""
        if self._written is None:
            return None
        source, step = self._written
        lasts = {
            c.last_model_path
            for c in getattr(trainer, "checkpoint_callbacks", [])
            if isinstance(c, ModelCheckpoint) and c.save_last
        }
        return source if step == trainer.global_step and source != path and path in lasts else None

    def wait(self) -> None:
        """Until the save in flight is complete (raising its error on every rank); no-op if none."""
        if self.background is not None:
            self.background.wait()

    def remove(self, path: str, global_rank: int) -> None:
        """Rank 0 removes the checkpoint at ``path``; after the save in flight, and only if it succeeds."""
        if self.background is not None and global_rank == 0:
            self.background.remove_after(path)
        else:
            remove_checkpoint(path)

    def load(
        self,
        path: str,
        module: nn.Module,
        optimizers: list[Optimizer],
        weights_only: bool | None,
        zero_shards: ZeroShards = NO_SHARDS,
    ) -> dict[str, Any]:
        """Collective: the module's and the optimizers' shards for this layout, and Lightning's dict."""
        self.wait()
        self._written = None  # the state changes: nothing written before holds it
        global_batch_size = _global_batch_size(module)
        expect = {} if global_batch_size is None else {"global_batch_size": global_batch_size}
        return load_sharded(
            path,
            module,
            optimizers,
            expect_layout=expect,
            weights_only=weights_only,
            allow_config_change=self.allow_config_change,
            zero_shards=zero_shards,
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


def refuse_missing_last(trainer: Any, ckpt_path: Any) -> None:
    """``ckpt_path="last"`` asks to resume: with no ``last`` checkpoint, Lightning warns and starts a
    new run. Refuse that instead when a checkpoint directory holds anything (the ``.tmp-*`` of an
    interrupted save, other checkpoints), naming what it holds. An empty or missing directory is a
    first run, which Lightning's "last" is meant to let start (the same command for every launch).

    No collective: each rank reads the same directories and raises the same error, before any rank
    joins the process group. Call it before the launch, with the ``ckpt_path`` given to fit/validate.
    """
    if ckpt_path != "last":
        return
    # directories set by the user (or titan's CLI): Lightning's default is a new version_N per run
    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    dirs = {c: Path(c.dirpath) for c in callbacks if c.dirpath}
    last = set().union(*(c._find_last_checkpoints(trainer) for c in dirs))
    on_exception = [c.ckpt_path for c in trainer.callbacks if isinstance(c, OnExceptionCheckpoint)]
    if last or any(Path(p).exists() for p in on_exception):
        return  # Lightning loads it; the load refuses one that is incomplete, naming it
    for dirpath in sorted(set(dirs.values())):
        held = sorted(dirpath.iterdir()) if dirpath.is_dir() else []
        if not held:
            continue
        complete = [p for p in held if files.is_complete_checkpoint(p)]
        newest = str(max(complete, key=files.completed_at)) if complete else None
        resume = (
            f"to resume from its newest complete checkpoint, pass ckpt_path={newest!r}"
            if newest
            else "it holds no complete checkpoint to resume from"
        )
        shown = ", ".join(files.describe(p) for p in held[:6])
        more = f" and {len(held) - 6} more" if len(held) > 6 else ""
        raise ValueError(
            f'ckpt_path="last" found no last checkpoint in {dirpath}, which holds {shown}{more}. '
            f"Lightning would start a new run instead of resuming; {resume}, or to start a new "
            "run leave ckpt_path out (the next save removes what an interrupted one left)"
        )
