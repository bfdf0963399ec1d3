"""The one seam between the hot path and the tools that watch it or break it.

    with probes.span("all_to_all", "tokens"):   # a recorded span while tracing records
        ...
    x = probes.fault("all_to_all", x)           # may raise, exit or poison x when a fault is armed

Dispatch, the pipeline links and stage, the engine, the reducer and checkpoint saving call only these
two functions. Unused (the default) each costs a global read and returns at once: ``tracing.start``
and ``faults`` (armed by ``TITAN_FAULT`` when the strategy imports it) install themselves here, so the
hot path never imports the tools.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, overload

from torch import Tensor

Tracer = Callable[[str, str, dict[str, Any]], AbstractContextManager[Any]]
Faulter = Callable[[str, Tensor | None], Tensor | None]

tracer: Tracer | None = None  # set by tracing.start(), cleared by tracing.stop()
faulter: Faulter | None = None  # set by faults when TITAN_FAULT names a fault
_NULL = nullcontext()


def span(kind: str, name: str, **args: Any) -> AbstractContextManager[Any]:
    """Record ``(kind, name)`` on this rank while tracing records; else a shared no-op context."""
    record = tracer
    return _NULL if record is None else record(kind, name, args)


@overload
def fault(phase: str) -> None: ...
@overload
def fault(phase: str, tensor: Tensor) -> Tensor: ...
def fault(phase: str, tensor: Tensor | None = None) -> Tensor | None:
    """An injection point: ``tensor`` as it is, unless an armed fault fires here."""
    fire = faulter
    return tensor if fire is None else fire(phase, tensor)
