"""Preemption: SIGTERM (what SLURM and Kubernetes send) stops the job after the same step on every
rank, with ``last`` saved through the normal checkpoint path, and exit code 143.

- ``on_signal``: the handler only sets a flag. Lightning's own handler is replaced once training
  starts: it runs a broadcast inside the handler and stops only the rank that got the signal. (A fork
  launcher's parent, no rank, forwards the signal to the ranks: ``supervisor.TitanForkLauncher``.)
- SIGINT (Ctrl+C) in a job of several processes (the ``popen`` launcher, which is rank 0, or a rank)
  stops the same way, with exit code 130: Lightning's own handling of the KeyboardInterrupt saves
  nothing and kills the ranks wherever they are. A second Ctrl+C stops at once (the launcher kills
  its ranks). A single process keeps Lightning's handling (a notebook's interrupt stays immediate);
  fork ranks ignore SIGINT (their parent decides).
- ``start_agreement``/``decide``: the ranks agree on the flag (the signal's number) once per step, in one tiny all-reduce whose
  result rides on the step's one host read (``TitanStrategy.finish_gradients``). Once they agree,
  ``trainer.received_sigterm`` is set on every rank, so Lightning's loop raises ``SIGTERMException``
  on every rank at the end of the same step.
- ``Preemptible.on_exception``: every rank then saves ``last`` (``save_sharded`` is collective and
  atomic) and the exception's exit code becomes 143 (130 when SIGINT was the only signal).
- ``_outside_fit``: in ``validate``/``test``/``predict`` a SIGTERM stops at once (nothing to save).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_titan.lightning import supervisor

EXIT_CODE = 128 + signal.SIGTERM  # 143: what a shell and a scheduler report for "terminated"
_requested = threading.Event()  # this process got SIGTERM or SIGINT
_signum = 0  # the first of them it got; the ranks agree on the largest: SIGTERM wins over SIGINT


def on_signal(signum: int, frame: Any) -> None:
    """Set the flag; nothing else (a handler may run between any two bytecodes of a collective).
    A second SIGINT (Ctrl+C again) ends this process at once, and the ranks it started."""
    global _signum
    if signum == signal.SIGINT and _requested.is_set():
        os.write(2, f"[titan] pid {os.getpid()} got SIGINT again: stopping now\n".encode())
        supervisor.kill_ranks()
        os._exit(128 + signal.SIGINT)
    if _requested.is_set():
        return
    _signum = signum
    _requested.set()
    again = " (Ctrl+C again: stop at once)" if signum == signal.SIGINT else ""
    name = signal.Signals(signum).name
    line = f"[titan] pid {os.getpid()} got {name}: stopping after this step, saving last{again}\n"
    os.write(2, line.encode())  # one raw write: the stream's buffer may be in use


def install(world_size: int = 1) -> None:
    """SIGTERM always; SIGINT in a job of several processes, unless ignored here (a fork rank).
    ``Trainer._teardown`` restores both handlers (Lightning's signal connector saved them)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, on_signal)
    if world_size > 1 and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, on_signal)


def start_agreement(device: torch.device) -> Callable[[], torch.Tensor]:
    """Start the all-reduce (max over the world) of this rank's flag; the returned function waits
    for it (on CUDA: the stream waits, the host does not) and gives the agreed flag, 0-dim."""
    flag = torch.tensor(float(_signum) if _requested.is_set() else 0.0, device=device)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return lambda: flag
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True)

    def agreed() -> torch.Tensor:
        work.wait()
        return flag

    return agreed


class Preemptible:
    """A mixin of ``TitanStrategy``: install the handler, act on the agreement, save ``last``."""

    _preempted_at: int | None = None  # the global step after which every rank stops
    _stop_signal: int = signal.SIGTERM  # the signal the ranks agreed on

    def on_train_start(self: Any) -> None:
        super().on_train_start()  # type: ignore[misc]
        install(self.world_size)  # after Lightning registered its handlers (Trainer._run)

    def barrier(self: Any, name: str | None = None) -> None:
        # "run-stage" is the Trainer's first call after it registered its own signal handlers and
        # before the evaluation loop's first collective (its dataloader-length all-reduce): a SIGTERM
        # there would run Lightning's handler, whose broadcast waits out the timeout mid-collective
        if name == "run-stage":
            _outside_fit(self)
        super().barrier(name)  # type: ignore[misc]

    def decide(self: Any, agreed: float) -> None:
        """``agreed``: the all-reduced flag (a signal's number, or 0), read with the step's numbers."""
        if agreed > 0 and self._preempted_at is None:
            self._stop_signal = int(agreed)
            trainer = self.lightning_module.trainer
            self._preempted_at = trainer.global_step
            supervisor.preempting.set()  # the launcher's watcher: a rank's exit 143 is no failure
            trainer._signal_connector.received_sigterm = True  # Lightning stops after this step

    def on_exception(self: Any, exception: BaseException) -> None:
        if isinstance(self.launcher, supervisor.TitanForkLauncher) and not dist.is_initialized():
            if isinstance(exception, (KeyboardInterrupt, SystemExit)):  # the parent: no failure
                what = "interrupted" if isinstance(exception, KeyboardInterrupt) else "preempted"
                supervisor.say(f"[titan] the launcher was {what}: every rank has stopped")
                return
        if not (isinstance(exception, SIGTERMException) and self._preempted_at is not None):
            super().on_exception(exception)  # type: ignore[misc]
            return
        trainer = self.lightning_module.trainer
        saved = save_last(trainer)
        where = f"rank {self.global_rank}/{self.world_size}"
        what = f"saved {', '.join(saved)}" if saved else "no ModelCheckpoint: nothing saved"
        code, name = 128 + self._stop_signal, signal.Signals(self._stop_signal).name
        how = "interrupted" if self._stop_signal == signal.SIGINT else "preempted"
        supervisor.say(
            f"[titan] {where} {how} ({name}) after global_step={trainer.global_step}: {what}; "
            f"exit code {code}"
        )
        exception.code = code
        procs = getattr(self.launcher, "procs", None)
        if procs and self.global_rank == 0:  # the popen launcher leaves after its ranks
            supervisor.wait_for(procs, self.options.grace_s)


def _outside_fit(strategy: Any) -> None:
    """``titan validate``/``test``/``predict``: no step to agree on, nothing to save, so SIGTERM stops
    this process (and the ranks a popen launcher started) at once, exit code 143. Lightning's own
    handler would broadcast inside the handler, which blocks, mid-collective, until the timeout."""
    trainer = strategy.lightning_module.trainer
    if trainer.state.fn == TrainerFn.FITTING:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    grace_s = strategy.options.grace_s
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
