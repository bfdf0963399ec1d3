"""The one seam between the hot path and the tools that watch it or break it.

    with probes.span("all_to_all", "tokens"):   # a recorded span while tracing records
        ...
    x = probes.fault("all_to_all", x)           # may raise, exit or poison x when a fault is armed

Dispatch, the pipeline links and stage, the engine, the reducer and checkpoint saving call only these
two functions. The tools plug in through ``install`` (``tracing.start``; ``faults``, armed by
``TITAN_FAULT`` when the strategy imports it), so the hot path never imports them. What is installed
is this module's alone: ``install`` writes it, ``span`` and ``fault`` read it, and the handle it
returns takes it out again. Process-wide, not passed along, because the points sit deep inside the
stage, the reducer's hooks and the dispatch, on whatever thread autograd runs them. Unused (the
default) each call costs one global read and returns at once.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, overload

from torch import Tensor

Tracer = Callable[[str, str, dict[str, Any]], AbstractContextManager[Any]]
Faulter = Callable[[str, Tensor | None], Tensor | None]

# written by install() and Installed.remove() only; read by span() and fault()
_tracer: Tracer | None = None
_faulter: Faulter | None = None
_NULL = nullcontext()


class Installed:
    """What one ``install`` call put in place; ``remove()`` takes it out (once: removing twice, or
    after something else took its place, changes nothing)."""

    def __init__(self, tracer: Tracer | None, faulter: Faulter | None) -> None:
        self.tracer, self.faulter = tracer, faulter

    def remove(self) -> None:
        global _tracer, _faulter
        if self.tracer is not None and _tracer is self.tracer:
            _tracer = None
        if self.faulter is not None and _faulter is self.faulter:
            _faulter = None
        self.tracer = self.faulter = None


def install(*, tracer: Tracer | None = None, faulter: Faulter | None = None) -> Installed:
    """Route every ``span`` to ``tracer`` and every ``fault`` to ``faulter`` (either may be left out)
    until the returned handle's ``remove()``. One of each at a time: a second is refused."""
    global _tracer, _faulter
    if tracer is not None and _tracer is not None:
        raise RuntimeError("a tracer is installed already; remove it first (tracing.stop())")
    if faulter is not None and _faulter is not None:
        raise RuntimeError("a faulter is installed already; remove it first")
    if tracer is not None:
        _tracer = tracer
    if faulter is not None:
        _faulter = faulter
    return Installed(tracer, faulter)


def span(kind: str, name: str, **args: Any) -> AbstractContextManager[Any]:
    """Record ``(kind, name)`` on this rank while tracing records; else a shared no-op context."""
    record = _tracer
    return _NULL if record is None else record(kind, name, args)


@overload
def fault(phase: str) -> None: ...
@overload
def fault(phase: str, tensor: Tensor) -> Tensor: ...
def fault(phase: str, tensor: Tensor | None = None) -> Tensor | None:
    """An injection point: ``tensor`` as it is, unless an armed fault fires here."""
    fire = _faulter
    return tensor if fire is None else fire(phase, tensor)
