"""``titan plan --check``: the planner's ranking against this machine.

For every world size from 1 to ``--devices`` (the powers of two that divide it), the layouts the bench
can run are predicted for this machine's CPU ranks; the fastest and the slowest few are then run by
``titan bench``'s worker (the same runner, a few steps each), and the predicted step time and state
are printed beside the measured ones, with the Spearman rank correlation of the step times.

Only what the bench's runner sets is checked: zero=0, every schedule at the microbatch count the
planner chose (interleaved 1F1B and ZBV with two chunks per rank), no recompute (not a bench case). Under
``--precision bf16-mixed`` the planner prices bf16 and every step runs under CPU autocast, one region
per step as Lightning's (``bench/worker.py``), so the activations are compared in the run's dtypes.
"""

from __future__ import annotations

import time

from lightning_titan.model.config import NONE
from lightning_titan.model.decoder import ModelConfig
from lightning_titan.plan.devices import cpu_device
from lightning_titan.plan.layouts import candidates
from lightning_titan.plan.precision import FP32, Precision
from lightning_titan.plan.rank import Ranked, ranked
from lightning_titan.runtime.launch import run_on_ranks
from lightning_titan.tools.bench.cases import OURS, Case, Settings
from lightning_titan.tools.bench.memory import state_total
from lightning_titan.tools.bench.worker import run_world

SCHEDULES = ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv")
PER_END = {2: 2, 4: 3, 8: 3}  # layouts taken from each end of a world's ranking


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties share their mean rank)."""

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def _case(r: Ranked) -> Case:
    d = r.candidate.degrees
    return Case(
        dp=d["dp"],
        pp=d["pp"],
        ep=d["ep"],
        cp=d["cp"],
        tp=d["tp"],
        schedule=r.options.schedule,
        virtual_stages=r.options.virtual_stages,
        microbatches=r.options.microbatches,  # the planned M (one microbatch can rank first)
        impls=(OURS,),
    )


def chosen(
    config: ModelConfig,
    batch: int,
    world: int,
    memory: float,
    per_end: int,
    precision: Precision = FP32,
    only: list[str] | None = None,
) -> list[Ranked]:
    """The fastest and slowest ``per_end`` runnable layouts of ``world`` ranks, as predicted; with
    ``only`` (labels, ``dp8``), the fastest row of each named layout instead."""
    device = cpu_device(world, config.n_experts, config.top_k, memory)
    # the bench's cases run unfolded layouts only
    found = [c for c in candidates(config, world, batch)[0] if c.zero == 0 and not c.fold_ep]
    rows = [
        r
        for r in ranked(config, found, batch, device, (NONE,), precision)
        if r.options.schedule in SCHEDULES and r.candidate.state_bytes <= memory
    ]
    if only:
        firsts = {r.candidate.label: r for r in reversed(rows) if r.candidate.label in only}
        return sorted(firsts.values(), key=lambda r: r.cost.step)
    if len(rows) <= 2 * per_end:
        return rows
    return rows[:per_end] + rows[-per_end:]


def check(
    config: ModelConfig,
    batch: int,
    devices: int,
    memory: float,
    steps: int = 2,
    rounds: int = 3,
    precision: Precision = FP32,
    only: list[str] | None = None,
) -> float:
    """Run, print the table, return the Spearman correlation of predicted and measured step time."""
    settings = Settings(
        config=config,
        global_batch=batch,
        warmup=1,
        steps=steps,
        rounds=rounds,
        traced_steps=0,
        timeout_s=600.0,
        precision=precision.name,
    )
    worlds = [w for w in (1, 2, 4, 8, 16) if w <= devices and devices % w == 0]
    rows: list[tuple[int, Ranked, dict]] = []
    start = time.perf_counter()
    for world in worlds:
        picked = chosen(config, batch, world, memory, PER_END.get(world, 3), precision, only)
        if not picked:
            continue
        print(
            f"titan plan --check: {world} rank(s), {len(picked)} layouts, {precision.name} ...",
            flush=True,
        )
        per_rank = run_on_ranks(
            run_world, world, [_case(r) for r in picked], settings, timeout_s=settings.timeout_s
        )
        for i, r in enumerate(picked):
            rows.append((world, r, _measured([results[i][OURS] for results in per_rank])))
    predicted = [r.cost.step for _, r, _ in rows]
    measured = [m["step_s"] for _, _, m in rows]
    rho = spearman(predicted, measured)
    print("\n".join(_table(rows)))
    print(
        f"Spearman rank correlation of predicted and measured step time over {len(rows)} layouts: "
        f"{rho:.3f} ({time.perf_counter() - start:.0f} s; wall times on a shared machine are noisy)"
    )
    return rho


def _measured(ranks: list[dict]) -> dict:
    return {
        "step_s": ranks[0]["median_step_s"],  # the slowest rank's (all-reduced max)
        "cpu_s": ranks[0]["median_cpu_s"],  # every rank's CPU seconds: steadier under load
        "state": max(sum(r["state_bytes"].values()) for r in ranks),
        "expert_state": max(state_total(r["state_bytes"], "expert") for r in ranks),
        "saved_peak": max(r["saved_peak_bytes"] for r in ranks),
    }


def _table(rows: list[tuple[int, Ranked, dict]]) -> list[str]:
    lines = [
        "| ranks | layout | step options | predicted ms | measured ms | predicted state MB | "
        "measured state MB | predicted activations MB | measured activations MB | "
        "predicted / measured activations | measured CPU s (all ranks) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, r, m in rows:
        lines.append(
            f"| {world} | {r.label} | {r.options_label} | {r.cost.step * 1e3:,.1f} | "
            f"{m['step_s'] * 1e3:,.1f} | {r.candidate.state_bytes / 1e6:,.3f} | "
            f"{m['state'] / 1e6:,.3f} | {r.activation_bytes / 1e6:,.2f} | {m['saved_peak'] / 1e6:,.2f} | "
            f"{r.activation_bytes / m['saved_peak']:.3f} | {m['cpu_s']:,.3f} |"
        )
    return lines
