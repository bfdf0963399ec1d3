"""Run folders without processes: each launch of a config gets its own ``version_N``, the ranks of a
launch (and its restarted attempts) the launcher's; ``last`` and a run folder name the newest complete
checkpoint whose checksums verify, a corrupt newer one skipped by name
(tests/cli/test_run_folders.py launches real runs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lightning_titan.checkpoint import files, runs
from lightning_titan.cli import TitanCLI, UsageError, cli_components
from lightning_titan.lightning.run_folders import (
    RESUME_ENV,
    RUN_ENV,
    decide_version,
    resolve_ckpt_path,
)
from lightning_titan.runtime.launch import RESTART_ENV
from lightning_titan.runtime.orphans import LAUNCHER_PID

ROOT = Path(__file__).resolve().parents[2]
STARTED_BY = ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID", "TORCHELASTIC_RUN_ID",
              "TORCHELASTIC_RESTART_COUNT", LAUNCHER_PID, RUN_ENV, RESUME_ENV, RESTART_ENV)  # fmt: skip


@pytest.fixture
def launching(monkeypatch):
    """This process as a user's `titan fit`: started by nothing (and what titan sets here undone)."""
    for name in STARTED_BY:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return monkeypatch


def _complete(path: Path, completed_at: float) -> Path:
    """A complete checkpoint whose marker holds its shard's checksum, finished at ``completed_at``."""
    path.mkdir(parents=True)
    (path / files.META_FILE).write_bytes(b"meta")
    (path / files.DCP_METADATA).write_bytes(b"index")
    (path / "__0_0.distcp").write_bytes(b"shard bytes")
    checksums = {"__0_0.distcp": files.checksum(path / "__0_0.distcp")}
    marker = {"completed_at": completed_at, "files": checksums}
    (path / files.MARKER).write_text(json.dumps(marker))
    return path


def _corrupt(path: Path) -> None:
    (path / "__0_0.distcp").write_bytes(b"shard bytEs")


def test_each_launch_takes_a_new_folder_and_its_ranks_the_launchers(tmp_path, launching):
    root = tmp_path / "runs" / "ep"
    assert decide_version(root) == 0 and (root / "version_0").is_dir()
    # a rank that launch starts (popen re-runs the command: it parses too) or restarts
    launching.setenv(LAUNCHER_PID, str(os.getpid()))
    assert decide_version(root) == 0  # not the next free one, 1
    launching.setenv(RESTART_ENV, "2")
    assert decide_version(root) == 0
    launching.delenv(RESTART_ENV)
    launching.delenv(LAUNCHER_PID)
    assert decide_version(root) == 1  # the next launch
    assert runs.versions(root) == [0, 1]
    # torchrun's ranks: the value this process left in the environment is not theirs; they all
    # compute the next free number, and none creates it before every rank has parsed
    launching.setenv("RANK", "1")
    launching.setenv("TORCHELASTIC_RUN_ID", "job")
    assert decide_version(root) == 2 and runs.versions(root) == [0, 1]
    launching.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # its agent restarted them: the newest
    assert decide_version(root) == 1


def test_last_and_run_folders_name_the_newest_complete_checkpoint_that_verifies(
    tmp_path, launching, capfd
):
    root = tmp_path / "runs" / "ep"
    older = _complete(root / "version_0" / "checkpoints" / "last.ckpt", completed_at=100.0)
    _complete(root / "version_0" / "checkpoints" / "epoch=0-step=2.ckpt", completed_at=90.0)
    newest = _complete(root / "version_1" / "checkpoints" / "last.ckpt", completed_at=200.0)
    (root / "version_2" / "checkpoints" / ".last.ckpt.tmp-h-1-0123456789ab").mkdir(parents=True)
    (root / "version_3").mkdir()  # a run that died before its first save
    search = runs.run_checkpoint_dirs(root)
    assert resolve_ckpt_path("last", search, root) == str(newest)
    assert runs.resolve(root) == newest and runs.resolve(root / "version_0") == older
    assert runs.resolve(root / "version_0" / "checkpoints") == older
    assert runs.resolve(newest) == newest
    assert capfd.readouterr().err == ""

    # the ranks this process starts take its choice, their checksums unread (once is enough)
    launching.setenv(LAUNCHER_PID, str(os.getpid()))
    _corrupt(newest)
    assert resolve_ckpt_path("last", search, root) == str(newest)
    launching.delenv(LAUNCHER_PID)
    assert resolve_ckpt_path("last", search, root) == str(older)
    err = capfd.readouterr().err
    assert err == (
        f"[titan] skipping corrupt checkpoint {newest} (__0_0.distcp changed after the save); "
        "trying the one before it\n"
    )
    with pytest.raises(ValueError, match=f"{root / 'version_1'} holds no complete checkpoint"):
        runs.resolve(root / "version_1")
    with pytest.raises(ValueError, match=f"{root / 'version_3'} holds no complete checkpoint"):
        runs.resolve(root / "version_3")

    # nothing to resume but what an interrupted save left: refused, naming it; nothing at all: a
    # first run, which starts and says so
    leftovers = [root / "version_2" / "checkpoints"]
    with pytest.raises(ValueError, match=r"found no complete checkpoint in .*a save of last.ckpt"):
        resolve_ckpt_path("last", leftovers, root)
    assert resolve_ckpt_path("last", [tmp_path / "none"], tmp_path / "none") is None
    assert "no checkpoint in" in capfd.readouterr().err


def _cli(*args: str) -> TitanCLI:
    config = ["--config", str(ROOT / "configs" / "ep.yaml")]
    return TitanCLI(*cli_components(), run=False, args=[*config, *args])


def test_titan_puts_each_run_of_a_config_in_its_own_folder(tmp_path, launching):
    """A CLI built to look at (no subcommand) creates nothing; its run would be the next folder."""
    launching.chdir(tmp_path)
    for n in (0, 1):
        trainer = _cli().trainer
        assert trainer.logger.version == n and not (tmp_path / "runs/ep" / f"version_{n}").exists()
        folder = tmp_path / "runs" / "ep" / f"version_{n}" / "checkpoints"
        assert trainer.checkpoint_callback.dirpath == str(folder)
        folder.mkdir(parents=True)  # as the run's first save would
    named = _cli("--trainer.logger.init_args.version=exp").trainer
    assert named.checkpoint_callback.dirpath == str(tmp_path / "runs/ep/exp/checkpoints")
    _complete(tmp_path / "runs" / "ep" / "exp" / "checkpoints" / "last.ckpt", completed_at=1.0)
    with pytest.raises(UsageError, match=r"run folder runs/ep/exp already holds a run"):
        _cli("--trainer.logger.init_args.version=exp")
    # a run folder as --ckpt_path: its newest complete checkpoint
    resolved = resolve_ckpt_path("runs/ep/exp", [], None)
    assert resolved == str(Path("runs/ep/exp/checkpoints/last.ckpt"))


def test_rank_0_says_from_which_step_a_run_resumes_or_that_a_restart_starts_over(launching):
    from types import SimpleNamespace

    from lightning_titan.lightning.run_folders import resume_line

    folder = SimpleNamespace(dirpath="runs/ep/version_2/checkpoints")
    resumed = SimpleNamespace(ckpt_path="runs/ep/version_1/checkpoints/last.ckpt", global_step=6)
    assert resume_line(resumed) == (
        "[titan] resuming from step 6 of runs/ep/version_1/checkpoints/last.ckpt"
    )
    fresh = SimpleNamespace(ckpt_path=None, global_step=0, checkpoint_callbacks=[folder])
    assert resume_line(fresh) is None  # a first launch without a checkpoint: nothing to say
    launching.setenv(RESTART_ENV, "1")
    assert resume_line(fresh) == (
        "[titan] restart 1: no complete checkpoint in runs/ep/version_2/checkpoints: "
        "starting over from step 0"
    )


def test_a_line_to_a_stream_without_a_descriptor_is_written_not_raised(monkeypatch):
    """A notebook's stderr (ipykernel's stream) has no file descriptor: the ranks' one-write lines
    ("resuming from step N ...") go through its write instead of failing the run."""
    import io
    import sys

    from lightning_titan.lightning.supervisor import say

    class NotebookStream(io.StringIO):
        def fileno(self) -> int:
            raise io.UnsupportedOperation("fileno")

    stream = NotebookStream()
    monkeypatch.setattr(sys, "stderr", stream)
    say("[titan] resuming from step 2 of last.ckpt")
    assert stream.getvalue() == "[titan] resuming from step 2 of last.ckpt\n"


def test_a_weights_and_biases_run_gets_a_run_folder_too(tmp_path, launching):
    """WandbLogger has no version folder: its save_dir becomes the run's, runs/<name>/version_N (a
    launch takes the next), where the checkpoints and the callbacks' files go as with the CSV logger
    (wandb need not be installed to place it)."""
    from jsonargparse import Namespace

    from lightning_titan.lightning.run_folders import place_run

    launching.chdir(tmp_path)

    def placed(**init_args: object) -> tuple[str, str]:
        logger = Namespace(class_path="lightning.pytorch.loggers.WandbLogger",
                           init_args=Namespace(offline=True, **init_args))  # fmt: skip
        checkpoint = Namespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint",
                               init_args=Namespace(dirpath=None))  # fmt: skip
        config = Namespace(trainer=Namespace(logger=logger, callbacks=[checkpoint]))
        place_run(config, UsageError)
        return logger.init_args.save_dir, checkpoint.init_args.dirpath

    for n in (0, 1):
        folder = Path("runs", "sweep", f"version_{n}")
        assert placed(save_dir="runs", name="sweep") == (str(folder), str(folder / "checkpoints"))
        assert (tmp_path / folder).is_dir()  # taken by this launch
    assert placed(project="titan")[0] == str(Path("titan", "version_0"))  # no name: the project
