"""Per-rank span recorder for measured timelines, and the analysis of what it recorded.

    with tracing.span("p2p", "send_forward", mb=3):
        ...
    tracing.start(rank, step=7)   # this process records from now on
    spans = tracing.stop()        # ... and hands back what it recorded

Recording is off unless ``start`` was called in this process; it reaches the instrumented code through
``lightning_titan.runtime.probes`` (``probes.install``; a shared no-op context otherwise: a function
call and a global read). The recorder is process-wide (like ``torch.profiler``), not passed around,
because the spans come from deep inside the stage, the reducer hooks and the MoE dispatch, which run
on whatever thread autograd picks.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from lightning_titan.runtime import holders, probes

COMPUTE_KINDS = ("forward", "backward")
COMM_KINDS = ("p2p", "all_to_all", "all_reduce", "wait", "all_gather", "tp", "cp")
# all_gather: ZeRO's params; tp: the sequence-parallel collectives and the vocab-parallel loss's
# all-reduces; cp: the key / value all-gather (and its grads' reduce-scatter)
KINDS = (*COMPUTE_KINDS, *COMM_KINDS, "optimizer")
# in_flight: an all-to-all from its start to the end of its wait, while the rank computes on
# (``parallel/all_to_all.py``); it holds no time of its own: the waited part is its all_to_all span
BACKGROUND_KINDS = ("in_flight",)
OTHER = "other"  # time inside a step covered by no span (Python, scheduler, logging)


@dataclass(slots=True)
class Span:
    kind: str
    name: str
    rank: int
    start_ns: int
    end_ns: int
    step: int = 0
    thread: int = 0
    args: dict = field(default_factory=dict)
    # the recording thread's CPU time inside the span (None: timed by CUDA events, or made up):
    # what the span computed, without time its core went to another process
    cpu_ns: int | None = None

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def _new_cuda_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


class _Recorder:
    def __init__(self, rank: int, step: int, synchronize: bool) -> None:
        self.rank, self.step, self.synchronize = rank, step, synchronize
        self.spans: list[Span] = []
        self.lock = threading.Lock()  # autograd may run hooks on its own device threads
        # On CUDA a span edge records an event instead of waiting for the GPU; ``stop`` waits once
        # and places the events on this clock, anchored by one event recorded now.
        self.pending: list[tuple[Span, Any, Any]] = []
        if synchronize:
            self.anchor = _new_cuda_event()
            self.anchor.record()
            self.anchor_ns = time.perf_counter_ns()
        self.installed = probes.install(tracer=self.open)  # records from here until stop()

    def resolve(self) -> None:
        """Give the spans timed by events their times on the host clock (waits for the GPU once)."""
        for span, start, end in self.pending:
            end.synchronize()  # the first one waits, the others are done by then
            span.start_ns = self.anchor_ns + round(self.anchor.elapsed_time(start) * 1e6)
            span.end_ns = self.anchor_ns + round(self.anchor.elapsed_time(end) * 1e6)
        self.pending.clear()

    def open(self, kind: str, name: str, args: dict) -> _Open:
        """A span about to be entered (the tracer this recorder installs at ``probes``)."""
        return _Open(self, kind, name, args)


_recorder: _Recorder | None = None  # start()'s, until stop(): this module writes and reads it


class _Open:
    __slots__ = ("recorder", "kind", "name", "args", "start_ns", "start_cpu_ns", "start_event")

    def __init__(self, recorder: _Recorder, kind: str, name: str, args: dict) -> None:
        self.recorder, self.kind, self.name, self.args = recorder, kind, name, args

    def __enter__(self) -> _Open:
        if self.recorder.synchronize:  # on CUDA: time the kernels, not their launches
            self.start_event = _new_cuda_event()
            self.start_event.record()
        self.start_cpu_ns = time.thread_time_ns()
        self.start_ns = time.perf_counter_ns()
        return self

    def __exit__(self, *exc: object) -> None:
        rec = self.recorder
        end = time.perf_counter_ns()
        cpu = None if rec.synchronize else time.thread_time_ns() - self.start_cpu_ns
        where = (rec.rank, self.start_ns, end, rec.step, threading.get_ident())
        span = Span(self.kind, self.name, *where, self.args, cpu)
        end_event = None
        if rec.synchronize:
            end_event = _new_cuda_event()
            end_event.record()
        with rec.lock:
            rec.spans.append(span)
            if end_event is not None:
                rec.pending.append((span, self.start_event, end_event))


span = probes.span  # the hot path calls probes.span directly; tools outside it may use this name


def start(rank: int, *, step: int = 0, synchronize: bool = False) -> None:
    """Record spans in this process from now on, tagged with ``rank`` and ``step``.

    ``synchronize`` (on CUDA) times the spans by the GPU: each edge records a CUDA event, and ``stop``
    waits for the GPU once and gives the spans the events' times, so spans hold kernel time without a
    host sync per span.
    """
    global _recorder
    if _recorder is not None:
        raise RuntimeError("tracing.start() called while already recording; call stop() first")
    _recorder = _Recorder(rank, step, synchronize)


def stop() -> list[Span]:
    """Stop recording and return the spans recorded since ``start`` (empty if not recording)."""
    global _recorder
    rec, _recorder = _recorder, None
    if rec is None:
        return []
    rec.installed.remove()
    rec.resolve()
    return rec.spans


def is_recording() -> bool:
    return _recorder is not None


# -- analysis -------------------------------------------------------------------------------------------


def exclusive_ns(spans: Iterable[Span], window: tuple[int, int] | None = None) -> dict[str, int]:
    """Time of one rank by kind, each instant counted once, for the innermost span covering it.

    A forward that contains an all-to-all gives the all-to-all's time to ``all_to_all`` and the rest to
    ``forward``. Instants of ``window`` covered by no span go to ``OTHER``. ``BACKGROUND_KINDS``
    spans are left out: the compute under them keeps its kind. Where two threads' spans overlap (a
    forward-backward pair), an instant goes to the innermost span of the thread holding the rank
    (``holders.py``), not to the other's, which waits for it.
    """
    spans = [s for s in spans if s.end_ns > s.start_ns and s.kind not in BACKGROUND_KINDS]
    out: dict[str, int] = defaultdict(int)
    for left, right, mine in holders.sweep(spans, window or ()):
        if window is not None and not window[0] <= left < right <= window[1]:
            continue
        if mine:  # innermost: started last; among equal starts, the one ending first
            out[max(mine, key=lambda s: (s.start_ns, -s.end_ns)).kind] += right - left
        elif window is not None:
            out[OTHER] += right - left
    return dict(out)


def _union_ns(intervals: list[tuple[int, int]]) -> int:
    total, reach = 0, -(2**63)
    for a, b in sorted(intervals):
        total += max(0, b - max(a, reach))
        reach = max(reach, b)
    return total


def theory_bubble(
    pp: int, num_microbatches: int, virtual_stages: int = 1, split_backward: bool = False
) -> float:
    """Idle fraction of each stage for GPipe and 1F1B with equal stages: (P - 1) / (M + P - 1); for
    interleaved 1F1B over ``v`` chunks per rank: (P - 1) / (v * M + P - 1). ZB-H1
    (``split_backward``, with F = B = W): the W's fill two of the three units a 1F1B warm-up and
    cool-down leave idle per stage, (P - 1) / (3M + P - 1)."""
    if split_backward and virtual_stages == 1:
        return (pp - 1) / (3 * num_microbatches + pp - 1)
    return (pp - 1) / (virtual_stages * num_microbatches + pp - 1)


@dataclass
class StageBubble:
    stage: int
    measured: float  # median over (pipeline, step) samples: one disturbed step does not decide it
    theory: float
    # M: distinct microbatches, not forwards (v per microbatch when interleaved)
    num_microbatches: int
    samples: int  # (pipeline, step) pairs measured
    mean: float = 0.0
    virtual_stages: int = 1  # chunks per rank (v)
    split_backward: bool = False  # zero-bubble: weight-grad spans (W) apart from the input grad (B)


def measure_bubbles(spans: Sequence[Span], pipelines: Sequence[Sequence[int]]) -> list[StageBubble]:
    """Idle fraction of each pipeline stage, measured: ``1 - busy / window`` where busy is the union of
    the stage's forward/backward spans and the window runs from the pipeline's first compute start to
    its last compute end, per step; the median over pipelines and steps (and the mean). ``pipelines``
    lists each pipeline's global ranks by stage (``ParallelDims.all_groups("pp")``). Time in send/recv
    counts as idle: that is the bubble."""
    compute: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    # forwards as (chunk, microbatch): interleaved, a rank runs v forwards per microbatch
    forwards: dict[tuple[int, int], set] = defaultdict(set)
    for s in spans:
        if s.kind in COMPUTE_KINDS:
            compute[(s.rank, s.step)].append((s.start_ns, s.end_ns))
            if s.kind == "forward":
                mb = s.args.get("mb", len(forwards[(s.rank, s.step)]))  # unlabelled: one each
                forwards[(s.rank, s.step)].add((s.args.get("chunk", 0), mb))
    steps = sorted({step for _, step in compute})
    fractions: dict[int, list[float]] = defaultdict(list)
    microbatches: dict[int, tuple[int, int]] = {}  # stage -> (M, v)
    for ranks in pipelines:
        for step in steps:
            per_rank = [compute.get((r, step), []) for r in ranks]
            if not all(per_rank):
                continue
            start = min(a for iv in per_rank for a, _ in iv)
            end = max(b for iv in per_rank for _, b in iv)
            for stage, intervals in enumerate(per_rank):
                fractions[stage].append(1.0 - _union_ns(intervals) / max(1, end - start))
                ids = forwards[(ranks[stage], step)]
                microbatches[stage] = (len({mb for _, mb in ids}), len({c for c, _ in ids}))
    pp = len(pipelines[0]) if pipelines else 1
    m, v = microbatches.get(0, (1, 1))
    split = any(s.name == "backward_weight" for s in spans)
    theory = theory_bubble(pp, m, v, split)
    out = []
    for stage, f in sorted(fractions.items()):
        stage_m, stage_v = microbatches[stage]
        out.append(
            StageBubble(
                stage,
                statistics.median(f),
                theory,
                stage_m,
                len(f),
                sum(f) / len(f),
                stage_v,
                split,
            )
        )
    return out


def replay_without_communication(
    spans: Sequence[Span], pipelines: Sequence[Sequence[int]]
) -> list[Span]:
    """The recorded forwards and backwards, each stage in its recorded order and with its recorded
    durations, re-timed as if send/recv cost nothing: forward i on stage p starts once forward i on
    p - 1 ended, backward i once backward i on p + 1 ended. ``measure_bubbles`` of the result is the
    bubble that compute alone (its imbalance and jitter) explains; the rest is communication.

    Virtual stages (spans with ``args["chunk"]``) count as stage ``chunk * P + p``, or
    ``args["stage"]`` where the span says (the V of zbv); a zero-bubble weight-grad span (name
    ``backward_weight``) waits for its own input-grad span only."""
    by_rank_step: dict[tuple[int, int], list[Span]] = defaultdict(list)
    for s in spans:
        if s.kind in COMPUTE_KINDS:
            by_rank_step[(s.rank, s.step)].append(s)
    out = []
    for ranks in pipelines:
        for step in sorted({st for r, st in by_rank_step if r in ranks}):
            orders = [sorted(by_rank_step[(r, step)], key=lambda s: s.start_ns) for r in ranks]
            last = len(ranks) * (1 + max(s.args.get("chunk", 0) for o in orders for s in o)) - 1
            done: dict[tuple[str, int, object], int] = {}
            free, nxt = [0] * len(ranks), [0] * len(ranks)
            while any(n < len(o) for n, o in zip(nxt, orders, strict=True)):
                progressed = False
                for p, order in enumerate(orders):
                    if nxt[p] == len(order):
                        continue
                    s, mb = order[nxt[p]], order[nxt[p]].args.get("mb")
                    v_stage = s.args.get("stage", s.args.get("chunk", 0) * len(ranks) + p)
                    kind = "weight" if s.name == "backward_weight" else s.kind
                    if kind == "forward":
                        deps = [("forward", v_stage - 1, mb)] if v_stage > 0 else []
                    elif kind == "weight":
                        deps = [("backward", v_stage, mb)]
                    else:
                        deps = [("forward", v_stage, mb)] + (
                            [("backward", v_stage + 1, mb)] if v_stage < last else []
                        )
                    if any(d not in done for d in deps):
                        continue
                    start = max([free[p]] + [done[d] for d in deps])
                    free[p] = done[(kind, v_stage, mb)] = start + s.duration_ns
                    out.append(replace(s, start_ns=start, end_ns=free[p]))
                    nxt[p] += 1
                    progressed = True
                if not progressed:
                    raise ValueError(
                        f"the recorded order of step {step} on ranks {list(ranks)} cannot be "
                        "replayed: spans without matching microbatch ids (args['mb'])?"
                    )
    return out


def with_steady_compute(spans: Sequence[Span]) -> list[Span]:
    """The forward and backward spans, each one's duration replaced by the median of that rank's spans
    of the same kind and chunk: jitter removed, uneven stages kept. Only meaningful replayed (the
    start times no longer fit together)."""

    def key(s: Span) -> tuple:  # by name too: a zero-bubble backward's two halves differ
        return s.rank, s.kind, s.name, s.args.get("stage", s.args.get("chunk", 0))

    durations: dict[tuple, list[int]] = defaultdict(list)
    compute = [s for s in spans if s.kind in COMPUTE_KINDS]
    for s in compute:
        durations[key(s)].append(s.duration_ns)
    median = {k: round(statistics.median(d)) for k, d in durations.items()}
    return [replace(s, end_ns=s.start_ns + median[key(s)]) for s in compute]


def with_cpu_lengths(spans: Sequence[Span]) -> list[Span] | None:
    """The forward and backward spans, each as long as the CPU time its thread spent in it (None if
    a span has no CPU time: CUDA-timed or made up). Replayed, this is the bubble of the schedule on
    a machine where every rank has its own core: on an oversubscribed CPU box a span's wall length
    also holds the time another rank ran on its core, which the order did not cause."""
    compute = [s for s in spans if s.kind in COMPUTE_KINDS]
    if not compute or any(s.cpu_ns is None for s in compute):
        return None
    return [replace(s, end_ns=s.start_ns + (s.cpu_ns or 0)) for s in compute]


def bubble_breakdown(spans: Sequence[Span], pipelines: Sequence[Sequence[int]]) -> list[dict]:
    """Per stage, the measured bubble beside what explains it, each a ``measure_bubbles`` median:

    - ``theory``: (P-1)/(M+P-1), equal and steady stages, free transfers;
    - ``steady_compute``: the recorded order replayed with free send/recv and every forward/backward
      at its rank's median length, i.e. what uneven stages alone cost;
    - ``compute_only``: the same with the recorded lengths, i.e. uneven stages and jitter;
    - ``cpu_compute``: the same with each span's CPU time as its length (None without CPU times):
      uneven stages and jitter of the compute itself, without a shared core's waits;
    - ``measured``: the rest is time in (or waiting for) sends and receives.
    """
    measured = measure_bubbles(spans, pipelines)
    recorded = measure_bubbles(replay_without_communication(spans, pipelines), pipelines)
    steady = measure_bubbles(
        replay_without_communication(with_steady_compute(spans), pipelines), pipelines
    )
    cpu_spans = with_cpu_lengths(spans)
    cpu: list[float | None] = [None] * len(measured)
    if cpu_spans is not None:
        replayed = measure_bubbles(replay_without_communication(cpu_spans, pipelines), pipelines)
        cpu = [b.measured for b in replayed]
    return [
        {**asdict(b), "compute_only": r.measured, "steady_compute": q.measured, "cpu_compute": c}
        for b, r, q, c in zip(measured, recorded, steady, cpu, strict=True)
    ]


def step_windows(spans: Iterable[Span]) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, step) -> (first span start, last span end)."""
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for s in spans:
        key = (s.rank, s.step)
        a, b = out.get(key, (s.start_ns, s.end_ns))
        out[key] = (min(a, s.start_ns), max(b, s.end_ns))
    return out


def time_by_kind(spans: Sequence[Span]) -> dict[str, float]:
    """Mean per rank and step of the exclusive time of each kind, in ms (``OTHER`` included)."""
    by_key: dict[tuple[int, int], list[Span]] = defaultdict(list)
    for s in spans:
        by_key[(s.rank, s.step)].append(s)
    windows = step_windows(spans)
    totals: dict[str, float] = defaultdict(float)
    for key, group in by_key.items():
        for kind, ns in exclusive_ns(group, windows[key]).items():
            totals[kind] += ns / 1e6
    n = max(1, len(by_key))
    return {kind: totals.get(kind, 0.0) / n for kind in (*KINDS, OTHER)}
