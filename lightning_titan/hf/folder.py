"""What a Hugging Face model folder may point at: its own files, never a path out of it.

An index entry like ``../../.ssh/id_rsa`` or a symlinked ``tokenizer.json`` would otherwise make
``init_from`` read, and ``titan export`` copy, any file the user can read. Links are followed, and
the file they end at must be inside the folder. The one exception is the Hugging Face hub cache,
whose ``snapshots/<revision>/`` files are links into the same repository's ``blobs/``.

Its files are read here too, so that a damaged one (a cut download, an edit) is named with the fix:
json's and safetensors' own errors name no file. So is a tensor holding NaN or inf, by its name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

REDOWNLOAD = "re-download it (or write the folder again with save_pretrained())"


def _roots(folder: Path) -> list[Path]:
    real = folder.resolve()
    if real.parent.name == "snapshots":  # <cache>/models--org--name/snapshots/<revision>
        return [real, real.parent.parent / "blobs"]
    return [real]


def outside(folder: str | Path, path: str | Path) -> Path | None:
    """Where ``path`` (relative to ``folder``) ends, links followed, if that is outside ``folder``;
    None when it stays inside."""
    real = (Path(folder) / path).resolve()
    return None if any(real.is_relative_to(root) for root in _roots(Path(folder))) else real


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file of the folder (``config.json``, the safetensors index), which must hold an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): it is "
            f"damaged or cut short; {REDOWNLOAD}"
        ) from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); {REDOWNLOAD}"
        ) from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ValueError(
            f"{path} nests its JSON deeper than Python's parser goes (a config.json or index is a "
            f"few levels deep): it is damaged or not a model's file; {REDOWNLOAD}"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object; {REDOWNLOAD}")
    return value


def open_safetensors(path: Path) -> Any:
    """``safe_open`` of one tensor file (use it in a ``with``); a header it cannot read (a length
    past the end of the file, offsets out of it, no JSON) is named with the fix."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as e:
        raise ValueError(
            f"{path} is not a safetensors file that can be read ({e}): it is damaged or cut short; "
            f"{REDOWNLOAD}"
        ) from None


def check_finite(path: Path, name: str, tensor: Tensor) -> None:
    """Raise unless every value of ``tensor`` (``name``, read from ``path``) is finite: a NaN or inf
    in a pretrained weight would make training diverge, and look like a learning rate too high."""
    # a NaN or inf makes the sum non-finite; the sum allocates nothing the size of the tensor (a
    # mask would, on the rank's peak while loading), and the mask is built only to count
    if not tensor.is_floating_point() or torch.isfinite(tensor.sum()):
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        raise ValueError(
            f"{path.name}: {name!r} holds {bad} non-finite value(s) (NaN or inf) of "
            f"{tensor.numel()}: the checkpoint is damaged; {REDOWNLOAD}, or repair that tensor"
        )
