"""Agreeing on errors across ranks, so that nobody waits forever in a collective a peer will not enter.

From the process group's start to the end of the strategy's ``setup()`` every collective of ours is
an agreement (one object gather): a rank that fails there joins the gather its peers wait in, and
every rank raises the same error. Checkpoint save/load use the same agreement before their collectives.
"""

from __future__ import annotations

import builtins
from typing import Any

import torch
import torch.distributed as dist


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _portable(error: BaseException) -> tuple[type[BaseException], str]:
    """(class, message) another rank can raise: a builtin class whose constructor takes one message,
    else RuntimeError with the class name kept in the message (a user's class may not unpickle there,
    and e.g. ``UnicodeDecodeError(message)`` is itself a TypeError)."""
    kind, message = type(error), str(error)
    if getattr(builtins, kind.__name__, None) is kind:
        try:
            kind(message)
            return kind, message
        except Exception:  # noqa: BLE001 - its constructor wants other arguments
            pass
    return RuntimeError, f"{kind.__name__}: {message}"


def agree(error: BaseException | None, payload: Any = None, group: Any = None) -> list[Any]:
    """Collective over ``group`` (None: the world): if any rank has an error, raise the lowest rank's
    on every rank; else gather the payloads."""
    if not distributed():
        if error is not None:
            raise error
        return [payload]
    report = None if error is None else _portable(error)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (report, payload), group=group)
    reports = [(rank, r) for rank, (r, _) in enumerate(gathered) if r is not None]
    if not reports:
        return [p for _, p in gathered]
    first_rank, (kind, message) = reports[0]
    if len(reports) < len(gathered) or any(r != reports[0][1] for _, r in reports):
        message = f"{message} (raised on rank {first_rank})"
    if error is not None and report == (
        kind,
        message,
    ):  # this rank's own error, unchanged: raise it as it is
        raise error
    raise kind(message) from error


class SetupPhase:
    """While active, barriers and broadcasts are agreements, so a failing rank can join them."""

    def __init__(self) -> None:
        self.active = False

    def start(self) -> None:
        self.active = True

    def end(self) -> None:
        """Close the phase: one last agreement, so a rank that failed late in setup is heard."""
        if self.active and distributed():
            self.agree()
        self.active = False

    def agree(self, error: BaseException | None = None, payload: Any = None) -> list[Any]:
        try:
            return agree(error, payload)
        except BaseException:
            self.active = False  # agreed: the peers raise it too, nobody waits for another
            raise

    def barrier(self, device: torch.device) -> None:
        """A barrier of the world; while active, an agreement (a rank that failed joins it as an error)."""
        if not distributed():
            return
        if self.active:
            self.agree()
        elif dist.get_backend() == "nccl":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int, rank: int) -> Any:
        """``obj`` of global rank ``src`` on every rank; while active, an agreement."""
        if not distributed():
            return obj
        if self.active:
            return self.agree(None, obj if rank == src else None)[src]
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def fail(self, exception: BaseException) -> None:
        """This rank failed: if the peers wait in a setup agreement, tell them."""
        if self.active and distributed():
            try:
                self.agree(exception)
            except BaseException:  # noqa: BLE001 - this rank raises its own error
                pass
        self.active = False
