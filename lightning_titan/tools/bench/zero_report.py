"""The ZeRO tables: state per rank at zero=0 / 1 / 2 against the ideal split, and what it costs."""

from __future__ import annotations

from lightning_titan.model.grad_kinds import EXPERT, SEQUENCE, TP_SHARDED
from lightning_titan.parallel.mesh import ParallelDims
from lightning_titan.plan.memory import PARTS
from lightning_titan.tools.bench.cases import DDP_ZERO, FSDP2, OURS, ZERO1, ZERO2
from lightning_titan.tools.bench.paired import INTERVAL, Ratio, all_of, mark, step_and_cpu

_MB = 1e6
TIME_TARGET = 1.05  # zero>0's step and CPU time / zero=0's, at most


def _mb(states: list[dict[str, int]], kind: str) -> float:
    """The largest rank's bytes of one kind (params, grads, optimizer), expert and non-expert, in MB."""
    return max(s[f"expert_{kind}"] + s[f"non_expert_{kind}"] for s in states) / _MB


def optimizer_shares(
    zero0: dict, zero1: dict, row: dict, kind: str = "optimizer"
) -> tuple[list[float], list[float]]:
    """Per rank: optimizer (or ``kind``: ZeRO-2's grads) bytes at zero>0 / zero=0, and the ideal
    ratio, each parameter's over its own data-parallel group: expert state over the expert-DP group
    (dp x cp x tp ranks), TP-cut weights' over dp x ep x cp, the rest (norms, routers, whole on every
    TP rank) over dp x ep x cp x tp. The cut weights hold their share of the non-expert parameter
    bytes of the non-expert state too (the same bytes per element)."""
    dims = ParallelDims(
        row["dp"], row.get("pp", 1), row["ep"], tp=row.get("tp", 1), cp=row.get("cp", 1)
    )
    n_expert, n_cut, n_rest = (len(dims.group_ranks(k)) for k in (EXPERT, TP_SHARDED, SEQUENCE))
    ratios, ideals = [], []
    e, n = f"expert_{kind}", f"non_expert_{kind}"
    states0, states1 = zero0["state_bytes_per_rank"], zero1["state_bytes_per_rank"]
    cuts = zero0.get("tp_cut_bytes_per_rank", [0] * len(states0))
    for s0, s1, cut in zip(states0, states1, cuts, strict=True):
        whole = s0[e] + s0[n]
        cut_share = cut / s0["non_expert_params"] if s0["non_expert_params"] else 0.0
        non_expert = s0[n] * (cut_share / n_cut + (1 - cut_share) / n_rest)
        ratios.append((s1[e] + s1[n]) / whole)
        ideals.append((s0[e] / n_expert + non_expert) / whole)
    return ratios, ideals


def zero_rows(rows: list[dict]) -> list[dict]:
    """Per case with ours at zero=1: per-rank state (largest rank) at zero=0, zero=1 and under torch's
    ZeroRedundancyOptimizer; the optimizer-state ratio against its ideal (target: the worst rank
    within 5%); step and CPU time against zero=0 in the same rounds (target: zero=1 within 1.05x in
    both, and a step no slower than the ZeroRedundancyOptimizer's), each decided over the paired
    rounds (``paired``: met, missed or undecided)."""
    out = []
    for row in rows:
        impls = row["impls"]
        if ZERO1 not in impls:
            continue
        states = {impl: v["state_bytes_per_rank"] for impl, v in impls.items()}
        ratios, ideals = optimizer_shares(impls[OURS], impls[ZERO1], row)
        worst = max(range(len(ratios)), key=lambda r: ratios[r] / ideals[r])
        zero0, zero1, peer = impls[OURS], impls[ZERO1], impls.get(DDP_ZERO)
        step, cpu = step_and_cpu(zero1, zero0)
        entry = {
            "world": row["world"],
            "case": row["case"],
            "dp": row["dp"],
            "ep": row["ep"],
            "mb": {impl: {kind: _mb(st, kind) for kind in PARTS} for impl, st in states.items()},
            "optimizer_ratio_per_rank": ratios,
            "ideal_per_rank": ideals,
            "optimizer_ratio": ratios[worst],
            "ideal": ideals[worst],
            "memory_met": abs(ratios[worst] / ideals[worst] - 1) <= 0.05,
            **_time_entry(step, cpu),
            "time_target": TIME_TARGET,
        }
        if "time_ms" in zero1:  # recorded steps, per rank: what zero=1 saves and what it adds
            entry["split_ms"] = {
                level: {kind: t[kind] for kind in ("optimizer", "all_gather")}
                for level, t in (("zero0", row["time_ms"]), ("zero1", zero1["time_ms"]))
            }
        if ZERO2 in impls:
            entry["zero2"] = _zero2_entry(row, states)
        if peer is not None:
            entry.update(_peer_entry(peer, zero1))
        out.append(entry)
    return out


def _zero2_entry(row: dict, states: dict[str, list[dict[str, int]]]) -> dict:
    """ZeRO-2 against zero=0: grads per rank (target: the worst rank within 5% of the ideal) and step
    and CPU time (target: within 1.05x); FSDP2 against it (target: no faster)."""
    zero0, zero2 = row["impls"][OURS], row["impls"][ZERO2]
    ratios, ideals = optimizer_shares(zero0, zero2, row, "grads")
    worst = max(range(len(ratios)), key=lambda r: ratios[r] / ideals[r])
    entry = {
        "grads_ratio_per_rank": ratios,
        "grads_ratio": ratios[worst],
        "grads_ideal": ideals[worst],
        "grads_met": abs(ratios[worst] / ideals[worst] - 1) <= 0.05,
        **_time_entry(*step_and_cpu(zero2, zero0)),
    }
    if "time_ms" in zero2:
        entry["split_ms"] = {k: zero2["time_ms"][k] for k in ("optimizer", "all_gather")}
    peer = row["impls"].get(FSDP2)
    if peer is not None:  # the peer that shards what zero=2 does (and its parameters too)
        entry.update(_peer_entry(peer, zero2))
    return entry


def _time_entry(step: Ratio, cpu: Ratio) -> dict:
    return {
        "step_ratio": step.median,
        "step_cell": step.cell,
        "cpu_ratio": cpu.median,
        "cpu_cell": cpu.cell,
        "time_met": all_of(step.at_most(TIME_TARGET), cpu.at_most(TIME_TARGET)),
    }


def _peer_entry(peer: dict, ours: dict) -> dict:
    """The sharded-state peer against ours at the zero level it matches (target: ours no slower)."""
    step, cpu = step_and_cpu(peer, ours)
    return {
        "peer_step_ratio": step.median,
        "peer_step_cell": step.cell,
        "peer_cpu_ratio": cpu.median,
        "peer_cpu_cell": cpu.cell,
        "peer_met": step.at_least(1.0),
    }


def zero_markdown(zero: list[dict]) -> list[str]:
    """The ZeRO-1 table: state per rank at zero=0 / zero=1 and the time both cost, beside torch's
    ZeroRedundancyOptimizer (over DDP) where the case has it."""
    if not zero:
        return []
    lines = [
        "",
        "**ZeRO-1**: model state per rank in MB (largest rank; params and grads stay whole "
        "at zero=1), optimizer state zero=1 / zero=0 on the worst rank against the ideal "
        "(each parameter's over its own data-parallel group: experts over dp x cp x tp ranks, "
        "TP-cut weights over dp x ep x cp, the rest over dp x ep x cp x tp); step and CPU time "
        "per step against zero=0, and ZRO's against zero=1, in the same rounds "
        f"({INTERVAL}); optimizer and parameter all-gather ms per rank from the recorded steps. "
        "ZRO: torch DDP + ZeroRedundancyOptimizer(AdamW)",
        "",
        "| ranks | composition | params MB | grads MB | optimizer MB zero=0 | zero=1 "
        "| zero=1 / zero=0 (ideal) | within 5% | ZRO optimizer MB "
        "| optimizer + all-gather ms zero=0 -> zero=1 | step zero=1 / zero=0 "
        "| CPU zero=1 / zero=0 | both <= 1.05x | step ZRO / zero=1 | CPU ZRO / zero=1 "
        "| zero=1 as fast as ZRO |",
        "|---:|---|---:|---:|---:|---:|---|---|---:|---|---:|---:|---|---:|---:|---|",
    ]
    for z in zero:
        mb = z["mb"]
        peer = "- | - | - | - |"
        if DDP_ZERO in mb:
            peer = (
                f"{mb[DDP_ZERO]['optimizer']:.3f} | {z['peer_step_cell']} | "
                f"{z['peer_cpu_cell']} | {mark(z['peer_met'])} |"
            )
        peer_mb, peer_time = peer.split(" | ", 1)
        split = "-"
        if "split_ms" in z:
            split = " -> ".join(
                f"{t['optimizer']:.1f} + {t['all_gather']:.1f}"
                for t in (z["split_ms"]["zero0"], z["split_ms"]["zero1"])
            )
        lines.append(
            f"| {z['world']} | {z['case']} | {mb[OURS]['params']:.3f} | {mb[OURS]['grads']:.3f} | "
            f"{mb[OURS]['optimizer']:.3f} | {mb[ZERO1]['optimizer']:.3f} | "
            f"{z['optimizer_ratio']:.3f} ({z['ideal']:.3f}) | {mark(z['memory_met'])} | "
            f"{peer_mb} | {split} | {z['step_cell']} | {z['cpu_cell']} | "
            f"{mark(z['time_met'])} | {peer_time}"
        )
    return lines + zero2_markdown(zero)


def zero2_markdown(zero: list[dict]) -> list[str]:
    """The ZeRO-2 table: grads per rank after the step and the time, against zero=0."""
    rows = [z for z in zero if "zero2" in z]
    if not rows:
        return []
    lines = [
        "",
        "**ZeRO-2**: grads a rank keeps after the step in MB (largest rank; its rows of the "
        "reduce-scattered grads), zero=2 / zero=0 on the worst rank against the ideal (split as "
        "the optimizer state); optimizer state as zero=1; step and CPU "
        "time per step against zero=0, and FSDP2's against zero=2, in the same rounds "
        f"({INTERVAL}); optimizer and parameter all-gather ms per rank from the recorded steps; "
        "FSDP2: torch's fully_shard on each block and the "
        "root (reshard_after_forward=False: it shards the parameters too, between steps) over AdamW",
        "",
        "| ranks | composition | grads MB zero=0 | zero=2 | zero=2 / zero=0 (ideal) | within 5% "
        "| optimizer MB zero=2 | optimizer + all-gather ms "
        "| step zero=2 / zero=0 | CPU zero=2 / zero=0 | both <= 1.05x "
        "| FSDP2 params / grads / optimizer MB | step FSDP2 / zero=2 | zero=2 as fast as FSDP2 |",
        "|---:|---|---:|---:|---|---|---:|---|---:|---:|---|---|---:|---|",
    ]
    for z in rows:
        mb, z2 = z["mb"], z["zero2"]
        split = "-"
        if "split_ms" in z2:
            t = z2["split_ms"]
            split = f"{t['optimizer']:.1f} + {t['all_gather']:.1f}"
        lines.append(
            f"| {z['world']} | {z['case']} | {mb[OURS]['grads']:.3f} | {mb[ZERO2]['grads']:.3f} | "
            f"{z2['grads_ratio']:.3f} ({z2['grads_ideal']:.3f}) | {mark(z2['grads_met'])} | "
            f"{mb[ZERO2]['optimizer']:.3f} | {split} | {z2['step_cell']} | "
            f"{z2['cpu_cell']} | {mark(z2['time_met'])} | {_fsdp2_cells(z)} |"
        )
    return lines


def _fsdp2_cells(z: dict) -> str:
    if FSDP2 not in z["mb"]:
        return "- | - | -"
    mb, z2 = z["mb"][FSDP2], z["zero2"]
    return (
        f"{mb['params']:.3f} / {mb['grads']:.3f} / {mb['optimizer']:.3f} | "
        f"{z2['peer_step_cell']} | {mark(z2['peer_met'])}"
    )
