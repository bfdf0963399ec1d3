"""One stage's tensors of a checkpoint, read in one process without a collective.

A rank of a layout that has no optimizer to restore (generation) loads its own layers and expert
rows from a checkpoint written under any layout: only those tensors' bytes are read. ``load_sharded``
is the collective load training resumes with.
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import nn

from lightning_titan.checkpoint import integrity, storage
from lightning_titan.checkpoint import state as keys
from lightning_titan.checkpoint.reader import (
    check_config,
    check_entries,
    mismatch,
    model_prefix,
    read_checkpoint_info,
    read_metadata,
    single_process_ok,
)


def load_stage(
    path: str | os.PathLike,
    model: nn.Module,
    *,
    share: tuple[int, int] = (0, 1),
    weights_only: bool | None = None,
) -> int:
    """Load ``model``, a stage of any layout (a StageModel: its layers, its global experts' rows), from
    the checkpoint at ``path`` in place; returns the tensor bytes read.

    Shapes and the model config are checked against the saved ones first. ``share=(i, n)``: this
    process checks the i-th of every n shard files against its checksum, so n processes loading
    their stages together check every file once (as ``load_sharded`` splits them); (0, 1) checks
    them all."""
    path = Path(path)
    info = read_checkpoint_info(path, weights_only=weights_only)
    metadata = read_metadata(path)
    prefix = model_prefix(metadata)
    # the views into the model's tensors, under the checkpoint's keys: DCP reads straight into them
    targets = {
        prefix + key.removeprefix(keys.MODEL): view
        for key, view in keys.model_entries(model).items()
    }
    problems = check_entries(targets, metadata)
    if problems:
        raise mismatch(path, info.get("model_config"), model, problems)
    check_config(path, info.get("model_config"), model)
    index, count = share
    integrity.verify(path, integrity.shard_names(metadata)[index::count])
    with single_process_ok():
        storage.load(targets, path, no_dist=True, weights_only=weights_only)
    return sum(t.numel() * t.element_size() for t in targets.values())
