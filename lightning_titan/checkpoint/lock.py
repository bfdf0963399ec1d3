"""One job per checkpoint directory: an ``flock`` on the directory itself, held for the process's life.

Two jobs saving into one directory delete each other's work (recovery takes the other's temp
directory for a leftover; top-k removal and ``last`` race). Global rank 0 locks the directory before
its first save (and at setup); the lock is never released while the process lives and the kernel frees
it when the process dies, even by SIGKILL. No lock file is written: the directory holds only
checkpoints, and a refused job finds the holder's pid in ``/proc/locks``. Re-locking in the same
process is a no-op.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

_held: dict[str, tuple[int, float]] = {}  # resolved dirpath -> (fd, when locked)


class CheckpointDirInUse(RuntimeError):
    pass


def _holder(dirpath: Path) -> str:
    """``pid N (command)`` of the process holding an flock on ``dirpath``, from ``/proc/locks``."""
    try:
        st = os.stat(dirpath)
        inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in Path("/proc/locks").read_text().splitlines():
            parts = line.split()
            if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == inode:
                pid = parts[4]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                return f"pid {pid}: {cmd.strip()[:120]}"
    except (OSError, ValueError):
        pass
    return "a process on this or another host"


def acquire(dirpath: str | os.PathLike) -> float:
    """Own ``dirpath`` for this process's life; returns when it was locked. Raises if another holds it."""
    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    key = str(dirpath.resolve())
    if key in _held:
        fd, since = _held[key]
        if os.fstat(fd).st_ino == os.stat(dirpath).st_ino:
            return since
        os.close(fd)  # the directory was deleted and made again: lock the new one
        del _held[key]
    fd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CheckpointDirInUse(
            f"checkpoint directory {dirpath} is in use by another job ({_holder(dirpath)}); two "
            "jobs saving into one directory delete each other's checkpoints. Give this run its own "
            "directory (ModelCheckpoint(dirpath=...)) or stop the other job first"
        ) from None
    except OSError as e:  # a file system without flock: refuse rather than run unprotected
        os.close(fd)
        raise CheckpointDirInUse(
            f"cannot lock checkpoint directory {dirpath} ({e}); save checkpoints on a local or "
            "flock-capable file system"
        ) from e
    _held[key] = (fd, time.time())
    return _held[key][1]
