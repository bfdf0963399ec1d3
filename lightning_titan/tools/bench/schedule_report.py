"""``titan bench --schedules``: each schedule's bubble and activation memory against its theory, and
its step time against torch.distributed.pipelining's schedule over the same stage modules.

The theories come from the schedule functions themselves (``parallel/pipeline/theory.py``, which the planner
uses too): the order each rank runs its work in, replayed with ideal durations, gives the bubble, and
counting what each forward saves until its backward frees it gives the peak of live activations.
"""

from __future__ import annotations

from lightning_titan.parallel.pipeline.schedules import SPLIT_BACKWARD
from lightning_titan.parallel.pipeline.theory import ideal_bubble, live_peak
from lightning_titan.tools.bench.cases import OURS, TORCH_PP
from lightning_titan.tools.bench.paired import INTERVAL, Ratio, mark

TORCH_TARGET = 1.05  # torch's step time / ours, at least
REPLAY_POINTS = (
    0.02  # interleaved replay and the auto split's uneven-stage share: within this of theory
)


def schedule_rows(rows: list[dict]) -> list[dict]:
    """One row per pipeline case that measured its microbatch's activations (the schedules table)."""
    out = []
    for r in rows:
        if r["pp"] == 1 or "microbatch_saved_mb_per_stage" not in r:
            continue
        pp, v, m, schedule = r["pp"], r["virtual_stages"], r["microbatches"], r["schedule"]
        memory = [
            live_peak(schedule, pp, p, v, m, r["microbatch_saved_mb_per_stage"][p])
            for p in range(pp)
        ]
        ours, torch_pp = r["impls"][OURS], r["impls"].get(TORCH_PP)
        ratio = torch_pp and Ratio.of(torch_pp, ours)
        out.append(
            {
                "world": r["world"],
                "case": r["case"],
                "pp": pp,
                "schedule": schedule,
                "virtual_stages": v,
                "microbatches": m,
                "stage_layers": r["stage_layers"],
                "auto_split": r["auto_split"],
                "step_ms": ours["step_ms"],
                "torch_step_ms": torch_pp and torch_pp["step_ms"],
                "ratio": ratio and ratio.median,
                "ratio_cell": ratio and ratio.cell,
                "torch_met": ratio and ratio.at_least(TORCH_TARGET),
                "measured": [b["measured"] for b in r["bubbles"]],
                "replay": [b["compute_only"] for b in r["bubbles"]],
                "replay_cpu": [b.get("cpu_compute") for b in r["bubbles"]],
                "uneven": [b["steady_compute"] for b in r["bubbles"]],
                "theory": ideal_bubble(schedule, pp, v, m),
                "saved_mb": r["saved_peak_mb_per_stage"],
                "theory_saved_mb": [b for b, _ in memory],
                "live": [n for _, n in memory],
            }
        )
    return out


def schedule_checks(srows: list[dict]) -> list[dict]:
    """Issue 17's measure list, each against the run's own numbers."""
    checks = []
    for s in srows:
        if s["schedule"] == "interleaved_1f1b":
            for what in ("replay", "replay_cpu") if _has(s, "replay_cpu") else ("replay",):
                worst = max(abs(b - s["theory"]) for b in s[what])
                lengths = {"replay": "recorded", "replay_cpu": "CPU-time"}[what]
                checks.append(
                    {
                        "case": s["case"],
                        "check": f"compute-only replay ({lengths} lengths) within 0.02 of "
                        f"(P-1)/(v*M+P-1) = {s['theory']:.3f}",
                        "value": f"{worst:.3f} off",
                        "met": worst <= REPLAY_POINTS,
                    }
                )
        if s["auto_split"]:
            worst = max(abs(b - s["theory"]) for b in s["uneven"])
            checks.append(
                {
                    "case": s["case"],
                    "check": "uneven-stage share (replay at median lengths) "
                    f"within 0.02 of {s['theory']:.3f}",
                    "value": f"{worst:.3f} off",
                    "met": worst <= REPLAY_POINTS,
                }
            )
        if s["schedule"] in SPLIT_BACKWARD:
            base = next(
                (
                    o
                    for o in srows
                    if o["pp"] == s["pp"]
                    and o["schedule"] == "1f1b"
                    and o["microbatches"] == s["microbatches"]
                    and not o["auto_split"]
                ),
                None,
            )
            if base is not None:
                kinds = ["measured", "replay", "uneven"]
                if _has(s, "replay_cpu") and _has(base, "replay_cpu"):
                    kinds.append("replay_cpu")
                for what in kinds:
                    zb, one = max(s[what]), max(base[what])
                    label = {"uneven": "median-length replay", "replay_cpu": "CPU-time replay"}.get(
                        what, what
                    )
                    checks.append(
                        {
                            "case": s["case"],
                            "check": f"{label} bubble (worst stage) below {base['case']}'s",
                            "value": f"{zb:.3f} vs {one:.3f}",
                            "met": zb < one,
                        }
                    )
        if s["ratio"] is not None:  # decided over the paired rounds (``paired``), or undecided
            checks.append(
                {
                    "case": s["case"],
                    "check": f"torch step / ours >= {TORCH_TARGET}",
                    "value": s["ratio_cell"],
                    "met": s["torch_met"],
                }
            )
    return checks


def _has(row: dict, key: str) -> bool:
    return bool(row.get(key)) and None not in row[key]


def _stages(values: list[float | None], fmt: str = "{:.2f}") -> str:
    return " / ".join("-" if x is None else fmt.format(x) for x in values)


def schedules_markdown(srows: list[dict], checks: list[dict]) -> list[str]:
    if not srows:
        return []
    lines = [
        "",
        "**Schedules**: per stage, the bubble measured, in the compute-only replay "
        "(recorded lengths, free send/recv), the same at each span's CPU time (*replay CPU*: "
        "without the waits of a shared core) and at median lengths (*uneven stages*), beside the "
        "schedule's ideal one (its order replayed with equal stages, F 1, B 2, zero-bubble B 1 + W "
        "1); activations saved for backward (peak MB) beside the theory: the schedule's live "
        "microbatch-chunks (count) times what one microbatch of each chunk saves; step time "
        "against torch.distributed.pipelining's schedule over the same stage modules "
        f"({INTERVAL})",
        "",
        "| case | M | layers per stage | step ms | torch ms | torch / ours | bubble measured "
        "| replay | replay CPU | uneven stages | theory | activations MB | theory MB | live |",
        "|---|---:|---|---:|---:|---:|---|---|---|---|---:|---|---|---|",
    ]
    for s in srows:
        torch_ms = "-" if s["torch_step_ms"] is None else f"{s['torch_step_ms']:.1f}"
        ratio = s["ratio_cell"] or "-"
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
        lines.append(f"| {c['case']} | {c['check']} | {c['value']} | {mark(c['met'])} |")
    return lines
