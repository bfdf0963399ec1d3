"""A restarted rank's launch, without processes: which checkpoint it resumes, and that the metrics of
the earlier launches stay on disk (tests/distributed/test_reliability.py restarts real jobs)."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_titan.checkpoint.files import DCP_METADATA, MARKER, META_FILE
from lightning_titan.lightning.restarts import keep_logger_versions, resumed_call
from lightning_titan.runtime.launch import RESTART_ENV


def _complete(path: Path, completed_at: float) -> Path:
    """The files that make ``path`` a complete checkpoint, its save finished at ``completed_at``."""
    path.mkdir(parents=True)
    (path / META_FILE).write_bytes(b"")
    (path / DCP_METADATA).write_bytes(b"")
    (path / MARKER).write_text(json.dumps({"completed_at": completed_at}))
    return path


def _fit(model=None, datamodule=None, ckpt_path=None):  # the parameters of Trainer._fit_impl
    pass


@pytest.mark.parametrize("restarts", ["0", "1"])
def test_a_restart_resumes_the_newest_complete_checkpoint_whatever_ckpt_path_was_given(
    tmp_path, monkeypatch, restarts
):
    """Two complete checkpoints in the run's folder and an older one given as ``ckpt_path``: the
    first launch begins at the given one, a restart at the newer of the folder's (the save's finish
    time decides, not the name; a partial save is never taken). Nothing saved yet: the given one."""
    monkeypatch.setenv(RESTART_ENV, restarts)
    given = _complete(tmp_path / "elsewhere" / "step=2.ckpt", completed_at=100.0)
    ckpt = tmp_path / "ckpt"
    _complete(ckpt / "epoch=0-step=6.ckpt", completed_at=300.0)
    newest = _complete(ckpt / "epoch=0-step=4-v1.ckpt", completed_at=400.0)  # a later save
    (ckpt / "epoch=0-step=8.ckpt").mkdir()  # died in its write: no marker
    trainer = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(ckpt))])
    for args, kwargs in [((), {"ckpt_path": str(given)}), (("model", "data", str(given)), {})]:
        args, kwargs = resumed_call(_fit, args, kwargs, trainer)
        called = dict(zip(("model", "datamodule", "ckpt_path"), args, strict=False), **kwargs)
        assert called["ckpt_path"] == str(given if restarts == "0" else newest), called
    _, kwargs = resumed_call(_fit, (), {}, trainer)
    assert kwargs.get("ckpt_path") == (None if restarts == "0" else str(newest)), kwargs

    empty = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(tmp_path / "new"))])
    _, kwargs = resumed_call(_fit, (), {"ckpt_path": str(given)}, empty)
    assert kwargs["ckpt_path"] == str(given)  # died before its first save: where it began
    _, kwargs = resumed_call(_fit, (), {"ckpt_path": "last"}, empty)
    assert kwargs["ckpt_path"] == "last"  # Lightning's name, left to Lightning (and refused there)
    newer_given = _complete(tmp_path / "elsewhere" / "step=9.ckpt", completed_at=500.0)
    _, kwargs = resumed_call(_fit, (), {"ckpt_path": str(newer_given)}, trainer)
    assert kwargs["ckpt_path"] == str(newer_given)  # the folder's are older: another job's


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_restarted_launch_appends_to_the_metrics_of_the_earlier_ones(tmp_path, monkeypatch):
    """The first launch's CSV rows are on disk; the restarted launch's logger must leave them there
    from its creation on (its rank may die again before its first flush) and append its own rows
    after them, also when they bring a new column."""
    first = CSVLogger(tmp_path, name="run")
    first.log_metrics({"train_loss": 2.0}, step=0)
    first.log_metrics({"train_loss": 1.5}, step=1)
    first.save()
    metrics = Path(first.log_dir) / "metrics.csv"
    before = _rows(metrics)
    assert [r["step"] for r in before] == ["0", "1"]

    monkeypatch.setenv(RESTART_ENV, "1")
    monkeypatch.setenv("TITAN_LOGGER_VERSIONS", "0")
    again = CSVLogger(tmp_path, name="run")
    keep_logger_versions(SimpleNamespace(loggers=[again], global_rank=0))
    assert again.log_dir == first.log_dir
    writer = again.experiment  # what the Trainer creates first; the rank may die right after
    assert _rows(metrics) == before, "the earlier launch's metrics are gone from disk"
    assert writer.metrics == []  # none held in memory only
    again.log_metrics({"train_loss": 1.2}, step=1)
    again.save()
    again.log_metrics({"train_loss": 1.0, "lr": 0.1}, step=2)
    again.save()
    rows = _rows(metrics)
    assert [(r["step"], r["train_loss"]) for r in rows] == [
        ("0", "2.0"),
        ("1", "1.5"),
        ("1", "1.2"),
        ("2", "1.0"),
    ], rows
    assert rows[-1]["lr"] == "0.1"


def test_a_restart_skips_a_corrupt_newest_checkpoint_naming_it(tmp_path, monkeypatch, capfd):
    """A newest checkpoint whose shard fails its checksum would fail every attempt the same way: the
    restart resumes the newest one that verifies, rank 0 naming the one it skipped."""
    from lightning_titan.checkpoint.files import checksum

    def saved(path: Path, completed_at: float) -> Path:
        _complete(path, completed_at)
        (path / "__0_0.distcp").write_bytes(b"shard")
        files = {"__0_0.distcp": checksum(path / "__0_0.distcp")}
        (path / MARKER).write_text(json.dumps({"completed_at": completed_at, "files": files}))
        return path

    monkeypatch.setenv(RESTART_ENV, "1")
    ckpt = tmp_path / "ckpt"
    older = saved(ckpt / "epoch=0-step=2.ckpt", 100.0)
    newest = saved(ckpt / "last.ckpt", 200.0)
    (newest / "__0_0.distcp").write_bytes(b"shArd")
    trainer = SimpleNamespace(
        checkpoint_callbacks=[SimpleNamespace(dirpath=str(ckpt))], global_rank=0
    )
    _, kwargs = resumed_call(_fit, (), {"ckpt_path": str(newest)}, trainer)
    assert kwargs["ckpt_path"] == str(older)
    assert f"[titan] skipping corrupt checkpoint {newest}" in capfd.readouterr().err


# a rank of the fake job below: attempt 0 rank 1 stops itself, rank 0 (its peer, stalled) deletes
# the checkpoint folder and fails; attempt 1 ends clean
_RANK = """
import os, shutil, signal, sys, time
rank, attempt = os.environ["LOCAL_RANK"], os.environ["TITAN_RESTART_COUNT"]
if attempt == "0" and rank == "1":
    os.kill(os.getpid(), signal.SIGSTOP)
if attempt == "0":
    time.sleep(1.0)
    shutil.rmtree(sys.argv[1])
    sys.exit(1)
"""


@pytest.mark.timeout(60)
def test_a_restart_names_a_stopped_rank_and_says_what_it_resumes(tmp_path, monkeypatch, capfd):
    """Rank 1 stopped (SIGSTOP) stalls rank 0, which fails first: the launcher names the stopped
    rank as the cause, not rank 0's exit. Between the attempts the checkpoint folder is deleted:
    the restart line says it starts over from step 0 and why, not "from the newest complete
    checkpoint". With a complete checkpoint it names that one."""
    from contextlib import nullcontext

    from lightning.pytorch.strategies.launchers import subprocess_script

    from lightning_titan.lightning.restarts import RestartingLauncher, restart_line

    ckpt = tmp_path / "ckpt"
    saved = _complete(ckpt / "last.ckpt", completed_at=1.0)
    command = [sys.executable, "-I", "-c", _RANK, str(ckpt)]
    monkeypatch.setattr(subprocess_script, "_basic_subprocess_cmd", lambda: command)
    env = SimpleNamespace(main_address="127.0.0.1", main_port=1)
    launcher = RestartingLauncher(lambda *a: None, nullcontext, env, 2, 1, grace_s=0.5)
    trainer = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(ckpt))], loggers=[])
    assert launcher.launch(_fit, trainer=trainer, ckpt_path=None) is None
    err = capfd.readouterr().err
    assert re.search(
        r"\[titan\] rank 1 \(pid \d+\) is stopped \(SIGSTOP\) and stalled the job: restarting "
        rf"every rank \(1 of 1\) over from step 0: no complete checkpoint in {re.escape(str(ckpt))}",
        err,
    ), err
    trainer_with = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(ckpt))])
    saved = _complete(ckpt / "last.ckpt", completed_at=1.0)
    line = restart_line(1, "was killed by SIGKILL", 0, 2, saved, trainer_with)
    assert line == (
        f"[titan] rank 1 was killed by SIGKILL: restarting every rank (1 of 2) from {saved}"
    )


# attempt 0: rank 1 stops itself, rank 0 waits for it for good (a SIGTERM cannot be agreed on)
_STALLED = """
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.environ["LOCAL_RANK"] == "1":
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_sigterm_to_a_restarting_launcher_with_a_stopped_rank_exits_143_within_the_grace(
    tmp_path, monkeypatch
):
    """A SIGTERM while a stopped rank stalls the job: no restart, every rank gone (the stopped
    one and the one waiting for it killed after grace_s), exit 143; and a restart after the
    checkpoint folder was deleted resumes nothing (the rank starts over), whatever it had."""
    import signal
    import threading
    import time
    from contextlib import nullcontext

    from lightning.pytorch.strategies.launchers import subprocess_script

    from lightning_titan.lightning.restarts import RestartingLauncher

    command = [sys.executable, "-I", "-c", _STALLED]
    monkeypatch.setattr(subprocess_script, "_basic_subprocess_cmd", lambda: command)
    env = SimpleNamespace(main_address="127.0.0.1", main_port=1)
    launcher = RestartingLauncher(lambda *a: None, nullcontext, env, 2, 1, grace_s=1.0)
    trainer = SimpleNamespace(checkpoint_callbacks=[], loggers=[])
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    start = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        launcher.launch(_fit, trainer=trainer)
    assert stopped.value.code == 143
    assert time.monotonic() - start < 1.5 + 1.0 + 2.0
    assert all(p.poll() is not None for p in launcher.procs)

    ckpt = tmp_path / "ckpt"
    _complete(ckpt / "last.ckpt", completed_at=1.0)
    shutil.rmtree(ckpt)  # between the attempts
    monkeypatch.setenv(RESTART_ENV, "1")
    folder = SimpleNamespace(checkpoint_callbacks=[SimpleNamespace(dirpath=str(ckpt))])
    assert resumed_call(_fit, (), {}, folder)[1].get("ckpt_path") is None
