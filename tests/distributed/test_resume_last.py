"""``ckpt_path="last"`` resumes, or fails: with no ``last`` checkpoint but something in the checkpoint
directory (the ``.tmp-*`` of an interrupted save, other checkpoints), every launch refuses before any
rank joins the process group, instead of Lightning's warning and a new run. An empty directory is a
first run and starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_titan import TitanStrategy
from lightning_titan.checkpoint import save_sharded
from lightning_titan.lightning.checkpoint_hooks import refuse_missing_last
from lightning_titan.lightning.module import TitanLM
from lightning_titan.model.decoder import ModelConfig, StageModel
from lightning_titan.runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, ffn_dim=48, n_experts=4)
LEFTOVER = ".last.ckpt.tmp-otherhost-4242-0123456789ab"  # a save killed before it completed


def _interrupted_save(dirpath: Path) -> Path:
    (dirpath / LEFTOVER).mkdir(parents=True)
    (dirpath / LEFTOVER / "__0_0.distcp").write_bytes(b"half a shard")
    return dirpath


def _trainer(dirpath: Path, **strategy) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu", devices=2, logger=False,
        strategy=TitanStrategy(dp=2, timeout_minutes=0.2, **strategy),  # a planted bug fails soon
        callbacks=[ModelCheckpoint(dirpath=dirpath, save_last=True)], enable_progress_bar=False,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_last_with_only_an_interrupted_save_is_refused_by_every_launch(tmp_path, monkeypatch):
    dirpath = _interrupted_save(tmp_path / "ckpt")
    message = rf'ckpt_path="last" found no last checkpoint in {dirpath}, which holds {LEFTOVER} '
    message += r"\(a save of last.ckpt that was interrupted\)"
    # fork: the parent refuses before it starts a rank
    with pytest.raises(ValueError, match=message):
        _trainer(dirpath, start_method="fork").fit(TitanLM(CONFIG), ckpt_path="last")
    with pytest.raises(ValueError, match=message):
        _trainer(dirpath, start_method="fork").validate(TitanLM(CONFIG), ckpt_path="last")
    # processes started outside (torchrun): each rank refuses before init_process_group
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # a rank that went on would wait there
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", rank)
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(ValueError, match=message):
            _trainer(dirpath).fit(TitanLM(CONFIG), ckpt_path="last")


def test_last_refuses_only_where_lightning_would_start_a_new_run(tmp_path):
    trainer = _trainer(tmp_path / "first")
    refuse_missing_last(trainer, "last")  # a missing directory, then an empty one: a first run
    (tmp_path / "first").mkdir()
    refuse_missing_last(trainer, "last")
    refuse_missing_last(_trainer(_interrupted_save(tmp_path / "any")), str(tmp_path / "any"))

    dirpath = _interrupted_save(tmp_path / "ckpt")
    model = StageModel(CONFIG)
    save_sharded(dirpath / "epoch=0-step=4.ckpt", model, [], {}, layout={})
    with pytest.raises(ValueError, match=rf"pass ckpt_path='{dirpath}/epoch=0-step=4.ckpt'"):
        refuse_missing_last(_trainer(dirpath), "last")
    save_sharded(dirpath / "last.ckpt", model, [], {}, layout={})
    refuse_missing_last(_trainer(dirpath), "last")  # Lightning finds it and loads it


@pytest.mark.timeout(180)
def test_titan_fit_ckpt_path_last_with_only_an_interrupted_save_fails(tmp_path):
    """A run's checkpoint folder (runs/<name>/version_N/checkpoints), as a killed first save left it:
    ``last`` of a new run finds nothing complete in any run of the config, and says what is there."""
    dirpath = _interrupted_save(tmp_path / "runs" / "resume" / "version_0" / "checkpoints")
    cmd = [
        sys.executable, "-m", "lightning_titan", "fit", "--config", str(ROOT / "configs" / "pp_ep.yaml"),
        "--trainer.logger.init_args.save_dir=runs", "--trainer.logger.init_args.name=resume",
        "--trainer.max_steps=2", "--ckpt_path", "last",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), LIGHTNING_TITAN_CACHE=str(tmp_path / "cache"))
    job = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170)
    assert job.returncode != 0
    found = 'ckpt_path="last" found no complete checkpoint in runs/resume/version_0/checkpoints, '
    found += f"which holds checkpoints/{LEFTOVER} (a save of last.ckpt that was interrupted)"
    assert found in job.stderr, job.stderr[-3000:]
    assert "leave ckpt_path out" in job.stderr
    assert "Initializing distributed" not in job.stderr  # no rank started
    assert sorted(p.name for p in dirpath.iterdir()) == [LEFTOVER]
