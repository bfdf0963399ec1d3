"""Run folders, and which checkpoint a path or ``last`` names. Pure file operations, no collectives.

Every launch of a config writes into a folder of its own, ``<save_dir>/<name>/version_N/`` (Lightning's
numbering), with its metrics, plots and ``checkpoints/`` inside; so reruns never collide. A path given
where a checkpoint is expected may be a run folder (``runs/ep/version_3``), its ``checkpoints``
folder, or a config's folder of runs (``runs/ep``): it names the newest complete checkpoint in it
whose files verify. ``last`` is that of the config's folder of runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from lightning_titan.checkpoint import files, integrity

CHECKPOINTS = "checkpoints"  # a run folder's checkpoint folder
_VERSION = "version_"


def versions(root: str | os.PathLike) -> list[int]:
    """The N of every ``version_N`` folder in ``root`` (a config's folder of runs)."""
    root = Path(root)
    if not root.is_dir():
        return []
    names = (p.name for p in root.iterdir() if p.is_dir())
    return sorted(int(n[len(_VERSION) :]) for n in names if _is_version(n))


def _is_version(name: str) -> bool:
    return name.startswith(_VERSION) and name[len(_VERSION) :].isdigit()


def next_version(root: str | os.PathLike) -> int:
    return max(versions(root), default=-1) + 1


def claim_version(root: str | os.PathLike) -> int:
    """Create the next ``version_N`` folder in ``root`` and return N. ``mkdir`` either creates or
    fails, so two launches at the same moment get two folders."""
    Path(root).mkdir(parents=True, exist_ok=True)
    while True:
        n = next_version(root)
        try:
            (Path(root) / f"{_VERSION}{n}").mkdir()
            return n
        except FileExistsError:
            continue  # another launch took it between the listing and the mkdir


def run_checkpoint_dirs(root: str | os.PathLike) -> list[Path]:
    """Every run's ``checkpoints`` folder in ``root`` (a config's folder of runs), and ``root``'s
    own ``checkpoints`` where a run of an older version of this tool saved there."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p / CHECKPOINTS for p in [root, *root.iterdir()] if (p / CHECKPOINTS).is_dir())


def checkpoint_dirs(path: str | os.PathLike) -> list[Path]:
    """The checkpoint folders ``path`` names: itself (a folder of checkpoints), its ``checkpoints``
    (a run folder), or every run's ``checkpoints`` in it (a config's folder of runs)."""
    path = Path(path)
    if not path.is_dir():
        return []
    return run_checkpoint_dirs(path) or [path]


def corrupt_reason(path: Path) -> str | None:
    """Why the complete checkpoint ``path`` fails its checksums (the marker's size and crc32 of
    every file); None when every file verifies. One without checksums is left to the load, which
    says what it is."""
    saved = integrity.saved_checksums(path)
    for name, expected in (saved or {}).items():
        try:
            found = files.checksum(path / name)
        except (FileNotFoundError, IsADirectoryError):
            return f"{name} is missing"
        if found != list(expected):
            return f"{name} changed after the save"
    return None


def newest_valid(
    dirs: Iterable[str | os.PathLike], say: Callable[[str], None] = lambda line: None
) -> Path | None:
    """The most recently completed checkpoint directly inside ``dirs`` whose files verify; a newer
    one that does not is skipped with one line to ``say`` naming it. None: none is complete."""
    complete = [
        p
        for d in dirs
        if Path(d).is_dir()
        for p in Path(d).iterdir()
        if not p.name.startswith(".") and files.is_complete_checkpoint(p)
    ]
    for path in sorted(complete, key=files.completed_at, reverse=True):
        why = corrupt_reason(path)
        if why is None:
            return path
        say(f"[titan] skipping corrupt checkpoint {path} ({why}); trying the one before it")
    return None


def resolve(path: str | os.PathLike, say: Callable[[str], None] = lambda line: None) -> Path:
    """The checkpoint ``path`` names: itself if it is one, else the newest valid complete checkpoint
    of the run folder, checkpoint folder or folder of runs it is. Raises ValueError naming the
    folder when it holds none; a path that is not a folder is returned as given (the load says
    what is wrong with it)."""
    path = Path(path)
    if not path.is_dir() or files.is_complete_checkpoint(path):
        return path
    found = newest_valid(checkpoint_dirs(path), say)
    if found is None:
        raise ValueError(
            f"{path} holds no complete checkpoint (as a run folder, a folder of checkpoints or a "
            f"folder of runs): {files.WHAT_A_CHECKPOINT_IS}. Pass one, or a run folder that has "
            f"one in its {CHECKPOINTS}/"
        )
    return found
