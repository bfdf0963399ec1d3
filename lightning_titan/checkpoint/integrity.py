"""Checksums written with a save, checked on load: a changed byte in any file fails the load, naming it.

Each rank checksums the shard files it wrote (right after ``dcp.save``, while they are in its page
cache); rank 0 adds ``.metadata`` and ``meta.pt`` and writes them all into the ``COMPLETE`` marker.
On load the shard files are split over the ranks, so each byte is read once more in all.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from lightning_titan.checkpoint import files


def shard_names(metadata: Metadata) -> list[str]:
    """The data files DCP's index refers to."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()})


def checksums(directory: Path, names: list[str]) -> dict[str, list[int]]:
    return {name: files.checksum(directory / name) for name in names}


def verify(path: Path, names: list[str]) -> None:
    """Raise ValueError naming the first of ``names`` whose size or crc32 differs from the save's."""
    saved = files.read_marker(path).get("files")
    if saved is None:
        warnings.warn(
            f"checkpoint {path} has no checksums (written by an older lightning_titan): its files "
            "are not verified",
            stacklevel=3,
        )
        return
    for name in names:
        expected = saved.get(name)
        if expected is None:
            raise ValueError(
                f"corrupt checkpoint {path}: {name} is not among the files its save wrote; use "
                "another checkpoint"
            )
        try:
            found = files.checksum(path / name)
        except FileNotFoundError:
            raise ValueError(f"corrupt checkpoint {path}: {name} is missing") from None
        if found != list(expected):
            raise ValueError(
                f"corrupt checkpoint {path}: {name} changed after the save (now {found[0]} bytes, "
                f"crc32 {found[1]:08x}; saved {expected[0]} bytes, crc32 {expected[1]:08x}), a "
                "disk or copy error or an edit; use another checkpoint (an earlier one, or a copy)"
            )
