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
        self.handovers = 0

    def _role(self) -> str:
        return "forward" if threading.get_ident() == self.caller else "backward"

    def hand_over(self) -> None:
        me = self._role()
        other = "backward" if me == "forward" else "forward"
        with self.cond:
            if other not in self.running:  # the other half is done: go on alone
                return
            self.holder, self.handovers = other, self.handovers + 1
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


class _Pairs:
    """The pair running in this process and the hand-overs of those that ran: ``run_pair`` writes
    them, ``hand_over`` and ``handovers`` read them. Process-wide, because the exchanges that hand
    over run deep inside a forward or a backward, on whatever thread autograd picks, and cannot be
    handed the pair."""

    def __init__(self) -> None:
        self.running: _Baton | None = None  # at most one: pairs do not nest
        self.handovers = 0

    def start(self) -> _Baton:
        if self.running is not None:
            raise RuntimeError("run_pair inside a running pair: pairs do not nest")
        self.running = _Baton()
        return self.running

    def end(self, baton: _Baton) -> None:
        self.running = None
        self.handovers += baton.handovers


_pairs = _Pairs()


def hand_over() -> None:
    """Let the other half of a running pair compute (an exchange was just started); a no-op outside
    a pair, or once the other half has finished."""
    baton = _pairs.running
    if baton is not None:
        baton.hand_over()


def handovers() -> int:
    """Hand-overs in this process so far, of every pair that ran to its end: a caller's witness that
    its pairs interleaved (read it before and after)."""
    return _pairs.handovers


def run_pair(forward: Callable[[], A], backward: Callable[[], B]) -> tuple[A, B]:
    """``(forward(), backward())``, interleaved at their exchanges (module doc). An error in either
    is raised here once both have stopped."""
    baton = _pairs.start()
    result: dict[str, Any] = {}

    def helper() -> None:
        try:
            baton.take()
            result["backward"] = backward()
        except BaseException as error:  # raised on the caller's thread below
            result["error"] = error
        finally:
            baton.leave()

    thread = threading.Thread(target=helper, name="titan-backward", daemon=True)
    thread.start()
    try:
        baton.take()
        y = forward()
    finally:
        baton.leave()  # the backward finishes alone (an error here: it ends before we raise)
        thread.join()
        _pairs.end(baton)
    if "error" in result:
        raise result["error"]
    return y, result["backward"]
