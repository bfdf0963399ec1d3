"""Checksums written with a save, checked on load: a changed byte in any file fails the load, naming it.

Each rank checksums the shard files it wrote (right after ``dcp.save``, while they are in its page
cache); rank 0 adds ``.metadata`` and ``meta.pt`` and writes them all into the ``COMPLETE`` marker.
On load the shard files are split over the ranks, so each byte is read once more in all.

``meta.pt`` records that the marker holds checksums (``CHECKSUMMED``): a marker without them is then
damaged, and the load is refused. Only a checkpoint saved before checksums existed loads unverified,
and only when ``ALLOW_UNVERIFIED`` is set.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from lightning_titan.checkpoint import files

CHECKSUMMED = "checksummed"  # the key in meta.pt
ALLOW_UNVERIFIED = "LIGHTNING_TITAN_ALLOW_UNVERIFIED_CHECKPOINT"


def shard_names(metadata: Metadata) -> list[str]:
    """The data files DCP's index refers to."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()})


def checksums(directory: Path, names: list[str]) -> dict[str, list[int]]:
    return {name: files.checksum(directory / name) for name in names}


def saved_checksums(path: Path) -> dict[str, Any] | None:
    """The checksums in the marker (file name -> [size, crc32]); None when it holds none."""
    saved = files.read_marker(path).get("files")
    return saved if isinstance(saved, dict) else None


def _marker_state(path: Path) -> str:
    marker = path / files.MARKER
    if not marker.is_file():
        return "is missing"
    if marker.stat().st_size == 0:
        return "is empty"
    if not files.read_marker(path):
        return "is not the JSON a save writes (truncated or overwritten)"
    return "lists no files"


def _allowed() -> bool:
    return os.environ.get(ALLOW_UNVERIFIED) == "1"


def check_verifiable(path: Path, info: dict[str, Any]) -> None:
    """Raise unless the marker of ``path`` holds checksums. ``info``: its ``meta.pt``.

    A checkpoint whose ``meta.pt`` says it was saved with checksums has a damaged marker: refused
    whatever the environment says. One from before checksums loads only with ``ALLOW_UNVERIFIED=1``.
    """
    if saved_checksums(path) is not None:
        return
    marker, state = path / files.MARKER, _marker_state(path)
    if info.get(CHECKSUMMED):
        raise ValueError(
            f"corrupt checkpoint {path}: its marker {marker} {state}, but the save wrote every "
            "file's checksum into it, so none of its files can be verified (a disk or copy error "
            "or an edit); use another checkpoint (an earlier one, or a copy)"
        )
    if not _allowed():
        raise ValueError(
            f"checkpoint {path} cannot be verified: its marker {marker} {state} (no checksums), as "
            "in a checkpoint saved by a lightning_titan from before checksums, or one whose marker "
            f"was damaged. To load it unverified, only if you trust its files, set "
            f"{ALLOW_UNVERIFIED}=1 (e.g. `{ALLOW_UNVERIFIED}=1 titan fit ... --ckpt_path {path}`)"
        )
    warnings.warn(
        f"checkpoint {path} has no checksums in {marker} (saved before checksums existed): its "
        f"files are not verified ({ALLOW_UNVERIFIED}=1)",
        stacklevel=3,
    )


def verify(path: Path, names: list[str]) -> None:
    """Raise ValueError naming the first of ``names`` whose size or crc32 differs from the save's."""
    saved = saved_checksums(path)
    if saved is None:
        # read_checkpoint_info runs first and says why; this guards any other way in
        if not _allowed():
            check_verifiable(path, {})
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
