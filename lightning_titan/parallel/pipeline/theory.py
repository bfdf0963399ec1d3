"""What a schedule costs in theory, read off the schedule functions themselves.

A stand-in stage records the order each rank runs its forwards, backwards (and, zero-bubble, deferred
weight grads) in. Replayed with ideal durations (equal stages, free transfers), that order gives the
bubble; counting what each forward saves until its backward (or W) frees it gives the peak of live
activations. ``titan bench --schedules`` sets its measurements beside these, and ``titan plan``
checks its closed forms against them (``plan/cost.py``, ``plan/activations.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_titan.parallel.pipeline.schedules import V_SHAPED, get_schedule
from lightning_titan.parallel.pipeline.split import StageSplit
from lightning_titan.runtime import tracing


class _Order:
    """A stand-in stage (one chunk or several) that records what the schedule computes, in order:
    ``(kind, chunk, microbatch)`` with kind F, B (frees the activations) or B_input (keeps them for W)."""

    def __init__(self, pp: int, pp_rank: int, num_chunks: int) -> None:
        self.pp, self.pp_rank, self.num_chunks = pp, pp_rank, num_chunks
        self.ops: list[tuple[str, int, int]] = []

    def forward(self, i: int, x: Any) -> None:
        self.ops.append(("F", 0, i))

    def backward(self, i: int, grad: Any) -> None:
        self.ops.append(("B", 0, i))

    def backward_input(self, i: int, grad: Any) -> None:
        self.ops.append(("B_input", 0, i))

    def backward_weight(self, i: int) -> None:
        self.ops.append(("W", 0, i))

    def forward_chunk(self, chunk: int, i: int) -> None:
        self.ops.append(("F", chunk, i))

    def backward_chunk(self, chunk: int, i: int) -> None:
        self.ops.append(("B", chunk, i))

    def backward_input_chunk(self, chunk: int, i: int) -> None:
        self.ops.append(("B_input", chunk, i))

    def backward_weight_chunk(self, chunk: int, i: int) -> None:
        self.ops.append(("W", chunk, i))

    # an overlapped pair (parallel/overlap.py): its backward starts first and frees what it is done
    # with faster than its forward saves (it also ends first), so the pair counts as B then F
    def forward_backward(self, i: int, x: Any, j: int, grad: Any) -> tuple[None, None]:
        self.ops += [("B", 0, j), ("F", 0, i)]
        return None, None

    def overlap_chunks(self, f: tuple[int, int], b: tuple[int, int]) -> None:
        self.ops += [("B", *b), ("F", *f)]

    def __getattr__(self, name: str) -> Any:  # every send, receive and exchange: nothing to move
        return lambda *args, **kwargs: None


@functools.cache
def orders(schedule: str, pp: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's ``(kind, chunk, microbatch)`` in the order it runs them (cached: do not change)."""
    out = []
    for p in range(pp):
        stage = _Order(pp, p, v)
        get_schedule(schedule)(stage, m)
        out.append(stage.ops)
    return out


IDEAL_COST = {"F": 1.0, "B": 2.0, "B_input": 1.0, "W": 1.0}  # per stage; zero-bubble: B = W = F


def ideal_spans(
    schedule: str,
    pp: int,
    v: int,
    m: int,
    cost: dict[str, float] | list[dict[str, float]] | None = None,
) -> list[tracing.Span]:
    """The schedule's timeline with equal stages and free transfers: forward 1, backward 2 (zero-bubble:
    B 1 and W 1; or ``cost``, one for every stage or a list with one per rank), each chunk 1/v of a
    stage; every op as early as its stage and inputs allow."""
    costs = cost if isinstance(cost, list) else [cost or IDEAL_COST] * pp
    spans = []
    for p, ops in enumerate(orders(schedule, pp, v, m)):
        stage_cost = costs[p]
        for k, (kind, chunk, i) in enumerate(ops):
            args = {"mb": i, "chunk": chunk} if v > 1 else {"mb": i}
            if schedule in V_SHAPED:  # the replay's data dependencies follow the V
                args["stage"] = StageSplit(v, v_shape=True).stage_ids(pp, p)[chunk]
            name = "backward_weight" if kind == "W" else ("forward" if kind == "F" else "backward")
            span_kind = "forward" if kind == "F" else "backward"
            ns = round(1e6 * stage_cost[kind] / v)  # drawn in ms: 1 ms = one forward of a stage
            spans.append(tracing.Span(span_kind, name, p, k, k + ns, args=args))
    return tracing.replay_without_communication(spans, [list(range(pp))])


@functools.cache  # the planner asks for the same few small replays for every layout
def ideal_bubble(schedule: str, pp: int, v: int, m: int) -> float:
    """The worst stage's bubble of ``ideal_spans``: (P-1)/(M+P-1) for 1F1B, (P-1)/(v*M+P-1)
    interleaved, (P-1)/(3M+P-1) for ZB-H1 (its W's fill the cooldown); ZBV's, replayed likewise."""
    bubbles = tracing.measure_bubbles(ideal_spans(schedule, pp, v, m), [list(range(pp))])
    return max(b.measured for b in bubbles)


def live_peak(
    schedule: str,
    pp: int,
    pp_rank: int,
    v: int,
    m: int,
    chunk_bytes: Sequence[int] | Mapping[tuple[int, int], int],
) -> tuple[int, int]:
    """(peak bytes, peak microbatch-chunks) of activations stage ``pp_rank`` holds under the schedule's
    order: a forward saves ``chunk_bytes[chunk]`` (or, a mapping, ``chunk_bytes[chunk, microbatch]``:
    each forward's own) until its backward (zero-bubble: until its W)."""
    if isinstance(chunk_bytes, Mapping):
        size = dict(chunk_bytes)
    else:
        size = {(c, i): chunk_bytes[c] for c in range(v) for i in range(m)}
    live: set[tuple[int, int]] = set()
    peak = peak_count = 0
    for kind, chunk, i in orders(schedule, pp, v, m)[pp_rank]:
        if kind == "F":
            live.add((chunk, i))
        elif kind in ("B", "W"):
            live.discard((chunk, i))
        peak = max(peak, sum(size[key] for key in live))
        peak_count = max(peak_count, len(live))
    return peak, peak_count
