"""Bad input found at construction or in data setup, in-process: each message names the value or file
and the fix (issue 13, item 7). Slower, launched cases live in test_reliability's bad-input tables;
the `titan fit` launches here (slow tier, one per case) check the command's output: one line, exit 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_titan import TitanDataModule
from lightning_titan.cli import fit_summary, skipped_warning
from lightning_titan.lightning.module import TitanLM
from lightning_titan.model.decoder import ModelConfig


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"max_bytes": -5}, r"max_bytes=-5 must be at least 1.*or None"),
        ({"max_bytes": 0}, r"max_bytes=0 must be at least 1"),
        ({"streaming": True, "steps_per_epoch": 0}, r"steps_per_epoch=0 must be at least 1.*None"),
        ({"val_batches": 0}, r"val_batches=0 must be at least 1.*val_fraction=0"),
    ],
)
def test_datamodule_rejects_non_positive_counts_at_construction(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        TitanDataModule(**kwargs)


def test_weight_decay_must_not_be_negative():
    with pytest.raises(ValueError, match=r"weight_decay=-1 must be >= 0"):
        TitanLM(weight_decay=-1)
    TitanLM(weight_decay=0.0)  # 0 turns it off: allowed


def test_compile_must_be_a_bool():
    with pytest.raises(ValueError, match=r"compile='yes' must be True or False"):
        TitanLM(compile="yes")  # type: ignore[arg-type]


def _trainer(skipped: int | None, steps: int) -> SimpleNamespace:
    strategy = SimpleNamespace() if skipped is None else SimpleNamespace(skipped_steps=skipped)
    return SimpleNamespace(
        callback_metrics={}, global_step=steps, strategy=strategy, logger=None,
        checkpoint_callback=None, world_size=1,
    )  # fmt: skip


def test_fit_summary_counts_skipped_steps_and_warns_when_most_were_skipped():
    module = TitanLM()
    assert "skipped steps      7 of 8" in fit_summary(_trainer(7, 8), module)
    assert "skipped steps      0 of 8" in fit_summary(_trainer(0, 8), module)
    assert "skipped" not in fit_summary(_trainer(None, 8), module)  # another strategy
    warning = skipped_warning(_trainer(7, 8))
    assert warning is not None and warning.startswith(
        "WARNING: 7 of 8 optimizer steps were skipped"
    )
    assert "on_nonfinite='raise'" in warning
    assert skipped_warning(_trainer(4, 8)) is not None
    assert skipped_warning(_trainer(1, 8)) is None and skipped_warning(_trainer(0, 8)) is None
    assert skipped_warning(_trainer(None, 8)) is None


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _bad_files(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the message must say): each one `datasets` fails on without naming a file."""
    (root / "binary").mkdir()
    cases = {
        "binary .txt": (root / "binary" / "a.txt", r"holds binary data \(a NUL byte at offset 0\)"),
        "latin-1 .txt": (root / "latin1.txt", r"is not UTF-8 text \(byte 0xe9 at offset 3\)"),
        "binary .jsonl": (root / "noise.jsonl", r"(holds binary data|is not UTF-8 text)"),
        "bad JSON line": (root / "broken.jsonl", r"is not JSON Lines: line 2"),
    }
    cases["binary .txt"][0].write_bytes(bytes(range(256)) * 50)
    cases["latin-1 .txt"][0].write_bytes(
        ("caf\xe9 na\xefve " * 200 + "\n\nmore\n").encode("latin-1")
    )
    cases["binary .jsonl"][0].write_bytes(bytes(range(255, -1, -1)) * 20)
    cases["bad JSON line"][0].write_text('{"text": "fine"}\n{"text": "cut off\n{"text": "x"}\n')
    return cases


@pytest.mark.timeout(240)
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_an_unreadable_data_file_is_named_with_the_fix(tmp_path, streaming):
    for name, (path, pattern) in _bad_files(tmp_path).items():
        dm = TitanDataModule(
            source=str(path), cache_dir=str(tmp_path / "cache"), streaming=streaming,
            steps_per_epoch=2, seq_len=16, global_batch_size=2,
        )  # fmt: skip
        with pytest.raises(ValueError, match=f"source file '{path}' {pattern}") as info:
            dm.bind(0, 1).setup("fit")
        assert "leave it out of source" in str(info.value), name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("streaming", [False, True], ids=["map", "streaming"])
def test_a_text_column_that_is_not_text_is_named(tmp_path, streaming):
    ints, mixed = tmp_path / "ints.jsonl", tmp_path / "mixed.jsonl"
    write_jsonl(ints, [{"text": i, "body": "x" * 50} for i in range(50)])
    write_jsonl(mixed, [{"text": "abc" * 30 if i % 2 else 7} for i in range(50)])
    for path, kind in ((ints, "int64"), (mixed, "Json")):
        dm = TitanDataModule(
            source=str(path), cache_dir=str(tmp_path / "cache"), streaming=streaming,
            steps_per_epoch=2, seq_len=16, global_batch_size=2,
        )  # fmt: skip
        with pytest.raises(ValueError, match=f"text_column='text' of source '{path}' holds {kind}"):
            dm.bind(0, 1).setup("fit")


def test_as_text_names_a_value_that_is_not_text():
    from lightning_titan.data.readable import as_text

    assert as_text("abc", "text", "s") == "abc" and as_text(None, "text", "s") == ""
    with pytest.raises(ValueError, match=r"text_column='n' of source 'f.jsonl' holds int values"):
        as_text(3, "n", "f.jsonl")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("offline", ["1", ""], ids=["HF_HUB_OFFLINE", "no-flag"])
def test_an_unknown_tokenizer_fails_fast_and_says_tokenizer(monkeypatch, offline):
    """Offline (or on a hub without that name) the error says which tokenizer and the fix, in seconds,
    not after transformers' retries (about 50 s offline, before the fix, with an OSError)."""
    pytest.importorskip("transformers")
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    name = "lightning-titan-no-such-owner/no-such-tokenizer"
    start = time.perf_counter()
    with pytest.raises(
        ValueError, match=rf"tokenizer '{name}' could not be loaded.*tokenizer='byte'"
    ):
        _ = TitanDataModule(tokenizer=name).vocab_size  # what the launcher's preflight reads
    assert time.perf_counter() - start < 30
    with pytest.raises(
        ValueError, match=r"tokenizer '/no/such/folder' could not be loaded: no such"
    ):
        _ = TitanDataModule(tokenizer="/no/such/folder").vocab_size


@pytest.mark.parametrize("damaged", ["tokenizer.json", "tokenizer_config.json"])
def test_a_damaged_tokenizer_folder_is_named_as_such_not_as_a_network_problem(tmp_path, damaged):
    pytest.importorskip("transformers")
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(_byte_level_tokenizer()))
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    (folder / damaged).write_text("{ not json")
    with pytest.raises(ValueError) as info:
        _ = TitanDataModule(tokenizer=str(folder)).vocab_size
    message = str(info.value)
    assert message.startswith(f"tokenizer folder '{folder}' could not be read (")
    assert (
        f"{folder / damaged} is not valid JSON" in message
    )  # the file, not a bare JSONDecodeError
    assert "damaged or missing" in message and "offline" not in message


def _byte_level_tokenizer() -> dict:
    from lightning_titan.hf.export import byte_tokenizer_files

    return byte_tokenizer_files()["tokenizer.json"]


def _damage(path: Path, how: str) -> None:
    arrow = next((path / "train").glob("*.arrow"))
    if how == "truncated":
        with open(arrow, "r+b") as f:
            f.truncate(arrow.stat().st_size // 2)
    elif how == "emptied":
        arrow.write_bytes(b"")
    elif how == "no meta.json":
        (path / "meta.json").unlink()
    elif how == "short":  # loads, but fewer rows than were written
        meta = json.loads((path / "meta.json").read_text())
        meta["train"]["sequences"] += 3
        (path / "meta.json").write_text(json.dumps(meta))


@pytest.mark.timeout(240)
def test_a_damaged_data_cache_is_named_and_rebuilt(tmp_path, capfd):
    from lightning_titan.data.prepare import DamagedCache, load_packed

    write_jsonl(tmp_path / "docs.jsonl", [{"text": f"document {i} " * 20} for i in range(60)])
    args = dict(source=str(tmp_path / "docs.jsonl"), cache_dir=str(tmp_path / "cache"), seq_len=16)
    dm = TitanDataModule(**args, global_batch_size=2).bind(0, 1)
    dm.setup("fit")
    path, first = dm.corpus.path, dm.corpus.train[:]["input_ids"]
    for how in ("truncated", "emptied", "no meta.json", "short"):
        _damage(path, how)
        with pytest.raises(
            DamagedCache, match=rf"cache {path} is damaged .*rm -r {path}\) and it is"
        ):
            load_packed(path)
        capfd.readouterr()
        dm = TitanDataModule(**args, global_batch_size=2).bind(0, 1)
        dm.setup("fit")  # rebuilt under the lock, the same rows as at first
        assert dm.corpus.train[:]["input_ids"] == first, how
        assert f"the prepared data cache {path} is damaged (" in capfd.readouterr().err, how


@pytest.mark.parametrize(
    "args,message",
    [
        (["--trainer.strategy.init_args.dp=-1", "--trainer.strategy.init_args.pp=-1"],
         "dp and pp are -1: at most one degree may be -1 (fill the rest)"),
        (["--trainer.strategy.init_args.timeout_minutes=0"], "timeout_minutes=0.0 must be > 0"),
    ],
)  # fmt: skip
def test_a_bad_strategy_argument_is_the_last_line_not_a_cli_dump(
    tmp_path, monkeypatch, args, message
):
    """LightningCLI builds the strategy through jsonargparse's ``str | Strategy`` union, whose error
    lists every type's complaint and dumps the whole namespace; ours must be the whole message."""
    from lightning_titan.cli import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[2] / "configs" / "dp.yaml"
    with pytest.raises(ValueError) as info:
        main(["fit", "--config", str(config), *args])
    assert str(info.value) == message
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "arg, message",
    [
        ("router_bias_update_rate=-0.1", "router_bias_update_rate=-0.1 must be >= 0 (0 turns it off)"),
        ("capacity_factor=-1", "capacity_factor=-1.0 must be a number > 0 (e.g. 1.25), or None for "
                               "dropless routing (every assignment kept)"),
        ("capacity_factor=4", "capacity_factor=4.0 >= n_experts / top_k = 4: an expert could take a "
                              "whole sequence, so nothing is ever dropped; use capacity_factor=None "
                              "(dropless) or a smaller factor"),
    ],
)  # fmt: skip
def test_a_bad_model_argument_is_the_last_line_not_a_cli_dump(tmp_path, monkeypatch, arg, message):
    """The routing options (issue 19) fail in the launcher, before any rank starts, with the
    ModelConfig's own message rather than jsonargparse's dump of the ``ModelConfig | None`` union."""
    from lightning_titan.cli import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[2] / "configs" / "dp.yaml"
    with pytest.raises(ValueError) as info:
        main(["fit", "--config", str(config), f"--model.model.{arg}"])
    assert str(info.value) == message
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "field", ["--model.compile=true", "--model.model.activation_checkpointing=true"]
)
def test_an_overlapped_schedule_with_compile_or_recompute_is_named_while_parsing(
    tmp_path, monkeypatch, field
):
    """dualpipev runs two microbatches' halves on two threads, which compile and recompute are not
    built for: named while the command line is parsed (it was the launcher's ValueError and a
    traceback), before any rank or data."""
    from lightning_titan.cli import UsageError, main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[2] / "configs" / "pp_ep.yaml"
    # a UsageError: raised by the parser's checks (the launcher's would be a plain ValueError)
    with pytest.raises(UsageError, match=r"schedule='dualpipev' does not run with .*=true"):
        main(
            [
                "fit",
                "--config",
                str(config),
                "--trainer.strategy.init_args.schedule=dualpipev",
                field,
            ]
        )
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("rank", [0, 2])
def test_torchrun_with_more_processes_than_devices_names_world_size(monkeypatch, rank):
    """torchrun --nproc_per_node=3 with Trainer devices=2: every rank (not only the one outside the
    layout, while the others wait in the rendezvous) says WORLD_SIZE differs and how to match it."""
    import lightning.pytorch as L

    from lightning_titan.lightning.strategy import TitanStrategy

    env = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "3", "RANK": str(rank), "LOCAL_RANK": str(rank),
           "GROUP_RANK": "0", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as info:
        L.Trainer(accelerator="cpu", devices=2, strategy=TitanStrategy(dp=-1), logger=False)
    assert str(info.value) == (
        "WORLD_SIZE from torchrun is 3 but the Trainer has devices x num_nodes = 2 x 1 = 2: start 2 "
        "processes per node on 1 node(s) (torchrun --nproc_per_node=2 --nnodes=1), or set Trainer "
        "devices and num_nodes so that devices x num_nodes = 3"
    )


def test_fit_summary_reads_the_counts_the_fork_launcher_carries_back():
    """Under start_method=fork the summary is printed by the launcher, whose own trainer has run no
    step: FitCounts puts the worker's counts among the callback metrics, which the launcher receives."""
    import torch

    from lightning_titan.cli import FitCounts

    worker = _trainer(7, 8)
    worker.callback_metrics = {}
    worker.strategy.root_device = torch.device("cpu")
    worker.strategy.reduce = lambda tensor, reduce_op: tensor  # one rank: the identity
    FitCounts().on_train_end(worker, None)
    launcher = _trainer(None, 0)
    launcher.callback_metrics = {**worker.callback_metrics, "train_loss": torch.tensor(2.5)}
    summary = fit_summary(launcher, TitanLM())
    assert "final train_loss   2.5000 (step 8)" in summary
    assert "skipped steps      7 of 8" in summary
    assert "a rank (host max RSS)" in summary  # the worker's peak, carried back too
    assert skipped_warning(launcher).startswith("WARNING: 7 of 8 optimizer steps were skipped")


def test_a_configure_optimizers_returning_a_bare_optimizer_trains(tmp_path):
    """A TitanLM subclass may return its optimizer alone (no lr_scheduler): the step has none to take."""
    import lightning as L
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_titan import TitanStrategy

    class PlainSGD(TitanLM):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    config = ModelConfig(d_model=16, n_layers=1, n_heads=2, ffn_dim=16, n_experts=2, seq_len=8)
    tokens = torch.randint(0, config.vocab_size, (4, config.seq_len + 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=TitanStrategy(), max_steps=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=tmp_path,
    )  # fmt: skip
    environ = dict(os.environ)
    try:
        trainer.fit(PlainSGD(config), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), 2))
    finally:  # the fit leaves a process group and its address behind; later spawns need neither
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    assert trainer.global_step == 2


@pytest.mark.parametrize(
    "content", [b"just some notes\n", b"\xfb" + bytes(range(256)) * 4], ids=["text", "bytes"]
)
def test_a_ckpt_path_file_that_is_no_checkpoint_says_what_one_is(tmp_path, monkeypatch, content):
    """Not torch's advice to retry with weights_only=False (LightningCLI reads a file ckpt_path's
    hyper-parameters before any rank starts): the file, the cause, what a checkpoint is, the fix."""
    from lightning_titan.checkpoint import files
    from lightning_titan.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.ckpt").write_bytes(content)
    config = Path(__file__).resolve().parents[2] / "configs" / "dp.yaml"
    with pytest.raises(ValueError) as info:
        main(["fit", "--config", str(config), "--ckpt_path", "notes.ckpt"])
    message = str(info.value)
    assert message.startswith("--ckpt_path notes.ckpt is not a checkpoint ("), message
    assert files.WHAT_A_CHECKPOINT_IS in message and "--ckpt_path last" in message
    assert "weights_only" not in message
    assert not (tmp_path / "runs").exists()


CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def titan_fit(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIGHTNING_TITAN_CACHE": str(cwd / "cache")}
    return subprocess.run(
        [sys.executable, "-m", "lightning_titan", "fit", "--trainer.max_steps=1", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip


def assert_one_line(done: subprocess.CompletedProcess, *says: str) -> None:
    """Exit status 2 and one line on stderr that says each of ``says``: no traceback, no usage, no
    line from the seed or the Trainer before it, nothing on stdout."""
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr[-3000:])
    assert lines[0].startswith("titan: error: "), lines[0]
    assert all(s in lines[0] for s in says), (says, lines[0])
    assert "Traceback" not in done.stderr and not done.stdout.strip(), done.stdout[-2000:]


# what a plain `titan fit` printed besides its progress and summary, none of it asked for
NOISE = {
    "Lightning's tips": "Tip:",
    "the accelerator inventory": "available:",
    "datasets' bars while it saves the packed data": "Saving the dataset",
    "a line about the MFU's denominator": "mfu:",
}
# the end summary, field by field: the loss, time, speed, memory and where things went
SUMMARY = (
    r"^final train_loss   \d+\.\d{4} \(step 2\)$",
    r"^wall time          \d+\.\d s$",
    r"^tokens/s           [\d,]+ \(mean of the 1 step after the first\)$",
    r"^MFU                \d+\.\d\d% of [\d.e+-]+ TFLOP/s \(every rank's peak summed\)$",
    r"^peak memory        \d+ MiB a rank \(host max RSS\)$",
    r"^layout             dp=1 pp=1 ep=1 \(1 ranks\)$",
    r"^logs               \S+/runs/lightning_logs/version_0/metrics\.csv$",
    r"^loss curve         \S+/runs/lightning_logs/version_0/loss_curve\.png$",
    r"^checkpoints        \S+/runs/lightning_logs/version_0/checkpoints$",
)


@pytest.mark.slow  # one `titan fit` of two steps on the default model and data (about 30 s)
@pytest.mark.timeout(200)
def test_titan_fit_without_a_config_trains_the_default_model_under_titan_strategy(tmp_path):
    """Not Lightning's strategy="auto" (SingleDeviceStrategy, which TitanLM refuses); on a new data
    cache (built and saved in this run), quiet but for progress, and ending with the summary."""
    done = titan_fit(tmp_path, "--trainer.limit_val_batches=0", "--trainer.max_steps=2",
                     "--trainer.log_every_n_steps=1")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    for what, text in NOISE.items():
        assert text not in output, f"titan fit printed {what}:\n{output[-3000:]}"
    summary = done.stdout.split("== titan fit: done\n", 1)[-1]
    for field in SUMMARY:
        assert re.search(field, summary, flags=re.M), (field, summary)
    assert (tmp_path / "cache").is_dir()  # the data was prepared (and saved) by this run
    # rank 0 drew the loss curve in the run folder, beside metrics.csv
    png = tmp_path / "runs" / "lightning_logs" / "version_0" / "loss_curve.png"
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.slow  # one `titan` process (about 15 s)
@pytest.mark.timeout(200)
def test_a_layout_that_does_not_fit_the_world_is_one_line(tmp_path):
    done = titan_fit(tmp_path, "--config", str(CONFIGS / "single.yaml"),
                     "--trainer.strategy.init_args.ep=2")  # fmt: skip
    assert_one_line(done, "1*1*2*1*1 = 2 but the world size is 1", "set one degree to -1")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # one `titan` process (about 15 s)
@pytest.mark.timeout(200)
def test_a_misspelt_schedule_is_one_line_naming_the_schedules(tmp_path, monkeypatch):
    done = titan_fit(tmp_path, "--config", str(CONFIGS / "single.yaml"),
                     "--trainer.strategy.init_args.schedule=zb-h1")  # fmt: skip
    assert_one_line(
        done, "schedule='zb-h1' is not one of 1f1b, gpipe, interleaved_1f1b, zb_h1, zbv,",
        "did you mean --trainer.strategy.init_args.schedule=zb_h1?",
    )  # fmt: skip
    # the same in a config file (in this process): the file and its key
    from lightning_titan.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.yaml").write_text(
        f"config: {CONFIGS / 'single.yaml'}\ntrainer.strategy.init_args.schedule: interleaved\n"
    )
    with pytest.raises(ValueError) as info:
        main(["fit", "--config", "mine.yaml"])
    assert str(info.value).startswith("schedule='interleaved' is not one of 1f1b, gpipe,")
    assert str(info.value).endswith(
        "did you mean mine.yaml: trainer.strategy.init_args.schedule=interleaved_1f1b?"
    )


@pytest.mark.slow  # one `titan` process (about 15 s)
@pytest.mark.timeout(200)
def test_a_layout_that_does_not_fit_the_model_is_one_line(tmp_path):
    """Found before the Trainer is built (on every rank, before any process group), not by the
    launcher's checks after the Trainer printed its devices."""
    done = titan_fit(tmp_path, "--config", str(CONFIGS / "ep.yaml"), "--trainer.devices=4",
                     "--trainer.strategy.init_args.ep=4", "--model.model.n_experts=6")  # fmt: skip
    assert_one_line(
        done, "n_experts=6 is not divisible by ep=4", "choose ep dividing 6 or change n_experts"
    )
    assert not (tmp_path / "runs").exists()


def test_strategy_choices_are_checked_in_each_form_of_the_flag():
    """`--flag=value`, `--flag value` and the short `--trainer.strategy.<name>`; an int choice too."""
    from lightning_titan.lightning.arguments import check_choices_in_argv

    for argv, message in [
        (["--trainer.strategy.init_args.schedule", "gpipee"], "schedule='gpipee' is not one of"),
        (["--trainer.strategy.schedule=zbv2"], "did you mean --trainer.strategy.schedule=zbv?"),
        (["--trainer.strategy.init_args.zero=4"], "zero='4' is not one of 0, 1, 2, 3"),
        (["--trainer.strategy.init_args.reducer=ring"], "e.g. --trainer.strategy.init_args."
                                                        "reducer=bucketed"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(message)):
            check_choices_in_argv(["fit", *argv])
    check_choices_in_argv(["fit", "--trainer.strategy.init_args.zero=1",
                           "--trainer.strategy.init_args.schedule", "zb_h1",
                           "--trainer.strategy.init_args.dp=2", "--trainer.strategy=ddp"])  # fmt: skip


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.lora.base_dtype=bf16"], "precision='32-true'"),
        (["--model.lora.rank=0"], "lora rank=0 must be an int >= 1"),
        (["--model.lora.targets=[attention, qkv]"], "lora target 'qkv' is not one of"),
    ],
)
def test_a_bad_lora_option_is_one_line_while_parsing(tmp_path, monkeypatch, args, message):
    """LoRA's options are checked in the launcher, before any rank starts: a bf16 base without
    bf16 autocast, a rank or a target that cannot be."""
    from lightning_titan.cli import main

    monkeypatch.chdir(tmp_path)
    config = Path(__file__).resolve().parents[2] / "configs" / "dp.yaml"
    with pytest.raises(ValueError, match=re.escape(message)):
        main(["fit", "--config", str(config), *args])
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: d / "absent", "has no config.json: pass a Hugging Face model folder"),
        (lambda d: "Qwen/Qwen3-30B-A3B", "download it first (huggingface-cli download"),
        (lambda d: _damaged_config(d), "is not valid JSON"),
    ],
)
def test_a_bad_init_from_is_one_line_while_parsing(tmp_path, monkeypatch, make, message):
    """A missing folder, a Hub id, a damaged config.json: named before any rank starts."""
    from lightning_titan.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        main(["fit", f"--model.init_from={make(tmp_path)}", "--trainer.max_steps=1"])
    assert not (tmp_path / "runs").exists()


def _damaged_config(folder: Path) -> Path:
    (folder / "hf").mkdir()
    (folder / "hf" / "config.json").write_text('{"model_type": "qwen3_moe"')
    return folder / "hf"


def _tiny_corpus(folder: Path) -> Path:
    folder.mkdir()
    (folder / "a.txt").write_text("hello world, a small corpus. " * 30)  # 13 windows of 65 tokens
    return folder


@pytest.mark.timeout(120)
def test_a_split_too_small_for_one_batch_names_its_size_and_the_fix(tmp_path):
    """Each split packs into fewer seq_len+1 windows than one global batch: the message names the
    split, its windows and tokens, what one batch needs, and the fixes."""
    from lightning_titan.data.checks import TooLittleData

    source = str(_tiny_corpus(tmp_path / "tiny"))
    cases = {  # (val_fraction, global_batch_size) -> what the message says
        (0.0, 16): ("the training split packs into 13 sequences of 65 tokens (", "tokens from 1 "
                    "documents)", "(1040 tokens)"),
        (0.1, 2): ("the validation split packs into 0 sequences of 65 tokens", "(130 tokens)",
                   "raise val_fraction (or set it to 0: no validation)"),
    }  # fmt: skip
    for (val_fraction, batch), says in cases.items():
        dm = TitanDataModule(source=source, cache_dir=str(tmp_path / "cache"), seq_len=64,
                             val_fraction=val_fraction, global_batch_size=batch)  # fmt: skip
        with pytest.raises(TooLittleData) as info:
            dm.bind(0, 1).setup("fit")
        message = str(info.value)
        assert f"needs global_batch_size={batch} of them" in message, message
        assert all(s in message for s in says), (says, message)
        assert "give more text (source / max_bytes)" in message, message
        assert message.endswith("or lower global_batch_size or seq_len"), message


@pytest.mark.slow  # one `titan fit` on one rank that stops in the data's setup (about 20 s)
@pytest.mark.timeout(200)
def test_a_split_too_small_for_one_batch_is_one_line_from_the_ranks(tmp_path):
    """Found in the data's setup on the ranks, not while parsing: no traceback, no rank report, the
    message as the last line, exit status 2."""
    source = _tiny_corpus(tmp_path / "tiny")
    done = titan_fit(tmp_path, f"--data.source={source}", "--trainer.enable_progress_bar=false")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    assert lines[-1].startswith("titan: error: the validation split packs into 0 sequences"), lines
    assert "Traceback" not in done.stderr and "failed:" not in done.stderr, done.stderr[-3000:]
    assert "== titan fit" not in done.stdout, done.stdout[-2000:]


def test_a_forked_rank_that_found_too_little_data_raises_it_in_the_parent():
    """Under start_method=fork torch hands the parent a rank's traceback as text: the launcher raises
    the rank's TooLittleData again (the command's one line, a notebook's exception); other errors
    stay torch's."""
    from torch.multiprocessing import ProcessRaisedException

    from lightning_titan.data.checks import TooLittleData
    from lightning_titan.lightning.launchers import found_alike

    said = "the training split packs into 3 sequences of 65 tokens (...); give more text"
    traceback = ("\n\n-- Process 1 terminated with the following error:\nTraceback (most recent "
                 'call last):\n  File "x.py", line 1, in f\n    raise TooLittleData(\n'
                 f"lightning_titan.data.checks.TooLittleData: {said}\n")  # fmt: skip
    found = found_alike(ProcessRaisedException(traceback, 1, 123))
    assert isinstance(found, TooLittleData) and str(found) == said
    other = traceback.replace("lightning_titan.data.checks.TooLittleData", "ValueError")
    assert found_alike(ProcessRaisedException(other, 1, 123)) is None
    assert found_alike(TooLittleData(said)) is None  # not a rank's: raised as it is
