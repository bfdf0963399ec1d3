"""The ``titan`` command: LightningCLI over TitanLM and TitanDataModule, plus ``export``, ``plan``,
``bench`` and ``doctor``.

titan fit --config configs/dp_pp_ep.yaml
titan fit --config configs/dp_pp_ep.yaml --trainer.strategy.init_args.pp=4
python -m lightning_titan validate --config configs/single.yaml --ckpt_path last
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_titan.checkpoint import files
from lightning_titan.checkpoint.storage import short_cause
from lightning_titan.data import records
from lightning_titan.data.chat import check_options
from lightning_titan.data.checks import TooLittleData
from lightning_titan.data.corpus import Source
from lightning_titan.data.prepare import default_cache_dir
from lightning_titan.hf import load as hf_load
from lightning_titan.lightning import arguments
from lightning_titan.lightning.config_files import compose_config
from lightning_titan.lightning.datamodule import TitanDataModule
from lightning_titan.lightning.module import TitanLM, check_base_precision
from lightning_titan.lightning.progress import StepProgressBar
from lightning_titan.lightning.quiet import quiet_known_noise
from lightning_titan.lightning.restarts import RestartingLauncher
from lightning_titan.lightning.run_folders import place_run
from lightning_titan.lightning.strategy import TitanStrategy
from lightning_titan.lightning.summary import (
    FitCounts,
    draw_loss_curve,
    fit_summary,
    skipped_warning,
)
from lightning_titan.model.config import FULL
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.model.lora import LoRA
from lightning_titan.train.options import check_overlap_threads

__all__ = [
    "FitCounts",
    "TitanCLI",
    "cli_components",
    "compose_config",
    "fit_summary",
    "main",
    "quiet_known_noise",
    "skipped_warning",
]

TRAINER_DEFAULTS = {
    "accelerator": "cpu",
    # TitanLM trains under TitanStrategy only: without a --config, not Lightning's "auto"
    "strategy": {"class_path": "lightning_titan.TitanStrategy"},
    "logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger",
        "init_args": {"save_dir": "runs"},
    },
}
# the commands that are not Trainer methods: name -> one line for `titan --help`
OTHER_COMMANDS = {
    "export": "Write a checkpoint as a Hugging Face folder of its family (transformers loads it).",
    "plan": "Rank the layouts a model allows on N devices by their modelled step time and memory.",
    "generate": "Continue a prompt with a checkpoint's model, in one process or on a pp x ep "
    "layout (greedy or sampled).",
    "bench": "Time every composition on 2, 4 and 8 ranks at the same tokens per step.",
    "doctor": "Check a new GPU machine: ep2, dualpipev, background saves and compile against their "
    "references, a pass/fail table (--cpu: the same on CPU ranks).",
}


def one_seed(seed: bool | int) -> int:
    """``seed_everything`` is also the model's init seed and the data's order seed: one value."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(
            f"seed_everything={seed!r}: titan needs an int seed, the same on every rank, for the "
            "initial weights and the data order; e.g. --seed_everything=1234"
        )
    return seed


def model_seq_len(model: Namespace | ModelConfig | None) -> int:
    """The model's ``seq_len`` from the parsed ``model.model`` value (None: ModelConfig's default)."""
    if model is None:
        return ModelConfig().seq_len
    if isinstance(model, ModelConfig):
        return model.seq_len
    return int(model.init_args.seq_len)


class UsageError(ValueError):
    """A bad value on the command line: ``titan`` prints its message alone, exit status 2."""


class TitanCLI(LightningCLI):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # TitanLM builds its optimizer on its weight-decay groups once its stage exists, where
        # LightningCLI's --optimizer would build one on no parameters: --model.optimizer instead
        kwargs.setdefault("auto_configure_optimizers", False)
        self.started = time.perf_counter()  # the summary's wall time: parsing, ranks, data, fit
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # no `predict`: the pipeline engine computes losses, not outputs to collect; to generate, use
        # `titan export` and transformers' `generate()`
        return {k: v for k, v in LightningCLI.subcommands().items() if k != "predict"}

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict
    ) -> None:
        main_kwargs.setdefault(
            "description",
            "Train Mixture-of-Experts decoders with data, pipeline, expert, context and tensor "
            "parallelism composed.",
        )
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        action = self.parser._subcommands_action
        if add_subcommands and action is not None:  # listed in `titan --help`; main() runs them
            for name, line in OTHER_COMMANDS.items():
                action.add_subcommand(name, self.init_parser(description=line), help=line)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        config = self.config.get(self.config.get("subcommand") or "", self.config)
        if not isinstance(config, Namespace):
            return
        check_ckpt_file(config.get("ckpt_path"))
        check_records(config.get("data"))
        # here, before LightningCLI seeds and the Trainer says which devices it found: a mistake is
        # then the only line printed
        trainer = config.trainer
        strategy, model = check_strategy(trainer), check_model_config(config.get("model"))
        check_lora(config.get("model"), trainer.get("precision"))
        check_init_from(config.get("model"))
        if strategy is not None:
            module = config.get("model")
            compiled = bool(module.get("compile")) if isinstance(module, Namespace) else False
            recompute = model is not None and model.recompute == FULL
            try:
                arguments.check_layout_fits(strategy, model, trainer)
                check_overlap_threads(strategy.options, recompute=recompute, compiled=compiled)
            except ValueError as err:
                raise UsageError(str(err)) from None

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.model", "data.seq_len", compute_fn=model_seq_len)
        parser.link_arguments("seed_everything", "model.seed", compute_fn=one_seed)
        parser.link_arguments("seed_everything", "data.seed", compute_fn=one_seed)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        # its own run folder (created when a subcommand runs); ckpt_path "last" or a folder resolved
        place_run(config, UsageError, claim=self.subcommand is not None)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer = config["trainer"]
        callbacks = list(trainer.get("callbacks") or [])
        has_bar = any(isinstance(c, ProgressBar) for c in callbacks)
        extra: list[Callback] = [FitCounts()]
        if trainer.get("enable_progress_bar") is not False and not has_bar:
            extra.append(StepProgressBar())
        kwargs["callbacks"] = [*callbacks, *extra]
        try:
            return super().instantiate_trainer(**kwargs)
        except ValueError as err:  # the Trainer's checks of its arguments (the strategy's layout)
            raise UsageError(str(err)) from None

    def after_fit(self) -> None:
        if isinstance(self.trainer.strategy.launcher, RestartingLauncher):
            return  # this process trained no rank: its rank 0 printed the summary
        if self.trainer.is_global_zero:
            seconds = time.perf_counter() - self.started
            curve = draw_loss_curve(self.trainer)
            print(fit_summary(self.trainer, self.model, seconds, curve), flush=True)
            warning = skipped_warning(self.trainer)
            if warning:
                print(warning, file=sys.stderr, flush=True)


def check_records(data: Any) -> None:
    """A malformed chat or prompt/completion record of a local source, named by file and line,
    before any rank starts: the line alone, not a launcher's traceback."""
    if not isinstance(data, Namespace) or "class_path" in data or "source" not in data:
        return  # another data module, or given by class path: it checks its own data
    src = Source(data.source, data.text_column, data.source_config, data.source_split,
                 data.max_bytes, data.get("format", "auto"), data.get("train_on", "responses"),
                 data.get("pack"))  # fmt: skip
    try:
        check_options(src.data_format, src.train_on)
        records.check_records(src, data.cache_dir or default_cache_dir(), bool(data.streaming))
    except ValueError as err:
        raise UsageError(str(err)) from None


def check_strategy(trainer: Namespace) -> TitanStrategy | None:
    """Build a TitanStrategy once before LightningCLI does, so that its ValueError is the last line the
    user sees: jsonargparse buries it in a dump of what each type of ``str | Strategy`` expected.
    Returns it for the layout's checks (None: another strategy, or one LightningCLI reports)."""
    strategy = trainer.get("strategy")
    if not isinstance(strategy, Namespace) or "class_path" not in strategy:
        return None
    module, _, name = strategy.class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name, None)
    if not (isinstance(cls, type) and issubclass(cls, TitanStrategy)):
        return None
    init = strategy.get("init_args")
    kwargs = init.as_dict() if isinstance(init, Namespace) else dict(init or {})
    try:
        built: TitanStrategy = cls(**kwargs)
    except ValueError as err:
        raise UsageError(str(err)) from None
    except Exception:  # noqa: BLE001 - anything else: LightningCLI reports it as before
        return None
    return built


def check_ckpt_file(ckpt_path: Any) -> None:
    """LightningCLI reads a ``ckpt_path`` that is a file with ``torch.load`` for its hyper-parameters;
    on a file that is no checkpoint, torch's error advises ``weights_only=False``, wrong for a file
    of unknown bytes. Name the file and what a checkpoint is instead."""
    if not ckpt_path or not Path(ckpt_path).is_file():
        return  # a directory (ours), "last", or missing: the load says what is wrong
    try:
        loaded = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        if isinstance(loaded, dict):
            return  # a plain Lightning checkpoint: the strategy's load says what it is
        cause = f"it holds a {type(loaded).__name__}"
    except Exception as e:  # noqa: BLE001 - whatever the bytes made torch raise
        cause = short_cause(e)
    raise UsageError(
        f"--ckpt_path {ckpt_path} is not a checkpoint ({cause}): {files.WHAT_A_CHECKPOINT_IS}. "
        "Pass such a directory, or --ckpt_path last to resume from the newest"
    )


def check_model_config(model: Namespace | None) -> ModelConfig | None:
    """Build the ModelConfig once before LightningCLI does, for the same reason as ``check_strategy``:
    its ValueError (e.g. ``capacity_factor=-1 must be ...``) is then the whole message. Returns the
    model trained, for the layout's checks (None: not known before ``init_from``'s folder is read)."""
    if not isinstance(model, Namespace):
        return None
    fields = model.get("model")
    if fields is None:  # TitanLM's default model
        return None if model.get("init_from") else ModelConfig()
    if not isinstance(fields, Namespace):
        return None
    try:
        config = ModelConfig(**fields.as_dict())
    except ValueError as err:
        raise UsageError(str(err)) from None
    except Exception:  # noqa: BLE001 - anything else: LightningCLI reports it as before
        return None
    return None if model.get("init_from") else config


def check_init_from(model: Namespace | None) -> None:
    """``--model.init_from``'s folder read (config.json, the tensors' names and shapes) as TitanLM
    will: a missing, damaged or incomplete folder, or a Hub id, is then one line."""
    if not isinstance(model, Namespace) or model.get("init_from") is None:
        return
    folder, fields = model.get("init_from"), model.get("model")
    given = ModelConfig(**fields.as_dict()) if isinstance(fields, Namespace) else None
    try:
        hf_load.check_folder(folder, hf_load.config_from_folder(folder, given))
    except (ValueError, OSError) as err:
        raise UsageError(str(err)) from None


def check_lora(model: Namespace | None, precision: Any) -> None:
    """``--model.lora.*`` built once here, and its base dtype against the precision: one line each."""
    lora = model.get("lora") if isinstance(model, Namespace) else None
    if not isinstance(lora, Namespace):
        return
    try:
        check_base_precision(LoRA(**lora.as_dict()), str(precision))
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from None


def cli_components() -> tuple[type, type]:
    return TitanLM, TitanDataModule


def main(args: list[str] | None = None) -> None:
    """``titan``: ``args`` for Python callers; None reads the command line (as every rank does)."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] == "export":
        from lightning_titan.hf.export import main as export_main

        return export_main(argv[1:])
    if argv and argv[0] == "plan":
        from lightning_titan.tools.plan_cli import main as plan_main

        plan_main(argv[1:])
        return None
    if argv and argv[0] == "bench":
        from lightning_titan.tools.bench import main as bench_main

        bench_main(argv[1:])  # its results dict is for Python callers, not an exit status
        return None
    if argv and argv[0] == "generate":
        from lightning_titan.tools.generate import main as generate_main

        generate_main(argv[1:])
        return None
    if argv and argv[0] == "doctor":
        from lightning_titan.tools.doctor import main as doctor_main

        status = doctor_main(argv[1:])
        if status:  # a failed row: a script or CI job must see it
            sys.exit(status)
        return None
    quiet_known_noise()
    try:
        check_optimizer_flags(argv)
        check_config_files(argv)
        try:  # a misspelt schedule: jsonargparse would print its usage and every union type's error
            arguments.check_choices_in_argv(argv)
        except ValueError as err:
            raise UsageError(str(err)) from None
        try:
            TitanCLI(
                *cli_components(),
                trainer_defaults=TRAINER_DEFAULTS,
                seed_everything_default=1234,
                save_config_kwargs={"overwrite": True},
                args=args,  # None: LightningCLI reads sys.argv itself (both would warn)
            )
        except SystemExit as done:
            if done.code == 0 and asks_for_help(argv):  # the strategy's options after the rest
                print(arguments.strategy_help())
            raise
    except UsageError as err:
        if args is not None:  # a Python caller gets the exception
            raise
        # under torchrun every rank parses and prints: say which one
        rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        where = f"rank {rank}/{world}: " if rank is not None and world not in (None, "1") else ""
        print(f"titan: error: {where}{err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except TooLittleData as err:  # found alike on every rank (data/checks.py): rank 0 says it
        if args is not None:
            raise
        if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
            print(f"titan: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


def asks_for_help(argv: list[str]) -> bool:
    """``titan fit --help`` (or validate, test): the subcommand's own help, not a group's."""
    return bool(argv) and argv[0] in TitanCLI.subcommands() and ("--help" in argv or "-h" in argv)


def check_config_files(argv: list[str]) -> None:
    """Read each ``--config`` as the parser will, so that a key it would reject with a dump of the
    whole namespace is refused first, naming the file, the key and the fix."""
    given = [b for a, b in zip(argv, argv[1:], strict=False) if a == "--config"]
    given += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in given:
        if os.path.isfile(path):  # a missing file: the parser says so
            try:
                arguments.check_choices_in_config(compose_config(path), path)
            except ValueError as err:
                raise UsageError(str(err)) from None


def check_optimizer_flags(argv: list[str]) -> None:
    for flag in ("--optimizer", "--lr_scheduler"):
        if any(a == flag or a.startswith(flag + "=") or a.startswith(flag + ".") for a in argv):
            raise UsageError(
                f"{flag} is not a titan option: TitanLM builds the optimizer on its weight-decay "
                "groups and runs its warmup and cosine schedule; name another optimizer with "
                "--model.optimizer=torch.optim.SGD --model.optimizer.lr=0.1 (its own arguments)"
            )


if __name__ == "__main__":
    main()
