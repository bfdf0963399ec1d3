"""What Lightning needs from a strategy whose every rank holds its own shard of the model and of the
optimizer state: the ranks' bookkeeping (as DDPStrategy keeps it), no full state dict gathered for a
checkpoint (each rank writes and reads its own shards), and the reductions Lightning's loops ask for.
TitanStrategy (``strategy.py``) builds the layout, the step and the checkpoints on top of it."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_titan.checkpoint.background import DEFAULT_TIMEOUT
from lightning_titan.lightning import supervisor
from lightning_titan.lightning.checkpoint_hooks import ShardedCheckpoints
from lightning_titan.parallel.dp.zero import NO_SHARDS, ZeroShards
from lightning_titan.parallel.mesh import check_launched_world


class ShardedStrategy(ParallelStrategy):
    """A process per device, each holding its own shards, which every rank writes and reads itself
    (``ShardedCheckpoints``); the subclass says which layout a checkpoint records.

    ``allow_config_change``: model-config fields a resume may change (others must match the saved).
    ``async_save``: write the checkpoints saved during training in the background.
    ``save_timeout``: the bound of a wait for that write and of its collectives (the subclass's
    collective timeout).

    ``zero_shards``: the ZeRO shards this rank's optimizers step in place of whole parameters, which
    the checkpoints key by the parameters' global names. Empty until a subclass shards its optimizers
    and sets it; it stays with them (a save after ``fit`` still needs it)."""

    def __init__(
        self,
        allow_config_change: list[str] | None = None,
        async_save: bool = False,
        save_timeout: timedelta = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._num_nodes = 1
        allowed = tuple(allow_config_change or ())
        self.checkpoints = ShardedCheckpoints(allowed, async_save, save_timeout)
        self.zero_shards: ZeroShards = NO_SHARDS

    def checkpoint_layout(self) -> dict[str, Any]:
        """The layout a checkpoint records (it loads under any)."""
        raise NotImplementedError

    @property
    def module(self) -> pl.LightningModule:
        """The LightningModule being run (Lightning connects it before any hook here runs)."""
        if self.lightning_module is None:
            raise RuntimeError(f"{type(self).__name__} has no LightningModule: pass one to fit()")
        return self.lightning_module

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None  # set by the accelerator connector
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        # the accelerator connector reads this: without it sync_dist and the sampler are silently off
        return True

    def set_world_ranks(self) -> None:
        """Runs when the Trainer is built: check the world the launcher started against the devices."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
            check_launched_world(self.cluster_environment, self.num_processes, self.num_nodes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any | None = "mean") -> Any:
        if not isinstance(tensor, Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op)

    # -- checkpoints: the shards are the state; Lightning's dict carries the rest --------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the stage-local model and the optimizer must exist to load into

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already loaded it, resharded for this layout

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the shards are written by save_checkpoint; no full copy is gathered

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # done in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass  # done in load_checkpoint

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__} takes no storage_options (it writes DCP shards)"
            )
        path, layout = self.broadcast(str(filepath)), self.checkpoint_layout()
        optimizers, shards = self.optimizers, self.zero_shards
        with self.whole_params():
            self.checkpoints.save(path, checkpoint, self.module, optimizers, layout, shards)

    @override
    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        optimizers, shards = self.optimizers, self.zero_shards
        with self.whole_params():
            return self.checkpoints.load(path, self.module, optimizers, weights_only, shards)

    def whole_params(self) -> AbstractContextManager[None]:
        """Every parameter whole inside, for a save or a load (a subclass whose parameters are
        sharded between steps, zero=3, gathers them)."""
        return nullcontext()

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoints.remove(filepath, self.global_rank)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self.checkpoints.claim(self.module.trainer, self.global_rank)

    @override
    def teardown(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        failed = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        try:  # a failed run completes a healthy save in flight too (the failure watch bounds this)
            self.checkpoints.wait()
        except Exception:
            if not failed:
                raise  # else the failure that stopped the run is the one to report
        finally:
            supervisor.stop_watching()  # the peers' exits from here on are no deaths
            super().teardown()
