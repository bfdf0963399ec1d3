"""``titan bench --schedules``: each schedule's bubble and activation memory against its theory, and
its step time against torch.distributed.pipelining's schedule over the same stage modules.

The theories come from the schedule functions themselves: a stand-in stage records the order each
rank runs its forwards, backwards (and, zero-bubble, deferred weight grads) in; replayed with ideal
durations that order gives the bubble, and counting what each forward saves until its backward frees
it gives the peak of live activations.
"""

from __future__ import annotations

from typing import Any

from lightning_titan import tracing
from lightning_titan.bench.cases import OURS, TORCH_PP
from lightning_titan.pipeline.schedules import V_SHAPED, get_schedule
from lightning_titan.pipeline.split import StageSplit

TORCH_TARGET = 1.05  # torch's step time / ours, at least
REPLAY_POINTS = (
    0.02  # interleaved replay and the auto split's uneven-stage share: within this of theory
)


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

    def __getattr__(self, name: str) -> Any:  # every send, receive and exchange: nothing to move
        return lambda *args, **kwargs: None


def orders(schedule: str, pp: int, v: int, m: int) -> list[list[tuple[str, int, int]]]:
    out = []
    for p in range(pp):
        stage = _Order(pp, p, v)
        get_schedule(schedule)(stage, m)
        out.append(stage.ops)
    return out


IDEAL_COST = {"F": 1.0, "B": 2.0, "B_input": 1.0, "W": 1.0}  # per stage; zero-bubble: B = W = F


def ideal_spans(schedule: str, pp: int, v: int, m: int, cost: dict[str, float] | None = None
                ) -> list[tracing.Span]:  # fmt: skip
    """The schedule's timeline with equal stages and free transfers: forward 1, backward 2 (zero-bubble:
    B 1 and W 1; or ``cost``), each chunk 1/v of a stage; every op as early as its stage and inputs
    allow."""
    cost = cost or IDEAL_COST
    spans = []
    for p, ops in enumerate(orders(schedule, pp, v, m)):
        for k, (kind, chunk, i) in enumerate(ops):
            args = {"mb": i, "chunk": chunk} if v > 1 else {"mb": i}
            if schedule in V_SHAPED:  # the replay's data dependencies follow the V
                args["stage"] = StageSplit(v, v_shape=True).stage_ids(pp, p)[chunk]
            name = "backward_weight" if kind == "W" else ("forward" if kind == "F" else "backward")
            span_kind = "forward" if kind == "F" else "backward"
            ns = round(1e6 * cost[kind] / v)  # drawn in ms: 1 ms = one forward of a stage
            spans.append(tracing.Span(span_kind, name, p, k, k + ns, args=args))
    return tracing.replay_without_communication(spans, [list(range(pp))])


def ideal_bubble(schedule: str, pp: int, v: int, m: int) -> float:
    """The worst stage's bubble of ``ideal_spans``: (P-1)/(M+P-1) for 1F1B, (P-1)/(v*M+P-1)
    interleaved, (P-1)/(3M+P-1) for ZB-H1 (its W's fill the cooldown); ZBV's, replayed likewise."""
    bubbles = tracing.measure_bubbles(ideal_spans(schedule, pp, v, m), [list(range(pp))])
    return max(b.measured for b in bubbles)


def live_peak(schedule: str, pp: int, pp_rank: int, v: int, m: int, chunk_bytes: list[int]
              ) -> tuple[int, int]:  # fmt: skip
    """(peak bytes, peak microbatch-chunks) of activations stage ``pp_rank`` holds under the schedule's
    order: a forward saves ``chunk_bytes[chunk]`` until its backward (zero-bubble: until its W)."""
    live: set[tuple[int, int]] = set()
    peak = peak_count = 0
    for kind, chunk, i in orders(schedule, pp, v, m)[pp_rank]:
        if kind == "F":
            live.add((chunk, i))
        elif kind in ("B", "W"):
            live.discard((chunk, i))
        peak = max(peak, sum(chunk_bytes[c] for c, _ in live))
        peak_count = max(peak_count, len(live))
    return peak, peak_count


def schedule_rows(rows: list[dict]) -> list[dict]:
    """One row per pipeline case that measured its microbatch's activations (the schedules table)."""
    out = []
    for r in rows:
        if r["pp"] == 1 or "microbatch_saved_mb_per_stage" not in r:
            continue
        pp, v, m, schedule = r["pp"], r["virtual_stages"], r["microbatches"], r["schedule"]
        memory = [live_peak(schedule, pp, p, v, m, r["microbatch_saved_mb_per_stage"][p])
                  for p in range(pp)]  # fmt: skip
        ours, torch_pp = r["impls"][OURS], r["impls"].get(TORCH_PP)
        out.append({
            "world": r["world"], "case": r["case"], "pp": pp, "schedule": schedule,
            "virtual_stages": v, "microbatches": m, "stage_layers": r["stage_layers"],
            "auto_split": r["auto_split"],
            "step_ms": ours["step_ms"], "torch_step_ms": torch_pp and torch_pp["step_ms"],
            "ratio": torch_pp and torch_pp["step_ms"] / ours["step_ms"],
            "measured": [b["measured"] for b in r["bubbles"]],
            "replay": [b["compute_only"] for b in r["bubbles"]],
            "replay_cpu": [b.get("cpu_compute") for b in r["bubbles"]],
            "uneven": [b["steady_compute"] for b in r["bubbles"]],
            "theory": ideal_bubble(schedule, pp, v, m),
            "saved_mb": r["saved_peak_mb_per_stage"], "theory_saved_mb": [b for b, _ in memory],
            "live": [n for _, n in memory],
        })  # fmt: skip
    return out


def schedule_checks(srows: list[dict]) -> list[dict]:
    """Issue 17's measure list, each against the run's own numbers."""
    checks = []
    for s in srows:
        if s["schedule"] == "interleaved_1f1b":
            for what in ("replay", "replay_cpu") if _has(s, "replay_cpu") else ("replay",):
                worst = max(abs(b - s["theory"]) for b in s[what])
                lengths = {"replay": "recorded", "replay_cpu": "CPU-time"}[what]
                checks.append({"case": s["case"], "check": f"compute-only replay ({lengths} "
                               f"lengths) within 0.02 of (P-1)/(v*M+P-1) = {s['theory']:.3f}",
                               "value": f"{worst:.3f} off", "met": worst <= REPLAY_POINTS})  # fmt: skip
        if s["auto_split"]:
            worst = max(abs(b - s["theory"]) for b in s["uneven"])
            checks.append({"case": s["case"], "check": "uneven-stage share (replay at median "
                           f"lengths) within 0.02 of {s['theory']:.3f}", "value": f"{worst:.3f} off",
                           "met": worst <= REPLAY_POINTS})  # fmt: skip
        if s["schedule"] in ("zb_h1", "zbv"):
            base = next((o for o in srows if o["pp"] == s["pp"] and o["schedule"] == "1f1b"
                         and o["microbatches"] == s["microbatches"] and not o["auto_split"]),
                        None)  # fmt: skip
            kinds = ["measured", "replay", "uneven"]
            kinds += (
                ["replay_cpu"]
                if base and _has(s, "replay_cpu") and _has(base, "replay_cpu")
                else []
            )
            for what in kinds if base else ():
                zb, one = max(s[what]), max(base[what])
                label = {"uneven": "median-length replay", "replay_cpu": "CPU-time replay"}.get(
                    what, what
                )
                checks.append({"case": s["case"], "check": f"{label} bubble (worst stage) below "
                               f"{base['case']}'s", "value": f"{zb:.3f} vs {one:.3f}",
                               "met": zb < one})  # fmt: skip
        if s["ratio"] is not None:
            checks.append({"case": s["case"], "check": f"torch step / ours >= {TORCH_TARGET}",
                           "value": f"{s['ratio']:.2f}x", "met": s["ratio"] >= TORCH_TARGET})  # fmt: skip
    return checks


def _has(row: dict, key: str) -> bool:
    return bool(row.get(key)) and None not in row[key]


def _stages(values: list[float | None], fmt: str = "{:.2f}") -> str:
    return " / ".join("-" if x is None else fmt.format(x) for x in values)


def schedules_markdown(srows: list[dict], checks: list[dict]) -> list[str]:
    if not srows:
        return []
    lines = ["", "**Schedules** (issue 17): per stage, the bubble measured, in the compute-only replay "
             "(recorded lengths, free send/recv), the same at each span's CPU time (*replay CPU*: "
             "without the waits of a shared core) and at median lengths (*uneven stages*), beside the "
             "schedule's ideal one (its order replayed with equal stages, F 1, B 2, zero-bubble B 1 + W "
             "1); activations saved for backward (peak MB) beside the theory: the schedule's live "
             "microbatch-chunks (count) times what one microbatch of each chunk saves; step time "
             "against torch.distributed.pipelining's schedule over the same stage modules", "",
             "| case | M | layers per stage | step ms | torch ms | torch / ours | bubble measured "
             "| replay | replay CPU | uneven stages | theory | activations MB | theory MB | live |",
             "|---|---:|---|---:|---:|---:|---|---|---|---|---:|---|---|---|"]  # fmt: skip
    for s in srows:
        torch_ms = "-" if s["torch_step_ms"] is None else f"{s['torch_step_ms']:.1f}"
        ratio = "-" if s["ratio"] is None else f"{s['ratio']:.2f}x"
        lines.append(
            f"| {s['case']} | {s['microbatches']} | {'-'.join(map(str, s['stage_layers']))} | "
            f"{s['step_ms']:.1f} | {torch_ms} | {ratio} | {_stages(s['measured'])} | "
            f"{_stages(s['replay'])} | {_stages(s.get('replay_cpu') or [None])} | "
            f"{_stages(s['uneven'])} | {s['theory']:.3f} | "
            f"{_stages(s['saved_mb'])} | {_stages(s['theory_saved_mb'])} | "
            f"{_stages(s['live'], '{}')} |"
        )
    lines += ["", "| case | check | value | met |", "|---|---|---|---|"]
    for c in checks:
        lines.append(
            f"| {c['case']} | {c['check']} | {c['value']} | {'yes' if c['met'] else '**no**'} |"
        )
    return lines
