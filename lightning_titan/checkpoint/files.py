"""Directory checkpoints that are either complete or invisible: temp siblings, a marker, atomic swaps.

A save writes ``.<name>.tmp-<token>`` next to ``path``, puts the ``COMPLETE`` marker in it once every
file is on disk, then swaps it into ``path`` (one ``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere
rename-aside / rename-in) and deletes the old one. Hidden names never match Lightning's
``last*.ckpt`` / top-k patterns, so a killed save is never picked up, and ``path`` always holds either
the previous complete checkpoint or the new complete one. Pure file operations, no collectives.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import secrets
import shutil
import socket
import time
import zlib
from pathlib import Path

from lightning_titan.runtime import orphans

MARKER = "COMPLETE"
META_FILE = "meta.pt"
DCP_METADATA = ".metadata"  # written last by torch.distributed.checkpoint's coordinator
_SIBLING_KINDS = ("tmp", "old", "del")
# for errors about a path that is not one
WHAT_A_CHECKPOINT_IS = (
    f"a TitanStrategy checkpoint is a directory holding {DCP_METADATA}, {META_FILE} and {MARKER} "
    "(with its .distcp shards), written by TitanStrategy.save_checkpoint, e.g. "
    "runs/<name>/version_N/checkpoints/last.ckpt"
)


def new_token() -> str:
    """``<host>-<pid>-<random>``: whoever finds the leftover can tell whether its writer still lives."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(6)}"


_TOKEN = re.compile(r"(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{12}")


def _newest_mtime(path: Path) -> float:
    times = [path.lstat().st_mtime]
    if path.is_dir() and not path.is_symlink():
        times += [p.lstat().st_mtime for p in path.iterdir()]
    return max(times)


def is_dead(path: Path, leftover: Path, since: float) -> bool:
    """Whether no live process can still be writing ``leftover`` (a hidden sibling of ``path``).

    Its name records the writer's host and pid: on this host, dead means that pid is gone (this very
    process counts as dead: its saves are synchronous, so an own leftover is from a failed one).
    Otherwise (another host, an older name) it must be untouched since ``since``, the time this
    job took the directory's lock: a writer alive then would have held the lock.
    """
    token = leftover.name[len(f".{path.name}.") :].partition("-")[2]  # after "<kind>-"
    match = _TOKEN.fullmatch(token)
    if match and match["host"] == socket.gethostname():
        pid = int(match["pid"])
        return pid == os.getpid() or not orphans.running(pid)
    try:
        return _newest_mtime(leftover) < since
    except FileNotFoundError:
        return False  # it is being moved or deleted by its owner right now


def sibling(path: Path, kind: str, token: str) -> Path:
    """Hidden working name next to ``path``: ``.<name>.<kind>-<token>``."""
    return path.parent / f".{path.name}.{kind}-{token}"


def siblings(path: Path) -> list[Path]:
    """Leftovers of earlier saves/removals of ``path`` (temp, set-aside and being-deleted dirs)."""
    if not path.parent.is_dir():
        return []
    prefixes = tuple(f".{path.name}.{kind}-" for kind in _SIBLING_KINDS)
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefixes))


_LEFTOVER = re.compile(rf"\.(?P<name>.+)\.(?P<kind>{'|'.join(_SIBLING_KINDS)})-.+")
_LEFTOVER_IS = {
    "tmp": "a save of {name} that was interrupted",
    "old": "the previous {name}, set aside by an interrupted swap",
    "del": "a removal of {name} that was interrupted",
}


def describe(path: Path) -> str:
    """``path``'s name and what it is, for an error that lists a checkpoint directory."""
    leftover = _LEFTOVER.fullmatch(path.name)
    if leftover:
        what = _LEFTOVER_IS[leftover["kind"]].format(name=leftover["name"])
    elif is_complete_checkpoint(path):
        what = "a complete checkpoint"
    else:
        what = "a directory" if path.is_dir() else "a file"
    return f"{path.name} ({what})"


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a directory checkpoint whose save ran to the end."""
    path = Path(path)
    return all((path / name).is_file() for name in (MARKER, META_FILE, DCP_METADATA))


def completed_at(path: Path) -> float:
    """When the save of a complete checkpoint finished (from its marker), for ordering."""
    try:
        return float(json.loads((path / MARKER).read_text())["completed_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return (path / MARKER).stat().st_mtime


def latest_complete(dirpath: str | os.PathLike) -> Path | None:
    """The most recently completed checkpoint directly inside ``dirpath``, ignoring partial ones."""
    dirpath = Path(dirpath)
    if not dirpath.is_dir():
        return None
    done = [
        p for p in dirpath.iterdir() if not p.name.startswith(".") and is_complete_checkpoint(p)
    ]
    return max(done, key=completed_at, default=None)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    """Write and fsync, so the marker never reaches the disk before the data it vouches for."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def checksum(file: Path) -> list[int]:
    """``[size, crc32]`` of a file, read in 8 MiB pieces."""
    crc, size = 0, 0
    with open(file, "rb") as f:
        while piece := f.read(8 << 20):
            crc, size = zlib.crc32(piece, crc), size + len(piece)
    return [size, crc]


def read_marker(path: Path) -> dict:
    """The ``COMPLETE`` marker's JSON ({} if it is not JSON: an older or foreign marker)."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def mark_complete(path: Path, info: dict) -> None:
    """Write the marker last into a finished directory (its files are already fsynced)."""
    write_file(path / MARKER, json.dumps({**info, "completed_at": time.time()}).encode())
    _fsync(path)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2``); False if this OS/filesystem cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE) failed: {os.strerror(err)}")


def _delete(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        # the marker first: a delete killed midway must not leave a partial directory that looks complete
        (path / MARKER).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def install(tmp: Path, path: Path, *, allow_exchange: bool = True) -> None:
    """Move the complete directory ``tmp`` to ``path``, replacing what is there only once it is in.

    Without an atomic exchange there is a moment when ``path`` is missing while its previous version
    sits aside as ``.<name>.old-*``; ``recover`` puts the newest complete one back after a crash there.
    """
    if not (path.exists() or path.is_symlink()):
        os.rename(tmp, path)
    elif allow_exchange and not path.is_symlink() and _exchange(tmp, path):
        _delete(tmp)  # ``tmp`` now names the previous version
    else:
        old = sibling(path, "old", new_token())
        os.rename(path, old)
        os.rename(tmp, path)
        _delete(old)
    _fsync(path.parent)


def recover(path: Path, since: float | None = None) -> None:
    """Clean up what earlier killed saves/removals of ``path`` left behind (rank 0, before a save).

    If ``path`` is missing but a finished save (or the version set aside for it) survived as a hidden
    sibling, the newest complete one is moved back to ``path``; every other leftover is deleted. Only
    leftovers of dead writers are touched (:func:`is_dead`; ``since``: when this job took the
    directory's lock, default now): a live job's save in progress is never deleted.
    """
    since = time.time() if since is None else since
    leftovers = [p for p in siblings(path) if is_dead(path, p, since)]
    if not (path.exists() or path.is_symlink()):
        complete = [p for p in leftovers if not p.name.startswith(f".{path.name}.del-")]
        complete = [p for p in complete if is_complete_checkpoint(p)]
        if complete:
            newest = max(complete, key=completed_at)
            os.rename(newest, path)
            leftovers.remove(newest)
    for p in leftovers:
        _delete(p)


def link_files(source: Path, target: Path) -> list[str]:
    """Put every file of the complete checkpoint ``source`` but its marker and ``meta.pt`` into the
    new directory ``target`` as hard links (copies where the file system has none): a second name
    for the same shards, written once. Returns their names. Nothing ever writes into a checkpoint's
    files after its save, so the two directories can share them; removing one leaves the other."""
    if not is_complete_checkpoint(source):
        raise FileNotFoundError(
            f"{source} is not a complete checkpoint to link {target.name} to (it was removed or "
            f"replaced during the save); {WHAT_A_CHECKPOINT_IS}"
        )
    target.mkdir()
    names = []
    for file in sorted(source.iterdir()):
        if file.name in (MARKER, META_FILE) or not file.is_file():
            continue
        try:
            os.link(file, target / file.name)
        except OSError as e:
            if e.errno not in (
                errno.EPERM,
                errno.EXDEV,
                errno.ENOTSUP,
                errno.EOPNOTSUPP,
                errno.EMLINK,
            ):
                raise
            shutil.copy2(file, target / file.name)
        names.append(file.name)
    return names


def remove(path: str | os.PathLike) -> None:
    """Delete a checkpoint directory (or file) so that no partial state ever looks complete.

    The marker goes first, then the directory is renamed out of sight, then deleted.
    """
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink()
        return
    if not path.exists():
        return
    (path / MARKER).unlink(missing_ok=True)
    doomed = sibling(path, "del", new_token())
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
