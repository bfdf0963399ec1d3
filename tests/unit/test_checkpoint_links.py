"""`last` of a checkpoint event is the top-k checkpoint's shards under a second name: hard links
with a meta.pt of their own, made after the top-k write without waiting for it; only
ModelCheckpoint's `last` of the same step is linked, anything else is written."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import SimpleNamespace

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_titan import ModelConfig, StageModel
from lightning_titan.checkpoint import (
    BackgroundSaves,
    files,
    is_complete_checkpoint,
    latest_complete,
    load_sharded,
    read_checkpoint_info,
    save_sharded,
)
from lightning_titan.checkpoint.devices import DeviceHooks
from lightning_titan.checkpoint.sharded import link_sharded
from lightning_titan.lightning.checkpoint_hooks import ShardedCheckpoints

CONFIG = ModelConfig(
    vocab_size=17, d_model=8, n_layers=2, n_heads=2, ffn_dim=8, n_experts=2, top_k=1
)
LAYOUT = {"dp": 1, "pp": 1, "ep": 1}


def model_of(version: int) -> StageModel:
    model = StageModel(CONFIG)
    model.init_weights(version)
    return model


def holds(path: Path, version: int) -> bool:
    model = model_of(0)
    load_sharded(path, model, [])  # checks every file against the marker's checksums
    want = model_of(version).state_dict()
    return all(torch.equal(t, want[k]) for k, t in model.state_dict().items())


class _Gate:
    def __init__(self, open_: threading.Event) -> None:
        self.open = open_

    def synchronize(self) -> None:
        assert self.open.wait(30)


class GatedHooks(DeviceHooks):
    """The writer's fence passes only once the test opens it: the write stays in flight."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def record_fence(self) -> _Gate:
        return _Gate(self.open)


def test_last_is_linked_after_the_write_in_flight_without_waiting_for_it(tmp_path):
    hooks = GatedHooks()
    saves = BackgroundSaves(hooks)
    topk, last = tmp_path / "step=4.ckpt", tmp_path / "last.ckpt"
    save_sharded(last, model_of(1), [], {"step": 2}, layout=LAYOUT)  # the previous event's
    save_sharded(topk, model_of(2), [], {"step": 4}, layout=LAYOUT, background=saves)
    link_sharded(
        last, topk, model_of(2), [], {"step": 4, "last": True}, layout=LAYOUT, background=saves
    )
    assert saves.in_flight and not topk.exists() and holds(last, 1)  # returned before either
    hooks.open.set()
    saves.wait()
    assert is_complete_checkpoint(topk) and is_complete_checkpoint(last)
    assert read_checkpoint_info(last)["meta"] == {"step": 4, "last": True}
    assert read_checkpoint_info(topk)["meta"] == {"step": 4}
    shards = [n for n in os.listdir(last) if n.endswith(".distcp")] + [files.DCP_METADATA]
    assert all(os.stat(last / n).st_ino == os.stat(topk / n).st_ino for n in shards)
    assert latest_complete(tmp_path) == last  # the newest complete one, for restarts
    files.remove(topk)  # top-k drops it later: `last` keeps the shards
    assert holds(last, 2)


def test_only_modelcheckpoints_last_of_the_same_step_is_linked(tmp_path):
    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    last = str(tmp_path / "last.ckpt")
    callback.last_model_path = last  # Lightning names it before saving it
    trainer = SimpleNamespace(global_step=4, checkpoint_callbacks=[callback])
    checkpoints = ShardedCheckpoints()
    checkpoints._written = (str(tmp_path / "step=4.ckpt"), 4)
    assert checkpoints._same_event(last, trainer) == str(tmp_path / "step=4.ckpt")
    assert checkpoints._same_event(str(tmp_path / "other.ckpt"), trainer) is None
    assert (
        checkpoints._same_event(last, SimpleNamespace(**{**vars(trainer), "global_step": 5}))
        is None
    )
    callback.save_last = False
    assert checkpoints._same_event(last, trainer) is None


def test_a_job_after_a_failed_save_is_dropped_and_the_failure_raised(tmp_path):
    """A `last` queued after its top-k write failed is dropped, whether the failure had ended on
    this rank or not (every rank then skips the link's collective), and ``wait`` raises it."""
    saves, ran = BackgroundSaves(), []

    def failing_write() -> None:
        raise OSError(28, "No space left on device")

    saves.start(failing_write, DeviceHooks().record_fence())
    saves._done.wait(30)  # ended, its error not raised yet
    saves.then(lambda: ran.append("link"))
    assert ran == []
    try:
        saves.wait()
    except OSError as e:
        assert "No space left" in str(e)
    else:
        raise AssertionError("the failed save's error was not raised")


def test_a_failed_job_does_not_stop_the_next(tmp_path):
    """Rank 0's removal that fails must not keep it from the link every rank runs after it."""
    saves, ran, release = BackgroundSaves(), [], threading.Event()
    saves.start(lambda: release.wait(30) and None, DeviceHooks().record_fence())

    def failing_removal() -> None:
        raise PermissionError("cannot remove")

    saves.then(failing_removal)
    saves.then(lambda: ran.append("link"))
    release.set()
    try:
        saves.wait()
    except PermissionError:
        pass
    else:
        raise AssertionError("the removal's error was not raised")
    assert ran == ["link"]
