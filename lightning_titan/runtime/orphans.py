"""No orphaned ranks: a rank leaves within seconds of its launcher's death, before and after rendezvous.

Two ways, because a rank must also go while it still imports Lightning (6 CPU-seconds), before any
code of ours runs, and at the rendezvous, where a rank whose launcher was killed would otherwise wait
for ``timeout_minutes`` (the launcher holds the rendezvous store: ``launch.hosted_rendezvous``):

- ``die_with_launcher``: ``TitanLauncher`` starts its ranks with ``PR_SET_PDEATHSIG`` (Linux): the
  kernel sends them ``PARENT_GONE`` when the launcher dies. Its default action ends a rank at once;
- ``watch_launcher``, from the first import of this package (standard library only): the signal then
  sets an alarm of ``GONE_S`` instead, time for the rank's own failure report (its collectives fail
  when the launcher dies); a thread that polls the parent pid covers the rest (fork, spawn).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from typing import Any

LAUNCHER_PID = "TITAN_LAUNCHER_PID"  # set by TitanLauncher for the ranks it starts
GONE_S = 5.0  # after the launcher died: how long a rank's own failure report may take
PARENT_GONE = signal.SIGUSR2  # what the kernel sends a rank when its launcher dies
_PR_SET_PDEATHSIG = 1
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

    def leave(*_: object) -> None:
        line = f"[titan] pid {os.getpid()}: the launcher (pid {launcher}) is gone: leaving\n"
        os.write(2, line.encode())
        signal.alarm(leave_s)

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.25)
        leave()

    if threading.current_thread() is threading.main_thread():
        signal.signal(PARENT_GONE, leave)
    threading.Thread(target=watch, daemon=True, name="titan-launcher-watch").start()


def _pdeathsig() -> Any:
    """A function for ``preexec_fn`` (runs in the child between fork and exec: no imports there)."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(_PR_SET_PDEATHSIG, int(PARENT_GONE), 0, 0, 0)


class die_with_launcher:  # noqa: N801 - used like a function: ``with die_with_launcher(module):``
    """Within it, ``module.subprocess.Popen`` (Lightning's launcher's) starts processes that get
    ``PARENT_GONE`` when this process dies."""

    def __init__(self, module: Any) -> None:
        self.module, self.real = module, module.subprocess
        self.set_signal = _pdeathsig()

    def __getattr__(self, name: str) -> Any:  # the stand-in for the ``subprocess`` module
        return getattr(self.real, name)

    def Popen(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - subprocess.Popen's name
        return self.real.Popen(*args, preexec_fn=self.set_signal, **kwargs)

    def __enter__(self) -> None:
        if self.set_signal is not None:
            self.module.subprocess = self

    def __exit__(self, *exc: object) -> None:
        self.module.subprocess = self.real
