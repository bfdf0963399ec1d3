"""A wait for a background save is bounded as a synchronous save's collectives are: by the job's
``timeout_minutes``. ``wait`` raises TimeoutError after it, and the writer's gloo group times out
after it too (a group made without a timeout waits torch's 30 minutes). The job-level case, a rank
stopped during the write, is in tests/distributed/test_reliability.py."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_titan.checkpoint import BackgroundSaves
from lightning_titan.lightning.checkpoint_hooks import ShardedCheckpoints
from lightning_titan.lightning.strategy import TitanStrategy


def test_a_wait_for_a_stuck_write_raises_after_the_timeout_and_the_write_still_counts():
    saves = BackgroundSaves(timeout=timedelta(seconds=0.3))
    release, wrote = threading.Event(), threading.Event()

    def write() -> None:  # a writer held, as by a peer stopped inside a collective
        assert release.wait(30)
        wrote.set()

    class Done:
        def synchronize(self) -> None:
            pass

    saves.start(write, Done())
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out: not done within timeout_minutes=0\.005;"):
        saves.wait()
    assert 0.3 <= time.monotonic() - start < 5
    assert saves.in_flight  # the write goes on
    start = time.monotonic()
    with pytest.raises(TimeoutError):  # a second wait (the failure's teardown) adds no timeout
        saves.wait()
    assert time.monotonic() - start < 0.2
    release.set()
    deadline = time.monotonic() + 10
    while True:  # a wait once the write ended returns (its end is seen a moment after `release`)
        try:
            saves.wait()
            break
        except TimeoutError:
            assert time.monotonic() < deadline, "the released write never ended"
            time.sleep(0.01)
    assert wrote.is_set() and not saves.in_flight
    release.clear()  # the next write gets the whole timeout again
    saves.start(write, Done())
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        saves.wait()
    assert time.monotonic() - start >= 0.3
    release.set()


def test_the_timeout_reaches_the_background_saves_from_the_strategy_and_is_checked():
    strategy = TitanStrategy(async_save=True, timeout_minutes=0.5)
    assert strategy.checkpoints.background is not None
    assert strategy.checkpoints.background.timeout == timedelta(seconds=30)
    with pytest.raises(ValueError, match="must be > 0"):
        BackgroundSaves(timeout=timedelta(0))
    assert ShardedCheckpoints(async_save=False).background is None


def test_the_writer_group_times_out_after_the_timeout(tmp_path):
    """Its collectives (DCP's gathers, the checksum agreement) wait ``timeout`` for a stopped peer."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        saves = BackgroundSaves(timeout=timedelta(seconds=7))
        group = saves.group()
        assert group is not None
        assert group._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=7)
    finally:
        dist.destroy_process_group()
