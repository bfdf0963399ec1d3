"""How a TitanStrategy job fails: fast, on every rank, naming the rank, and never hanging.

- the launchers (``launchers.py``) start the ranks and watch them: a rank's death stops the job
  within a second, naming it; the launcher itself then leaves within ``LAUNCHER_WAIT_S``.
- ``watch_launcher`` (``orphans``): a rank leaves within seconds of the launcher's death, before and
  after the rendezvous; the launcher, leaving, kills the ranks it started (a stopped one too).
- ``leave_after_failure``: a failed rank leaves as soon as its traceback is printed (none when a
  dead or stopped peer caused the failure: the report names it), after the ``atexit`` handlers
  (bounded by ``grace_s``); one whose failure handling inside Lightning does not
  finish within ``grace_s`` leaves then. A caller that catches the error keeps running. Without it, a
  rank that raised while an async collective of its own still waited for peers that are blocked
  elsewhere stays in gloo's destructor at exit, its sockets open, and those peers wait for it until
  the collective timeout.
- ``watch_peers``: where no launcher of ours watches every rank (torchrun, srun, several nodes), the
  ranks watch each other (``peer_watch``): a rank's death on any node makes every rank leave within
  seconds, naming it, also where NCCL would wait for the collective timeout.
- ``failure_report`` (``peers``): the one line every rank prints, naming itself, the step, any peer
  that died or is stopped (a stall), and the collective it was waiting in.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from subprocess import Popen
from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
)

from lightning_titan.runtime.orphans import (
    LAUNCHER_PID,
    process_state,
    watch_launcher,
)
from lightning_titan.runtime.peer_watch import PeerWatch
from lightning_titan.runtime.peers import (
    PEER_GONE,
    blamed_peers,
    dead_peers,
    failure_report,
    gather_peers,
    lost_hosts,
)

__all__ = [
    "LAUNCHER_PID",
    "blamed_peers",
    "dead_peers",
    "failure_report",
    "gather_peers",
    "lost_hosts",
    "watch_launcher",
]
LAUNCHER_WAIT_S = 3.0  # after a rank died: how long the launcher's own failure may take to start
_failing = threading.Event()  # set once this process is in Lightning's failure handling
_echo = threading.Event()  # set when a peer's death or stop caused this rank's failure
preempting = threading.Event()  # the ranks agreed to stop (SIGTERM, SIGINT): 143 or 130 expected
_children: list[tuple[int, Popen]] = []  # (rank, process) this process (the popen launcher) started
_watch: list[PeerWatch] = []  # this rank's watch of its peers, while a Trainer call runs


def say(line: str) -> None:
    """One line to stderr in one write: the ranks share the stream, and a pipe keeps a write of up to
    PIPE_BUF (4 KiB) bytes whole, so lines of different ranks never interleave."""
    data = line.encode(errors="replace")[:4000].rstrip(b"\n") + b"\n"
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (OSError, ValueError):  # a notebook's stream (ipykernel) has no descriptor
        sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()
        return
    os.write(fd, data)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def leave(code: int, grace_s: float, loggers: Sequence[Any] = ()) -> None:
    """End this process now with ``code``, after what a normal exit would do for the user: finalize
    ``loggers`` (CSV, W&B, MLflow write what they buffered) and run the ``atexit`` handlers, bounded
    by ``grace_s`` and 5 s (a handler may block on a dead peer). Then ``os._exit``: an orderly interpreter exit
    can hang in a process group's destructor while work of its own still waits for peers."""

    def flush() -> None:
        for logger in loggers:
            try:
                logger.finalize("failed")
            except Exception as err:  # noqa: BLE001 - the process is leaving: say it, go on
                say(f"[titan] {type(logger).__name__}.finalize failed: {err!r}")

    # Lightning's handler destroys an NCCL group at exit, which can wait on the dead peer; the OS
    # frees the communicators of a process that ends anyway.
    atexit.unregister(_destroy_dist_connection)
    for step, seconds in ((flush, grace_s), (atexit._run_exitfuncs, min(grace_s, 5.0))):
        worker = threading.Thread(target=step, daemon=True, name="titan-leave")
        worker.start()
        worker.join(timeout=seconds)
    # the ranks this launcher started leave by themselves once it is gone (``orphans``); not a stopped
    # one (SIGSTOP): it cannot run, and would hold the job's pipes and ports forever
    for rank, p in _children:
        if p.poll() is None and process_state(p.pid) == "T":
            say(f"[titan] rank {rank} (pid {p.pid}) is stopped (SIGSTOP): killing it")
            p.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_worker() -> bool:
    """Whether this process exists only to be a rank (started by TitanLauncher, torchrun or
    multiprocessing), as opposed to the user's own script or notebook."""
    launcher = os.environ.get(LAUNCHER_PID)
    return (
        (launcher is not None and int(launcher) != os.getpid())
        or "TORCHELASTIC_RUN_ID" in os.environ
        or multiprocessing.parent_process() is not None
    )


def leave_after_failure(grace_s: float, *, traceback: bool = True, code: int = 1) -> None:
    """Once the uncaught exception's traceback is printed, leave with ``code`` (``leave``: atexit
    handlers run, bounded by ``grace_s``); if Lightning's own failure handling (``on_exception``
    hooks, loggers' finalize, teardown) does not finish within ``grace_s``, leave then.
    ``code``: 1, or 143 (130) where this process was asked to stop by SIGTERM (SIGINT) and failed
    before the ranks could agree on it: the scheduler that sent it sees the stop it asked for.

    ``traceback=False``: a dead or stopped peer caused the failure, which the report names; this
    rank's traceback (a gloo timeout, a closed connection) only echoes it, so it is not printed.

    Only an exception nobody catches reaches ``sys.excepthook``, and the deadline stops counting once
    the exception has left Lightning's call: a user's script that handles the failure keeps running.
    Call it from the failing call (``Strategy.on_exception``)."""
    _failing.set()
    if not traceback:
        _echo.set()
    call = _lightning_call_frame()
    if call is not None:
        threading.Thread(
            target=_leave_unless_done,
            args=(call, grace_s, code),
            daemon=True,
            name="titan-failure-watch",
        ).start()
    elif is_worker():
        signal.alarm(max(1, round(grace_s)))  # no Lightning call to watch: a bounded exit anyway
    previous = sys.excepthook
    if getattr(previous, "_titan", False):
        return

    def excepthook(*exc_info: Any) -> None:
        if not _echo.is_set():
            previous(*exc_info)
        leave(code, grace_s)

    excepthook._titan = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def _lightning_call_frame() -> Any:
    """The frame of Lightning's ``_call_and_handle_interrupt`` this thread is failing inside."""
    frame: Any = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_call_and_handle_interrupt":
        frame = frame.f_back
    return frame


def _on_main_stack(frame: Any) -> bool:
    main = threading.main_thread().ident
    current = None if main is None else sys._current_frames().get(main)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


def _leave_unless_done(call: Any, grace_s: float, code: int) -> None:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _on_main_stack(call):
            _failing.clear()
            return  # the exception left Lightning: its caller handles it, or the excepthook does
        time.sleep(0.1)
    say(f"[titan] failure handling did not finish within {grace_s:g} s: leaving")
    trainer = call.f_locals.get("trainer")
    del call
    leave(code, grace_s, list(getattr(trainer, "loggers", None) or []))


def kill_ranks() -> None:
    """SIGKILL the ranks this process (the popen launcher) started; safe in a signal handler."""
    for _, p in _children:
        if p.returncode is None:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def wait_for(procs: Sequence[Popen], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the ranks this launcher started, then SIGKILL any left, naming it."""
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            say(f"[titan] rank pid {p.pid} did not leave within {grace_s:g} s: killing it")
            p.kill()
            p.wait()


def watch_peers(num_nodes: int, trainer: Any, grace_s: float) -> list[tuple[str, int]]:
    """``gather_peers``; and where no launcher of ours watches every rank (torchrun, srun, several
    nodes), a ``PeerWatch``: a peer dead on any node makes this rank leave (``leave``), naming it."""
    peers = gather_peers()
    stop_watching()
    ours = os.environ.get(LAUNCHER_PID) is not None or multiprocessing.parent_process() is not None
    # the store the rendezvous used, which the ranks reach as MASTER_ADDR:MASTER_PORT
    if len(peers) > 1 and (num_nodes > 1 or not ours) and "MASTER_PORT" in os.environ:
        who = f"rank {dist.get_rank()}/{len(peers)}"

        def gone(reason: str) -> None:
            say(f"[titan] {who}: {reason}: leaving")
            if not _failing.is_set():  # this rank's own failure handling leaves, bounded
                leave(1, grace_s, list(getattr(trainer, "loggers", None) or []))

        _watch[:] = [PeerWatch(peers, dist.get_rank(), gone)]
        _watch[0].start()
    return peers


def stop_watching() -> None:
    """At the end of a Trainer call: one that did not fail tells the peers it finished (they then
    stop watching, and do not take this rank's exit for a death)."""
    for watch in _watch:
        watch.stop(finished=not _failing.is_set())
    _watch.clear()


def watched_blame(exception: BaseException, blamed: str) -> str:
    """A failing rank's blame (``blamed_peers``: this host's dead peers) shared with the other nodes
    through the watch, or, with none here, what another rank announced (waiting up to 3 s for it
    when the error says a peer's connection closed)."""
    if not _watch:
        return blamed
    first_line = (str(exception).strip().splitlines() or [""])[0]
    wait_s = 3.0 if any(words in first_line for words in PEER_GONE) else 0.0
    try:
        found = _watch[0].share(0.0 if blamed else wait_s)
    except Exception:  # noqa: BLE001 - the store is gone with its host: this host's view stands
        found = None
    return blamed or (f"{found}; " if found else "")
