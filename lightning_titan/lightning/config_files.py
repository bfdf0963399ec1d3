"""What a layout config means as one plain dict: configs/<layout>.yaml = configs/base.yaml + its keys.

The ``titan`` parser (jsonargparse) reads a config's ``config: base.yaml`` key as "load that file here",
relative to the config; each later key replaces one value of it (dotted: ``trainer.devices: 8``; a
model field: ``model.model.init_args.seq_len: 256``) or a whole block (nested). ``compose_config`` applies the same rules without a parser, for scripts that edit
a config (tests, docs/gen_reference.py); tests/cli/test_cli.py checks that it agrees with the parser.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

INCLUDE = "config"
# values the parser holds as {class_path, init_args}: a dotted key sets their fields under init_args
CLASS_VALUED = ("model.model", "trainer.strategy", "trainer.logger")


def compose_config(path: str | Path) -> dict[str, Any]:
    """The full nested config that ``titan fit --config path`` starts from (before defaults)."""
    path = Path(path)
    own = yaml.safe_load(path.read_text()) or {}
    if not isinstance(own, dict):
        raise ValueError(f"{path} holds a {type(own).__name__}, not a mapping of config keys")
    composed: dict[str, Any] = {}
    for key, value in own.items():
        if key == INCLUDE:
            if composed:
                raise ValueError(
                    f"{path}: `{INCLUDE}: {value}` must come first: the keys before it would be "
                    "overwritten by the included file"
                )
            composed = compose_config(path.parent / value)
        else:
            check_dotted_key(path, key)
            _set(composed, key.split("."), value)
    return composed


def _set(tree: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        if key == "init_args" and "class_path" not in tree:
            # a dataclass block (model.model) takes its fields under init_args in dotted keys, as
            # the parser wants them, but holds them directly
            continue
        if not isinstance(tree.get(key), dict):
            tree[key] = {}
        tree = tree[key]
    tree[keys[-1]] = value


def check_dotted_key(path: Path, key: str) -> None:
    """``model.model.n_layers: 4`` would reach the user as jsonargparse's dump of the model's union
    type: say which key to write instead."""
    for prefix in CLASS_VALUED:
        rest = key[len(prefix) + 1 :].split(".")[0] if key.startswith(prefix + ".") else None
        if rest not in (None, "class_path", "init_args", "dict_kwargs"):
            fixed = f"{prefix}.init_args.{key[len(prefix) + 1 :]}"
            raise ValueError(
                f"{path}: the key `{key}` sets a field of {prefix}, which goes under init_args: "
                f"write `{fixed}`"
            )
