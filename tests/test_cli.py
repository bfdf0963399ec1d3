"""The `titan` CLI over configs/: every config parses, trains, checkpoints and reproduces the single-process
curve; checkpoints resume under other layouts on the uninterrupted curve; `titan export` gives a model that
Hugging Face transformers loads with our logits.

The runs are shared by the tests of this file (one fixture), because every launch costs seconds per rank.
All launches but the main job's use start_method=fork (no re-import per rank); the main job
(dp_pp_ep.yaml) keeps the default script launch.
"""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_titan.cli import TitanCLI, cli_components

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
STEPS, RESUMED_STEPS = 3, 6
COMMON = [
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--model.lr_decay_steps=50",
    # no warm-up and a larger step, so a gradient of the wrong size shows in the curve; z-loss on too
    "--model.warmup_steps=0",
    "--model.learning_rate=0.003",
    "--model.model.z_loss_coef=0.001",
]
FORK = "--trainer.strategy.init_args.start_method=fork"


def config(name: str) -> Path:
    return ROOT / "configs" / f"{name}.yaml"


def layout(dp: int, pp: int, ep: int, *extra: str) -> list[str]:
    return [f"--trainer.devices={dp * pp * ep}", f"--trainer.strategy.init_args.dp={dp}",
            f"--trainer.strategy.init_args.pp={pp}", f"--trainer.strategy.init_args.ep={ep}", *extra]  # fmt: skip


def titan_fit(cwd: Path, cfg: Path, name: str, *extra: str, steps: int = STEPS) -> str:
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(cwd / "cache")}
    cmd = [sys.executable, "-m", "lightning_titan", "fit", "--config", str(cfg), *COMMON,
           f"--trainer.max_steps={steps}", f"--trainer.logger.init_args.name={name}", *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def curve(cwd: Path, name: str, key: str = "train_loss") -> dict[int, float]:
    rows = csv.DictReader(open(cwd / "runs" / name / "version_0" / "metrics.csv"))
    return {int(r["step"]): float(r[key]) for r in rows if r.get(key)}


FP32_REL = {
    "train_loss": 1e-5,
    "aux_loss": 1e-4,
    "grad_norm": 1e-4,
}  # a norm is a derivative: looser
BF16_REL = dict.fromkeys(FP32_REL, 5e-2)


def assert_same_curves(name: str, got: str, want: str, cwd: Path, rel: dict, steps: int) -> None:
    """Loss, aux loss and pre-clip grad norm of run ``got`` equal run ``want``'s at steps < ``steps``."""
    for key in ("train_loss", "aux_loss", "grad_norm"):
        reference = {k: v for k, v in curve(cwd, want, key).items() if k < steps}
        assert sorted(reference) == list(range(steps)), f"{want} {key}"
        ours = {k: v for k, v in curve(cwd, got, key).items() if k < steps}
        assert sorted(ours) == sorted(reference), f"{name} {key}"
        for step, value in reference.items():
            assert ours[step] == pytest.approx(value, rel=rel[key]), f"{name} {key} step {step}"


def mid_epoch_checkpoint(cwd: Path, name: str) -> list[str]:
    """One more ModelCheckpoint that saves at step 3 inside the epoch, as a run that is stopped (or
    preempted) mid-epoch has. (A run that simply reaches max_steps ends its epoch: resuming it with a
    larger max_steps starts the next epoch, which is Lightning's semantics, not a continuation.)"""
    return ["--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={cwd / 'mid' / name}",
            f"--trainer.callbacks.every_n_train_steps={STEPS}", "--trainer.callbacks.save_top_k=-1"]  # fmt: skip


def last_ckpt(cwd: Path, config_name: str) -> Path:
    # the configs fix ModelCheckpoint's dirpath (runs/<config>/checkpoints) so `--ckpt_path last` finds
    # it from a new run: runs of one config with other logger names share it
    path = cwd / "runs" / config_name / "checkpoints" / "last.ckpt"
    assert (path / "COMPLETE").exists(), f"{config_name} left no complete last.ckpt"
    return path


def step3_ckpt(cwd: Path, name: str) -> Path:
    path = cwd / "mid" / name / f"epoch=0-step={STEPS}.ckpt"
    assert (path / "COMPLETE").exists(), f"{name} left no complete checkpoint at step {STEPS}"
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cli")
    out = {}
    for cfg in CONFIGS:
        extra = [] if cfg.stem == "dp_pp_ep" else [FORK]  # the main job keeps the script launch
        if cfg.stem in ("dp_pp_ep", "single"):
            extra += mid_epoch_checkpoint(cwd, cfg.stem)
        # the single-process run goes on to step 6: the uninterrupted curve the resumed runs must follow
        steps = RESUMED_STEPS if cfg.stem == "single" else STEPS
        out[cfg.stem] = titan_fit(cwd, cfg, cfg.stem, *extra, steps=steps)
    titan_fit(
        cwd, config("pp_ep"), "pp_ep_gpipe", FORK, "--trainer.strategy.init_args.schedule=gpipe"
    )
    titan_fit(cwd, config("pp"), "pp4", FORK, *layout(1, 4, 1), *mid_epoch_checkpoint(cwd, "pp4"))
    titan_fit(cwd, config("pp_ep"), "pp_ep_bf16", FORK, "--trainer.precision=bf16-mixed")
    return cwd, out


def test_configs_exist_for_every_composition():
    assert {c.stem for c in CONFIGS} == {
        "single",
        "dp",
        "pp",
        "ep",
        "dp_pp",
        "pp_ep",
        "dp_ep",
        "dp_pp_ep",
    }


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.stem)
def test_every_config_parses(cfg):
    cli = TitanCLI(*cli_components(), run=False, args=["--config", str(cfg)])
    dims = cli.trainer.strategy.parallel_dims
    assert dims.world_size == cli.trainer.num_devices
    assert cli.datamodule.global_batch_size == 16
    assert (
        cli.model.config.n_layers % 4 == 0 and cli.model.config.n_experts % 4 == 0
    )  # pp, ep <= 4 by flag


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_config_trains_the_single_process_curve(runs):
    cwd, stdout = runs
    for name in [c.stem for c in CONFIGS] + ["pp_ep_gpipe", "pp4"]:
        assert_same_curves(name, name, "single", cwd, FP32_REL, steps=STEPS)
        if name != "single":
            assert sorted(curve(cwd, name)) == list(range(STEPS)), name
    # the aux (load-balance + z) losses are on, so their gradients are in the compared norms
    assert all(v > 0 for v in curve(cwd, "single", "aux_loss").values())
    for cfg in CONFIGS:
        last_ckpt(cwd, cfg.stem)
    # the main job ends with a summary
    assert (
        "== titan fit: done" in stdout["dp_pp_ep"]
        and "dp=2 pp=2 ep=2 (8 ranks)" in stdout["dp_pp_ep"]
    )


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bf16_mixed_trains_under_pp_and_ep(runs):
    cwd, _ = runs
    fp32 = {k: v for k, v in curve(cwd, "single").items() if k < STEPS}
    bf16 = curve(cwd, "pp_ep_bf16")
    # the backward too: gradient norms (and the aux losses) follow fp32 within bf16's precision
    assert_same_curves("bf16", "pp_ep_bf16", "single", cwd, BF16_REL, steps=STEPS)
    assert bf16 != fp32, "bf16 autocast was not in effect"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_validate_from_a_checkpoint_under_another_layout(runs):
    cwd, _ = runs
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(cwd / "cache")}
    val_loss = {}
    # the same step-3 weights, written by 8 ranks and by one; read under pp x ep and by one process
    for name, cfg, ckpt in (("validate", "pp_ep", step3_ckpt(cwd, "dp_pp_ep")),
                            ("validate_ref", "single", step3_ckpt(cwd, "single"))):  # fmt: skip
        cmd = [sys.executable, "-m", "lightning_titan", "validate", "--config", str(config(cfg)),
               FORK, "--trainer.limit_val_batches=2", f"--ckpt_path={ckpt}",
               f"--trainer.logger.init_args.name={name}"]  # fmt: skip
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "val_loss" in proc.stdout and "val_perplexity" in proc.stdout
        rows = csv.DictReader(open(cwd / "runs" / name / "version_0" / "metrics.csv"))
        (val_loss[name],) = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert val_loss["validate"] == pytest.approx(val_loss["validate_ref"], rel=1e-5), val_loss
    # and not the initial model's: the checkpoint was loaded
    assert val_loss["validate"] < curve(cwd, "single")[0], val_loss


RESUMES = [  # (written by, config to resume with, layout overrides)
    ("dp_pp_ep", "dp_pp_ep", layout(1, 2, 4)),
    ("dp_pp_ep", "dp_pp_ep", layout(4, 1, 2)),
    ("dp_pp_ep", "single", []),
    ("single", "dp_pp_ep", []),
    ("pp4", "dp_pp_ep", ["--trainer.strategy.init_args.schedule=gpipe"]),
]


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_resume_under_another_layout_continues_the_curve(runs):
    """Model, optimizer, LR schedule, data position and loops resume under a different (dp, pp, ep):
    steps 3..5 equal those of an uninterrupted run."""
    cwd, _ = runs
    uninterrupted = curve(cwd, "single")
    for i, (source, cfg, overrides) in enumerate(RESUMES):
        name = f"resume{i}_{source}_to_{cfg}"
        titan_fit(cwd, config(cfg), name, FORK, *overrides, f"--ckpt_path={step3_ckpt(cwd, source)}",
                  steps=RESUMED_STEPS)  # fmt: skip
        resumed = curve(cwd, name)
        assert sorted(resumed) == list(range(STEPS, RESUMED_STEPS)), name
        for step, loss in resumed.items():
            assert loss == pytest.approx(uninterrupted[step], rel=1e-5), f"{name} step {step}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_loads_in_transformers_with_our_logits(runs, tmp_path):
    import transformers  # a test dependency: missing, this must fail, not skip

    from lightning_titan.export import load_full_model

    cwd, _ = runs
    ckpt = last_ckpt(cwd, "dp_pp_ep")  # written by 8 ranks, read by one process
    proc = subprocess.run([sys.executable, "-m", "lightning_titan", "export", "--ckpt", str(ckpt),
                           "--out", str(tmp_path / "hf")], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = load_full_model(ckpt)
    theirs = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def main():\n    return 'héllo'\n"
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode("utf-8")), "the exported tokenizer is our byte tokenizer"
    tokens = torch.tensor([ids[:64]])
    with torch.no_grad():
        expected, _ = ours(tokens)
        got = theirs(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert tokenizer.decode(ids) == text
