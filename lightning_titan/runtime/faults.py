"""Fault injection for the reliability tests: make one rank fail at one step in one phase.

    TITAN_FAULT="rank=1,step=2,phase=backward,action=kill" titan fit --config configs/pp_ep.yaml

``step`` is the index of the training step (``trainer.global_step`` when the step began; a checkpoint
saved after a step belongs to it), ``rank`` the global rank. The fault fires once, at the first
injection point of that phase in that step. Actions:

- ``raise``: raise :class:`InjectedFault` (a Python error, as a bug would);
- ``exit``: leave at once with exit code :data:`EXIT_CODE`, no cleanup (as a C++ abort would);
- ``kill``: SIGKILL this process (as the OOM killer would);
- ``term``: SIGTERM to this process (as a scheduler preempting the job would);
- ``stop``: SIGSTOP to this process, every thread of it (a stalled rank: alive, its sockets open,
  so its peers wait for it until the collective timeout);
- ``note``: the line below, then this rank waits (at most :data:`NOTE_HOLD_S`) for a SIGUSR1: a test
  reads the line, sends a signal of its own, then SIGUSR1 to the pid the line names, so that a loaded
  machine cannot run the job past the step before the test's signal lands;
- ``nan`` / ``inf``: poison the phase's tensor (stage output, backward objective, all-to-all payload).

The variable is read once, when this module is imported (by the strategy); a fault installs itself at
``lightning_titan.runtime.probes`` (``probes.install``), the injection points' seam. Unset, nothing
is installed; nor in a restarted job (``launch.restart_count``), so that a test sees the restart run
clean.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_titan.runtime import probes
from lightning_titan.runtime.launch import restart_count

ENV = "TITAN_FAULT"
PHASES = ("forward", "backward", "p2p", "all_to_all", "all_reduce", "checkpoint_save")
ACTIONS = ("raise", "exit", "kill", "term", "stop", "note", "nan", "inf")
TENSOR_PHASES = ("forward", "backward", "all_to_all")  # where nan/inf has a tensor to poison
EXIT_CODE = 13
NOTE_HOLD_S = 60.0


class InjectedFault(RuntimeError):
    """The error ``action=raise`` raises."""


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    phase: str
    action: str

    @classmethod
    def parse(cls, spec: str) -> Fault:
        """``"rank=1,step=2,phase=backward,action=raise"`` -> Fault; ValueError naming what is wrong."""
        fields: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key not in ("rank", "step", "phase", "action"):
                raise ValueError(
                    f"{ENV}={spec!r}: {item!r} is not one of rank=R, step=S, phase=P, action=A"
                )
            fields[key] = value.strip()
        missing = [k for k in ("rank", "step", "phase", "action") if k not in fields]
        if missing:
            raise ValueError(f"{ENV}={spec!r} lacks {', '.join(missing)}; e.g. {_EXAMPLE}")
        for key in ("rank", "step"):
            if not fields[key].isdigit():
                raise ValueError(f"{ENV}={spec!r}: {key}={fields[key]!r} must be an int >= 0")
        fault = cls(int(fields["rank"]), int(fields["step"]), fields["phase"], fields["action"])
        if fault.phase not in PHASES:
            raise ValueError(f"{ENV}={spec!r}: phase={fault.phase!r} is not one of {PHASES}")
        if fault.action not in ACTIONS:
            raise ValueError(f"{ENV}={spec!r}: action={fault.action!r} is not one of {ACTIONS}")
        if fault.action in ("nan", "inf") and fault.phase not in TENSOR_PHASES:
            raise ValueError(
                f"{ENV}={spec!r}: action={fault.action} needs a tensor; use a phase of {TENSOR_PHASES}"
            )
        return fault


_EXAMPLE = "rank=1,step=2,phase=backward,action=raise"
# a restarted job's ranks run clean: the fault stands for a one-off failure, not one at every launch
_fault: Fault | None = (
    Fault.parse(os.environ[ENV]) if os.environ.get(ENV) and not restart_count() else None
)
# a context variable: a checkpoint written in the background runs in a copy of the context that
# started it (``checkpoint/background.py``), so its save belongs to the step that saved it
_step: contextvars.ContextVar[int] = contextvars.ContextVar("titan_fault_step", default=0)
_fired = False


def set_step(step: int) -> None:
    """The training step now running (the strategy calls this as each step begins)."""
    _step.set(step)


@contextlib.contextmanager
def _held_until_sigusr1() -> Iterator[None]:
    """``note``: the handler is in place before the body prints the line (the test's SIGUSR1 may
    follow it at once); then wait for the signal, at most :data:`NOTE_HOLD_S`, and put back the
    handler that was there."""
    released: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: released.append(signum))
    try:
        yield
        deadline = time.monotonic() + NOTE_HOLD_S
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs between these sleeps, as any signal's would
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _fire(phase: str, tensor: Tensor | None) -> Tensor | None:
    """An injection point reached: return ``tensor`` (poisoned for nan/inf), or fail as TITAN_FAULT says."""
    global _fired
    fault = _fault
    assert fault is not None
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    step = _step.get()
    if _fired or phase != fault.phase or step != fault.step or rank != fault.rank:
        return tensor
    _fired = True
    # only the main thread can take a signal handler; elsewhere (a saving thread) note just prints
    hold = fault.action == "note" and threading.current_thread() is threading.main_thread()
    what = f"{ENV} fired: rank {rank} (pid {os.getpid()}) {fault.action} in {phase} at step {step}"
    with _held_until_sigusr1() if hold else contextlib.nullcontext():
        sys.stderr.flush()
        os.write(sys.stderr.fileno(), f"{what}\n".encode())  # one write: ranks share the stream
    if fault.action == "raise":
        raise InjectedFault(what)
    if fault.action == "exit":
        sys.stdout.flush()
        os._exit(EXIT_CODE)
    signals = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}
    if fault.action in signals:
        os.kill(os.getpid(), signals[fault.action])
    if fault.action in ("term", "stop", "note"):  # a stopped rank that is resumed (SIGCONT) goes on
        return tensor
    assert tensor is not None  # parse() takes nan/inf only for TENSOR_PHASES, whose points pass one
    value = float("nan") if fault.action == "nan" else float("inf")
    # multiply (not fill) so autograd carries the poison to every gradient upstream
    return tensor * torch.tensor(value, dtype=tensor.dtype, device=tensor.device)


if _fault is not None:  # for the process's life (a restarted job's ranks are new processes)
    probes.install(faulter=_fire)
