"""Two runs of one config land in two run folders, the second resuming the first's newest complete
checkpoint through ``--ckpt_path last`` with no warning about the folder or the loader; a run folder
or a config's runs is a checkpoint for ``titan export`` and ``titan generate``, which skip a corrupt
newest checkpoint, naming it (the unit tests: tests/unit/test_run_versions.py)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WARNINGS = ("exists and is not empty", "not resumable", "The dirpath has changed")


def titan(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(cwd / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("TITAN_RUN_VERSION", None)
    cmd = [sys.executable, "-m", "lightning_titan", *args]
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, f"{args[:3]}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def steps(metrics: Path) -> list[int]:
    return sorted({int(r["step"]) for r in csv.DictReader(open(metrics)) if r.get("train_loss")})


@pytest.mark.slow  # two 2-rank launches (popen: each rank parses the command line) and two tools
@pytest.mark.timeout(600)
def test_two_runs_of_a_config_get_two_folders_and_last_is_the_newest(tmp_path: Path) -> None:
    fit = ["fit", "--config", str(ROOT / "configs" / "ep.yaml"), "--trainer.limit_val_batches=0",
           "--trainer.enable_progress_bar=false", "--ckpt_path", "last"]  # fmt: skip
    first = titan(tmp_path, *fit, "--trainer.max_steps=2")
    runs = tmp_path / "runs" / "ep"
    assert "[titan] --ckpt_path last: no checkpoint in runs/ep yet: starting from step 0" in (
        first.stderr
    )
    second = titan(tmp_path, *fit, "--trainer.max_steps=4")
    assert sorted(p.name for p in runs.iterdir()) == ["version_0", "version_1"]
    newest = runs / "version_1" / "checkpoints" / "last.ckpt"
    for version, want in (("version_0", [0, 1]), ("version_1", [2, 3])):
        assert steps(runs / version / "metrics.csv") == want, version
        assert (runs / version / "checkpoints" / "last.ckpt" / "COMPLETE").is_file(), version
    said = "[titan] resuming from step 2 of runs/ep/version_0/checkpoints/last.ckpt"
    assert said in second.stderr, second.stderr[-3000:]
    for out in (first, second):
        for warning in WARNINGS:
            assert warning not in out.stdout + out.stderr, warning

    # a run folder is a checkpoint: export the first run's
    titan(tmp_path, "export", "--ckpt", "runs/ep/version_0", "--out", "hf", "--dtype", "fp32")
    assert (tmp_path / "hf" / "config.json").is_file()
    # a corrupt newest checkpoint is skipped by name for the one before it (the first run's)
    shard = next(newest.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    gen = ["generate", "--ckpt", "runs/ep", "--prompt", "def", "--max-new-tokens", "2"]
    done = titan(tmp_path, *gen)
    assert f"[titan] skipping corrupt checkpoint {Path('runs/ep/version_1/checkpoints')}" in (
        done.stderr
    ), done.stderr[-2000:]


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every event file in ``folder`` (TFRecord framing: length, its CRC,
    the event, its CRC), read with tensorboardX's protobuf classes."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            length = int.from_bytes(data[at : at + 8], "little")
            event = Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


@pytest.mark.slow  # one `titan fit` of two steps on one rank (about 20 s)
@pytest.mark.timeout(300)
def test_a_tensorboard_run_writes_its_events_and_files_into_its_run_folder(tmp_path: Path) -> None:
    """--trainer.logger=TensorBoardLogger: the event files, holding the train loss of each step, the
    checkpoints and a callback's plot all land in runs/<name>/version_0; the summary names it."""
    done = titan(tmp_path, "fit", "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
                 "--trainer.logger.init_args.save_dir=runs", "--trainer.logger.init_args.name=tb",
                 "--trainer.max_steps=2", "--trainer.log_every_n_steps=1",
                 "--trainer.limit_val_batches=0", "--trainer.enable_progress_bar=false",
                 "--trainer.callbacks+=lightning_titan.lightning.callbacks.ExpertLoad")  # fmt: skip
    folder = tmp_path / "runs" / "tb" / "version_0"
    losses = tensorboard_scalars(folder)["train_loss"]
    assert sorted(losses) == [0, 1] and all(3 < v < 8 for v in losses.values()), losses
    assert (folder / "expert_load.png").is_file()
    assert next((folder / "checkpoints").glob("*.ckpt/COMPLETE"))
    assert f"logs               {folder.resolve()}\n" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "runs"]  # nothing elsewhere
