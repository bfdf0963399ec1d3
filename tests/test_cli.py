"""The `titan` CLI over configs/: every config parses, runs, and reproduces the single-process curve."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_titan.cli import TitanCLI, cli_components

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
SHORT = ["--trainer.max_steps=3", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=1"]


def titan_fit(config: Path, cwd: Path, *extra: str, name: str | None = None, timeout: int = 240):
    name = name or config.stem
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(cwd.parent / "cache")}
    cmd = [sys.executable, "-m", "lightning_titan", "fit", "--config", str(config), *SHORT,
           f"--trainer.logger.init_args.name={name}", *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{config.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def train_losses(run_dir: Path) -> list[float]:
    rows = list(csv.DictReader(open(run_dir / "version_0" / "metrics.csv")))
    return [float(r["train_loss"]) for r in rows if r.get("train_loss")]


def test_configs_exist_for_every_composition():
    names = {c.stem for c in CONFIGS}
    assert names == {"single", "dp", "pp", "ep", "dp_pp", "pp_ep", "dp_ep", "dp_pp_ep"}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.stem)
def test_every_config_parses(config):
    cli = TitanCLI(*cli_components(), run=False, args=["--config", str(config)])
    strategy = cli.trainer.strategy
    dims = strategy.parallel_dims
    assert dims.world_size == cli.trainer.num_devices
    assert cli.datamodule.global_batch_size == 16 and cli.model.config.n_layers % 4 == 0
    assert cli.model.config.n_experts % 4 == 0  # so pp and ep up to 4 work by flag


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_config_runs_and_matches_single(tmp_path):
    """Each config trains 3 steps (validation, checkpointing and callbacks included) and its per-step
    train_loss equals the single-process run's; pp_ep with gpipe equals it too."""
    runs = tmp_path / "work"
    runs.mkdir()
    for config in CONFIGS:
        proc = titan_fit(config, runs)
        if config.stem == "dp_pp_ep":
            assert "== titan fit: done" in proc.stdout and "dp=2 pp=2 ep=2" in proc.stdout
    titan_fit(ROOT / "configs" / "pp_ep.yaml", runs, "--trainer.strategy.init_args.schedule=gpipe",
              name="pp_ep_gpipe")  # fmt: skip
    reference = train_losses(runs / "runs" / "single")
    assert len(reference) == 3
    for name in [c.stem for c in CONFIGS] + ["pp_ep_gpipe"]:
        losses = train_losses(runs / "runs" / name)
        assert losses == pytest.approx(reference, rel=1e-5), name
        assert (runs / "runs" / name / "version_0" / "checkpoints" / "last.ckpt" / "COMPLETE").exists(), name
