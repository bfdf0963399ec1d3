"""Reading and validating a checkpoint directory in one process (no process group needed).

``consolidate`` turns a sharded checkpoint into one full state dict (experts stacked back to
``[E, ...]``) for inference, evaluation or export; the helpers here also do the validation that
``load_sharded`` runs on every rank before it touches a tensor.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from lightning_titan.checkpoint import files, integrity, records, storage
from lightning_titan.checkpoint import state as keys
from lightning_titan.checkpoint.storage import UnsafeCheckpointError
from lightning_titan.model.config import ModelConfig

FORMAT_VERSION = 1


def _not_ours(path: Path) -> str | None:
    """Why a directory without our marker is not a TitanStrategy checkpoint (None: it is one of ours
    whose marker is gone, i.e. its save or removal was interrupted)."""
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return "it is empty"
    if (path / files.META_FILE).is_file():
        try:
            info = torch.load(path / files.META_FILE, map_location="cpu", weights_only=True)
            if isinstance(info, dict) and "format_version" in info:
                return None
        except Exception:  # noqa: BLE001 - unreadable: not ours
            pass
    shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
    return f"it holds {shown} but no {files.MARKER} marker and no {files.META_FILE} of ours"


def _check_is_checkpoint(path: Path) -> None:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist; check the path (or ckpt_path)")
    if not path.is_dir():
        raise ValueError(
            f"{path} is a file, not a sharded checkpoint directory (a plain Lightning checkpoint?): "
            f"{files.WHAT_A_CHECKPOINT_IS}. Pass such a directory (or ckpt_path='last')"
        )
    if files.is_complete_checkpoint(path):
        return
    inner = files.latest_complete(path)
    if inner is not None:
        raise ValueError(
            f"{path} is a directory of checkpoints, not one checkpoint; pass one of them, e.g. "
            f"{inner} (or ckpt_path='last')"
        )
    foreign = _not_ours(path)
    if foreign is not None:
        raise ValueError(
            f"{path} is not a TitanStrategy checkpoint: {foreign} (a checkpoint of another "
            "strategy, e.g. Lightning's FSDP or ModelParallelStrategy?). Load it with the strategy "
            "that wrote it, or pass a directory written by TitanStrategy"
        )
    raise ValueError(
        f"incomplete checkpoint {path}: no {files.MARKER} marker (or its shard index or "
        f"{files.META_FILE} is missing); its save was interrupted, use an earlier checkpoint"
    )


def read_checkpoint_info(
    path: str | os.PathLike, *, weights_only: bool | None = None
) -> dict[str, Any]:
    """``meta.pt`` of a complete checkpoint: format_version, checksummed, meta, layout, model_config,
    param_groups.

    Read weights-only (plain containers, numbers, strings, tensors: nothing in it can run code)
    unless ``weights_only=False``, for a checkpoint you trust whose Lightning state holds other
    objects (a callback's custom state)."""
    path = Path(path)
    _check_is_checkpoint(path)
    verifiable = integrity.saved_checksums(path) is not None
    if verifiable:  # before it is read; without checksums, meta.pt says whether it had them
        integrity.verify(path, [files.META_FILE])
    try:
        info = torch.load(
            path / files.META_FILE, map_location="cpu", weights_only=weights_only is not False
        )
    except Exception as e:  # noqa: BLE001 - whatever the bytes made torch raise
        if storage.refers_to_code(e):
            raise UnsafeCheckpointError(
                f"refused to load {path / files.META_FILE}: {storage.why_refused(e)} (it holds an "
                "object a weights-only load does not allow: loading it could run code). If "
                "you wrote this checkpoint and trust it, load it with weights_only=False, e.g. "
                "trainer.fit(..., weights_only=False)"
            ) from None
        # from None: torch's error advises weights_only=False, wrong for bytes that are no pickle
        raise ValueError(storage.not_written_here(path, files.META_FILE, e)) from None
    version = info.get("format_version") if isinstance(info, dict) else None
    if version != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {path} has format_version={version!r}, this code reads {FORMAT_VERSION}; "
            "use the lightning_titan version that wrote it"
        )
    if not verifiable:  # a damaged marker, or a checkpoint from before checksums
        integrity.check_verifiable(path, info)
    return info


def read_metadata(path: Path) -> Metadata:
    """DCP's shard index (read through the allow-list), after checking that every shard file is
    there and not truncated."""
    integrity.verify(path, [files.DCP_METADATA])
    try:
        metadata = storage.load_metadata(path / files.DCP_METADATA)
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ValueError(storage.not_written_here(path, files.DCP_METADATA, e)) from None
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


def _config_object(model: nn.Module) -> Any:
    for module in model.modules():
        config = getattr(module, "config", None)
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            return config
    return None


def model_config(model: nn.Module) -> dict[str, Any] | None:
    """The first dataclass ``config`` on the model or a submodule (e.g. ``ModelConfig``), as a dict."""
    config = _config_object(model)
    return None if config is None else dataclasses.asdict(config)


# Fields that change neither what a loaded model computes nor how it trains on: free to differ.
FREE_FIELDS = frozenset({"activation_checkpointing", "init_std"})


def check_config(
    path: Path, saved: dict | None, model: nn.Module, allow: Collection[str] = ()
) -> None:
    """Every field of the model's config must equal the saved one, except ``FREE_FIELDS`` and those
    named in ``allow`` (a deliberate change, e.g. ``["rope_theta"]``); shapes alone miss n_heads,
    top_k, rope_theta... A field the checkpoint predates passes if the model has its default."""
    config = _config_object(model)
    if not saved or config is None:
        return
    current = dataclasses.asdict(config)
    unknown = sorted(set(allow) - set(current))
    if unknown:
        raise ValueError(
            f"allow_config_change names {unknown}, not fields of {type(config).__name__} "
            f"({', '.join(current)})"
        )
    # n_kv_heads=None is n_kv_heads=n_heads: a field differs only if it differs spelled out too
    spell = ModelConfig.spelled_out if isinstance(config, ModelConfig) else dict
    spelled_saved, spelled_current = spell(saved), spell(current)
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    diffs = []
    for k in sorted(set(saved) | set(current)):
        if k in FREE_FIELDS or k in allow:
            continue
        if k not in saved and current.get(k) == defaults.get(k, dataclasses.MISSING):
            continue
        if saved.get(k) != current.get(k) and spelled_saved.get(k) != spelled_current.get(k):
            diffs.append(k)
    if diffs:

        def value(raw: dict, spelled: dict, k: str) -> str:
            same = raw.get(k) == spelled.get(k)
            return repr(raw.get(k)) if same else f"{raw.get(k)!r} (= {spelled.get(k)!r})"

        shown = "; ".join(
            f"checkpoint has {k}={value(saved, spelled_saved, k)}, "
            f"model has {value(current, spelled_current, k)}"
            for k in diffs
        )
        raise ValueError(
            # the same opening as a shape mismatch: ranks whose shapes fit report this one instead
            f"checkpoint {path} does not fit this model: {shown}. Build the model "
            f"with the checkpoint's config, or to change it deliberately pass "
            f"allow_config_change={diffs} (load_sharded's argument; on a TitanStrategy set "
            "strategy.allow_config_change)"
        )


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


def mismatch(
    path: Path, saved_config: dict | None, model: nn.Module, problems: list[str]
) -> ValueError:
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


def _full_state(path: Path, prefix: str, weights_only: bool | None) -> dict[str, Any]:
    """Every entry under ``prefix``, read in this process, per-expert rows stacked to ``[E, ...]``.

    Returned names drop the prefix; optimizer entries keep their ``/<state name>`` suffix.
    """
    read_checkpoint_info(path, weights_only=weights_only)
    metadata = read_metadata(path)
    integrity.verify(path, integrity.shard_names(metadata))
    state: dict[str, Any] = {}
    for key, saved in metadata.state_dict_metadata.items():
        if key.startswith(prefix):
            state[key] = (
                torch.empty(saved.size, dtype=saved.properties.dtype)
                if isinstance(saved, TensorStorageMetadata)
                else None
            )
    with single_process_ok():
        storage.load(state, path, no_dist=True, weights_only=weights_only)

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


def consolidate(path: str | os.PathLike, *, weights_only: bool | None = None) -> dict[str, Tensor]:
    """The full model state dict, experts stacked to ``[E, ...]``, read in one process.

    Names are those of the module given to ``save_sharded`` (``model.layers.0...`` when that was a
    LightningModule holding the StageModel as ``self.model``). Every file is checked against the
    checksums written with the save; nothing in the files can run code (see ``read_checkpoint_info``
    for ``weights_only``).
    """
    return _full_state(Path(path), keys.MODEL, weights_only)


def consolidate_optimizers(
    path: str | os.PathLike, *, weights_only: bool | None = None
) -> list[dict[str, dict[str, Any]]]:
    """Each optimizer's full state as ``{param name: {state name: value}}``, experts stacked."""
    path = Path(path)
    out = []
    info = read_checkpoint_info(path, weights_only=weights_only)
    for i in range(len(info["param_groups"])):
        per_param: dict[str, dict[str, Any]] = {}
        for key, value in _full_state(path, keys.optim_prefix(i), weights_only).items():
            param, _, state_name = key.rpartition("/")
            per_param.setdefault(param, {})[state_name] = value
        out.append(per_param)
    return out


def model_prefix(metadata: Metadata) -> str:
    """What the checkpoint's keys put before a model tensor's name: TitanLM holds the stage as
    ``self.model``, so its keys start with ``model/model.``; a bare StageModel's with ``model/``."""
    nested = any(k.startswith(keys.MODEL + "model.") for k in metadata.state_dict_metadata)
    return keys.MODEL + ("model." if nested else "")


class ModelEntries:
    """A checkpoint's model tensors read a few at a time, each into a tensor of its saved shape and
    dtype (what ``titan export`` streams): the files are checked once, here; a ``read`` holds only
    the entries it was asked for."""

    def __init__(self, path: str | os.PathLike, *, weights_only: bool | None = None) -> None:
        self.path, self.weights_only = Path(path), weights_only
        read_checkpoint_info(self.path, weights_only=weights_only)
        self.metadata = read_metadata(self.path)
        integrity.verify(self.path, integrity.shard_names(self.metadata))
        self.prefix = model_prefix(self.metadata)

    def key(self, name: str, expert: int | None) -> str:
        """The checkpoint's key of our tensor ``name`` (of global expert ``expert``'s row)."""
        return self.prefix + (name if expert is None else keys.expert_key(name, expert))

    def read(self, entries: list[tuple[str, int | None]]) -> list[Tensor]:
        """Tensors ``entries`` ((name, global expert or None) each), in that order, each read into
        its own new tensor: a read holds its bytes once (``records.read_into``)."""
        state: dict[str, Any] = {}  # the entries read through DCP
        read: dict[str, Tensor] = {}
        for name, expert in entries:
            key = self.key(name, expert)
            saved = self.metadata.state_dict_metadata.get(key)
            if not isinstance(saved, TensorStorageMetadata):
                raise ValueError(
                    f"corrupt checkpoint {self.path}: it holds no tensor {key!r}, which its "
                    "model config has; use another checkpoint"
                )
            out = torch.empty(saved.size, dtype=saved.properties.dtype)
            # the bytes straight into ``out``; a record of another form goes through DCP
            if not records.read_into(self.path, self.metadata, key, out):
                state[key] = out
            read[key] = out
        if state:
            with single_process_ok():
                storage.load(state, self.path, no_dist=True, weights_only=self.weights_only)
        return [read[self.key(name, expert)] for name, expert in entries]
