"""Restart by itself: a job whose rank dies starts again from its newest complete checkpoint.

- ``TitanStrategy(max_restarts=N)`` under the popen launcher: the launching process trains no rank
  of its own. It starts every rank (rank 0 too, as torchrun's agent does), watches them, and when one
  dies stops the others and starts them all again, at most N times.
- ``torchrun --max-restarts=N``: torchrun's agent does the same.

A restarted rank knows it from ``TITAN_RESTART_COUNT`` (ours) or ``TORCHELASTIC_RESTART_COUNT``
(torchrun's). Its launch then resumes the newest complete checkpoint, whatever ``ckpt_path`` the job
was given (that one is where the first launch began; a first launch that died before any save begins
there again, or over if none was given), and the loggers write on into the first launch's version
folder, a CSV logger appending to its file, so that the metrics of every launch are one file on disk.
"""

from __future__ import annotations

import csv
import inspect
import os
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from typing_extensions import override

from lightning_titan.checkpoint import files, runs
from lightning_titan.lightning.supervisor import LAUNCHER_WAIT_S, describe_exit, say
from lightning_titan.runtime.launch import RESTART_ENV, restart_count
from lightning_titan.runtime.orphans import LAUNCHER_PID, die_with_launcher, process_state

VERSIONS_ENV = "TITAN_LOGGER_VERSIONS"  # the first launch's logger versions, for every restart


def resumed_call(
    function: Callable, args: Sequence[Any], kwargs: dict[str, Any], trainer: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The Trainer call of a restarted rank: ``ckpt_path`` set to ``restart_checkpoint``'s."""
    if restart_count() == 0:
        return tuple(args), kwargs
    signature = inspect.signature(function)
    if "ckpt_path" not in signature.parameters:
        return tuple(args), kwargs
    bound = signature.bind_partial(*args, **kwargs)
    speak = say if getattr(trainer, "global_rank", 0) == 0 else (lambda line: None)
    found = restart_checkpoint(bound.arguments.get("ckpt_path"), trainer, speak)
    if found is not None:
        bound.arguments["ckpt_path"] = str(found)
    return bound.args, bound.kwargs


def restart_checkpoint(
    given: Any, trainer: Any, speak: Callable[[str], None] = lambda line: None
) -> Path | None:
    """What a restart resumes: the newest complete checkpoint of the trainer's ModelCheckpoint
    directories whose checksums verify (not always ``last``: with ``async_save`` the write of
    ``last`` may have died with the rank; a corrupt one is skipped, ``speak`` naming it), or the
    ``ckpt_path`` given if that is newer. A given ``ckpt_path`` is only where the first launch
    began: going back to it would train the steps since again. None: nothing to resume (the
    folders were emptied or deleted, or no save finished): the restart starts over."""
    dirs = [c.dirpath for c in getattr(trainer, "checkpoint_callbacks", []) if c.dirpath]
    # the newest whose checksums verify: a corrupt one would fail every attempt the same way
    newest = runs.newest_valid(dirs, speak)
    found = [] if newest is None else [newest]
    if given is not None and files.is_complete_checkpoint(given):
        if runs.corrupt_reason(Path(given)) is None:
            found.append(Path(given))
    return max(found, key=files.completed_at) if found else None


def restart_line(
    rank: int, why: str, attempt: int, max_restarts: int, resumes: Path | None, trainer: Any
) -> str:
    """The launcher's line when it restarts every rank: who brought the attempt down, and from
    which checkpoint the next one resumes, or that it starts over from step 0 and why."""
    if resumes is not None:
        where = f"from {resumes}"
    else:
        dirs = [str(c.dirpath) for c in getattr(trainer, "checkpoint_callbacks", []) if c.dirpath]
        held = ", ".join(dirs) or "no checkpoint folder"
        where = f"over from step 0: no complete checkpoint in {held}"
    every = f"restarting every rank ({attempt + 1} of {max_restarts})"
    return f"[titan] rank {rank} {why}: {every} {where}"


def keep_logger_versions(trainer: Any) -> None:
    """Loggers without a version of their own write into the one the job's first launch used, and
    a CSV logger keeps the rows written before the restart (Lightning's would delete the file)."""
    given = os.environ.get(VERSIONS_ENV)
    versions = given.split(",") if given else []
    for logger, version in zip(getattr(trainer, "loggers", []), versions, strict=False):
        if version and getattr(logger, "_version", "") is None:
            logger._version = int(version) if version.isdigit() else version
    if given is None and restart_count() > 0:  # torchrun's restart: the newest version is ours
        for logger in getattr(trainer, "loggers", []):
            if getattr(logger, "_version", "") is None and hasattr(logger, "_get_next_version"):
                logger._version = max(0, logger._get_next_version() - 1)
    if restart_count() > 0 and getattr(trainer, "global_rank", 0) == 0:
        for logger in getattr(trainer, "loggers", []):
            if isinstance(logger, CSVLogger):
                _keep_rows(logger)


def _keep_rows(logger: CSVLogger) -> None:
    if (Path(logger.log_dir) / "metrics.csv").is_file():
        logger._experiment = _AppendingWriter(logger.log_dir)  # the writer the logger would create


class _AppendingWriter(ExperimentWriter):
    """A restarted launch's CSV writer: it appends to the rows the earlier launches wrote. Lightning's
    deletes ``metrics.csv`` when it is created; a rank that died again before this launch's first
    flush would leave the job with no metrics, and the rows held in memory would die with it."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir)
        with open(self.metrics_file_path, newline="") as f:
            header = next(csv.reader(f), [])
        # Lightning's writer keeps its columns sorted: the same ones append, a new one (or a header
        # of another order) rewrites the file from disk with the new header
        self.metrics_keys = header if header == sorted(header) else []

    @override
    def _check_log_dir_exists(self) -> None:
        pass  # Lightning's deletes metrics.csv here


def _given_ckpt_path(function: Callable, args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    try:
        called = inspect.signature(function).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return None
    return called.get("ckpt_path")


def _stopped(proc: subprocess.Popen) -> bool:
    return process_state(proc.pid) in ("T", "t")


class RestartingLauncher(_Launcher):
    """Starts every rank of this node, and all of them again when one dies (``max_restarts`` times).
    A SIGTERM or Ctrl+C here stops every rank (they save ``last`` after the step) and restarts none."""

    def __init__(
        self,
        checks: Callable[[Callable, Sequence[Any], dict[str, Any], Any], None],
        rendezvous: Callable[[], AbstractContextManager[Any]],
        cluster_environment: Any,
        num_processes: int,
        max_restarts: int,
        grace_s: float,
    ) -> None:
        """``checks(function, args, kwargs, trainer)``: those of any launch, before any rank starts;
        ``rendezvous()``: holds the port the ranks meet on, for one launch."""
        self._checks, self._rendezvous = checks, rendezvous
        self.cluster_environment, self.num_processes = cluster_environment, num_processes
        self.max_restarts, self.grace_s = max_restarts, grace_s
        self.procs: list[subprocess.Popen] = []
        self._stopping = 0  # the signal that asked this launcher to stop, or 0
        self._why = ""  # how the last attempt's cause failed, where its exit code does not say it

    @property
    @override
    def is_interactive_compatible(self) -> bool:
        return False  # it re-runs the script

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self._checks(function, args, kwargs, trainer)
        versions = [getattr(lg, "version", None) for lg in getattr(trainer, "loggers", [])]
        os.environ[VERSIONS_ENV] = ",".join("" if v is None else str(v) for v in versions)
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for attempt in range(self.max_restarts + 1):
                with self._rendezvous():
                    rank, code = self._run(attempt)
                if code == 0:
                    return None
                if self._stopping or code in (130, 143):  # stopped, `last` saved: no failure
                    raise SystemExit(128 + self._stopping if self._stopping else code)
                why = self._why or describe_exit(code)
                if attempt == self.max_restarts:
                    say(f"[titan] rank {rank} {why}: no restart left of {attempt}")
                    raise SystemExit(1)
                given = _given_ckpt_path(function, args, kwargs)
                resumes = restart_checkpoint(given, trainer)
                say(restart_line(rank, why, attempt, self.max_restarts, resumes, trainer))
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return None

    def _run(self, attempt: int) -> tuple[int, int]:
        """Every rank of one launch until all end or one fails: (that rank, its exit code)."""
        env = self.cluster_environment
        base = {
            **os.environ,
            "MASTER_ADDR": env.main_address,
            "MASTER_PORT": str(env.main_port),
            "NODE_RANK": "0",
            "WORLD_SIZE": str(self.num_processes),
            RESTART_ENV: str(attempt),
            LAUNCHER_PID: str(os.getpid()),  # the ranks leave when this process is gone
        }
        command = subprocess_script._basic_subprocess_cmd()
        with die_with_launcher(subprocess_script):
            self.procs = [
                subprocess_script.subprocess.Popen(command, env={**base, "LOCAL_RANK": str(r)})
                for r in range(self.num_processes)
            ]
        while True:
            time.sleep(0.2)
            codes = [p.poll() for p in self.procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if self._stopping or (failed and failed[0][1] in (130, 143)):
                self._stop_all(signal.SIGTERM, self.grace_s)  # each saves `last`, then leaves
                codes = [p.poll() for p in self.procs]
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                break
            if failed or all(c == 0 for c in codes):
                # a stopped rank (SIGSTOP) stalled the others until their collective timeout: it is
                # the cause, though the others exited first; seen before it is killed below
                stalled = [r for r, c in enumerate(codes) if c is None and _stopped(self.procs[r])]
                # the others' collectives fail at once under gloo: time to report and flush their
                # logs; NCCL does not notice a dead peer, so they are killed after that
                self._stop_all(None, min(LAUNCHER_WAIT_S, self.grace_s))
                if failed and stalled:
                    r = stalled[0]
                    self._why = (
                        f"(pid {self.procs[r].pid}) is stopped (SIGSTOP) and stalled the job"
                    )
                    return r, self.procs[r].returncode
                break
        self._why = ""
        # a rank killed by a signal is the cause; the others' errors followed (both seen in one poll)
        return min(failed, key=lambda rc: rc[1] >= 0) if failed else (0, 0)

    def _stop_all(self, signum: int | None, wait_s: float) -> None:
        """Send ``signum`` (None: nothing) to the ranks still running, SIGKILL after ``wait_s``."""
        for p in self.procs:
            if p.poll() is None and signum is not None:
                p.send_signal(signum)
        deadline = time.monotonic() + wait_s
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()

    def _stop(self, signum: int, frame: Any) -> None:
        """SIGTERM or Ctrl+C: every rank saves ``last`` after its step and stops; no restart."""
        self._stopping = signum
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    @override
    def kill(self, signum: Any) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)
