"""One microbatch's forward and another's backward, interleaved at their all-to-alls.

    y, dx = run_pair(lambda: stage.forward(i, x), lambda: stage.backward(j, grad))

runs the backward on a helper thread and the forward on the caller's, one at a time: a baton says
which, the backward first. Whoever holds it computes; every started expert-parallel exchange (``hand_over``, called by
``parallel/all_to_all.py`` and the counts' exchange of ``parallel/dispatch.py``) passes it to the
other, whose compute then runs while the tokens travel: the forward's attention and experts under
the backward's dispatch and combine, and the other way round (DeepSeek-V3's overlap of two
microbatches, Megatron's ``--overlap-moe-expert-parallel-comm``). A thread that waits for its own
exchange waits holding the baton: that is the exposed time.

Why threads, not streams: a backward is one call into autograd's engine, which cannot pause at an
exchange; its thread can. Why one at a time: the interleaving is then a function of the program
alone, the same on every rank, so each process group sees its collectives in one order on all of
its ranks (as in a one-thread program) and nothing can deadlock that would not deadlock without
the pair. The pair trains the same model as running the two in turn: the forward touches no
gradient, and the backward's accumulation runs in its own order, unchanged.

Thread-local state: the forward stays on the caller's thread (autocast, grad mode, saved-tensor
hooks as the step set them); autograd's backward needs none of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

A = TypeVar("A")
B = TypeVar("B")

_baton: _Baton | None = None  # set while a pair runs
handovers = 0  # every hand-over so far (the tests' witness that a pair interleaved)


class _Baton:
    """Which half computes: "forward" (the caller's thread) or "backward" (any other: the helper,
    and on GPUs autograd's device threads, which run the backward's nodes for it)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.caller = threading.get_ident()
        # the backward computes first: it frees the activations it is done with at least as fast as
        # the forward saves new ones (two exchanges a layer to the forward's three), so the pair
        # never holds more than it held when it started, or holds when it ends (plus a sub-step)
        self.holder = "backward"
        self.running = {"forward", "backward"}

    def _role(self) -> str:
        return "forward" if threading.get_ident() == self.caller else "backward"

    def hand_over(self) -> None:
        global handovers
        me = self._role()
        other = "backward" if me == "forward" else "forward"
        with self.cond:
            if other not in self.running:  # the other half is done: go on alone
                return
            self.holder, handovers = other, handovers + 1
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.holder == me)

    def take(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.holder == self._role())

    def leave(self) -> None:
        me = self._role()
        with self.cond:
            self.running.discard(me)
            if self.running:
                self.holder = next(iter(self.running))
            self.cond.notify_all()


def hand_over() -> None:
    """Let the other half of a running pair compute (an exchange was just started); a no-op outside
    a pair, or once the other half has finished."""
    baton = _baton
    if baton is not None:
        baton.hand_over()


def run_pair(forward: Callable[[], A], backward: Callable[[], B]) -> tuple[A, B]:
    """``(forward(), backward())``, interleaved at their exchanges (module doc). An error in either
    is raised here once both have stopped."""
    global _baton
    if _baton is not None:
        raise RuntimeError("run_pair inside a running pair: pairs do not nest")
    result: dict[str, Any] = {}

    def helper() -> None:
        try:
            baton.take()
            result["backward"] = backward()
        except BaseException as error:  # raised on the caller's thread below
            result["error"] = error
        finally:
            baton.leave()

    baton = _Baton()
    _baton = baton
    thread = threading.Thread(target=helper, name="titan-backward", daemon=True)
    thread.start()
    try:
        baton.take()
        y = forward()
    finally:
        baton.leave()  # the backward finishes alone (an error here: it ends before we raise)
        thread.join()
        _baton = None
    if "error" in result:
        raise result["error"]
    return y, result["backward"]
