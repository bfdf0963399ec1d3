"""Save under one (dp, pp, ep), load under any other: the collective part of the checkpoint package.

A checkpoint is a directory: ``torch.distributed.checkpoint`` shards of the model and optimizer state
under global keys (``state``), ``meta.pt`` (Lightning's other state, optimizer hyper-parameters,
layout, model config) and the ``COMPLETE`` marker (``files``).

Every rank calls ``save_sharded``/``load_sharded`` together. Bad input is found before any shard is
written or read, and every rank raises the same error (the ranks agree through one object gather), so
a mistake seen on one stage never leaves the others waiting in a collective.
"""

from __future__ import annotations

import io
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_titan.checkpoint import files, integrity, lock, reader, storage
from lightning_titan.checkpoint import state as keys
from lightning_titan.checkpoint.background import BackgroundSaves
from lightning_titan.checkpoint.devices import DeviceHooks, Fence
from lightning_titan.checkpoint.reader import FORMAT_VERSION, read_checkpoint_info
from lightning_titan.parallel.dp.zero import NO_SHARDS, ZeroShards
from lightning_titan.runtime import probes
from lightning_titan.runtime.agreement import agree as _agree


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world() -> int:
    return dist.get_world_size() if _distributed() else 1


def save_sharded(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: list[Optimizer],
    meta: dict[str, Any],
    *,
    layout: dict[str, Any],
    background: BackgroundSaves | None = None,
    zero_shards: ZeroShards = NO_SHARDS,
) -> None:
    """Write a complete checkpoint directory at ``path``, or leave ``path`` as it was.

    ``meta`` (Lightning's checkpoint dict without ``state_dict``/``optimizer_states``) and ``layout``
    (dp, pp, ep, global batch size, ...) go into ``meta.pt`` from rank 0. An existing ``path`` is
    replaced only after the new directory is complete. Rank 0 first takes the lock of ``path``'s
    directory (``lock``): a second job saving there is refused.

    ``background``: return once the state is copied to host memory; a thread writes it
    (``background.py``). The save in flight, if any, is waited for first and its error raised.
    ``zero_shards``: under zero>0, the shards whose leaves the optimizers step (``ZeroShards`` of
    the engine's ``zero_groups``).
    """
    zero_shards.check_whole("save")
    if background is not None:
        background.wait()
    path = Path(path)
    error, token, state, info_bytes = None, None, {}, b""
    fence: Fence = DeviceHooks().record_fence()
    try:
        state = keys.model_entries(model, zero_shards)
        state.update(keys.optimizer_entries(model, optimizers, zero_shards).state_dict())
        if _rank() == 0:
            since = lock.acquire(path.parent)
            files.recover(path, since)
            token = files.new_token()
            info_bytes = _info_bytes(model, optimizers, meta, layout)
        if background is not None:
            staged = background.stage(state)
            state, fence = staged.state, staged.fence
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before the collective save
        error = e
    tmp = files.sibling(path, "tmp", _agree(error, token)[0])
    if background is None:
        _write(path, tmp, state, info_bytes, None)
    else:
        group = background.group()
        background.start(lambda: _write(path, tmp, state, info_bytes, group), fence)


def _info_bytes(
    model: nn.Module, optimizers: list[Optimizer], meta: dict[str, Any], layout: dict[str, Any]
) -> bytes:
    """``meta.pt``'s bytes; an unpicklable ``meta`` fails here, before any shard is written."""
    info = {
        "format_version": FORMAT_VERSION,
        integrity.CHECKSUMMED: True,  # so a marker without them reads as damaged, not old
        "meta": meta,
        "layout": {**layout, "world_size": _world()},
        "model_config": reader.model_config(model),
        "param_groups": [keys.hyperparameters(o) for o in optimizers],
    }
    buffer = io.BytesIO()
    torch.save(info, buffer)
    return buffer.getvalue()


def link_sharded(
    path: str | os.PathLike,
    source: str | os.PathLike,
    model: nn.Module,
    optimizers: list[Optimizer],
    meta: dict[str, Any],
    *,
    layout: dict[str, Any],
    background: BackgroundSaves | None = None,
) -> None:
    """Collective. Make ``path`` the checkpoint ``source`` with ``meta`` of its own, where
    ``source`` was saved from the same model and optimizer state (Lightning's ``last`` of the
    event that just saved a top-k checkpoint): its shard files are hard links to ``source``'s,
    ``meta.pt`` and the marker are new, and the swap into ``path`` is atomic as a save's is.

    ``background``: after its save in flight (``source``'s) and the jobs queued before, without
    waiting for it here; dropped if that save fails. Otherwise at once (``source`` is complete).
    """
    path, source = Path(path), Path(source)
    error, token, info_bytes = None, None, b""
    try:
        if _rank() == 0:
            since = lock.acquire(path.parent)
            files.recover(path, since)
            token = files.new_token()
            info_bytes = _info_bytes(model, optimizers, meta, layout)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it before the collective
        error = e
    tmp = files.sibling(path, "tmp", _agree(error, token)[0])
    if background is None:
        _link(path, tmp, source, info_bytes, None)
    else:
        group = background.group()
        background.then(lambda: _link(path, tmp, source, info_bytes, group))


def _link(path: Path, tmp: Path, source: Path, info_bytes: bytes, group: Any) -> None:
    """Rank 0 links ``source``'s files into ``tmp``; then ``_finish`` as after a write."""
    sums: dict[str, Any] = {}
    entries = 0
    if _rank() == 0:
        try:
            saved = files.read_marker(source)
            names = files.link_files(source, tmp)
            sums = {k: v for k, v in saved.get("files", {}).items() if k in names}
            entries = saved.get("entries", 0)
        except Exception as e:  # noqa: BLE001 - every rank raises it, in the agreement _finish closes with
            files.remove(tmp)
            _agree(e, None, group)
    _finish(path, tmp, info_bytes, sums, entries, group)


def _write(path: Path, tmp: Path, state: dict, info_bytes: bytes, group: Any) -> None:
    """Collective over ``group`` (None: the world): the shards into ``tmp``, their checksums, then
    ``_finish``; ``tmp`` is removed if anything fails."""
    writer = storage.RecordingWriter(tmp)
    try:
        with reader.single_process_ok():
            dcp.save(
                state,
                storage_writer=writer,
                checkpoint_id=tmp,
                process_group=group,
                no_dist=not _distributed(),
            )
        probes.fault("checkpoint_save")  # shards written, not yet complete: the worst moment to die
        # dcp.save returns only after its coordinator gathered every rank's write result, so all
        # shards are on disk (fsynced); each rank checksums its own while they are in its page cache.
        error, sums = None, {}
        try:
            sums = integrity.checksums(tmp, writer.shards)
        except Exception as e:  # noqa: BLE001
            error = e
        gathered = _agree(error, sums, group)
    except BaseException as e:
        if _rank() == 0:
            files.remove(tmp)
        explained = storage.explain_write_error(e, path, writer)
        if explained is None:
            raise
        raise explained from e
    sums = {k: v for s in gathered for k, v in s.items()}
    _finish(path, tmp, info_bytes, sums, len(state), group)


def _finish(path: Path, tmp: Path, info_bytes: bytes, sums: dict, entries: int, group: Any) -> None:
    """Rank 0 writes ``meta.pt`` and the marker (with every file's checksum) and swaps ``tmp`` in."""
    error = None
    if _rank() == 0:
        try:
            files.write_file(tmp / files.META_FILE, info_bytes)
            sums.update(integrity.checksums(tmp, [files.META_FILE, files.DCP_METADATA]))
            marker = {"format_version": FORMAT_VERSION, "entries": entries, "files": sums}
            files.mark_complete(tmp, marker)
            files.install(tmp, path)
        except Exception as e:  # noqa: BLE001
            error = storage.explain_write_error(e, path) if isinstance(e, OSError) else e
            error = error or e
            files.remove(tmp)
    _agree(error, None, group)  # the closing barrier: no rank returns before ``path`` is complete


@dataclass(frozen=True)
class _LoadOptions:
    expect_layout: Mapping[str, Any] | None
    weights_only: bool | None
    allow_config_change: Collection[str]
    zero_shards: ZeroShards


@dataclass
class _LoadPlan:
    """What one rank will read, and how to undo the optimizer-state initialisation if it must not."""

    info: dict[str, Any]
    targets: dict[str, Any] = field(
        default_factory=dict
    )  # key -> view into a live tensor, or value
    objects: dict[str, tuple[dict, str]] = field(default_factory=dict)  # non-tensors: where they go
    covered: int = 0  # bit i: this rank loads the checkpoint's i-th model key
    model_keys: list[str] = field(default_factory=list)
    initialised: list[tuple[Optimizer, Tensor]] = field(default_factory=list)
    stale: list[tuple[Optimizer, Tensor]] = field(default_factory=list)

    def rollback(self) -> None:
        for optimizer, p in self.initialised:
            optimizer.state.pop(p, None)


def _plan_load(
    path: Path, model: nn.Module, optimizers: list[Optimizer], options: _LoadOptions
) -> _LoadPlan:
    plan = _LoadPlan(info=read_checkpoint_info(path, weights_only=options.weights_only))
    metadata = reader.read_metadata(path)
    reader.check_layout(path, plan.info["layout"], options.expect_layout)
    config = plan.info.get("model_config")
    model_entries = keys.model_entries(model, options.zero_shards)
    problems = reader.check_entries(model_entries, metadata)
    if problems:  # another shape: no config change can allow that
        raise reader.mismatch(path, config, model, problems)
    reader.check_config(path, config, model, options.allow_config_change)
    # the cheap checks first; then each rank reads a share of the shard files against their checksums
    integrity.verify(path, integrity.shard_names(metadata)[_rank() :: _world()])
    plan.targets.update(model_entries)
    plan.model_keys = sorted(k for k in metadata.state_dict_metadata if k.startswith(keys.MODEL))
    index = {k: i for i, k in enumerate(plan.model_keys)}
    plan.covered = sum(1 << index[k] for k in model_entries)
    if not optimizers:  # model only (evaluation, export)
        return plan

    saved = plan.info["param_groups"]
    if [len(g) for g in saved] != [len(o.param_groups) for o in optimizers]:
        raise ValueError(
            f"checkpoint {path} has {len(saved)} optimizer(s) with {[len(g) for g in saved]} param "
            f"groups, this run has {len(optimizers)} with {[len(o.param_groups) for o in optimizers]}; "
            "configure the same optimizers (or pass none to load the model only)"
        )
    names, zero_shards = keys.param_names(model), options.zero_shards
    try:
        for i, optimizer in enumerate(optimizers):
            have = keys.params_with_state(metadata.state_dict_metadata, i)
            params = list(keys.optimizer_params(optimizer))
            name_of = {id(p): keys.optimizer_param_name(p, names, zero_shards) for p in params}
            empty = [p for p in params if name_of[id(p)] in have and not optimizer.state.get(p)]
            plan.initialised += [(optimizer, p) for p in empty]
            keys.init_optimizer_state(optimizer, empty)
            plan.stale += [(optimizer, p) for p in params if name_of[id(p)] not in have]
        entries = keys.optimizer_entries(model, optimizers, zero_shards)
        for optimizer, p in plan.stale:  # state the checkpoint does not have is dropped, not loaded
            i = optimizers.index(optimizer)
            name = keys.optimizer_param_name(p, names, zero_shards)
            for table in (entries.tensors, entries.objects):
                for key in [k for k in table if keys.key_param(k, i) == name]:
                    del table[key]
        problems = reader.check_entries(entries.state_dict(), metadata)
        if problems:
            raise ValueError(
                f"checkpoint {path} holds other optimizer state than this run's optimizers: "
                f"{'; '.join(problems[:4])}; configure the same optimizer type and options"
            )
    except BaseException:
        plan.rollback()
        raise
    plan.targets.update(entries.state_dict())
    plan.objects = entries.objects
    return plan


def load_sharded(
    path: str | os.PathLike,
    model: nn.Module,
    optimizers: list[Optimizer],
    *,
    expect_layout: Mapping[str, Any] | None = None,
    weights_only: bool | None = None,
    allow_config_change: Collection[str] = (),
    zero_shards: ZeroShards = NO_SHARDS,
) -> dict[str, Any]:
    """Load a checkpoint written under any (dp, pp, ep) into ``model`` and ``optimizers`` in place.

    Optimizer state missing here is created first (one lr=0 step on zero grads; parameters do not
    change), then overwritten; param-group hyper-parameters are restored. ``optimizers=[]`` loads the
    model only. ``expect_layout`` names layout values that must match, e.g.
    ``{"global_batch_size": 32}``. Returns the ``meta`` dict given to ``save_sharded``.

    Every file is checked against the checksums written with the save, and the model's config
    against the saved one: a differing field (n_heads, top_k, rope_theta, ...) is an error unless
    named in ``allow_config_change``. Nothing in the files can run code; ``weights_only=False``
    lets ``meta.pt`` and non-tensor values hold any object (only for checkpoints you trust).
    ``zero_shards``: as for ``save_sharded``.
    """
    zero_shards.check_whole("load")
    path = Path(path)
    plan, error = None, None
    options = _LoadOptions(expect_layout, weights_only, tuple(allow_config_change), zero_shards)
    try:
        plan = _plan_load(path, model, optimizers, options)
    except Exception as e:  # noqa: BLE001 - every rank must raise it, before the collective load
        error = e
    try:
        union = 0
        for mask in _agree(error, plan.covered if plan else 0):
            union |= mask
        assert plan is not None  # else this rank had an error, which _agree raised
        # Keys no rank loads mean the model is smaller than the checkpoint (fewer layers, experts).
        unused = [k[len(keys.MODEL) :] for i, k in enumerate(plan.model_keys) if not union >> i & 1]
        if unused:
            missing = f"the model has no place for {len(unused)} saved tensors, e.g. {unused[:3]}"
            raise reader.mismatch(path, plan.info.get("model_config"), model, [missing])
    except BaseException:
        if plan is not None:
            plan.rollback()
        raise

    with reader.single_process_ok():
        storage.load(plan.targets, path, no_dist=not _distributed(), weights_only=weights_only)
    for key, (state, name) in plan.objects.items():
        state[name] = plan.targets[key]  # DCP hands non-tensor values back by replacing the entry
    for optimizer, p in plan.stale:
        optimizer.state.pop(p, None)
    if optimizers:
        for optimizer, groups in zip(optimizers, plan.info["param_groups"], strict=True):
            keys.restore_hyperparameters(optimizer, groups)
    return plan.info["meta"]


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint on global rank 0 only (Lightning calls this on every rank); no collective."""
    if _rank() == 0:
        files.remove(path)
