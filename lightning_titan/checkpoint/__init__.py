"""Sharded, layout-free, atomic checkpoints: save under one layout, load under any other.

- ``sharded``: ``save_sharded`` / ``load_sharded``, called by every rank together;
- ``background``: ``BackgroundSaves``, a save's state copied to host memory and written by a thread;
- ``state``: the global keys (one per parameter, one per global expert row, optimizer state likewise);
- ``files``: the directory protocol (temp sibling, ``COMPLETE`` marker, atomic swap, recovery);
- ``lock``: one job per checkpoint directory;
- ``storage``: DCP reading that runs no code from the files, writing that names a full disk;
- ``integrity``: checksums written with a save, checked on load;
- ``reader``: reading one back in a single process (info, consolidation, checks and messages).
- ``stage``: one stage of any layout read in its own process, without a collective (generation).
"""

from lightning_titan.checkpoint.background import BackgroundSaves
from lightning_titan.checkpoint.files import is_complete_checkpoint, latest_complete
from lightning_titan.checkpoint.lock import CheckpointDirInUse
from lightning_titan.checkpoint.reader import (
    FORMAT_VERSION,
    ModelEntries,
    consolidate,
    consolidate_optimizers,
    read_checkpoint_info,
)
from lightning_titan.checkpoint.sharded import load_sharded, remove_checkpoint, save_sharded
from lightning_titan.checkpoint.storage import UnsafeCheckpointError

__all__ = [
    "BackgroundSaves",
    "FORMAT_VERSION",
    "ModelEntries",
    "CheckpointDirInUse",
    "UnsafeCheckpointError",
    "consolidate",
    "consolidate_optimizers",
    "is_complete_checkpoint",
    "latest_complete",
    "load_sharded",
    "read_checkpoint_info",
    "remove_checkpoint",
    "save_sharded",
]
