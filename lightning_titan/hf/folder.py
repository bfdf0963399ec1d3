"""What a Hugging Face model folder may point at: its own files, never a path out of it.

An index entry like ``../../.ssh/id_rsa`` or a symlinked ``tokenizer.json`` would otherwise make
``init_from`` read, and ``titan export`` copy, any file the user can read. Links are followed, and
the file they end at must be inside the folder. The one exception is the Hugging Face hub cache,
whose ``snapshots/<revision>/`` files are links into the same repository's ``blobs/``.
"""

from __future__ import annotations

from pathlib import Path


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
