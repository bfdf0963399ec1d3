"""Preemption: SIGTERM (what SLURM and Kubernetes send) stops the job after the same step on every
rank, with ``last`` saved through the normal checkpoint path, and exit code 143.

- ``Preemption.on_signal``: the handler only sets the object's flag. Lightning's own handler is
  replaced once training starts: it runs a broadcast inside the handler and stops only the rank that
  got the signal. (A fork launcher's parent, no rank, forwards the signal to the ranks:
  ``launchers.TitanForkLauncher``.)
- SIGINT (Ctrl+C) in a job of several processes (the ``popen`` launcher, which is rank 0, or a rank)
  stops the same way, with exit code 130: Lightning's own handling of the KeyboardInterrupt saves
  nothing and kills the ranks wherever they are. A second Ctrl+C stops at once (the launcher kills
  its ranks). A single process keeps Lightning's handling (a notebook's interrupt stays immediate);
  fork ranks ignore SIGINT (their parent decides).
- ``Preemption.requested``/``agreed``: the ranks agree on the flag (the signal's number) once per
  step, in one tiny all-reduce whose result rides on the step's one host read (``TrainStep``,
  ``train/step.py``). Once they agree, ``trainer.received_sigterm`` is set on every rank, so
  Lightning's loop raises ``SIGTERMException`` on every rank at the end of the same step.
- ``Preemption.handles`` (from ``on_exception``): every rank then saves ``last`` (``save_sharded`` is collective and
  atomic) and the exception's exit code becomes 143 (130 when SIGINT was the only signal).
- ``stop_at_once_outside_fit``: in ``validate``/``test``/``predict`` a SIGTERM stops at once (nothing to save).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_titan.lightning import supervisor
from lightning_titan.lightning.launchers import TitanForkLauncher
from lightning_titan.lightning.sharded_strategy import ShardedStrategy

EXIT_CODE = 128 + signal.SIGTERM  # 143: what a shell and a scheduler report for "terminated"


class Preemption:
    """What a TitanStrategy does about SIGTERM and Ctrl+C: install the handler once training starts,
    hand the step this rank's request (``requested``, a ``train.step.StopRequest``), act on the
    ranks' agreement (``agreed``), and save ``last`` when the agreed stop arrives as an exception."""

    def __init__(self) -> None:
        self._got = threading.Event()  # this process got SIGTERM or SIGINT
        self._signum = 0  # the first of them; the ranks agree on the largest: SIGTERM wins over 2
        self._trainer: Any = None  # the Trainer to stop, from install()
        self.stopped_after: int | None = None  # the global step after which every rank stops
        self.signal: int = signal.SIGTERM  # the signal the ranks agreed on

    def on_signal(self, signum: int, frame: Any) -> None:
        """Set the flag; nothing else (a handler may run between any two bytecodes of a
        collective). A second SIGINT (Ctrl+C again) ends this process at once, and its ranks."""
        if signum == signal.SIGINT and self._got.is_set():
            os.write(2, f"[titan] pid {os.getpid()} got SIGINT again: stopping now\n".encode())
            supervisor.kill_ranks()
            os._exit(128 + signal.SIGINT)
        if self._got.is_set():
            return
        self._signum = signum
        self._got.set()
        again = " (Ctrl+C again: stop at once)" if signum == signal.SIGINT else ""
        name = signal.Signals(signum).name
        line = (
            f"[titan] pid {os.getpid()} got {name}: stopping after this step, saving last{again}\n"
        )
        os.write(2, line.encode())  # one raw write: the stream's buffer may be in use

    def install(self, trainer: Any, world_size: int = 1) -> None:
        """SIGTERM always; SIGINT in a job of several processes, unless ignored here (a fork rank).
        ``Trainer._teardown`` restores both handlers (Lightning's signal connector saved them)."""
        self._trainer = trainer
        if threading.current_thread() is not threading.main_thread():
            return
        signal.signal(signal.SIGTERM, self.on_signal)
        if world_size > 1 and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, self.on_signal)

    def requested(self) -> int:
        """The signal this process got (0: none), for the step's agreement."""
        return self._signum if self._got.is_set() else 0

    def agreed(self, signal_number: int, step: int) -> None:
        """Every rank heard ``signal_number`` (0: no request) in the agreement of step ``step``:
        Lightning stops after this step, on every rank."""
        if signal_number > 0 and self.stopped_after is None:
            self.signal = signal_number
            self.stopped_after = step
            supervisor.preempting.set()  # the launcher's watcher: a rank's exit 143 is no failure
            # Lightning's loop raises SIGTERMException at the end of a step once this is set, and
            # only then (its own SIGTERM handler sets it; no public setter exists). The end of the
            # step is the place: this step's metrics are logged and no further batch is fetched,
            # so the saved data position is this step's.
            self._trainer._signal_connector.received_sigterm = True

    def handles(
        self, exception: BaseException, trainer: Any, strategy: ShardedStrategy, grace_s: float
    ) -> bool:
        """True when ``exception`` is the agreed stop (``last`` is then saved and the exit code set),
        or the interrupt of a fork launcher's parent, whose ranks have already stopped."""
        launcher, rank, world = strategy.launcher, strategy.global_rank, strategy.world_size
        if isinstance(launcher, TitanForkLauncher) and not dist.is_initialized():
            if isinstance(exception, (KeyboardInterrupt, SystemExit)):  # the parent: no failure
                what = "interrupted" if isinstance(exception, KeyboardInterrupt) else "preempted"
                supervisor.say(f"[titan] the launcher was {what}: every rank has stopped")
                return True
        if not (isinstance(exception, SIGTERMException) and self.stopped_after is not None):
            return False
        saved = save_last(trainer)
        strategy.checkpoints.wait()  # `last` may be the save in flight (async_save): complete it
        what = f"saved {', '.join(saved)}" if saved else "no ModelCheckpoint: nothing saved"
        code, name = 128 + self.signal, signal.Signals(self.signal).name
        how = "interrupted" if self.signal == signal.SIGINT else "preempted"
        supervisor.say(
            f"[titan] rank {rank}/{world} {how} ({name}) after global_step={trainer.global_step}: "
            f"{what}; exit code {code}"
        )
        exception.code = code
        procs = getattr(launcher, "procs", None)
        if procs and rank == 0:  # the popen launcher leaves after its ranks
            supervisor.wait_for(procs, grace_s)
        return True


def stop_at_once_outside_fit(trainer: Any, grace_s: float) -> None:
    """``titan validate``/``test``/``predict``: no step to agree on, nothing to save, so SIGTERM stops
    this process (and the ranks a popen launcher started) at once, exit code 143. Lightning's own
    handler would broadcast inside the handler, which blocks, mid-collective, until the timeout."""
    if trainer.state.fn == TrainerFn.FITTING:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    loggers = list(trainer.loggers)

    def stop_now(signum: int, frame: Any) -> None:
        supervisor.say(f"[titan] pid {os.getpid()} got SIGTERM outside training: stopping now")
        supervisor.kill_ranks()
        supervisor.leave(EXIT_CODE, grace_s, loggers)

    signal.signal(signal.SIGTERM, stop_now)  # Trainer._teardown restores the previous handler


def save_last(trainer: Any) -> list[str]:
    """Collective: save ``last`` of every ModelCheckpoint (unless it already holds this step)."""
    saved = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint) or not callback.dirpath:
            continue
        done = callback.save_last and callback._last_global_step_saved == trainer.global_step
        if not (done and callback.last_model_path):
            candidates = callback._monitor_candidates(trainer)
            path = callback.format_checkpoint_name(candidates, callback.CHECKPOINT_NAME_LAST)
            callback.last_model_path = path
            trainer.save_checkpoint(path, weights_only=False)
        saved.append(callback.last_model_path)
    return saved
