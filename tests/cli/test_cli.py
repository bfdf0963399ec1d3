"""The `titan` CLI over configs/: every config parses into its layout; the main job (dp2 x pp2 x ep2,
ZeRO-1) trains, checkpoints and reproduces the single-process curve; checkpoints resume under other layouts
and zero levels on the uninterrupted curve; `titan export` gives a model that Hugging Face transformers
loads with our logits.

The runs are shared by the tests of this file (one fixture), because every launch costs seconds per rank.
All launches but the main job's use start_method=fork (no re-import per rank); the main job
(dp_pp_ep.yaml) keeps the default script launch.
"""

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_titan.cli import TitanCLI, cli_components, compose_config, main
from lightning_titan.hf.export import export_hf
from lightning_titan.model import flops
from lightning_titan.model.decoder import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(
    c for c in (ROOT / "configs").glob("*.yaml") if c.stem not in ("base", "auto")
)  # the layouts (auto.yaml: tests/cli/test_plan.py)
STEPS, RESUMED_STEPS = 3, 6
MODEL = ["--model.model.z_loss_coef=0.001"]  # z-loss on too; a checkpoint's readers must agree
COMMON = [
    "--trainer.val_check_interval=2",
    "--trainer.limit_val_batches=1",
    "--model.lr_decay_steps=50",
    # no warm-up and a larger step, so a gradient of the wrong size shows in the curve
    "--model.warmup_steps=0",
    "--model.learning_rate=0.003",
    *MODEL,
]
FORK = "--trainer.strategy.init_args.start_method=fork"
ZERO1 = "--trainer.strategy.init_args.zero=1"
ZERO2 = "--trainer.strategy.init_args.zero=2"
DUALPIPEV = "--trainer.strategy.init_args.schedule=dualpipev"
OVERLAP_1F1B = "--trainer.strategy.init_args.schedule=1f1b_overlap"


def config(name: str) -> Path:
    return ROOT / "configs" / f"{name}.yaml"


def layout(dp: int, pp: int, ep: int, *extra: str, tp: int = 1, cp: int = 1) -> list[str]:
    degrees = {"dp": dp, "pp": pp, "ep": ep, "tp": tp, "cp": cp}
    return [f"--trainer.devices={dp * pp * ep * tp * cp}",
            *(f"--trainer.strategy.init_args.{a}={n}" for a, n in degrees.items()), *extra]  # fmt: skip


def titan_fit(cwd: Path, cfg: Path, name: str, *extra: str, steps: int = STEPS) -> str:
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(cwd / "cache")}
    cmd = [sys.executable, "-m", "lightning_titan", "fit", "--config", str(cfg), *COMMON,
           f"--trainer.max_steps={steps}", f"--trainer.logger.init_args.name={name}", *extra]  # fmt: skip
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout + proc.stderr


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
    preempted) mid-epoch has. (A run that reaches max_steps closes Lightning's epoch; its data goes
    on all the same: tests/distributed/test_data.py.)"""
    return ["--trainer.callbacks+=ModelCheckpoint", f"--trainer.callbacks.dirpath={cwd / 'mid' / name}",
            f"--trainer.callbacks.every_n_train_steps={STEPS}", "--trainer.callbacks.save_top_k=-1"]  # fmt: skip


def last_ckpt(cwd: Path, name: str) -> Path:
    # each run saves in its own folder, runs/<logger name>/version_N/checkpoints (the first: 0)
    path = cwd / "runs" / name / "version_0" / "checkpoints" / "last.ckpt"
    assert (path / "COMPLETE").exists(), f"{name} left no complete last.ckpt"
    return path


def step3_ckpt(cwd: Path, name: str) -> Path:
    path = cwd / "mid" / name / f"epoch=0-step={STEPS}.ckpt"
    assert (path / "COMPLETE").exists(), f"{name} left no complete checkpoint at step {STEPS}"
    return path


# Through the CLI: the single process (the reference curve), the main job and one layout in bf16. Every
# other composition runs at the engine level (tests/distributed/test_equivalence.py, many layouts per spawn); here
# every config parses into its layout (test_every_config_parses) and the resumes below change layouts.
TRAINED = ("single", "dp_pp_ep", "tp_pp_ep")
# cp_pp_ep.yaml trains on 256-token sequences: its reference is the same config on one process
CP_SINGLE = ["--trainer.devices=1"] + [
    f"--trainer.strategy.init_args.{a}=1" for a in ("pp", "ep", "cp")
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("cli")
    out = {}
    # the main job keeps the script launch and runs with ZeRO-1 (its checkpoints resume below under
    # zero=0 and zero=1 layouts, and the single run's under zero=1); the single-process run goes on to
    # step 6: the uninterrupted curve the resumed runs must follow
    out["single"] = titan_fit(cwd, config("single"), "single", FORK,
                              *mid_epoch_checkpoint(cwd, "single"), steps=RESUMED_STEPS)  # fmt: skip
    out["dp_pp_ep"] = titan_fit(cwd, config("dp_pp_ep"), "dp_pp_ep", ZERO1,
                                *mid_epoch_checkpoint(cwd, "dp_pp_ep"))  # fmt: skip
    # tp x pp x ep under DualPipeV (forward and backward of two microbatches overlapped): its
    # checkpoints resume below under other layouts and schedules
    out["tp_pp_ep"] = titan_fit(cwd, config("tp_pp_ep"), "tp_pp_ep", FORK, ZERO1, DUALPIPEV,
                                "--trainer.strategy.init_args.num_microbatches=4",
                                *mid_epoch_checkpoint(cwd, "tp_pp_ep"))  # fmt: skip
    out["cp_pp_ep"] = titan_fit(cwd, config("cp_pp_ep"), "cp_pp_ep", FORK,
                                *mid_epoch_checkpoint(cwd, "cp_pp_ep"))  # fmt: skip
    titan_fit(cwd, config("cp_pp_ep"), "cp_single", FORK, *CP_SINGLE, steps=RESUMED_STEPS)
    # bf16 under pp x ep x tp: the wire dtype between stages, the sequence collectives, the vocab
    # loss; with the timeline and expert-load callbacks, which must work under tp too
    titan_fit(cwd, config("tp_pp_ep"), "tp_pp_ep_bf16", FORK, "--trainer.precision=bf16-mixed",
              "--trainer.callbacks+=lightning_titan.lightning.callbacks.PipelineTimeline",
              "--trainer.callbacks.steps=[1, 2]", f"--trainer.callbacks.out_dir={cwd / 'timeline'}",
              "--trainer.callbacks+=lightning_titan.lightning.callbacks.ExpertLoad",
              f"--trainer.callbacks.plot_path={cwd / 'expert_load.png'}")  # fmt: skip
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
        "tp",
        "tp_pp_ep",
        "cp_pp_ep",
    }


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.stem)
def test_every_config_parses(cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--config", str(cfg), "--seed_everything=7", "--model.model.seq_len=32"]
    cli = TitanCLI(*cli_components(), run=False, args=args)
    dims = cli.trainer.strategy.parallel_dims
    assert dims.world_size == cli.trainer.num_devices
    assert cli.datamodule.global_batch_size == 16
    assert (
        cli.model.config.n_layers % 4 == 0 and cli.model.config.n_experts % 4 == 0
    )  # pp, ep <= 4 by flag
    # base.yaml's values arrive (a nested block in an overlay would have dropped them)
    assert cli.trainer.max_steps == 200 and cli.trainer.strategy.options.gradient_clip_norm == 1.0
    names = {type(c).__name__ for c in cli.trainer.callbacks}
    assert {"LearningRateMonitor", "EarlyStopping", "ModelCheckpoint", "StepProgressBar"} <= names
    # one name per layout, a folder per run: logs and checkpoints in runs/<layout>/version_N
    assert cli.trainer.logger.name == cfg.stem and cli.trainer.logger.version == 0
    assert cli.trainer.checkpoint_callback.dirpath == str(
        tmp_path / "runs" / cfg.stem / "version_0" / "checkpoints"
    )
    # set once: data.seq_len is the model's, and seed_everything seeds the init and the data order
    assert cli.datamodule.seq_len == cli.model.config.seq_len == 32
    assert cli.model.hparams.seed == cli.datamodule.seed == 7
    # compose_config (what scripts edit) agrees with the parser on every value it names
    composed = compose_config(cfg)
    composed["model"]["model"]["seq_len"] = 32  # as given above
    parsed = cli.config.as_dict()
    for key in ("trainer", "model", "data"):
        assert _subset(composed[key], parsed[key]), key


def _subset(small, big) -> bool:
    if isinstance(small, dict):
        return isinstance(big, dict) and all(_subset(v, big.get(k)) for k, v in small.items())
    if isinstance(small, list):
        return isinstance(big, list) and len(small) == len(big) and all(map(_subset, small, big))
    return small == big


def test_linked_and_misplaced_keys_fail_with_the_key_to_use(tmp_path, capsys):
    with pytest.raises(SystemExit):
        TitanCLI(
            *cli_components(), run=False, args=["--config", str(config("pp")), "--data.seq_len=32"]
        )
    assert 'Linked "data.seq_len" must be given via "model.model"' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        TitanCLI(
            *cli_components(),
            run=False,
            args=["--config", str(config("pp")), "--seed_everything=true"],
        )
    assert "titan needs an int seed" in capsys.readouterr().err
    late = tmp_path / "late.yaml"
    late.write_text(f"trainer.devices: 2\nconfig: {config('single')}\n")
    with pytest.raises(ValueError, match="must come first"):
        compose_config(late)
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text(f"config: {config('single')}\nmodel.model.n_layers: 2\n")
    with pytest.raises(ValueError, match=r"`model.model.n_layers` .* write `model.model.init_args"):
        compose_config(dotted)


def test_model_optimizer_is_built_on_the_weight_decay_groups(tmp_path, monkeypatch, capsys):
    """--model.optimizer names another optimizer (its own arguments); TitanLM still builds the two
    groups, the norms at weight_decay 0. LightningCLI's --optimizer, which would build one on the
    parameters of a stage that does not exist yet, is refused with the flag to use."""
    from lightning_titan.model.decoder import StageModel

    monkeypatch.chdir(tmp_path)
    args = ["--config", str(config("single")), "--model.lr_decay_steps=10",
            "--model.optimizer=torch.optim.SGD", "--model.optimizer.lr=0.5",
            "--model.optimizer.momentum=0.9", "--model.optimizer.weight_decay=0.01"]  # fmt: skip
    module = TitanCLI(*cli_components(), run=False, args=args).model
    module.model = StageModel(module.config, pp_rank=0, pp=1, ep_rank=0, ep=1)
    optimizer = module.configure_optimizers()["optimizer"]
    assert type(optimizer) is torch.optim.SGD
    matrices, norms = optimizer.param_groups
    assert (matrices["initial_lr"], matrices["momentum"], matrices["weight_decay"]) == (
        0.5,
        0.9,
        0.01,
    )
    assert norms["weight_decay"] == 0.0 and all(p.ndim < 2 for p in norms["params"])
    assert len(matrices["params"]) + len(norms["params"]) == len(list(module.parameters()))
    with pytest.raises(ValueError, match=r"--optimizer is not a titan option.*--model.optimizer="):
        main(["fit", "--config", str(config("single")), "--optimizer=torch.optim.SGD"])


@pytest.mark.slow  # several `titan` processes (about 35 s)
def test_a_bad_value_on_the_command_line_is_the_message_alone(tmp_path):
    """The `titan` command prints a bad strategy or model value as one line, no traceback, exit 2."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    dotted = tmp_path / "dotted.yaml"
    dotted.write_text(f"config: {config('dp')}\ntrainer.strategy.dp: 2\n")
    dp = ["--config", str(config("dp"))]
    for args, message in [
        ([f"--config={dotted}"], f"titan: error: {dotted}: the key `trainer.strategy.dp`"),
        ([*dp, "--trainer.strategy.init_args.pp=0"], "titan: error: pp=0 is not valid"),
        ([*dp, "--model.model.capacity_factor=-1"], "titan: error: capacity_factor=-1.0 must"),
        ([*dp, "--lr_scheduler=x"], "titan: error: --lr_scheduler is not a titan option"),
    ]:
        done = subprocess.run(
            [sys.executable, "-m", "lightning_titan.cli", "fit", *args],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr[-2000:]
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_help_lists_every_command_and_each_runs(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "export", "plan", "generate", "bench", "doctor"):
        assert f"    {command} " in out, f"`titan --help` does not list {command}:\n{out}"
    assert (
        "predict" not in out
    )  # TitanLM has no predict_step: `titan generate` and `titan export` are the ways to inference
    for command in ("export", "generate", "bench", "doctor"):  # main() runs them, not LightningCLI
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0 and f"titan {command}" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_main_job_trains_the_single_process_curve(runs):
    cwd, stdout = runs
    for name in TRAINED[1:]:  # and tensor parallelism (vocab-parallel loss, sequence parallel)
        assert_same_curves(name, name, "single", cwd, FP32_REL, steps=STEPS)
        assert sorted(curve(cwd, name)) == list(range(STEPS))
    # the aux (load-balance + z) losses are on, so their gradients are in the compared norms
    assert all(v > 0 for v in curve(cwd, "single", "aux_loss").values())
    # model FLOP/s and MFU on every step of every layout (logged on every rank: no deadlock)
    per_token = flops.training_flops_per_token(ModelConfig())  # base.yaml's model
    for name in TRAINED:
        rate, achieved = curve(cwd, name, "tokens_per_sec"), curve(cwd, name, "flops_per_sec")
        assert set(range(STEPS)) <= set(achieved), name
        assert all(achieved[s] == pytest.approx(rate[s] * per_token, rel=1e-5) for s in rate)
        # against each rank's probed share of this busy box: positive, its size is load's
        assert all(v > 0 for v in curve(cwd, name, "mfu").values()), (name, curve(cwd, name, "mfu"))
    for name in TRAINED:
        last_ckpt(cwd, name)
    # the main job ends with a summary
    assert (
        "== titan fit: done" in stdout["dp_pp_ep"]
        and "dp=2 pp=2 ep=2 (8 ranks)" in stdout["dp_pp_ep"]
    )
    assert "dp=1 pp=2 ep=2 tp=2 (8 ranks)" in stdout["tp_pp_ep"]
    # context parallelism, on 256-token sequences: the curve of the same config on one process
    assert_same_curves("cp_pp_ep", "cp_pp_ep", "cp_single", cwd, FP32_REL, steps=STEPS)
    assert "dp=1 pp=2 ep=2 cp=2 (8 ranks)" in stdout["cp_pp_ep"]
    # and each summary names the metrics file the run wrote (under fork the launcher, which logged
    # nothing itself, prints it: it must name the ranks' version folder, not a next, empty one)
    for name in TRAINED:
        (logs,) = re.findall(r"^logs +(\S+)$", stdout[name], flags=re.M)
        assert Path(logs) == (cwd / "runs" / name / "version_0" / "metrics.csv").resolve(), name


# what the main job printed before issue 12, each something a user could do nothing about
NOISE = {
    "LightningCLI's args and sys.argv warning": "not recommended to provide both args and command line",
    "torch's LeafSpec deprecation (Lightning's CombinedLoader)": "LeafSpec",
    "ModelCheckpoint's manual-optimization warning": "pre-optimization state",
    "sync_dist advice for values already global": "sync_dist=True",
    "`Epoch 0/-2` under max_steps": "/-2",
    "the logger version in the progress bar": "v_num",
}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_main_job_prints_progress_and_no_noise(runs):
    """The main job (script launch, 8 ranks, a validation and a ModelCheckpoint every 3 steps: each of
    the old messages had its trigger) shows steps out of max_steps, loss and tokens/s, and no warning."""
    _, output = runs
    job = output["dp_pp_ep"]
    for what, text in NOISE.items():
        assert text not in job, f"the main job printed {what}:\n{job[-3000:]}"
    warnings = [line for line in job.splitlines() if re.search(r"\.py:\d+: ", line)]
    assert not warnings, "the main job printed warnings:\n" + "\n".join(warnings)
    assert "train: 100%" in job and f"{STEPS}/{STEPS}" in job
    assert "loss=" in job and "tok/s=" in job


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bf16_mixed_trains_under_pp_ep_and_tp(runs):
    cwd, _ = runs
    fp32 = {k: v for k, v in curve(cwd, "single").items() if k < STEPS}
    bf16 = curve(cwd, "tp_pp_ep_bf16")
    # the backward too: gradient norms (and the aux losses) follow fp32 within bf16's precision
    assert_same_curves("bf16", "tp_pp_ep_bf16", "single", cwd, BF16_REL, steps=STEPS)
    assert bf16 != fp32, "bf16 autocast was not in effect"
    # the callbacks under tp x pp x ep: every rank's spans (TP's collectives among them), a bubble per
    # stage, and the expert load of every layer over the global batch
    trace = json.loads((cwd / "timeline" / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert {e["pid"] for e in events} == set(range(8))
    assert {"forward", "backward", "p2p", "all_to_all", "tp"} <= {e["cat"] for e in events}
    summary = json.loads((cwd / "timeline" / "bubbles.json").read_text())
    assert [b["stage"] for b in summary["bubbles"]] == [0, 1]
    assert summary["ms_per_step_and_rank"]["tp"] > 0 == summary["ms_per_step_and_rank"]["cp"]
    assert (cwd / "expert_load.png").stat().st_size > 0
    rows = list(csv.DictReader(open(cwd / "runs" / "tp_pp_ep_bf16" / "version_0" / "metrics.csv")))
    for layer in range(4):
        ratios = [float(r[f"expert_load/layer{layer}/max_over_mean"]) for r in rows
                  if r.get(f"expert_load/layer{layer}/max_over_mean")]  # fmt: skip
        assert len(ratios) == STEPS and all(1 <= x <= 8 for x in ratios), (layer, ratios)


GPIPE = "--trainer.strategy.init_args.schedule=gpipe"
INTERLEAVED = ["--trainer.strategy.init_args.schedule=interleaved_1f1b",
               "--trainer.strategy.init_args.virtual_stages=2",
               "--trainer.strategy.init_args.stage_layers=auto"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_validate_from_a_checkpoint_under_another_layout(runs):
    cwd, _ = runs
    env = {**os.environ, "LIGHTNING_TITAN_CACHE": str(cwd / "cache")}
    val_loss = {}
    # the same step-3 weights, written by 8 ranks and by one; read under pp x ep with 2 chunks per
    # rank (interleaved: the chunked forward-only order; the layers split by the probe, "auto") and
    # by one process
    for name, cfg, ckpt, extra in (
        ("validate", "pp_ep", step3_ckpt(cwd, "dp_pp_ep"), INTERLEAVED),
        ("validate_ref", "single", step3_ckpt(cwd, "single"), []),
    ):  # fmt: skip
        cmd = [sys.executable, "-m", "lightning_titan", "validate", "--config", str(config(cfg)),
               *MODEL, FORK, "--trainer.limit_val_batches=2", f"--ckpt_path={ckpt}",
               f"--trainer.logger.init_args.name={name}", *extra]  # fmt: skip
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "val_loss" in proc.stdout and "val_perplexity" in proc.stdout
        assert ("stage_layers='auto' chose [" in proc.stdout) == bool(extra), proc.stdout[-2000:]
        rows = csv.DictReader(open(cwd / "runs" / name / "version_0" / "metrics.csv"))
        (val_loss[name],) = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert val_loss["validate"] == pytest.approx(val_loss["validate_ref"], rel=1e-5), val_loss
    # and not the initial model's: the checkpoint was loaded
    assert val_loss["validate"] < curve(cwd, "single")[0], val_loss
    # `titan test` evaluates the held-out split (as validation sees it) from the same checkpoint
    cmd = [sys.executable, "-m", "lightning_titan", "test", "--config", str(config("single")), *MODEL,
           "--trainer.limit_test_batches=2", f"--ckpt_path={last_ckpt(cwd, 'dp_pp_ep')}",
           "--trainer.logger.init_args.name=test"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "test_loss" in proc.stdout and "test_perplexity" in proc.stdout


RESUMES = [  # (written by, config to resume with, layout overrides); dp_pp_ep saved under zero=1
    # an uneven split: 3 layers on the first stage, 1 beside the LM head
    (
        "dp_pp_ep",
        "dp_pp_ep",
        layout(1, 2, 4, GPIPE, "--trainer.strategy.init_args.stage_layers=[3,1]"),
    ),
    ("dp_pp_ep", "single", []),
    ("single", "dp_pp_ep", layout(4, 1, 2, ZERO1, OVERLAP_1F1B)),  # into an overlapped schedule
    # across tp, cp and zero: the tp=2 zero=1 checkpoint under tp=1 x cp=2 (zero=0) and under
    # tp=4 x ep=2 at zero=2 (the vocabulary padded 258 -> 260 rows; the TP-cut weights' state and
    # grads over ep, the norms' over ep x tp), and a cp=2 one (256-token sequences) on one process
    ("tp_pp_ep", "pp_ep", layout(1, 2, 2, cp=2)),
    ("tp_pp_ep", "tp_pp_ep", layout(1, 1, 2, ZERO2, tp=4)),
    ("cp_pp_ep", "cp_pp_ep", CP_SINGLE),
]
UNINTERRUPTED = {"cp_pp_ep": "cp_single"}  # the curve each source continues (default: single's)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_resume_under_another_layout_continues_the_curve(runs):
    """Model, optimizer, LR schedule, data position and loops resume under a different (dp, pp, ep,
    tp) and zero level: steps 3..5 equal those of an uninterrupted run."""
    cwd, _ = runs
    for i, (source, cfg, overrides) in enumerate(RESUMES):
        uninterrupted = curve(cwd, UNINTERRUPTED.get(source, "single"))
        name = f"resume{i}_{source}_to_{cfg}"
        titan_fit(cwd, config(cfg), name, FORK, *overrides, f"--ckpt_path={step3_ckpt(cwd, source)}",
                  steps=RESUMED_STEPS)  # fmt: skip
        resumed = curve(cwd, name)
        assert sorted(resumed) == list(range(STEPS, RESUMED_STEPS)), name
        for step, loss in resumed.items():
            assert loss == pytest.approx(uninterrupted[step], rel=1e-5), f"{name} step {step}"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_generate_continues_as_transformers_generates_from_the_export(runs, tmp_path):
    """`titan generate` on a trained checkpoint: its greedy tokens are those transformers' greedy
    `generate` gives on the exported folder; sampling is seeded (the same seed, the same text)."""
    import transformers

    cwd, _ = runs
    ckpt = last_ckpt(cwd, "dp_pp_ep")
    export_hf(ckpt, tmp_path / "hf", dtype="fp32")  # greedy ties: our fp32 weights
    prompt, new = "def main():\n    ", 24

    def titan_generate(*flags: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "lightning_titan", "generate", "--ckpt", str(ckpt),
                               "--prompt", prompt, "--max-new-tokens", str(new), *flags],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.removesuffix("\n")

    greedy = titan_generate()
    theirs = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([list(prompt.encode("utf-8"))])
    out = theirs.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=256,
                          pad_token_id=256)[0, ids.shape[1]:].tolist()  # fmt: skip
    expected = bytes(i for i in out if i != 256).decode("utf-8", errors="replace")
    assert greedy == prompt + expected
    sampled = [titan_generate("--temperature", "1.0", "--top-p", "0.9", "--seed", s) for s in "11"]
    assert sampled[0] == sampled[1] and sampled[0].startswith(prompt)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_loads_in_transformers_with_our_logits(runs, tmp_path):
    import transformers  # a test dependency: missing, this must fail, not skip

    from lightning_titan.hf.export import load_full_model

    cwd, _ = runs
    ckpt = last_ckpt(cwd, "dp_pp_ep")  # written by 8 ranks, read by one process
    proc = subprocess.run([sys.executable, "-m", "lightning_titan", "export", "--ckpt", str(ckpt),
                           "--out", str(tmp_path / "hf"), "--dtype", "fp32"], capture_output=True, text=True, timeout=300)  # fmt: skip
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
    # a TP run's checkpoint holds the same full model as one process's at the same step (the
    # vocabulary unpadded: 257 rows, as the export writes them)
    tp_model, single_model = (load_full_model(step3_ckpt(cwd, n)) for n in ("tp_pp_ep", "single"))
    tp_weights, single_weights = tp_model.state_dict(), single_model.state_dict()
    assert tp_weights.keys() == single_weights.keys()
    assert tp_weights["lm_head.weight"].shape[0] == tp_model.config.vocab_size == 257
    for name, value in single_weights.items():
        torch.testing.assert_close(tp_weights[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow  # one `titan fit` of two steps on one rank (about 20 s)
@pytest.mark.timeout(300)
def test_titan_fit_trains_on_chat_and_prompt_completion_records(tmp_path):
    """A folder of a chat file and a prompt/completion file (format auto: each record as its fields
    say), one launch: the loss of the answers only is finite and the run ends well; the records
    are packed (the default), several a sequence, and the packing efficiency is said."""
    (tmp_path / "sft").mkdir()
    chat = [{"messages": [{"role": "system", "content": "Add one."},
                          {"role": "user", "content": f"{i}"},
                          {"role": "assistant", "content": f"{i + 1}"}]} for i in range(40)]  # fmt: skip
    pairs = [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(40)]
    for name, rows in (("chat.jsonl", chat), ("pairs.jsonl", pairs)):
        (tmp_path / "sft" / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = titan_fit(tmp_path, config("single"), "sft", FORK, f"--data.source={tmp_path / 'sft'}",
                    "--data.val_fraction=0.2", "--data.global_batch_size=4", steps=2)  # fmt: skip
    losses = curve(tmp_path, "sft")
    assert sorted(losses) == [0, 1] and all(math.isfinite(v) for v in losses.values()), losses
    assert math.isfinite(curve(tmp_path, "sft", "val_loss")[1])
    meta = json.loads(next((tmp_path / "cache" / "packed").glob("*/meta.json")).read_text())
    assert meta["packed"] and meta["train"]["documents"] + meta["validation"]["documents"] == 80
    assert meta["train"]["sequences"] < meta["train"]["documents"]  # several records a sequence
    efficiency = meta["train"]["packing_efficiency"]
    assert f"packing efficiency {efficiency:.1%}" in out, out[-3000:]
