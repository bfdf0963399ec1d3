"""Which of a rank's threads holds the rank, where two of them record spans that overlap in wall
time: a forward-backward pair (``parallel/overlap.py``) runs one microbatch's forward on the caller's
thread and another's backward on a helper, one at a time.

A thread gives the rank away only right after recording an event of its own (the end of an
exchange's launch span, or of its last span), and a parked thread records nothing until the holder
hands back, which the holder does by recording an event first. So at any instant the holder is the
thread that records its next event first. With one thread this is that thread, so one-thread
timelines read as before.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Protocol, TypeVar


class Timed(Protocol):
    thread: int
    start_ns: int
    end_ns: int


T = TypeVar("T", bound=Timed)


def next_events(spans: Iterable[Timed]) -> dict[int, list[int]]:
    """Thread -> the sorted times of its spans' starts and ends."""
    out: dict[int, list[int]] = defaultdict(list)
    for s in spans:
        out[s.thread] += (s.start_ns, s.end_ns)
    return {thread: sorted(times) for thread, times in out.items()}


def holder(threads: Iterable[int], at: int, events: dict[int, list[int]]) -> int:
    """Of ``threads`` (those inside a span just before ``at``), the one whose next event at or
    after ``at`` comes first: the one that computed up to ``at``."""

    def next_at(thread: int) -> float:
        times = events[thread]
        i = bisect.bisect_left(times, at)
        return times[i] if i < len(times) else float("inf")

    return min(threads, key=lambda t: (next_at(t), t))


def sweep(spans: Sequence[T], extra: Iterable[int] = ()) -> Iterator[tuple[int, int, list[T]]]:
    """One rank's stretches between consecutive span edges (and the ``extra`` times), in time order:
    ``(start, end, the spans covering it of the thread that held the rank)``, empty where no span
    covers it."""
    events = next_events(spans)
    edges = sorted({t for s in spans for t in (s.start_ns, s.end_ns)} | set(extra))
    by_start = sorted(spans, key=lambda s: s.start_ns)
    active: list[T] = []
    nxt = 0
    for left, right in zip(edges, edges[1:], strict=False):
        while nxt < len(by_start) and by_start[nxt].start_ns <= left:
            active.append(by_start[nxt])
            nxt += 1
        active = [s for s in active if s.end_ns > left]
        thread = holder({s.thread for s in active}, right, events) if active else None
        yield left, right, [s for s in active if s.thread == thread]


def segments(spans: Sequence[Timed]) -> list[tuple[int, int, int]]:
    """One rank's ``(start, end, thread)`` stretches, in time order, each held by one thread (time
    inside no span is left out)."""
    out: list[tuple[int, int, int]] = []
    for left, right, mine in sweep(spans):
        if not mine:
            continue
        thread = mine[0].thread
        if out and out[-1][1] == left and out[-1][2] == thread:
            out[-1] = (out[-1][0], right, thread)
        else:
            out.append((left, right, thread))
    return out


def held(spans: Sequence[T], keep: Iterable[str] = ()) -> list[T]:
    """Each span cut to the stretches its thread held the rank (spans of one rank); spans whose
    ``kind`` is in ``keep`` stay whole (the exchanges in flight, which run whoever computes)."""
    keep = set(keep)
    cut = [s for s in spans if getattr(s, "kind", None) not in keep]
    by_thread: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for a, b, thread in segments(cut):
        by_thread[thread].append((a, b))
    out = [s for s in spans if getattr(s, "kind", None) in keep]
    for s in cut:
        mine = by_thread.get(s.thread, [])
        i = bisect.bisect_right(mine, (s.start_ns, float("inf"))) - 1
        for a, b in mine[max(i, 0) :]:
            if a >= s.end_ns:
                break
            lo, hi = max(a, s.start_ns), min(b, s.end_ns)
            if hi > lo:
                out.append(replace(s, start_ns=lo, end_ns=hi))  # type: ignore[type-var]
    return out
