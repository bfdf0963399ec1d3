"""No orphaned ranks: a rank leaves within seconds of its launcher's death, before and after rendezvous.

Standard library only: ``lightning_titan/__init__.py`` starts the watch as soon as a rank started by
``TitanLauncher`` imports the package, before Lightning is imported (6 CPU-seconds) and long before
the rendezvous, where a rank whose launcher failed (a busy ``MASTER_PORT``) or was killed would
otherwise wait for ``timeout_minutes``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

LAUNCHER_PID = "TITAN_LAUNCHER_PID"  # set by TitanLauncher for the ranks it starts
GONE_S = 3.0  # after the launcher died: how long a rank's own failure handling may take to leave
_watching = threading.Event()


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (R, S, D, T (stopped), t, Z, ...), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:  # no /proc: alive or not, nothing more
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"


def running(pid: int) -> bool:
    return process_state(pid) not in (None, "Z", "X")  # a zombie is dead, only not reaped yet


def launcher_pid() -> int | None:
    """The pid of the process that started this rank: TitanLauncher (popen) or a multiprocessing
    parent (fork, spawn); None in the launcher itself and under torchrun/SLURM."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher and int(launcher) != os.getpid():
        launcher_is_parent = os.getppid() == int(launcher)
        # a process a live launcher's rank started (a data worker) is not a rank: not watched
        return int(launcher) if launcher_is_parent or not running(int(launcher)) else None
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else None


def watch_launcher(grace_s: float = GONE_S) -> None:
    """In a rank: once the launcher is gone, leave within ``min(grace_s, GONE_S)`` seconds (SIGALRM's
    default action ends the process; a rank blocked in a collective cannot run Python code)."""
    launcher = launcher_pid()
    if launcher is None or _watching.is_set():
        return
    _watching.set()
    leave_s = max(1, round(min(grace_s, GONE_S)))

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.25)
        line = f"[titan] pid {os.getpid()}: the launcher (pid {launcher}) is gone: leaving\n"
        os.write(2, line.encode())
        signal.alarm(leave_s)

    threading.Thread(target=watch, daemon=True, name="titan-launcher-watch").start()
