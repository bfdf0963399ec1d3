"""Reading and validating a checkpoint directory in one process (no process group needed).

``consolidate`` turns a sharded checkpoint into one full state dict (experts stacked back to
``[E, ...]``) for inference, evaluation or export; the helpers here also do the validation that
``load_sharded`` runs on every rank before it touches a tensor.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_titan.checkpoint import files
from lightning_titan.checkpoint import state as keys

FORMAT_VERSION = 1


def read_checkpoint_info(path: str | os.PathLike) -> dict[str, Any]:
    """``meta.pt`` of a complete checkpoint: format_version, meta, layout, model_config, param_groups."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; check the path (or ckpt_path)")
    if not path.is_dir():
        raise ValueError(
            f"{path} is a file, not a sharded checkpoint directory; pass a directory written by "
            "save_sharded (TitanStrategy.save_checkpoint)"
        )
    if not files.is_complete_checkpoint(path):
        raise ValueError(
            f"incomplete checkpoint {path}: no {files.MARKER} marker (or its shard index or "
            f"{files.META_FILE} is missing); its save was interrupted, use an earlier checkpoint"
        )
    try:
        # Lightning's loop/callback state holds arbitrary objects, hence weights_only=False.
        info = torch.load(path / files.META_FILE, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means the same thing here
        raise ValueError(f"corrupt checkpoint {path}: cannot read {files.META_FILE}: {e}") from e
    version = info.get("format_version") if isinstance(info, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format_version={version!r}, this code reads {FORMAT_VERSION}; "
            "use the lightning_titan version that wrote it"
        )
    return info


def read_metadata(path: Path) -> Metadata:
    """DCP's shard index, after checking that every shard file is there and not truncated."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"corrupt checkpoint {path}: cannot read its shard index: {e}") from e
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else -1
        if size < end:
            found = "missing" if size < 0 else f"{size} bytes"
            raise ValueError(
                f"corrupt checkpoint {path}: shard {name} is {found}, its index needs {end} bytes"
            )
    return metadata


def model_config(model: nn.Module) -> dict[str, Any] | None:
    """The first dataclass ``config`` on the model or a submodule (e.g. ``ModelConfig``), as a dict."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            return dataclasses.asdict(config)
    return None


def check_entries(entries: Mapping[str, Any], metadata: Metadata) -> list[str]:
    """What in ``entries`` the checkpoint lacks or holds with another shape, one line each."""
    problems = []
    for key, value in entries.items():
        saved = metadata.state_dict_metadata.get(key)
        is_tensor = isinstance(value, Tensor)
        if saved is None:
            problems.append(f"{key} is not in the checkpoint")
        elif is_tensor != isinstance(saved, TensorStorageMetadata):
            problems.append(f"{key} is a {'tensor' if is_tensor else 'non-tensor'} here, not there")
        elif isinstance(saved, TensorStorageMetadata) and tuple(saved.size) != tuple(value.shape):
            problems.append(f"{key} has shape {tuple(saved.size)} there, {tuple(value.shape)} here")
    return problems


def mismatch(path: Path, saved_config: dict | None, model: nn.Module, problems: list[str]):
    """A ValueError that leads with the differing config fields, then the first few key problems."""
    current = model_config(model)
    diffs = []
    if saved_config and current:
        diffs = [
            f"checkpoint has {k}={saved_config.get(k)!r}, model has {current.get(k)!r}"
            for k in sorted(set(saved_config) | set(current))
            if saved_config.get(k) != current.get(k)
        ]
    shown = "; ".join(problems[:4]) + (f"; {len(problems) - 4} more" if len(problems) > 4 else "")
    return ValueError(
        f"checkpoint {path} does not fit this model: "
        + ("; ".join(diffs) + f" ({shown})" if diffs else shown)
        + "; build the model with the checkpoint's config"
    )


def check_layout(path: Path, layout: Mapping[str, Any], expect: Mapping[str, Any] | None) -> None:
    diffs = [
        f"{k}={layout.get(k)!r} (this run has {v!r})"
        for k, v in (expect or {}).items()
        if layout.get(k) != v
    ]
    if diffs:
        raise ValueError(
            f"checkpoint {path} was written with {', '.join(diffs)}; resume with the same values "
            "(the data position depends on them)"
        )


@contextmanager
def single_process_ok() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to ... in a single process": here it is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _full_state(path: Path, prefix: str) -> dict[str, Any]:
    """Every entry under ``prefix``, read in this process, per-expert rows stacked to ``[E, ...]``.

    Returned names drop the prefix; optimizer entries keep their ``/<state name>`` suffix.
    """
    read_checkpoint_info(path)
    metadata = read_metadata(path)
    state: dict[str, Any] = {}
    for key, saved in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            state[key] = (
                torch.empty(saved.size, dtype=saved.properties.dtype)
                if isinstance(saved, TensorStorageMetadata)
                else None
            )
    with single_process_ok():
        dcp.load(state, checkpoint_id=path, no_dist=True)

    out: dict[str, Any] = {}
    rows: dict[str, dict[int, Tensor]] = {}
    for key, value in state.items():
        param, sep, state_name = key[len(prefix) :].rpartition("/")
        name, expert = keys.split_expert_key(param if sep else state_name)
        name = f"{name}/{state_name}" if sep else name
        if expert is None:
            out[name] = value
        else:
            rows.setdefault(name, {})[expert] = value
    for name, by_expert in rows.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(
                f"corrupt checkpoint {path}: {name} has experts {sorted(by_expert)}, "
                f"not 0..{len(by_expert) - 1}"
            )
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def consolidate(path: str | os.PathLike) -> dict[str, Tensor]:
    """The full model state dict, experts stacked to ``[E, ...]``, read in one process.

    Names are those of the module given to ``save_sharded`` (``model.layers.0...`` when that was a
    LightningModule holding the StageModel as ``self.model``).
    """
    return _full_state(Path(path), keys.MODEL)


def consolidate_optimizers(path: str | os.PathLike) -> list[dict[str, dict[str, Any]]]:
    """Each optimizer's full state as ``{param name: {state name: value}}``, experts stacked."""
    path = Path(path)
    out = []
    for i in range(len(read_checkpoint_info(path)["param_groups"])):
        per_param: dict[str, dict[str, Any]] = {}
        for key, value in _full_state(path, keys.optim_prefix(i)).items():
            param, _, state_name = key.rpartition("/")
            per_param.setdefault(param, {})[state_name] = value
        out.append(per_param)
    return out
