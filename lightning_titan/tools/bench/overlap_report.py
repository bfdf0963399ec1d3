"""``titan bench --ep-overlap``: how much of the EP all-to-alls' time a rank still waits for, with the
exchanges overlapped (ours) and waited for at once (``A2A_BLOCKING``), per rank, from the traced steps.

Per rank and step (means over the traced steps):

- *in flight*: the union of the rank's exchanges from start to the end of their wait (``in_flight``
  spans, and the blocking exchange of the per-expert counts);
- *exposed*: the part the rank waited (its exclusive ``all_to_all`` time), also as a share of the step
  (the rank's first span start to its last span end).

Measured on a CPU box, compute and gloo's transport threads share the cores, so an exchange under
compute is slowed by it and slows it. The *replay* says what overlap buys where they do not: each
overlapped exchange takes as long as the same exchange (same name and place in the step) took
waited for at once on the EP rank that waited least for it (the last to arrive, which waited for the
transfer alone, not for a late peer), the median over the blocking run's steps; the rank's compute
between launch and wait takes that work's CPU time (the ``in_flight`` span's CPU time less its
launch's and its wait's): exposed = max(0, transfer - work) per exchange, the counts' exchange
whole; the replayed step is the measured step less its measured exposed time plus the replayed one.
It keeps each rank's measured lateness out of the transfers, not out of the step.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from collections.abc import Sequence

from lightning_titan.runtime.tracing import Span, exclusive_ns, step_windows
from lightning_titan.tools.bench.cases import A2A_BLOCKING, OURS
from lightning_titan.tools.bench.paired import INTERVAL, Ratio, mark

EXPOSED_TARGET = 0.15  # the replay's exposed all-to-all, at most this share of the step
_COUNTS = "counts"


def _exchanges(spans: Sequence[Span]) -> dict[tuple[int, int], list[tuple[Span, list[Span]]]]:
    """(rank, step) -> each exchange's in-flight span and the rank's exposed spans inside it (its
    launch and its wait), in start order; the counts' blocking exchange has no in-flight span: its
    own span stands for both."""
    exposed: dict[tuple[int, int, str], list[Span]] = defaultdict(list)
    for s in sorted(spans, key=lambda s: s.start_ns):
        if s.kind == "all_to_all":
            exposed[(s.rank, s.thread, s.name)].append(s)
    starts = {key: [w.start_ns for w in ws] for key, ws in exposed.items()}
    out: dict[tuple[int, int], list[tuple[Span, list[Span]]]] = defaultdict(list)
    for s in sorted(spans, key=lambda s: s.start_ns):
        if s.kind == "in_flight":  # its launch and wait: on the same thread, inside it
            key = (s.rank, s.thread, s.name)
            first = bisect.bisect_left(starts.get(key, []), s.start_ns)
            last = bisect.bisect_right(starts.get(key, []), s.end_ns)
            inside = [w for w in exposed[key][first:last] if w.end_ns <= s.end_ns]
            out[(s.rank, s.step)].append((s, inside))
        elif s.kind == "all_to_all" and s.name == _COUNTS:
            out[(s.rank, s.step)].append((s, [s]))
    return out


def _keyed(
    exchanges: list[tuple[Span, list[Span]]],
) -> dict[tuple[str, int], tuple[Span, list[Span]]]:
    """Each exchange keyed by (name, its place among the step's exchanges of that name)."""
    seen: dict[str, int] = defaultdict(int)
    out = {}
    for flight, inside in exchanges:
        out[(flight.name, seen[flight.name])] = (flight, inside)
        seen[flight.name] += 1
    return out


def _measured(spans: Sequence[Span]) -> dict[int, dict[str, float]]:
    """rank -> mean per step of step_ms, in_flight_ms, exposed_ms."""
    windows, exchanges = step_windows(spans), _exchanges(spans)
    by_key: dict[tuple[int, int], list[Span]] = defaultdict(list)
    for s in spans:
        by_key[(s.rank, s.step)].append(s)
    per_rank: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
    for key, group in by_key.items():
        a, b = windows[key]
        flights = sorted((f.start_ns, f.end_ns) for f, _ in exchanges.get(key, []))
        in_flight, reach = 0, a
        for lo, hi in flights:  # their union
            in_flight += max(0, hi - max(lo, reach))
            reach = max(reach, hi)
        exposed = exclusive_ns(group, (a, b)).get("all_to_all", 0)
        per_rank[key[0]].append(((b - a) / 1e6, in_flight / 1e6, exposed / 1e6))
    names = ("step_ms", "in_flight_ms", "exposed_ms")
    return {
        rank: {name: statistics.mean(x[i] for x in v) for i, name in enumerate(names)}
        for rank, v in per_rank.items()
    }


def _replayed(
    overlapped: Sequence[Span], blocking: Sequence[Span], groups: Sequence[Sequence[int]]
) -> dict[int, float] | None:
    """rank -> mean replayed exposed ms per step (None without CPU times: CUDA-timed spans)."""
    lengths: dict[tuple[int, str, int, int], int] = {}  # (rank, name, k, step) -> ns, at once
    for (rank, step), exchanges in _exchanges(blocking).items():
        for (name, k), (flight, _) in _keyed(exchanges).items():
            lengths[(rank, name, k, step)] = flight.duration_ns
    group_of = {r: tuple(g) for g in groups for r in g}
    shortest: dict[tuple[int, str, int, int], int] = {}  # over the ranks that exchanged it
    for (rank, name, k, step), ns in lengths.items():
        shortest[(rank, name, k, step)] = min(
            lengths.get((r, name, k, step), ns) for r in group_of.get(rank, (rank,))
        )
    transfer: dict[tuple[int, str, int], list[int]] = defaultdict(list)
    for (rank, name, k, _), ns in shortest.items():
        transfer[(rank, name, k)].append(ns)
    per_rank: dict[int, list[float]] = defaultdict(list)
    for (rank, _), exchanges in _exchanges(overlapped).items():
        exposed = 0.0
        for (name, k), (flight, inside) in _keyed(exchanges).items():
            if (rank, name, k) not in transfer or flight.cpu_ns is None:
                return None
            wire = statistics.median(transfer[(rank, name, k)])
            # the CPU time of the work between launch and wait (none for the counts' exchange)
            work = 0 if inside == [flight] else flight.cpu_ns - sum(w.cpu_ns or 0 for w in inside)
            exposed += max(0.0, wire - work)
        per_rank[rank].append(exposed / 1e6)
    return {rank: statistics.mean(v) for rank, v in per_rank.items()}


def exposure(
    overlapped: Sequence[Span], blocking: Sequence[Span], groups: Sequence[Sequence[int]] = ()
) -> dict:
    """Per rank, measured for both and replayed for the overlapped run (module docstring);
    ``groups``: the EP groups' ranks (``ParallelDims.all_groups("ep")``)."""
    ours, base = _measured(overlapped), _measured(blocking)
    replay = _replayed(overlapped, blocking, groups)
    ranks = sorted(ours)
    out: dict = {"ranks": ranks, "overlapped": [ours[r] for r in ranks]}
    out["blocking"] = [base[r] for r in ranks]
    if replay is not None:
        steps = [ours[r]["step_ms"] - ours[r]["exposed_ms"] + replay[r] for r in ranks]
        out["replay"] = [
            {"exposed_ms": replay[r], "step_ms": step} for r, step in zip(ranks, steps, strict=True)
        ]
    return out


def overlap_rows(rows: list[dict]) -> list[dict]:
    """One row per case timed with and without overlap: the exposure and the paired step ratio."""
    out = []
    for r in rows:
        if "ep_overlap" not in r:
            continue
        ratio = Ratio.of(r["impls"][A2A_BLOCKING], r["impls"][OURS])
        e = r["ep_overlap"]
        replay = e.get("replay")
        worst = replay and max(x["exposed_ms"] / x["step_ms"] for x in replay)
        out.append(
            {
                "case": r["case"],
                **e,
                "ratio": ratio.median,
                "ratio_cell": ratio.cell,
                "faster": ratio.at_least(1.0),
                "replay_worst_share": worst,
                "replay_met": None if worst is None else worst <= EXPOSED_TARGET,
            }
        )
    return out


def _cell(m: dict) -> str:
    share = m["exposed_ms"] / m["step_ms"]
    return f"{m['step_ms']:.1f} / {m['in_flight_ms']:.1f} / {m['exposed_ms']:.1f} ({share:.0%})"


def overlap_markdown(rows: list[dict]) -> str:
    lines = [
        "**EP all-to-all overlap** (per rank, mean per traced step; *step / in flight / exposed "
        "ms (exposed share of the step)*, measured on this machine, the exchanges waited for at once "
        "and overlapped; *replay*: the overlapped run with free cores, each transfer as long as "
        f"waited for at once, each rank's work between start and wait at its CPU time; blocking / "
        f"overlapped: step time ratio, {INTERVAL}; target: replayed exposed share <= "
        f"{EXPOSED_TARGET:.0%})",
        "",
        "| composition | rank | waited at once | overlapped | replay: step / exposed ms (share) "
        "| blocking / overlapped | overlap faster | replay <= target |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        for i, rank in enumerate(row["ranks"]):
            replay = row.get("replay")
            rep = "-"
            if replay:
                x = replay[i]
                rep = f"{x['step_ms']:.1f} / {x['exposed_ms']:.1f} ({x['exposed_ms'] / x['step_ms']:.0%})"
            first = i == 0
            lines.append(
                f"| {row['case'] if first else ''} | {rank} | {_cell(row['blocking'][i])} | "
                f"{_cell(row['overlapped'][i])} | {rep} | {row['ratio_cell'] if first else ''} | "
                f"{mark(row['faster']) if first else ''} | "
                f"{mark(row['replay_met']) if first else ''} |"
            )
    return "\n".join(lines)
