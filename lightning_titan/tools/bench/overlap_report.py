"""``titan bench --ep-overlap``: how much of the EP all-to-alls' time a rank still waits for, per
rank, from the traced steps: before (1F1B with each exchange waited for at once, ``A2A_BLOCKING``;
1F1B and zbv with the in-layer overlap) and after (``1f1b_overlap``, ``dualpipev``: one
microbatch's forward beside another's backward on two threads of the rank, ``parallel/overlap.py``).

Per rank and step (means over the traced steps):

- *in flight*: the union of the rank's exchanges from start to the end of their wait (``in_flight``
  spans; the counts' exchange from its launch to the end of its wait);
- *exposed*: the time a thread waited holding the rank (its ``all_to_all`` spans: launches and
  waits), also as a share of the step (the rank's first span start to its last span end).

Two threads: in a pair both record spans that overlap in wall time, but one computes at a time, so
every instant of the rank is counted once, for the thread that held the rank then
(``runtime/holders.py``: the one that records its next event first). Exposure and the step's time
split (``tracing.exclusive_ns``) both count that way; the other thread's spans, open while it is
parked, count for nothing.

Measured on a CPU box, compute and gloo's transport threads share the cores, so an exchange under
compute is slowed by it and slows it. The *replay* says what the overlap buys where they do not
compete: each exchange takes as long as a transfer of its kind (name, and forward or backward) took
waited for at once on the EP rank that waited least for it (the last to arrive waits for the
transfer alone, not for a late peer), the median over the blocking run's steps and layers; the work
under it is what the rank computed between its launch and its wait: the launching thread's CPU time
there, plus, in a pair, the partner's compute while it held the rank between the hand-overs (its
held wall time less its own waits, at its thread's CPU time per held wall time over the step).
exposed = max(0, transfer - work) per exchange; the replayed step is the measured step less its
measured exposed time plus the replayed one. It keeps each rank's measured lateness out of the
transfers, not out of the step, and lets no exchange hide under another's wait.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.parallel.pipeline.theory import live_peak
from lightning_titan.runtime import holders
from lightning_titan.runtime.tracing import (
    BACKGROUND_KINDS,
    COMPUTE_KINDS,
    Span,
    exclusive_ns,
    step_windows,
)
from lightning_titan.tools.bench.cases import A2A_BLOCKING, OVERLAP_IMPLS, Case, Settings
from lightning_titan.tools.bench.paired import INTERVAL, Ratio, mark

EXPOSED_TARGET = 0.15  # the replay's exposed all-to-all, at most this share of the step
_COUNTS = "counts"


@dataclass(frozen=True)
class _Exchange:
    name: str
    direction: str  # the kind of the compute span it ran in: forward or backward
    thread: int
    start: int
    launched: int  # its launch's end: where a pair hands the rank over
    waited: int  # its wait's start
    end: int
    own_cpu: int | None  # the launching thread's CPU time between launch and wait (None: no CPU)


def _by_rank_step(spans: Sequence[Span]) -> dict[tuple[int, int], list[Span]]:
    out: dict[tuple[int, int], list[Span]] = defaultdict(list)
    for s in spans:
        out[(s.rank, s.step)].append(s)
    return out


def _exchanges(group: Sequence[Span]) -> list[_Exchange]:
    """One rank-step's exchanges in start order: each ``in_flight`` span with its launch and wait
    (its thread's ``all_to_all`` spans of that name inside it), and the counts' launch and wait."""
    exposed: dict[tuple[int, str], list[Span]] = defaultdict(list)
    compute: dict[int, list[Span]] = defaultdict(list)
    for s in sorted(group, key=lambda s: s.start_ns):
        if s.kind == "all_to_all":
            exposed[(s.thread, s.name)].append(s)
        elif s.kind in COMPUTE_KINDS:
            compute[s.thread].append(s)

    def direction(thread: int, t: int) -> str:
        inside = [c for c in compute[thread] if c.start_ns <= t < c.end_ns]
        return max(inside, key=lambda c: c.start_ns).kind if inside else ""

    out = []
    for s in group:
        if s.kind != "in_flight":
            continue
        inside = [
            w
            for w in exposed[(s.thread, s.name)]
            if s.start_ns <= w.start_ns and w.end_ns <= s.end_ns
        ]
        launch, wait = (inside[0], inside[-1]) if inside else (s, s)
        own = None
        if s.cpu_ns is not None and all(w.cpu_ns is not None for w in inside):
            own = s.cpu_ns - sum(w.cpu_ns or 0 for w in inside)
        out.append(
            _Exchange(
                s.name,
                direction(s.thread, s.start_ns),
                s.thread,
                s.start_ns,
                launch.end_ns,
                wait.start_ns,
                s.end_ns,
                own,
            )  # fmt: skip
        )
    for (thread, name), spans in exposed.items():
        if name != _COUNTS:
            continue
        for i in range(0, len(spans), 2):  # launch, hand-over, wait: nothing of its own between
            launch, wait = spans[i], spans[min(i + 1, len(spans) - 1)]
            out.append(
                _Exchange(
                    name,
                    direction(thread, launch.start_ns),
                    thread,
                    launch.start_ns,
                    launch.end_ns,
                    wait.start_ns,
                    wait.end_ns,
                    0,
                )  # fmt: skip
            )
    return sorted(out, key=lambda e: e.start)


def _measured(spans: Sequence[Span]) -> dict[int, dict[str, float]]:
    """rank -> mean per step of step_ms, in_flight_ms, exposed_ms."""
    windows = step_windows(spans)
    per_rank: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
    for key, group in _by_rank_step(spans).items():
        a, b = windows[key]
        in_flight, reach = 0, a
        for e in _exchanges(group):  # their union, in start order
            in_flight += max(0, e.end - max(e.start, reach))
            reach = max(reach, e.end)
        exposed = exclusive_ns(group, (a, b)).get("all_to_all", 0)
        per_rank[key[0]].append(((b - a) / 1e6, in_flight / 1e6, exposed / 1e6))
    names = ("step_ms", "in_flight_ms", "exposed_ms")
    return {
        rank: {name: statistics.mean(x[i] for x in v) for i, name in enumerate(names)}
        for rank, v in per_rank.items()
    }


def _transfers(
    blocking: Sequence[Span], groups: Sequence[Sequence[int]]
) -> dict[tuple[int, str, str], float]:
    """(rank, name, direction) -> the median transfer, waited for at once (module docstring)."""
    lengths: dict[tuple[int, int, str, str, int], int] = {}  # (rank, step, name, direction, k)
    for (rank, step), group in _by_rank_step(blocking).items():
        seen: dict[tuple[str, str], int] = defaultdict(int)
        for e in _exchanges(group):
            k = seen[(e.name, e.direction)]
            seen[(e.name, e.direction)] += 1
            lengths[(rank, step, e.name, e.direction, k)] = e.end - e.start
    group_of = {r: tuple(g) for g in groups for r in g}
    out: dict[tuple[int, str, str], list[int]] = defaultdict(list)
    for (rank, step, name, direction, k), ns in lengths.items():
        peers = group_of.get(rank, (rank,))
        out[(rank, name, direction)].append(
            min(lengths.get((r, step, name, direction, k), ns) for r in peers)
        )
    return {key: statistics.median(v) for key, v in out.items()}


def _overlap(a: int, b: int, intervals: Sequence[tuple[int, int]]) -> int:
    return sum(max(0, min(b, hi) - max(a, lo)) for lo, hi in intervals)


def _replayed(
    spans: Sequence[Span], blocking: Sequence[Span], groups: Sequence[Sequence[int]]
) -> dict[int, float] | None:
    """rank -> mean replayed exposed ms per step (None without CPU times: CUDA-timed spans)."""
    transfer = _transfers(blocking, groups)
    per_rank: dict[int, list[float]] = defaultdict(list)
    for (rank, _), group in _by_rank_step(spans).items():
        timed = [s for s in group if s.kind not in BACKGROUND_KINDS]
        held: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for a, b, thread in holders.segments(timed):
            held[thread].append((a, b))
        waits: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for s in timed:
            if s.kind == "all_to_all":
                waits[s.thread].append((s.start_ns, s.end_ns))
        rate = {}  # CPU per held wall time, per thread: its share of a shared core
        for thread, stretches in held.items():
            outer, reach = [], -1  # its outermost spans (spans nest on one thread)
            for s in sorted(timed, key=lambda s: (s.start_ns, -s.end_ns)):
                if s.thread == thread and s.start_ns >= reach:
                    outer.append(s)
                    reach = s.end_ns
            if any(s.cpu_ns is None for s in outer):
                return None
            wall = sum(b - a for a, b in stretches)
            rate[thread] = min(1.0, sum(s.cpu_ns or 0 for s in outer) / max(1, wall))
        exposed = 0.0
        for e in _exchanges(group):
            if (rank, e.name, e.direction) not in transfer or e.own_cpu is None:
                return None
            work = float(e.own_cpu)
            for thread in held.keys() - {e.thread}:  # a pair's partner, between the hand-overs
                busy = _overlap(e.launched, e.waited, held[thread])
                busy -= _overlap(e.launched, e.waited, waits[thread])
                work += max(0, busy) * rate[thread]
            exposed += max(0.0, transfer[(rank, e.name, e.direction)] - work)
        per_rank[rank].append(exposed / 1e6)
    return {rank: statistics.mean(v) for rank, v in per_rank.items()}


def exposure(
    runs: Mapping[str, Sequence[Span]],
    blocking: Sequence[Span],
    groups: Sequence[Sequence[int]] = (),
) -> dict:
    """Per rank, measured for the blocking run and each of ``runs`` (impl -> its spans), and
    replayed for each of ``runs`` (module docstring); ``groups``: the EP groups' ranks
    (``ParallelDims.all_groups("ep")``)."""
    base, measured = _measured(blocking), {impl: _measured(s) for impl, s in runs.items()}
    ranks = sorted(set(base).intersection(*measured.values()))  # the same ranks in a real run
    out: dict = {"ranks": ranks, "blocking": [base[r] for r in ranks], "impls": {}}
    for impl, spans in runs.items():
        ours, replay = measured[impl], _replayed(spans, blocking, groups)
        got: dict = {"measured": [ours[r] for r in ranks]}
        if replay is not None:
            got["replay"] = [
                {"exposed_ms": replay[r], "step_ms": ours[r]["step_ms"] - ours[r]["exposed_ms"]
                 + replay[r]}
                for r in ranks
            ]  # fmt: skip
        out["impls"][impl] = got
    return out


def ep_overlap(case: Case, settings: Settings, per_rank: list[dict], dims: ParallelDims) -> dict:
    """Exposure per rank of each impl against the blocking run, and each one's activations against
    its schedule's theory (``live_peak`` over what each forward of the step saved)."""
    blocking = [s for r in per_rank for s in r[A2A_BLOCKING]["spans"]]
    impls = [i for i in OVERLAP_IMPLS if i in case.impls]
    runs = {i: [s for r in per_rank for s in r[i]["spans"]] for i in impls}
    out = exposure(runs, blocking, dims.all_groups("ep"))
    out["schedules"] = {i: case.of(i).schedule for i in (A2A_BLOCKING, *impls)}
    m = settings.num_microbatches(case)
    out["activations"] = {}
    for impl in impls:
        if "forward_saved_bytes" not in per_rank[0][impl]:
            continue
        c = case.of(impl)
        theory = [
            live_peak(c.schedule, c.pp, r[impl]["coords"][1], c.virtual_stages, m,
                      r[impl]["forward_saved_bytes"])
            for r in per_rank
        ]  # fmt: skip
        out["activations"][impl] = {
            "measured_mb": [r[impl]["saved_peak_bytes"] / 1e6 for r in per_rank],
            "theory_mb": [b / 1e6 for b, _ in theory],
            "live": [n for _, n in theory],
        }
    return out


def overlap_rows(rows: list[dict]) -> list[dict]:
    """One row per (case, impl) timed beside the exchanges waited for at once: its exposure, its
    activations against the schedule's theory, and the paired step ratio."""
    out = []
    for r in rows:
        if "ep_overlap" not in r:
            continue
        e = r["ep_overlap"]
        for impl in (A2A_BLOCKING, *OVERLAP_IMPLS):
            if impl not in r["impls"]:
                continue
            got = e["impls"].get(impl, {"measured": e["blocking"]})
            ratio = Ratio.of(r["impls"][A2A_BLOCKING], r["impls"][impl])
            replay = got.get("replay")
            worst = replay and max(x["exposed_ms"] / x["step_ms"] for x in replay)
            out.append(
                {
                    "case": r["case"],
                    "impl": impl,
                    "schedule": e["schedules"][impl],
                    "microbatches": r["microbatches"],
                    "ranks": e["ranks"],
                    "step_ms": r["impls"][impl]["step_ms"],
                    **got,
                    "activations": e["activations"].get(impl),
                    "ratio": ratio.median,
                    "ratio_cell": "-" if impl == A2A_BLOCKING else ratio.cell,
                    "faster": None if impl == A2A_BLOCKING else ratio.at_least(1.0),
                    "replay_worst_share": worst,
                    "replay_met": None if worst is None else worst <= EXPOSED_TARGET,
                }
            )
    return out


def _per_rank(values: Sequence[float], fmt: str) -> str:
    return " / ".join(fmt.format(x) for x in values)


def overlap_markdown(rows: list[dict]) -> str:
    lines = [
        "**EP all-to-all overlap** (per rank, in rank order, mean per traced step; *exposed*: the "
        "time a thread waited for an exchange holding the rank, ms and share of the step, measured "
        "on this machine; *replay*: the same run with free cores, each transfer as long as waited "
        "for at once, the work under it at its CPU time, a pair's partner included; *activations*: "
        "peak MB saved for backward, measured (in brackets: the schedule's theory, the most its "
        "order holds live, each forward at what it saved in the step); blocking / this: step time "
        f"ratio, {INTERVAL}; target: replayed exposed share <= {EXPOSED_TARGET:.0%})",
        "",
        "| case | schedule | M | step ms | blocking / this | exposed ms (measured) "
        "| exposed share (measured) | exposed share (replay) | replay <= target "
        "| activations MB, measured (theory) |",
        "|---|---|---:|---:|---:|---|---|---|---|---|",
    ]
    for row in rows:
        measured = row["measured"]
        replay = row.get("replay")
        rep = "-"
        if replay:
            rep = _per_rank([x["exposed_ms"] / x["step_ms"] for x in replay], "{:.0%}")
        acts = row["activations"]
        act = "-"
        if acts:
            act = " / ".join(
                f"{m:.2f} ({t:.2f})"
                for m, t in zip(acts["measured_mb"], acts["theory_mb"], strict=True)
            )
        label = row["schedule"] + (" (waited at once)" if row["impl"] == A2A_BLOCKING else "")
        lines.append(
            f"| {row['case']} | {label} | {row['microbatches']} | {row['step_ms']:.1f} | "
            f"{row['ratio_cell']} | {_per_rank([m['exposed_ms'] for m in measured], '{:.1f}')} | "
            f"{_per_rank([m['exposed_ms'] / m['step_ms'] for m in measured], '{:.0%}')} | "
            f"{rep} | {mark(row['replay_met']) if replay else '-'} | {act} |"
        )
    return "\n".join(lines)
