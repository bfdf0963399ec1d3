"""No orphaned ranks: a rank leaves within seconds of its launcher's death, before and after rendezvous.

Two ways, because a rank must also go while it still imports Lightning (6 CPU-seconds), before any
code of ours runs, and at the rendezvous, where a rank whose launcher was killed would otherwise wait
for ``timeout_minutes`` (the launcher holds the rendezvous store: ``launch.hosted_rendezvous``):

- ``die_with_launcher``: ``TitanLauncher`` starts its ranks with ``PR_SET_PDEATHSIG`` (Linux): the
  kernel sends them ``PARENT_GONE`` when the launcher dies. Its default action ends a rank at once;
- ``watch_launcher``, from the first import of this package (standard library only): the signal then
  sets an alarm of ``GONE_S`` instead, time for the rank's own failure report (its collectives fail
  when the launcher dies); a thread that polls the parent pid covers the rest (fork, spawn).

Neither reaches a stopped rank (SIGSTOP, a debugger): it cannot act on a signal until it runs
again, and would hold the job's ports and pipes for good. So ``die_with_launcher`` also starts a
reaper, this file run on its own (``reap``): when the launcher is gone it gives the ranks
``REAP_AFTER_S`` to leave by themselves, then SIGKILLs what is left (SIGKILL ends a stopped one too).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

LAUNCHER_PID = "TITAN_LAUNCHER_PID"  # set by TitanLauncher for the ranks it starts
GONE_S = 5.0  # after the launcher died: how long a rank's own failure report may take
REAP_AFTER_S = GONE_S + 2.0  # then the reaper SIGKILLs a rank still there (a stopped one)
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


def _started_at(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot, /proc): a reused pid's differs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


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
    ``PARENT_GONE`` when this process dies, and that a reaper SIGKILLs if they are still there
    ``REAP_AFTER_S`` later (``reap``)."""

    def __init__(self, module: Any) -> None:
        self.module, self.real = module, module.subprocess
        self.set_signal = _pdeathsig()
        self.reaper: subprocess.Popen | None = None

    def __getattr__(self, name: str) -> Any:  # the stand-in for the ``subprocess`` module
        return getattr(self.real, name)

    def Popen(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - subprocess.Popen's name
        proc = self.real.Popen(*args, preexec_fn=self.set_signal, **kwargs)
        if self.reaper is None:
            # standard library only, without the package (torch) or its folder on the path: ~50 ms
            command = [sys.executable, "-I", "-S", __file__, str(os.getpid())]
            self.reaper = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
            )
        assert self.reaper.stdin is not None
        self.reaper.stdin.write(f"{proc.pid}\n")
        self.reaper.stdin.flush()
        return proc

    def __enter__(self) -> None:
        if self.set_signal is not None:
            self.module.subprocess = self

    def __exit__(self, *exc: object) -> None:
        self.module.subprocess = self.real
        if self.reaper is not None and self.reaper.stdin is not None:
            self.reaper.stdin.close()  # every rank is started: the reaper has their pids


def reap(launcher: int, pids: list[int], poll_s: float = 0.25) -> None:
    """The reaper's loop: while ``launcher`` (its parent) lives, wait for ``pids`` to end; once it
    is gone, give them ``REAP_AFTER_S`` to leave by themselves, then SIGKILL the ones still there."""
    started = {pid: _started_at(pid) for pid in pids}

    def left() -> list[int]:
        return [p for p, at in started.items() if running(p) and _started_at(p) == at]

    while os.getppid() == launcher and left():
        time.sleep(poll_s)
    if os.getppid() == launcher:
        return  # every rank ended with its launcher alive
    deadline = time.monotonic() + REAP_AFTER_S
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left():
        how = "is stopped (SIGSTOP)" if process_state(pid) in ("T", "t") else "is still running"
        after = f"{REAP_AFTER_S:g} s after its launcher (pid {launcher}) died"
        line = f"[titan] rank pid {pid} {how} {after}: killing it\n"
        os.write(2, line.encode())
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":  # the reaper: the launcher's pid as argument, the ranks' pids on stdin
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl+C is for the ranks
    reap(int(sys.argv[1]), [int(line) for line in sys.stdin])
