"""The strategy's arguments checked as the command gives them, before jsonargparse or the Trainer sees
them: a misspelt choice, or a layout that fits neither the world nor the model, is then one ValueError
naming the value and the fix (``titan`` prints it alone) instead of a parser dump or a traceback."""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Iterator
from typing import Any, Literal

from lightning_titan.lightning.strategy import TitanStrategy
from lightning_titan.model.config import ModelConfig

# the flags that set a strategy argument: --trainer.strategy.init_args.<name> or --trainer.strategy.<name>
STRATEGY_FLAGS = ("--trainer.strategy.init_args.", "--trainer.strategy.")


def strategy_choices() -> dict[str, tuple[Any, ...]]:
    """TitanStrategy's arguments that take one of a few values (``schedule``, ``zero``, ...)."""
    hints = typing.get_type_hints(TitanStrategy.__init__)
    return {
        name: typing.get_args(hint)
        for name, hint in hints.items()
        if typing.get_origin(hint) is Literal
    }


def strategy_help(width: int = 100) -> str:
    """TitanStrategy's arguments as ``titan fit --help`` lists them after jsonargparse's own help
    (which shows a subclass-typed ``--trainer.strategy`` as one line): each flag, its type or
    choices, its default and its docstring's words."""
    import inspect
    import textwrap

    import docstring_parser

    docs = {
        p.arg_name: " ".join((p.description or "").split())
        for p in docstring_parser.parse(TitanStrategy.__doc__ or "").params
    }
    choices = strategy_choices()
    lines = [
        "",
        "TitanStrategy (--trainer.strategy=titan, the default): set each as "
        "--trainer.strategy.NAME=VALUE (or --trainer.strategy.init_args.NAME=VALUE)",
    ]
    for name, param in inspect.signature(TitanStrategy.__init__).parameters.items():
        if name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        kind = (
            "{" + ",".join(str(c) for c in choices[name]) + "}"
            if name in choices
            else str(param.annotation).replace("typing.", "")
        )
        default = "" if param.default is param.empty else f" (default: {param.default!r})"
        lines.append(f"  --trainer.strategy.{name} {kind}{default}")
        text = docs.get(name, "")
        if text:
            lines += textwrap.wrap(text, width, initial_indent=" " * 8, subsequent_indent=" " * 8)
    return "\n".join(lines)


def check_choice(name: str, value: Any, flag: str) -> None:
    """``value`` of the strategy's ``name`` is one of its choices; ``flag``: how the user set it."""
    choices = strategy_choices().get(name)
    if choices is None or str(value) in (str(c) for c in choices):
        return
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(value).replace("-", "_"), names, n=1, cutoff=0.6)
    fix = f"did you mean {flag}={close[0]}?" if close else f"e.g. {flag}={names[0]}"
    raise ValueError(f"{name}={value!r} is not one of {', '.join(names)}: {fix}")


def flag_values(argv: list[str]) -> Iterator[tuple[str, str, str]]:
    """(argument name, value, flag) of each strategy argument on the command line."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        prefix = next((p for p in STRATEGY_FLAGS if flag.startswith(p)), None)
        if prefix is None or "." in flag[len(prefix) :]:
            continue
        if not eq:  # --flag value
            if i + 1 == len(argv):
                continue
            value = argv[i + 1]
        yield flag[len(prefix) :], value, flag


def check_choices_in_argv(argv: list[str]) -> None:
    for name, value, flag in flag_values(argv):
        check_choice(name, value, flag)


def check_choices_in_config(config: dict[str, Any], path: str) -> None:
    """The strategy's choices in a composed ``--config`` file (``path``) that names TitanStrategy."""
    strategy = (config.get("trainer") or {}).get("strategy")
    if not isinstance(strategy, dict) or "TitanStrategy" not in str(strategy.get("class_path")):
        return
    for name, value in (strategy.get("init_args") or {}).items():
        check_choice(name, value, f"{path}: trainer.strategy.init_args.{name}")


def known_world_size(devices: Any, num_nodes: Any, accelerator: Any) -> int | None:
    """devices x num_nodes where the command gives both as counts (on CPU "auto" is 1 device). None
    where Lightning counts the devices (-1, "auto" on GPUs, device ids) or torchrun does (WORLD_SIZE:
    the Trainer names a mismatch itself)."""
    if "WORLD_SIZE" in os.environ or not isinstance(num_nodes, int):
        return None
    if devices == "auto" and accelerator == "cpu":
        devices = 1
    if isinstance(devices, str) and devices.isdigit():
        devices = int(devices)
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        return None
    return devices * num_nodes


def check_layout_fits(strategy: TitanStrategy, config: ModelConfig | None, trainer: Any) -> None:
    """The degrees multiply to the world size where it is known (``trainer``: the Trainer's parsed
    arguments) and split ``config``'s layers, experts, heads and sequence: what the Trainer and the
    launcher would find, found before either prints a line (``layout="auto"`` chooses degrees that
    fit)."""
    if strategy.layout.auto:
        return
    degrees = dict(strategy.layout.degrees)
    world = known_world_size(trainer.devices, trainer.num_nodes, trainer.accelerator)
    if world is not None:
        strategy.layout.resolve(world, 0)
        degrees = strategy.parallel_dims.degrees
    split = {a: degrees[a] for a in ("pp", "ep", "tp", "cp")}
    if config is not None and -1 not in split.values():
        config.validate_layout(
            **split, split=strategy.options.split, fold_ep=strategy.layout.fold_ep
        )
