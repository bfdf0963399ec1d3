"""A save killed at any file operation leaves ``last`` a complete, loadable checkpoint (the old one or the
new one), and the next save cleans up after it.

The checkpoint ``last`` holds version 1; a forked child saves version 2 over it and SIGKILLs itself just
before its N-th file-system operation (rename, renameat2 exchange, rmtree, unlink, fsync), for every N
until the save completes. The kill points are found by wrapping the OS calls, not by naming the steps
of the install, so they follow the code as it changes. Run with and without the atomic exchange.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from lightning_titan import ModelConfig, StageModel
from lightning_titan.checkpoint import (
    BackgroundSaves,
    is_complete_checkpoint,
    load_sharded,
    save_sharded,
)
from lightning_titan.checkpoint.devices import DeviceHooks

CONFIG = ModelConfig(
    vocab_size=17, d_model=8, n_layers=2, n_heads=2, ffn_dim=8, n_experts=2, top_k=1
)
LAYOUT = {"dp": 1, "pp": 1, "ep": 1}
NO_FENCE = DeviceHooks().record_fence()


def model_of(version: int) -> StageModel:
    model = StageModel(CONFIG)
    model.init_weights(version)
    return model


def version_in(path: Path) -> int | None:
    """Which version a complete checkpoint holds (1, 2, 3), or None if it does not load."""
    model = model_of(0)
    load_sharded(path, model, [])
    for version in (1, 2, 3):
        want = model_of(version).state_dict()
        if all(torch.equal(t, want[k]) for k, t in model.state_dict().items()):
            return version
    return None


def _counting(fn, hit):
    def wrapped(*args, **kwargs):
        hit()
        return fn(*args, **kwargs)

    return wrapped


def _patch_file_ops(kill_at: int, exchange: bool) -> None:
    """In the child: SIGKILL just before the ``kill_at``-th file operation."""
    count = [0]

    def hit():
        if count[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        count[0] += 1

    for module, name in ((os, "rename"), (os, "replace"), (os, "unlink"), (os, "remove"),
                         (os, "rmdir"), (os, "fsync"), (shutil, "rmtree")):  # fmt: skip
        setattr(module, name, _counting(getattr(module, name), hit))
    real_cdll = ctypes.CDLL

    def no_exchange(*args):
        ctypes.set_errno(errno.EINVAL)  # as on a filesystem without RENAME_EXCHANGE
        return -1

    class Lib:
        def __init__(self, *args, **kwargs):
            self._lib = real_cdll(*args, **kwargs)

        def __getattr__(self, name):
            fn = getattr(self._lib, name)
            if name == "renameat2":
                return _counting(fn if exchange else no_exchange, hit)
            return fn

    ctypes.CDLL = Lib


def _save_killed_at(path: Path, kill_at: int, exchange: bool, background: bool) -> bool:
    """Fork a child that saves version 2 to ``path`` and dies at operation ``kill_at``; True if the
    save completed first (``kill_at`` is past the last operation). ``background``: the child's save
    is written by the background thread (which then meets the kill) while its main thread waits."""
    model = model_of(2)
    pid = os.fork()
    if pid == 0:
        try:
            _patch_file_ops(kill_at, exchange)
            saves = BackgroundSaves() if background else None
            save_sharded(path, model, [], {"version": 2}, layout=LAYOUT, background=saves)
            if saves is not None:
                saves.wait()
            os._exit(0)
        except BaseException:  # noqa: BLE001 - the child must never return into pytest
            os._exit(1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the save killed at operation {kill_at} hung")
        time.sleep(0.01)
    status = done[1]
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 or os.WIFSIGNALED(status), status
    return os.WIFEXITED(status)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "exchange,background",
    [(True, False), (False, False), (True, True)],
    ids=["exchange", "rename_aside", "exchange_background"],
)
def test_a_save_killed_at_any_file_operation_leaves_a_complete_last(tmp_path, exchange, background):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # nothing in a thread pool when the child forks
    try:
        _kill_at_every_point(tmp_path, exchange, background)
    finally:
        torch.set_num_threads(threads)


def _kill_at_every_point(tmp_path: Path, exchange: bool, background: bool) -> None:
    last = tmp_path / "ckpt" / "last.ckpt"
    points = []
    for kill_at in range(200):
        shutil.rmtree(tmp_path / "ckpt", ignore_errors=True)
        save_sharded(last, model_of(1), [], {"version": 1}, layout=LAYOUT)
        completed = _save_killed_at(last, kill_at, exchange, background)
        where = (
            f"killed before file operation {kill_at} ({'exchange' if exchange else 'rename aside'})"
        )
        if is_complete_checkpoint(last):
            points.append(version_in(last))
            assert points[-1] in ((2,) if completed else (1, 2)), f"{where}: holds {points[-1]}"
        else:
            # with the exchange `last` is never missing: the old complete one or the new complete one
            assert not exchange and not completed, f"{where}: `last` is not a complete checkpoint"
            # without it, `last` may be missing for a moment while the old version is set aside
            aside = [p for p in last.parent.glob(f".{last.name}.*") if is_complete_checkpoint(p)]
            assert any(version_in(p) in (1, 2) for p in aside), f"{where}: nothing complete"
        # the next save recovers from whatever the killed one left
        save_sharded(last, model_of(3), [], {"version": 3}, layout=LAYOUT)
        assert version_in(last) == 3, where
        assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"], where
        if completed:
            break
    else:
        pytest.fail("the save never completed")
    if exchange:
        # the kill points spanned the install: before it `last` was version 1, after it version 2
        assert points[0] == 1 and points[-1] == 2, points


def test_a_background_save_removes_older_checkpoints_only_once_it_succeeded(tmp_path):
    """ModelCheckpoint's top-k drops the older checkpoint while the newer is still being written:
    the removal waits for the write, and is dropped when the write fails (nothing fewer than before).
    The next save waits for the one in flight and raises its error."""
    old = tmp_path / "old.ckpt"
    save_sharded(old, model_of(1), [], {}, layout=LAYOUT)
    release, saves = threading.Event(), BackgroundSaves()

    def slow_write() -> None:
        assert release.wait(30)

    saves.start(slow_write, NO_FENCE)
    assert saves.in_flight
    saves.remove_after(old)
    assert is_complete_checkpoint(old)  # the newer one is not complete yet
    release.set()
    saves.wait()
    assert not old.exists() and not saves.in_flight

    save_sharded(old, model_of(1), [], {}, layout=LAYOUT)
    release.clear()

    def failing_write() -> None:
        assert release.wait(30)
        raise OSError(28, "No space left on device")

    saves.start(failing_write, NO_FENCE)
    saves.remove_after(old)
    release.set()
    with pytest.raises(OSError, match="No space left"):
        save_sharded(tmp_path / "next.ckpt", model_of(2), [], {}, layout=LAYOUT, background=saves)
    assert is_complete_checkpoint(old) and not (tmp_path / "next.ckpt").exists()
    saves.wait()  # the error was raised once
