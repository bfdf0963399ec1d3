"""How a TitanStrategy job fails: fast, on every rank, naming the rank, and never hanging.

- ``TitanLauncher``: Lightning's script launcher (``popen``), plus the layout/model/data checks run
  before any rank starts, and a watcher that stops the job within a second of a rank's death, naming
  it (Lightning's own observer polls every 5 s and SIGKILLs every process, this one included). The
  launcher itself then leaves within ``LAUNCHER_WAIT_S``, its user's logs flushed, unless its own
  collectives fail first (gloo's do at once; NCCL does not notice a dead peer on the same node).
- ``watch_launcher``: a rank the launcher started leaves at most ``grace_s`` after the launcher died.
- ``leave_after_failure``: a failed rank leaves as soon as its traceback is printed, after the
  ``atexit`` handlers (bounded by ``grace_s``); one whose failure handling inside Lightning does not
  finish within ``grace_s`` leaves then. A caller that catches the error keeps running. Without it, a
  rank that raised while an async collective of its own still waited for peers that are blocked
  elsewhere stays in gloo's destructor at exit, its sockets open, and those peers wait for it until
  the collective timeout.
- ``failure_report``: the one line every rank prints, naming itself, the step and any peer that died.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from subprocess import Popen
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _destroy_dist_connection,
    _set_num_threads_if_needed,
)
from lightning.pytorch.strategies.launchers import (
    _MultiProcessingLauncher,
    _SubprocessScriptLauncher,
)
from typing_extensions import override

LAUNCHER_PID = "TITAN_LAUNCHER_PID"  # set for the ranks the launcher starts
LAUNCHER_WAIT_S = 3.0  # after a rank died: how long the launcher's own failure may take to start
_failing = threading.Event()  # set once this process is in Lightning's failure handling


class TitanLauncher(_SubprocessScriptLauncher):
    """Re-runs the script once per extra rank, like Lightning's; checks first, watches after."""

    def __init__(
        self,
        preflight: Callable[[Any, Any, Any], None],
        cluster_environment: Any,
        num_processes: int,
        num_nodes: int,
    ) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self._preflight = preflight

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        # one process, no process group: a bad layout, model or batch costs one interpreter start
        self._preflight(*_module_and_data(args, kwargs), trainer)
        self.cluster_environment.validate_settings(
            num_devices=self.num_processes, num_nodes=self.num_nodes
        )
        if not self.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID] = str(os.getpid())
            self._call_children_scripts()
            first = self.cluster_environment.node_rank() * self.num_processes + 1
            grace_s = getattr(getattr(trainer, "strategy", None), "_grace_s", 30.0)
            loggers = list(getattr(trainer, "loggers", None) or [])
            _RankWatcher(self.procs, first, grace_s=grace_s, loggers=loggers).start()
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


def _module_and_data(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The LightningModule and LightningDataModule among ``fit``/``validate``/... arguments."""
    values = [*args, *kwargs.values()]
    module = next((v for v in values if isinstance(v, pl.LightningModule)), None)
    data = next((v for v in values if isinstance(v, pl.LightningDataModule)), None)
    return module, data


def say(line: str) -> None:
    """One line to stderr in one write: the ranks share the stream, and a pipe keeps a write of up to
    PIPE_BUF (4 KiB) bytes whole, so lines of different ranks never interleave."""
    data = line.encode(errors="replace")[:4000].rstrip(b"\n") + b"\n"
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), data)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _RankWatcher(threading.Thread):
    """In the launcher: when a rank it started dies, say which, kill the others, and make sure this
    process (rank 0) goes down too.

    Under gloo this process then fails in its next collective (a closed connection is reported at
    once, also to work in flight) and leaves through ``leave_after_failure``. NCCL does not notice a
    dead peer on the same node: if no failure has started here within ``wait_s``, this thread leaves
    for the main thread, blocked in a collective that would wait for the whole collective timeout,
    after flushing the user's loggers and running the ``atexit`` handlers.
    """

    def __init__(
        self,
        procs: list[Popen],
        first_rank: int,
        *,
        grace_s: float = 30.0,
        loggers: Sequence[Any] = (),
        wait_s: float | None = None,
    ) -> None:
        super().__init__(daemon=True, name="titan-rank-watcher")
        self.procs, self.first_rank = procs, first_rank
        self.grace_s, self.loggers = grace_s, list(loggers)
        self.wait_s = min(LAUNCHER_WAIT_S, grace_s) if wait_s is None else wait_s

    def run(self) -> None:
        while True:
            time.sleep(0.2)
            codes = [p.poll() for p in self.procs]
            if all(code == 0 for code in codes):
                return
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                i, code = failed[0]
                say(
                    f"[titan] rank {self.first_rank + i} (pid {self.procs[i].pid}) "
                    f"{describe_exit(code)}: stopping every rank"
                )
                for p in self.procs:
                    if p.poll() is None:
                        p.kill()
                if not _failing.wait(self.wait_s):
                    say(
                        f"[titan] the launcher's own collectives did not fail within {self.wait_s:g} s "
                        "(NCCL does not notice a dead peer): leaving with its logs flushed"
                    )
                    leave(1, self.grace_s, self.loggers)
                return


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
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def watch_launcher(grace_s: float) -> None:
    """In a rank started by ``TitanLauncher``: leave at most ``grace_s`` after the launcher died.

    Its peers' collectives fail at once when it dies; this covers a rank that is not in one."""
    launcher = os.environ.get(LAUNCHER_PID)
    if not launcher or int(launcher) == os.getpid():
        return

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(0.5)
        signal.alarm(max(1, round(grace_s)))  # default action: terminate

    threading.Thread(target=watch, daemon=True, name="titan-launcher-watch").start()


def is_worker() -> bool:
    """Whether this process exists only to be a rank (started by TitanLauncher, torchrun or
    multiprocessing), as opposed to the user's own script or notebook."""
    launcher = os.environ.get(LAUNCHER_PID)
    return (
        (launcher is not None and int(launcher) != os.getpid())
        or "TORCHELASTIC_RUN_ID" in os.environ
        or multiprocessing.parent_process() is not None
    )


def leave_after_failure(grace_s: float) -> None:
    """Once the uncaught exception's traceback is printed, leave with code 1 (``leave``: atexit
    handlers run, bounded by ``grace_s``); if Lightning's own failure handling (``on_exception``
    hooks, loggers' finalize, teardown) does not finish within ``grace_s``, leave then.

    Only an exception nobody catches reaches ``sys.excepthook``, and the deadline stops counting once
    the exception has left Lightning's call: a user's script that handles the failure keeps running.
    Call it from the failing call (``Strategy.on_exception``)."""
    _failing.set()
    call = _lightning_call_frame()
    if call is not None:
        threading.Thread(
            target=_leave_unless_done, args=(call, grace_s), daemon=True, name="titan-failure-watch"
        ).start()
    elif is_worker():
        signal.alarm(max(1, round(grace_s)))  # no Lightning call to watch: a bounded exit anyway
    previous = sys.excepthook
    if getattr(previous, "_titan", False):
        return

    def excepthook(*exc_info: Any) -> None:
        previous(*exc_info)
        leave(1, grace_s)

    excepthook._titan = True  # type: ignore[attr-defined]
    sys.excepthook = excepthook


def _lightning_call_frame() -> Any:
    """The frame of Lightning's ``_call_and_handle_interrupt`` this thread is failing inside."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "_call_and_handle_interrupt":
        frame = frame.f_back
    return frame


def _on_main_stack(frame: Any) -> bool:
    current = sys._current_frames().get(threading.main_thread().ident)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


def _leave_unless_done(call: Any, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _on_main_stack(call):
            _failing.clear()
            return  # the exception left Lightning: its caller handles it, or the excepthook does
        time.sleep(0.1)
    say(f"[titan] failure handling did not finish within {grace_s:g} s: leaving")
    trainer = call.f_locals.get("trainer")
    del call
    leave(1, grace_s, list(getattr(trainer, "loggers", None) or []))


# -- who is alive ---------------------------------------------------------------------------------------


def gather_peers() -> list[tuple[str, int]]:
    """(host, pid) of every rank, from one gather while the group is healthy."""
    peers: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peers, (socket.gethostname(), os.getpid()))
    return peers


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return state not in ("Z", "X")  # a zombie is dead, only not reaped yet
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


# gloo's words for "the peer's sockets closed": the peer is dying, maybe not yet marked dead
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def dead_peers(
    peers: Sequence[tuple[str, int]] | None, wait_s: float = 0.0
) -> list[tuple[int, int]]:
    """(rank, pid) of the ranks on this host that are no longer running, waiting up to ``wait_s``
    for one (a killed process closes its sockets before the kernel marks it dead)."""
    if not peers:
        return []
    host = socket.gethostname()
    deadline = time.monotonic() + wait_s
    while True:
        dead = [(r, pid) for r, (h, pid) in enumerate(peers) if h == host and not _running(pid)]
        if dead or time.monotonic() >= deadline:
            return dead
        time.sleep(0.05)


def failure_report(
    exception: BaseException,
    *,
    who: str,
    rank: int | None = None,
    peers: Sequence[tuple[str, int]] | None = None,
) -> str:
    """``[titan] rank 1/4 (dp=0 pp=0 ep=1, global_step=3) failed: [rank 2 (pid 9) is no longer
    running; ]ValueError: ...``: the dead peers (of ``peers``, but ``rank``) first, the likely cause."""
    first_line = (str(exception).strip().splitlines() or [""])[0]
    line = f"[titan] {who} failed: "
    wait_s = 3.0 if any(words in first_line for words in _PEER_GONE) else 0.0
    gone = [(r, pid) for r, pid in dead_peers(peers, wait_s) if r != rank]
    if gone:
        names = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone)
        line += f"{names} {'is' if len(gone) == 1 else 'are'} no longer running; "
    return line + f"{type(exception).__name__}: {first_line}"


def launcher_for(strategy: Any, start_method: str) -> Any:
    """The launcher for a strategy: none when processes are created outside (torchrun, SLURM), ours
    for ``popen`` (checks first, watches after), Lightning's multiprocessing one for fork/spawn."""
    env = strategy.cluster_environment
    if env.creates_processes_externally:
        return None
    if start_method == "popen":
        return TitanLauncher(strategy.preflight, env, strategy.num_processes, strategy.num_nodes)
    return _MultiProcessingLauncher(strategy, start_method=start_method)  # type: ignore[arg-type]
